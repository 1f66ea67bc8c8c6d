"""Flax NNX modules: thin owners of parameters that call attnlab's pure functions."""

from attnlab.nn.baselines import CNN, BiRNN, TokenMLP
from attnlab.nn.layers import (
    Chars,
    Encoder,
    MultiHeadAttention,
    SequenceClassifier,
    TokenClassifier,
    TokenEmbedding,
    TransformerBlock,
    dropout,
    masked_max,
    masked_mean,
    sequence_mask,
)

__all__ = [
    "CNN",
    "BiRNN",
    "Chars",
    "Encoder",
    "MultiHeadAttention",
    "SequenceClassifier",
    "TokenClassifier",
    "TokenEmbedding",
    "TokenMLP",
    "TransformerBlock",
    "dropout",
    "masked_max",
    "masked_mean",
    "sequence_mask",
]
