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
from attnlab.data import packing
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

    def encode(
        self, features, lengths=None, *, segment_ids=None, positions=None, dropout_key=None, return_weights=False
    ):
        """``features [B, T, F]``, ``lengths [B]`` -> memory ``[B, S, D]``, memory lengths ``[B]`` (, weights).

        A packed batch (``packing.pack_pairs(..., source_align=2**subsample)``): pass ``segment_ids``
        ``[B, T]`` instead of (or with) ``lengths`` and get ``(memory, memory_segment_ids [B, S])``
        back. Each convolution tap that falls in another document (or padding) reads zeros, as it
        would at that document's edge alone, and each document attends only within itself with its
        positions restarting at 0; so a document packed gives what it gives alone, provided it
        starts at a multiple of ``2**subsample`` (the stride of the front end).
        """
        if features.ndim != 3:
            raise ValueError(f"EncoderDecoder.encode: features must be [B, T, F], got {features.shape}")
        if lengths is None and segment_ids is None:
            raise ValueError("EncoderDecoder.encode: pass lengths [B] or segment_ids [B, T] (a packed batch)")
        x = features
        if segment_ids is not None:
            segment_ids = self.encoder._check_packed(
                segment_ids, features.shape[:2], "segment_ids", "EncoderDecoder.encode"
            )
            if positions is None:
                positions = packing.segment_positions(segment_ids)
            if lengths is not None:  # the row's tail beyond lengths is padding too
                t = jnp.arange(x.shape[1])[None, :]
                segment_ids = jnp.where(t < lengths[:, None], segment_ids, packing.PAD_SEGMENT)
            for conv in self.convs:
                x = jax.nn.gelu(_packed_conv(conv, x, segment_ids))
                segment_ids, positions = segment_ids[:, ::2], positions[:, ::2] // 2
            out = self.encoder(
                x, segment_ids=segment_ids, positions=positions, dropout_key=dropout_key, return_weights=return_weights
            )
            return (*out, segment_ids) if return_weights else (out, segment_ids)
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
        """``tokens [B, U]`` at ``positions`` ``[U]`` or ``[B, U]`` -> ``[B, U, D]`` (scaled embedding + sinusoid)."""
        table = positional.sinusoidal(self.max_target_len, self.d_model)
        return self.embed(tokens) * jnp.sqrt(self.d_model).astype(jnp.float32) + table[positions]

    def logits(self, x):
        return self.out(self.ln_f(x))

    def decode(
        self,
        tokens,
        memory,
        memory_lengths=None,
        token_lengths=None,
        *,
        memory_segment_ids=None,
        token_segment_ids=None,
        token_positions=None,
        dropout_key=None,
        return_weights=False,
    ):
        """Teacher forcing: ``tokens [B, U]`` (bos first) -> next-token logits ``[B, U, V]`` (, cross weights).

        Packed: ``token_segment_ids [B, U]`` and ``memory_segment_ids [B, S]`` (from ``encode``) pair
        target document d with source document d of the same row: causal self-attention within each
        target document, cross-attention to its own source only, positions restarting at 0
        (``token_positions``, default from the ids).
        """
        U = tokens.shape[1]
        if U > self.max_target_len:
            raise ValueError(f"EncoderDecoder.decode: {U} tokens exceed max_target_len={self.max_target_len}")
        packed = token_segment_ids is not None or memory_segment_ids is not None
        if packed and (token_segment_ids is None or memory_segment_ids is None):
            raise ValueError(
                "EncoderDecoder.decode: a packed batch needs both token_segment_ids [B, U] and memory_segment_ids "
                "[B, S]; got only one"
            )
        if not packed and memory_lengths is None:
            raise ValueError("EncoderDecoder.decode: pass memory_lengths [B] (or, packed, memory_segment_ids)")
        keys = split_key(dropout_key, len(self.blocks) + 1)
        if packed:
            token_segment_ids = self.encoder._check_packed(
                token_segment_ids, tokens.shape[:2], "token_segment_ids", "EncoderDecoder.decode"
            )
            memory_segment_ids = self.encoder._check_packed(
                memory_segment_ids, memory.shape[:2], "memory_segment_ids", "EncoderDecoder.decode"
            )
            if token_lengths is not None:
                u = jnp.arange(U)[None, :]
                token_segment_ids = jnp.where(u < token_lengths[:, None], token_segment_ids, packing.PAD_SEGMENT)
            if memory_lengths is not None:
                s = jnp.arange(memory.shape[1])[None, :]
                memory_segment_ids = jnp.where(s < memory_lengths[:, None], memory_segment_ids, packing.PAD_SEGMENT)
            if token_positions is None:
                token_positions = packing.segment_positions(token_segment_ids)
            token_positions = self.encoder._check_packed(
                token_positions, tokens.shape[:2], "token_positions", "EncoderDecoder.decode"
            )
            pad = packing.PAD_SEGMENT
            self_mask = masks_lib.causal() & masks_lib.document(token_segment_ids, padding_id=pad)
            cross_mask = masks_lib.document(token_segment_ids, memory_segment_ids, padding_id=pad)
        else:
            token_positions = jnp.arange(U) if token_positions is None else token_positions
            self_mask = masks_lib.causal()
            if token_lengths is not None:
                self_mask = self_mask & masks_lib.padding(token_lengths, token_lengths)
            cross_mask = masks_lib.padding(token_lengths, memory_lengths)
        x = dropout(self.embed_tokens(tokens, token_positions), self.dropout_rate, keys[0])
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

    def __call__(
        self,
        features,
        lengths=None,
        tokens=None,
        token_lengths=None,
        *,
        source_segment_ids=None,
        target_segment_ids=None,
        dropout_key=None,
    ):
        """Teacher forcing from features: ``-> logits [B, U, V]``.

        Packed pairs (``packing.pack_pairs``): pass ``source_segment_ids [B, T]`` and
        ``target_segment_ids [B, U]``; each target document sees only its own source document.
        """
        if tokens is None:
            raise ValueError("EncoderDecoder: tokens [B, U] are required")
        if (source_segment_ids is None) != (target_segment_ids is None):
            raise ValueError("EncoderDecoder: pass both source_segment_ids and target_segment_ids (a packed batch)")
        k_enc, k_dec = split_key(dropout_key, 2)
        if source_segment_ids is not None:
            memory, mem_ids = self.encode(features, lengths, segment_ids=source_segment_ids, dropout_key=k_enc)
            return self.decode(
                tokens,
                memory,
                None,
                token_lengths,
                memory_segment_ids=mem_ids,
                token_segment_ids=target_segment_ids,
                dropout_key=k_dec,
            )
        memory, mem_lengths = self.encode(features, lengths, dropout_key=k_enc)
        return self.decode(tokens, memory, mem_lengths, token_lengths, dropout_key=k_dec)


def _packed_conv(conv: nnx.Conv, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``conv`` (kernel 3, stride 2, padding (1, 1)) over a packed row: a tap in another segment reads 0.

    Output frame j reads input frames 2j-1, 2j, 2j+1; each tap counts only if its segment is that of
    the centre 2j, which is what the document gives alone, where beyond its edges lie zeros.
    """
    kernel, bias = conv.kernel[...], conv.bias[...]  # [3, F_in, F_out], [F_out]
    T = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (1, 1), (0, 0)))
    ip = jnp.pad(segment_ids, ((0, 0), (1, 1)), constant_values=packing.PAD_SEGMENT)
    centre = ip[:, 1 : T + 1 : 2]  # [B, ceil(T/2)]
    out = bias
    for k in range(3):
        tap = xp[:, k : k + T : 2]
        keep = (ip[:, k : k + T : 2] == centre) & (centre != packing.PAD_SEGMENT)
        out = out + jnp.where(keep[..., None], tap, 0) @ kernel[k]
    return out
