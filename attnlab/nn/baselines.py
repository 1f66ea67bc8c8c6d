"""Baselines with the encoder's interface: per-token MLP, 1-D CNN, bidirectional GRU/LSTM.

The course note compares self-attention with these: an MLP sees one token (no context); a CNN sees
a fixed window ("a CNN is a simplified self-attention"); an RNN sees the whole sequence but
through a sequential memory. All take ``(inputs, lengths=None, *, dropout_key=None)`` and return
``[B, T, F]`` with ``.features == F``; padded positions never change the real ones. ``vocab_sizes``,
``input_dim`` and ``chars`` go to ``attnlab.nn.TokenEmbedding``.

Legend: B batch, T length, D width, F output features.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.nn.layers import Chars, TokenEmbedding, dropout, sequence_mask, split_key

__all__ = ["TokenMLP", "CNN", "BiRNN"]


class TokenMLP(nnx.Module):
    """Embedding, then L residual layers ``x + drop(GELU(Linear(x)))`` applied to each token alone."""

    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int = 2,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        chars: Chars | None = None,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.features = d_model
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, chars=chars, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d_model, d_model, rngs=rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.dropout_rate = dropout_rate

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        del lengths  # each token alone: padding cannot leak
        keys = split_key(dropout_key, len(self.layers) + 1)
        x = dropout(self.embed(inputs), self.dropout_rate, keys[0])
        for layer, k in zip(self.layers, keys[1:], strict=True):
            x = x + dropout(jax.nn.gelu(layer(x)), self.dropout_rate, k)
        return self.ln_f(x)


class CNN(nnx.Module):
    """Embedding, then L residual 1-D convolutions of width ``kernel_size`` (SAME padding).

    Padded positions are zeroed before every convolution, so they act as the zero padding at a
    sequence's end and never change real positions. Receptive field: L (kernel_size - 1) + 1.
    With ``grid=(height, width)`` the tokens are an image's cells row-major (T = height * width)
    and the convolutions are 2-D, ``kernel_size x kernel_size`` (zero padding at the border).
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int = 2,
        kernel_size: int = 5,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        chars: Chars | None = None,
        dropout_rate: float = 0.0,
        grid: tuple[int, int] | None = None,
        rngs: nnx.Rngs,
    ):
        self.features = d_model
        self.grid = None if grid is None else tuple(grid)
        kernel = kernel_size if grid is None else (kernel_size, kernel_size)
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, chars=chars, rngs=rngs)
        self.convs = nnx.List(
            [nnx.Conv(d_model, d_model, kernel, padding="SAME", rngs=rngs) for _ in range(num_layers)]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.dropout_rate = dropout_rate

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        keys = split_key(dropout_key, len(self.convs) + 1)
        x = dropout(self.embed(inputs), self.dropout_rate, keys[0])  # [B, T, D]
        valid = sequence_mask(lengths, x.shape[1])
        keep = 1.0 if valid is None else valid[..., None].astype(x.dtype)  # [B, T, 1]
        if self.grid is not None and x.shape[1] != self.grid[0] * self.grid[1]:
            raise ValueError(f"CNN: inputs length {x.shape[1]} != grid {self.grid[0]} x {self.grid[1]}")
        for conv, k in zip(self.convs, keys[1:], strict=True):
            h = x * keep
            if self.grid is not None:
                h = h.reshape(h.shape[0], *self.grid, h.shape[-1])  # [B, T, D] -> [B, Hg, Wg, D]
            h = conv(h).reshape(x.shape)  # back to [B, T, D]
            x = x + dropout(jax.nn.gelu(h), self.dropout_rate, k)
        return self.ln_f(x)


class BiRNN(nnx.Module):
    """Embedding, then L bidirectional GRU or LSTM layers (forward and backward states concatenated).

    The backward pass starts at each sequence's last real token (``seq_lengths``), so padding is
    never read. Output width F = 2 * hidden.
    """

    def __init__(
        self,
        *,
        d_model: int,
        hidden: int | None = None,
        num_layers: int = 1,
        cell: str = "lstm",
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        chars: Chars | None = None,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ):
        if cell not in ("gru", "lstm"):
            raise ValueError(f"BiRNN: cell must be 'gru' or 'lstm', got {cell!r}")
        hidden = hidden or d_model
        self.features = 2 * hidden
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, chars=chars, rngs=rngs)
        make = nnx.GRUCell if cell == "gru" else nnx.OptimizedLSTMCell
        layers = []
        for i in range(num_layers):
            din = d_model if i == 0 else 2 * hidden
            fwd = nnx.RNN(make(din, hidden, rngs=rngs), rngs=rngs)
            bwd = nnx.RNN(make(din, hidden, rngs=rngs), reverse=True, keep_order=True, rngs=rngs)
            layers.append(nnx.Bidirectional(fwd, bwd, rngs=rngs))
        self.layers = nnx.List(layers)
        self.dropout_rate = dropout_rate
        self.cell = cell
        self.hidden = hidden

    def _zero_carry(self, batch: int):
        # Explicit zeros: the cells' initialize_carry draws from an RNG stream, which cannot be
        # mutated inside a jitted, differentiated train step.
        h = jnp.zeros((batch, self.hidden))
        return (h, h) if self.cell == "lstm" else h

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        keys = split_key(dropout_key, len(self.layers) + 1)
        x = dropout(self.embed(inputs), self.dropout_rate, keys[0])
        if lengths is None:
            lengths = jnp.full(x.shape[:1], x.shape[1], jnp.int32)
        for layer, k in zip(self.layers, keys[1:], strict=True):
            carry = self._zero_carry(x.shape[0])
            x = layer(x, seq_lengths=lengths, initial_carry=(carry, carry))  # [B, T, 2 hidden]
            x = dropout(x, self.dropout_rate, k)
        return x
