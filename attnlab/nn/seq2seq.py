"""n -> m: an encoder-decoder with cross-attention (speech recognition, translation, DETR-like sets).

The encoder is ``attnlab.nn.Encoder`` (any attnlab mask: full, ``window(w, w)`` for truncated
self-attention, causal chunks for streaming) behind an optional convolutional front end that
subsamples long inputs (speech frames) by 2 per layer. The decoder stacks ``DecoderBlock``s:
causal self-attention over the outputs so far, cross-attention to the encoder's memory (padding
masks on both sides), an MLP; each is a pre-norm residual as in ``TransformerBlock``.

Teacher forcing: ``model(features, lengths, tokens, token_lengths)`` -> logits ``[B, U, V]`` for the
next token at every position. Incremental decoding with a KV cache: ``attnlab.decoding``.

Legend: B batch, T input frames, F input features, S encoder positions (T after subsampling),
U output tokens, V vocabulary, D model dim, N heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import masks as masks_lib
from attnlab import positional
from attnlab.nn.attention import Softmax
from attnlab.nn.layers import Encoder, MultiHeadAttention, dropout, split_key

__all__ = ["DecoderBlock", "EncoderDecoder", "subsampled_lengths"]


def subsampled_lengths(lengths: jax.Array, layers: int) -> jax.Array:
    """Valid lengths after ``layers`` stride-2 'SAME' convolutions: ceil(len / 2) each time."""
    for _ in range(layers):
        lengths = (lengths + 1) // 2
    return lengths


class DecoderBlock(nnx.Module):
    """Pre-norm decoder block: causal self-attention, cross-attention to the memory, MLP."""

    def __init__(self, d_model: int, num_heads: int, mlp_dim: int, *, dropout_rate: float = 0.0, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, rngs=rngs)
        self.ln3 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, mlp_dim, rngs=rngs)
        self.mlp_out = nnx.Linear(mlp_dim, d_model, rngs=rngs)
        self.dropout_rate = dropout_rate

    def mlp(self, x, key=None):
        k1, k2 = split_key(key, 2)
        h = dropout(jax.nn.gelu(self.mlp_in(self.ln3(x))), self.dropout_rate, k1)
        return x + dropout(self.mlp_out(h), self.dropout_rate, k2)

    def __call__(self, x, memory, *, self_mask, cross_mask, dropout_key=None, return_weights=False):
        """``x [B, U, D]``, ``memory [B, S, D]`` -> ``[B, U, D]`` (, cross-attention weights ``[B, N, U, S]``)."""
        k1, k2, k3 = split_key(dropout_key, 3)
        x = x + dropout(self.self_attn(self.ln1(x), mask=self_mask), self.dropout_rate, k1)
        a = self.cross_attn(self.ln2(x), memory, mask=cross_mask, return_weights=return_weights)
        a, w = a if return_weights else (a, None)
        x = self.mlp(x + dropout(a, self.dropout_rate, k2), k3)
        return (x, w) if return_weights else x


class EncoderDecoder(nnx.Module):
    """Encoder (optional conv subsampling + ``Encoder``) and a causal decoder with cross-attention.

    Args:
        input_dim: F, float features per input frame (e.g. 80 log-mel bins).
        vocab_size: V output tokens (the caller reserves its pad / bos / eos ids).
        d_model, num_heads, mlp_dim: D, N, MLP width (default 4 D).
        encoder_layers, decoder_layers: block counts.
        subsample: number of stride-2 convolutions (kernel 3, GELU) before the encoder: 2 -> 4x.
        encoder_mask: a structural ``attnlab.masks`` Mask ANDed with the encoder's padding, e.g.
            ``masks.window(16, 16)`` (truncated self-attention) or ``masks.chunks(c)``; None = full.
        max_source_len, max_target_len: longest encoder / decoder sequence (sinusoidal positions).
        dropout_rate: on residual branches and embeddings during training.
        ctc_head: also own a linear head from the encoder memory to the V tokens (``ctc_logits``),
            for an auxiliary CTC loss (hybrid CTC/attention training, Watanabe et al. 2017): it
            pushes the encoder to locate characters in time, so cross-attention learns to align
            sooner. It plays no part in decoding.
    """

    def __init__(
        self,
        *,
        input_dim: int,
        vocab_size: int,
        d_model: int = 128,
        num_heads: int = 4,
        mlp_dim: int | None = None,
        encoder_layers: int = 3,
        decoder_layers: int = 2,
        subsample: int = 2,
        encoder_mask: masks_lib.Mask | None = None,
        max_source_len: int = 4096,
        max_target_len: int = 256,
        dropout_rate: float = 0.0,
        implementation=None,
        ctc_head: bool = False,
        rngs: nnx.Rngs,
    ):
        for name, value in (("vocab_size", vocab_size), ("input_dim", input_dim), ("decoder_layers", decoder_layers)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EncoderDecoder: {name} must be an int >= 1, got {value!r}")
        if not isinstance(subsample, int) or subsample < 0:
            raise ValueError(f"EncoderDecoder: subsample must be an int >= 0, got {subsample!r}")
        mlp_dim = mlp_dim or 4 * d_model
        convs, width = [], input_dim
        for _ in range(subsample):
            # explicit (1, 1) padding: SAME with stride 2 would align frames differently for odd and even T
            convs.append(nnx.Conv(width, d_model, 3, strides=2, padding=((1, 1),), rngs=rngs))
            width = d_model
        self.convs = nnx.List(convs)
        self.subsample = subsample
        self.encoder = Encoder(
            d_model=d_model,
            num_layers=encoder_layers,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            input_dim=width,
            posenc=positional.Sinusoidal(max_source_len),
            attention=Softmax(implementation),
            dropout_rate=dropout_rate,
            attention_mask=encoder_mask,
            rngs=rngs,
        )
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.blocks = nnx.List(
            [
                DecoderBlock(d_model, num_heads, mlp_dim, dropout_rate=dropout_rate, rngs=rngs)
                for _ in range(decoder_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, vocab_size, rngs=rngs)
        self.ctc = nnx.Linear(d_model, vocab_size, rngs=rngs) if ctc_head else None
        self.d_model = d_model
        self.vocab_size = vocab_size
        self.max_target_len = max_target_len
        self.dropout_rate = dropout_rate

    # -- encoder ------------------------------------------------------------------------------

    def encode(self, features, lengths, *, dropout_key=None, return_weights=False):
        """``features [B, T, F]``, ``lengths [B]`` -> memory ``[B, S, D]``, memory lengths ``[B]`` (, weights)."""
        if features.ndim != 3:
            raise ValueError(f"EncoderDecoder.encode: features must be [B, T, F], got {features.shape}")
        x = features
        valid = (jnp.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
        for conv in self.convs:
            x = jax.nn.gelu(conv(jnp.where(valid, x, 0)))  # padding frames never leak into real ones
            lengths = subsampled_lengths(lengths, 1)
            valid = (jnp.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
        out = self.encoder(x, lengths, dropout_key=dropout_key, return_weights=return_weights)
        return (*out, lengths) if return_weights else (out, lengths)

    def ctc_logits(self, memory):
        """Encoder memory ``[B, S, D]`` -> per-frame token logits ``[B, S, V]`` (needs ``ctc_head=True``)."""
        if self.ctc is None:
            raise ValueError("EncoderDecoder.ctc_logits: the model was built without ctc_head=True")
        return self.ctc(memory)

    # -- decoder ------------------------------------------------------------------------------

    def embed_tokens(self, tokens, positions):
        """``tokens [B, U]`` at ``positions [U]`` -> ``[B, U, D]`` (scaled embedding + sinusoidal)."""
        table = positional.sinusoidal(self.max_target_len, self.d_model)
        return self.embed(tokens) * jnp.sqrt(self.d_model).astype(jnp.float32) + table[positions]

    def logits(self, x):
        return self.out(self.ln_f(x))

    def decode(self, tokens, memory, memory_lengths, token_lengths=None, *, dropout_key=None, return_weights=False):
        """Teacher forcing: ``tokens [B, U]`` (bos first) -> next-token logits ``[B, U, V]`` (, cross weights)."""
        U = tokens.shape[1]
        if U > self.max_target_len:
            raise ValueError(f"EncoderDecoder.decode: {U} tokens exceed max_target_len={self.max_target_len}")
        keys = split_key(dropout_key, len(self.blocks) + 1)
        x = dropout(self.embed_tokens(tokens, jnp.arange(U)), self.dropout_rate, keys[0])
        self_mask = masks_lib.causal()
        if token_lengths is not None:
            self_mask = self_mask & masks_lib.padding(token_lengths, token_lengths)
        cross_mask = masks_lib.padding(token_lengths, memory_lengths)
        weights = []
        for block, k in zip(self.blocks, keys[1:], strict=True):
            x = block(
                x, memory, self_mask=self_mask, cross_mask=cross_mask, dropout_key=k, return_weights=return_weights
            )
            if return_weights:
                x, w = x
                weights.append(w)
        logits = self.logits(x)
        return (logits, weights) if return_weights else logits

    def __call__(self, features, lengths, tokens, token_lengths=None, *, dropout_key=None):
        k_enc, k_dec = split_key(dropout_key, 2)
        memory, mem_lengths = self.encode(features, lengths, dropout_key=k_enc)
        return self.decode(tokens, memory, mem_lengths, token_lengths, dropout_key=k_dec)
