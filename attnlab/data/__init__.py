"""Data: loaders for real data shipped in packages, and generators for synthetic tasks."""
