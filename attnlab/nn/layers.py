"""Flax NNX modules for self-attention models: thin owners of parameters over the pure functions.

``MultiHeadAttention`` holds exactly the params pytree of ``attnlab.heads.init_multi_head_params``
and calls ``attnlab.heads.multi_head_attention``; everything else is a few lines of glue.

Every sequence model here (and in ``attnlab.nn.baselines``) has the same call:
``backbone(inputs, lengths=None, *, dropout_key=None) -> [B, T, F]`` with ``backbone.features == F``.
Dropout is a pure function of an explicit key (``dropout_key=None`` means evaluation), so a
training step is a pure function of (params, batch, key) and a run is reproducible.

Legend: B batch, T length, D model dim, F input features per token (int ids of F vocabularies,
or F floats), C classes, L layers, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import efficient, positional
from attnlab import masks as masks_lib
from attnlab.heads import init_multi_head_params, multi_head_attention

__all__ = [
    "dropout",
    "sequence_mask",
    "TokenEmbedding",
    "MultiHeadAttention",
    "TransformerBlock",
    "Encoder",
    "TokenClassifier",
    "SequenceClassifier",
]

POSENCS = ("none", "sinusoidal", "learned")
ATTENTION_KINDS = ("softmax", "linear", "performer")  # softmax: attnlab.attention; others: attnlab.efficient


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``key`` is None or ``rate == 0``."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _split(key, n):
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def sequence_mask(lengths: jax.Array | None, T: int) -> jax.Array | None:
    """``[B]`` lengths -> bool ``[B, T]``, True at real (non-padded) positions; None stays None."""
    if lengths is None:
        return None
    return jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]


class TokenEmbedding(nnx.Module):
    """Token inputs -> ``[B, T, D]``: sum of one embedding per int feature, or a linear projection.

    Args:
        d_model: D.
        vocab_sizes: an int, or one int per feature channel (inputs int ``[B, T]`` or ``[B, T, F]``;
            e.g. word id, suffix id, word-shape id). Exactly one of vocab_sizes / input_dim.
        input_dim: F for float inputs ``[B, T, F]`` (input projection).
    """

    def __init__(
        self,
        d_model: int,
        *,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        rngs: nnx.Rngs,
    ):
        if (vocab_sizes is None) == (input_dim is None):
            raise ValueError(
                "TokenEmbedding: pass exactly one of vocab_sizes (int ids) or input_dim "
                f"(float features), got vocab_sizes={vocab_sizes!r}, input_dim={input_dim!r}"
            )
        self.features = d_model
        if vocab_sizes is not None:
            sizes = (vocab_sizes,) if isinstance(vocab_sizes, int) else tuple(vocab_sizes)
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"TokenEmbedding: vocab_sizes must be positive ints, got {vocab_sizes!r}")
            self.single = isinstance(vocab_sizes, int)
            self.embeds = nnx.List([nnx.Embed(s, d_model, rngs=rngs) for s in sizes])
            self.proj = None
        else:
            self.single = False
            self.embeds = None
            self.proj = nnx.Linear(input_dim, d_model, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.proj is not None:
            return self.proj(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"TokenEmbedding: inputs must be int ids, got dtype {inputs.dtype}")
        ids = inputs[..., None] if self.single else inputs  # [B, T] -> [B, T, 1]
        if ids.shape[-1] != len(self.embeds):
            raise ValueError(
                f"TokenEmbedding: inputs have {ids.shape[-1]} id channels, expected "
                f"{len(self.embeds)} (shape {inputs.shape})"
            )
        return sum(e(ids[..., i]) for i, e in enumerate(self.embeds))


class MultiHeadAttention(nnx.Module):
    """Multi-head self- or cross-attention owning the params of ``init_multi_head_params``.

    ``mha(x)`` equals ``attnlab.multi_head_attention(mha.params(), x, ...)`` exactly.

    Args:
        d_model, num_heads, num_kv_heads, head_dim, kv_dim, use_bias, score: as
            ``attnlab.heads.init_multi_head_params`` (score ``"dot"`` or ``"additive"``).
        implementation: passed to ``attnlab.attention`` (None, "reference", "xla").
        kind: ``"softmax"`` (``attnlab.attention``, any mask), ``"linear"`` (elu+1 linear attention)
            or ``"performer"`` (FAVOR+ with ``num_features`` random features, drawn once at init
            from ``rngs`` and kept fixed: a non-trainable ``projection`` variable ``[M, H]``). The
            O(N) kinds take padding as ``kv_lengths`` instead of a mask (see ``attnlab.efficient``).

    Example:
        >>> mha = MultiHeadAttention(16, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
        >>> mha(jnp.ones((2, 5, 16))).shape          # [B, T, D]
        (2, 5, 16)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        use_bias: bool = True,
        score: str = "dot",
        implementation: str | None = None,
        kind: str = "softmax",
        num_features: int = 256,
        rngs: nnx.Rngs,
    ):
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"MultiHeadAttention: kind must be one of {ATTENTION_KINDS}, got {kind!r}")
        if kind != "softmax" and score != "dot":
            raise ValueError(f"MultiHeadAttention: kind={kind!r} needs score='dot', got {score!r}")
        params = init_multi_head_params(
            rngs.params(),
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kv_dim=kv_dim,
            use_bias=use_bias,
            score=score,
        )
        self.names = tuple(sorted(params))
        for name in self.names:
            setattr(self, name, nnx.Param(params[name]))
        self.score = score
        self.implementation = implementation
        self.kind = kind
        if kind == "performer":
            h = params["wq"].shape[-1]
            self.projection = nnx.Variable(efficient.performer_projection(rngs.params(), num_features, h))

    def params(self) -> dict[str, jax.Array]:
        """The params pytree for ``attnlab.heads.multi_head_attention``."""
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(self, x_q, x_kv=None, *, mask=None, bias=None, return_weights=False, kv_lengths=None):
        """``[..., T, D]`` (and ``[..., S, Dkv]``) -> ``[..., T, D]`` (, weights ``[..., N, T, S]``).

        ``kv_lengths`` (int ``[...]``) is the padding of the O(N) kinds; softmax takes a mask instead.
        """
        match self.kind:
            case "softmax":
                if kv_lengths is not None:
                    raise ValueError("MultiHeadAttention: kind='softmax' takes padding as a mask, not kv_lengths")
                fn = None
            case "linear":
                fn = functools.partial(efficient.linear_attention, kv_lengths=kv_lengths)
            case "performer":
                fn = functools.partial(
                    efficient.performer_attention, projection=self.projection[...], kv_lengths=kv_lengths
                )
        return multi_head_attention(
            self.params(),
            x_q,
            x_kv,
            mask=mask,
            bias=bias,
            score=self.score,
            implementation=self.implementation,
            return_weights=return_weights,
            attention_fn=fn,
        )


class TransformerBlock(nnx.Module):
    """Pre-norm block: ``x + drop(MHA(LN(x)))``, then ``x + drop(MLP(LN(x)))`` (MLP: D -> M -> D, GELU).

    Pre-norm as in Xiong et al. 2020 (arXiv 2002.04745): stable without learning-rate warmup.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        mlp_dim: int,
        *,
        dropout_rate: float = 0.0,
        num_kv_heads: int | None = None,
        score: str = "dot",
        implementation: str | None = None,
        attention: str = "softmax",
        num_features: int = 256,
        rngs: nnx.Rngs,
    ):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = MultiHeadAttention(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            score=score,
            implementation=implementation,
            kind=attention,
            num_features=num_features,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, mlp_dim, rngs=rngs)
        self.mlp_out = nnx.Linear(mlp_dim, d_model, rngs=rngs)
        self.dropout_rate = dropout_rate

    def __call__(self, x, *, mask=None, dropout_key=None, return_weights=False, kv_lengths=None):
        """``[B, T, D] -> [B, T, D]`` (, attention weights ``[B, N, T, S]``)."""
        k1, k2, k3 = _split(dropout_key, 3)
        a = self.attn(self.ln1(x), mask=mask, return_weights=return_weights, kv_lengths=kv_lengths)
        a, w = a if return_weights else (a, None)
        x = x + dropout(a, self.dropout_rate, k1)
        h = dropout(jax.nn.gelu(self.mlp_in(self.ln2(x))), self.dropout_rate, k2)
        x = x + dropout(self.mlp_out(h), self.dropout_rate, k3)
        return (x, w) if return_weights else x


class Encoder(nnx.Module):
    """Token embedding (or input projection) + positional encoding + L pre-norm blocks + final LayerNorm.

    Args:
        d_model: D.  num_layers: L.  num_heads: N.  mlp_dim: M (default 4 D).
        vocab_sizes / input_dim: see ``TokenEmbedding``.
        posenc: ``"none"`` | ``"sinusoidal"`` (Vaswani 2017) | ``"learned"`` (a ``[max_len, D]`` table).
        max_len: longest sequence for the positional table.
        window: None for full attention, or w: each token sees the w tokens on each side
            (``masks.window(w, w)``), combined with the padding mask.
        attention: ``"softmax"`` (default), or an O(N) kind ``"linear"`` / ``"performer"``
            (``MultiHeadAttention``'s ``kind``; padding goes in as ``kv_lengths``).
        attention_mask: a structural mask ANDed with padding (and window) for softmax attention,
            e.g. ``masks.chunks(c)`` (LRA's local attention) or ``masks.bigbird(max_len, ...)``;
            it is static module structure, so it holds no arrays (not padding or a dense mask).
        num_features: Performer's M.
        dropout_rate, num_kv_heads, score, implementation: passed to each block.

    Call: ``encoder(inputs, lengths=None, *, dropout_key=None, return_weights=False)`` with inputs
    ``[B, T]`` / ``[B, T, F]`` and lengths int ``[B]`` -> ``[B, T, D]`` (, list of L weights
    ``[B, N, T, T]``). Positions t >= lengths[b] are padding: no real token attends to them.

    Example:
        >>> enc = Encoder(vocab_sizes=100, d_model=16, num_layers=2, num_heads=4, rngs=nnx.Rngs(0))
        >>> enc(jnp.zeros((2, 7), int), jnp.array([7, 3])).shape
        (2, 7, 16)
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int,
        num_heads: int,
        mlp_dim: int | None = None,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        posenc: str = "sinusoidal",
        max_len: int = 512,
        window: int | None = None,
        dropout_rate: float = 0.0,
        num_kv_heads: int | None = None,
        score: str = "dot",
        implementation: str | None = None,
        attention: str = "softmax",
        attention_mask: masks_lib.Mask | None = None,
        num_features: int = 256,
        rngs: nnx.Rngs,
    ):
        if posenc not in POSENCS:
            raise ValueError(f"Encoder: posenc must be one of {POSENCS}, got {posenc!r}")
        if window is not None and (not isinstance(window, int) or window < 0):
            raise ValueError(f"Encoder: window must be None or an int >= 0, got {window!r}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"Encoder: attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if attention != "softmax" and (window is not None or attention_mask is not None):
            raise ValueError(f"Encoder: attention={attention!r} takes no window or attention_mask (softmax only)")
        if attention_mask is not None and not isinstance(attention_mask, masks_lib.Mask):
            raise ValueError(
                f"Encoder: attention_mask must be an attnlab.masks Mask, got {type(attention_mask).__name__}"
            )
        self.features = d_model
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, rngs=rngs)
        self.posenc = posenc
        self.max_len = max_len
        if posenc == "learned":
            self.pos_table = nnx.Param(positional.init_learned(rngs.params(), max_len, d_model))
        self.blocks = nnx.List(
            [
                TransformerBlock(
                    d_model,
                    num_heads,
                    mlp_dim or 4 * d_model,
                    dropout_rate=dropout_rate,
                    num_kv_heads=num_kv_heads,
                    score=score,
                    implementation=implementation,
                    attention=attention,
                    num_features=num_features,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.window = window
        self.dropout_rate = dropout_rate
        self.attention = attention
        self.attention_mask = attention_mask

    def mask(self, lengths, T):
        """The attention mask for a batch: padding(lengths) & window(w, w) & attention_mask (None when none)."""
        m = None if lengths is None else masks_lib.padding(lengths, lengths)
        for extra in (
            None if self.window is None else masks_lib.window(self.window, self.window),
            self.attention_mask,
        ):
            if extra is not None:
                m = extra if m is None else m & extra
        return m

    def __call__(self, inputs, lengths=None, *, dropout_key=None, return_weights=False):
        T = inputs.shape[1]
        if self.posenc != "none" and inputs.shape[1] > self.max_len:
            raise ValueError(f"Encoder: inputs length {T} exceeds max_len={self.max_len}")
        x = self.embed(inputs)  # [B, T, D]
        match self.posenc:
            case "sinusoidal":
                x = x + positional.sinusoidal(T, self.features)
            case "learned":
                x = x + self.pos_table[...][:T]
            case "none":
                pass
        keys = _split(dropout_key, len(self.blocks) + 1)
        x = dropout(x, self.dropout_rate, keys[0])
        softmax = self.attention == "softmax"
        mask = self.mask(lengths, T) if softmax else None
        kv_lengths = None if softmax else lengths
        weights = []
        for block, k in zip(self.blocks, keys[1:], strict=True):
            x = block(x, mask=mask, dropout_key=k, return_weights=return_weights, kv_lengths=kv_lengths)
            if return_weights:
                x, w = x
                weights.append(w)
        x = self.ln_f(x)
        return (x, weights) if return_weights else x


class TokenClassifier(nnx.Module):
    """Per-token classification head over any backbone: ``[B, T, ...] -> logits [B, T, C]``."""

    def __init__(self, backbone: nnx.Module, num_classes: int, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = nnx.Linear(backbone.features, num_classes, rngs=rngs)

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        return self.head(self.backbone(inputs, lengths, dropout_key=dropout_key))


class SequenceClassifier(nnx.Module):
    """Per-sequence head: mean over the real positions of the backbone output -> logits ``[B, C]``."""

    def __init__(self, backbone: nnx.Module, num_classes: int, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = nnx.Linear(backbone.features, num_classes, rngs=rngs)

    def __call__(self, inputs, lengths=None, *, dropout_key=None):
        h = self.backbone(inputs, lengths, dropout_key=dropout_key)  # [B, T, D]
        valid = sequence_mask(lengths, h.shape[1])
        if valid is None:
            pooled = h.mean(axis=1)
        else:
            w = valid[..., None].astype(h.dtype)  # [B, T, 1]
            pooled = (h * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
        return self.head(pooled)
