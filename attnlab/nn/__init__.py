"""Flax NNX modules: thin owners of parameters that call attnlab's pure functions."""

from attnlab.nn import attention
from attnlab.nn.attention import AttentionFn, Linear, Performer, Softmax
from attnlab.nn.baselines import CNN, BiRNN, TokenMLP
from attnlab.nn.conv import conv_as_attention, conv_offsets
from attnlab.nn.detr import DETR
from attnlab.nn.graph import GIN, GraphEncoder, distance_bias, gin_layer
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
    split_key,
)
from attnlab.nn.seq2seq import DecoderBlock, EncoderDecoder, subsampled_lengths

__all__ = [
    "AttentionFn",
    "Linear",
    "Performer",
    "Softmax",
    "attention",
    "CNN",
    "DecoderBlock",
    "DETR",
    "EncoderDecoder",
    "subsampled_lengths",
    "BiRNN",
    "Chars",
    "Encoder",
    "GIN",
    "GraphEncoder",
    "MultiHeadAttention",
    "SequenceClassifier",
    "TokenClassifier",
    "TokenEmbedding",
    "TokenMLP",
    "TransformerBlock",
    "conv_as_attention",
    "conv_offsets",
    "distance_bias",
    "dropout",
    "masked_max",
    "masked_mean",
    "gin_layer",
    "sequence_mask",
    "split_key",
]
