"""Data: loaders for real data shipped in packages, and generators for synthetic tasks."""

# Each loader is loaded on first use (`attnlab.data.packing.pack`); `import attnlab.data.packing` works too.
_SUBMODULES = ("brown", "canvases", "fashion_mnist", "listops", "molecules", "packing", "pku", "speech")


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        module = importlib.import_module(f"attnlab.data.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'attnlab.data' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_SUBMODULES})
