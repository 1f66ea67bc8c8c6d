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

import dataclasses
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
    "masked_mean",
    "masked_max",
    "Chars",
    "TokenEmbedding",
    "MultiHeadAttention",
    "TransformerBlock",
    "Encoder",
    "TokenClassifier",
    "SequenceClassifier",
]

POSENCS = (*positional.SCHEMES, "sinusoidal_2d")  # none, sinusoidal, learned, rope, alibi, t5; 2-D grids
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


def masked_mean(x: jax.Array, valid: jax.Array, axis: int = -2) -> jax.Array:
    """Mean of ``x`` over ``axis`` at the positions where ``valid`` is True; 0 where none is.

    ``x`` ``[..., C, E]`` and ``valid`` bool ``[..., C]`` (axis=-2) -> ``[..., E]``.
    """
    w = jnp.expand_dims(valid, -1).astype(x.dtype)  # [..., C, 1]
    return (x * w).sum(axis) / jnp.maximum(w.sum(axis), 1.0)


def masked_max(x: jax.Array, valid: jax.Array, axis: int = -2) -> jax.Array:
    """Max of ``x`` over ``axis`` at the positions where ``valid`` is True; 0 where none is."""
    v = jnp.expand_dims(valid, -1)  # [..., C, 1]
    m = jnp.where(v, x, jnp.finfo(x.dtype).min).max(axis)
    return jnp.where(v.any(axis), m, jnp.zeros_like(m))


@dataclasses.dataclass(frozen=True)
class Chars:
    """A character-level view of each token, for ``TokenEmbedding(chars=...)``.

    The last C id channels of the inputs are character ids (0 = padding). Each character gets an
    embedding of width D from one shared table; ``pool="mean"`` averages them over the token's
    real characters; ``pool="cnn"`` applies a width-``kernel_size`` convolution (D -> D, GELU) along
    the characters and takes the max over the real ones (a small char CNN, Ma & Hovy 2016,
    arXiv 1603.01354). The result is added to the sum of the word-level embeddings.

    Args:
        vocab_size: size of the character table (ids 0 .. vocab_size - 1; 0 is padding).
        pool: "mean" or "cnn".
        kernel_size: the char CNN's width (pool="cnn" only).
    """

    vocab_size: int
    pool: str = "cnn"
    kernel_size: int = 3

    def __post_init__(self):
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"Chars: vocab_size must be an int >= 2, got {self.vocab_size!r}")
        if self.pool not in ("mean", "cnn"):
            raise ValueError(f"Chars: pool must be 'mean' or 'cnn', got {self.pool!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1:
            raise ValueError(f"Chars: kernel_size must be an int >= 1, got {self.kernel_size!r}")


class TokenEmbedding(nnx.Module):
    """Token inputs -> ``[B, T, D]``: sum of one embedding per int feature, or a linear projection.

    Args:
        d_model: D.
        vocab_sizes: an int, or one int per feature channel (inputs int ``[B, T]`` or ``[B, T, F]``;
            e.g. word id, suffix id, word-shape id). Exactly one of vocab_sizes / input_dim.
        input_dim: F for float inputs ``[B, T, F]`` (input projection).
        chars: optional ``Chars``: the inputs are int ``[B, T, F + C]``, the first F channels
            embedded as above (F = len(vocab_sizes)) and the last C >= 1 character ids pooled
            into one more D-vector per token (see ``Chars``). Needs vocab_sizes.

    Example:
        >>> emb = TokenEmbedding(8, vocab_sizes=(10, 3), chars=Chars(20, pool="mean"), rngs=nnx.Rngs(0))
        >>> emb(jnp.array([[[4, 1, 7, 9, 0]]])).shape   # word 4, shape 1, chars 7 and 9 (0 = pad)
        (1, 1, 8)
    """

    def __init__(
        self,
        d_model: int,
        *,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        chars: Chars | None = None,
        rngs: nnx.Rngs,
    ):
        if (vocab_sizes is None) == (input_dim is None):
            raise ValueError(
                "TokenEmbedding: pass exactly one of vocab_sizes (int ids) or input_dim "
                f"(float features), got vocab_sizes={vocab_sizes!r}, input_dim={input_dim!r}"
            )
        if chars is not None and (vocab_sizes is None or isinstance(vocab_sizes, int)):
            raise ValueError(
                "TokenEmbedding: chars needs vocab_sizes as a sequence (inputs [B, T, F + C]), "
                f"got vocab_sizes={vocab_sizes!r}"
            )
        if chars is not None and not isinstance(chars, Chars):
            raise ValueError(f"TokenEmbedding: chars must be None or an attnlab.nn.Chars, got {chars!r}")
        self.features = d_model
        self.chars = chars
        if chars is not None:
            self.char_embed = nnx.Embed(chars.vocab_size, d_model, rngs=rngs)
            if chars.pool == "cnn":
                self.char_conv = nnx.Conv(d_model, d_model, chars.kernel_size, padding="SAME", rngs=rngs)
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
        F = len(self.embeds)
        if self.chars is None and ids.shape[-1] != F:
            raise ValueError(
                f"TokenEmbedding: inputs have {ids.shape[-1]} id channels, expected {F} (shape {inputs.shape})"
            )
        if self.chars is not None and ids.shape[-1] <= F:
            raise ValueError(
                f"TokenEmbedding: with chars, inputs need {F} word channels + at least 1 character "
                f"channel, got shape {inputs.shape}"
            )
        x = sum(e(ids[..., i]) for i, e in enumerate(self.embeds))
        if self.chars is not None:
            x = x + self.char_view(ids[..., F:])
        return x

    def char_view(self, char_ids: jax.Array) -> jax.Array:
        """Character ids ``[..., C]`` (0 = padding) -> pooled ``[..., D]`` (zeros for no characters)."""
        valid = char_ids > 0  # [..., C]
        e = self.char_embed(char_ids)  # [..., C, D]
        if self.chars.pool == "mean":
            return masked_mean(e, valid)
        lead = e.shape[:-2]
        h = (e * valid[..., None]).reshape(-1, *e.shape[-2:])  # [..., C, D] -> [M, C, D], padding zeroed
        h = jax.nn.gelu(self.char_conv(h)).reshape(*lead, *e.shape[-2:])  # [M, C, D] -> [..., C, D]
        return masked_max(h, valid)


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

    def __call__(self, x_q, x_kv=None, *, mask=None, bias=None, return_weights=False, rotary=None, kv_lengths=None):
        """``[..., T, D]`` (and ``[..., S, Dkv]``) -> ``[..., T, D]`` (, weights ``[..., N, T, S]``).

        ``bias`` (an array or a callable ``bias(q_idx, k_idx)`` such as ``positional.alibi(N)``) and
        ``rotary`` (e.g. ``positional.rope``, applied to q and k) are as in ``multi_head_attention``.
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
            rotary=rotary,
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

    def __call__(
        self, x, *, mask=None, bias=None, dropout_key=None, return_weights=False, rotary=None, kv_lengths=None
    ):
        """``[B, T, D] -> [B, T, D]`` (, attention weights ``[B, N, T, S]``); bias, rotary: see MultiHeadAttention."""
        k1, k2, k3 = _split(dropout_key, 3)
        a = self.attn(
            self.ln1(x), mask=mask, return_weights=return_weights, bias=bias, rotary=rotary, kv_lengths=kv_lengths
        )
        a, w = a if return_weights else (a, None)
        x = x + dropout(a, self.dropout_rate, k1)
        h = dropout(jax.nn.gelu(self.mlp_in(self.ln2(x))), self.dropout_rate, k2)
        x = x + dropout(self.mlp_out(h), self.dropout_rate, k3)
        return (x, w) if return_weights else x


class Encoder(nnx.Module):
    """Token embedding (or input projection) + positional encoding + L pre-norm blocks + final LayerNorm.

    Args:
        d_model: D.  num_layers: L.  num_heads: N.  mlp_dim: M (default 4 D).
        vocab_sizes / input_dim / chars: see ``TokenEmbedding``.
        posenc: one of ``positional.SCHEMES``: ``"none"`` | ``"sinusoidal"`` (Vaswani 2017, added to
            the embeddings) | ``"learned"`` (a ``[max_len, D]`` table, added) | ``"rope"`` (``positional.rope``
            on q and k in every layer) | ``"alibi"`` (``positional.alibi(N)`` as a callable bias on the
            logits of every layer) | ``"t5"`` (T5 bucketed relative bias, bidirectional, a learnable
            ``t5_table [num_buckets, N]`` shared by all layers as in T5, as a callable bias). Callable
            biases are evaluated per tile by the blockwise kernel: no ``[T, S]`` array is built there;
            or ``"sinusoidal_2d"`` (``positional.sinusoidal_2d`` over ``grid``, added; inputs are the
            grid's cells row-major, T = height * width: image patches or pixels).
        max_len: longest sequence for the absolute schemes (sinusoidal, learned); the relative
            schemes (rope, alibi, t5) take any length.
        t5_buckets, t5_max_distance: the T5 bias's ``num_buckets`` and ``max_distance``.
        window: None for full attention, or w: each token sees the w tokens on each side
            (``masks.window(w, w)``), combined with the padding mask.
        attention: ``"softmax"`` (default), or an O(N) kind ``"linear"`` / ``"performer"``
            (``MultiHeadAttention``'s ``kind``; padding goes in as ``kv_lengths``).
        attention_mask: a structural mask ANDed with padding (and window) for softmax attention,
            e.g. ``masks.chunks(c)`` (LRA's local attention), ``masks.bigbird(max_len, ...)`` or
            ``masks.window_2d(width, r)`` (2-D local attention on a grid);
            it is static module structure, so it holds no arrays (not padding or a dense mask).
        num_features: Performer's M.
        grid: ``(height, width)`` of the token grid, for ``posenc="sinusoidal_2d"``.
        dropout_rate, num_kv_heads, score, implementation: passed to each block.

    Call: ``encoder(inputs, lengths=None, *, dropout_key=None, return_weights=False)`` with inputs
    ``[B, T]`` / ``[B, T, F]`` and lengths int ``[B]`` -> ``[B, T, D]`` (, list of L weights
    ``[B, N, T, T]``). Positions t >= lengths[b] are padding: no real token attends to them.
    Optional ``mask=`` (an extra mask, e.g. ``masks.graph(adjacency)``, and-ed with the padding and
    window masks) and ``bias=`` (added to the logits of every layer, e.g. a Graphormer distance bias
    ``[B, N, T, T]``) let a caller restrict or bias attention per batch.

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
        chars: Chars | None = None,
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
        t5_buckets: int = 32,
        t5_max_distance: int = 128,
        grid: tuple[int, int] | None = None,
        rngs: nnx.Rngs,
    ):
        if posenc not in POSENCS:
            raise ValueError(f"Encoder: posenc must be one of {POSENCS}, got {posenc!r}")
        if window is not None and (not isinstance(window, int) or window < 0):
            raise ValueError(f"Encoder: window must be None or an int >= 0, got {window!r}")
        if (posenc == "sinusoidal_2d") != (grid is not None):
            raise ValueError(f"Encoder: grid=(height, width) goes with posenc='sinusoidal_2d', got grid={grid!r}")
        self.grid = None if grid is None else tuple(grid)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"Encoder: attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if attention != "softmax" and (window is not None or attention_mask is not None):
            raise ValueError(f"Encoder: attention={attention!r} takes no window or attention_mask (softmax only)")
        if attention_mask is not None and not isinstance(attention_mask, masks_lib.Mask):
            raise ValueError(
                f"Encoder: attention_mask must be an attnlab.masks Mask, got {type(attention_mask).__name__}"
            )
        self.features = d_model
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, chars=chars, rngs=rngs)
        self.posenc = posenc
        self.max_len = max_len
        if posenc == "learned":
            self.pos_table = nnx.Param(positional.init_learned(rngs.params(), max_len, d_model))
        if posenc == "rope" and (d_model % num_heads or (d_model // num_heads) % 2):
            raise ValueError(
                f"Encoder: posenc='rope' needs an even head dim d_model/num_heads, got {d_model}/{num_heads}"
            )
        if posenc == "t5":
            t5 = positional.init_t5_bias(rngs.params(), num_heads, num_buckets=t5_buckets, max_distance=t5_max_distance)
            self.t5_table = nnx.Param(t5.table)  # [num_buckets, N]
            self.t5_max_distance = t5_max_distance
        self.num_heads = num_heads
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

    def __call__(self, inputs, lengths=None, *, mask=None, bias=None, dropout_key=None, return_weights=False):
        T = inputs.shape[1]
        if self.grid is not None and T != self.grid[0] * self.grid[1]:
            raise ValueError(f"Encoder: inputs length {T} != grid {self.grid[0]} x {self.grid[1]}")
        if self.posenc in ("sinusoidal", "learned") and inputs.shape[1] > self.max_len:
            raise ValueError(f"Encoder: inputs length {T} exceeds max_len={self.max_len}")
        x = self.embed(inputs)  # [B, T, D]
        rotary = None
        if bias is not None and self.posenc in ("alibi", "t5"):
            raise ValueError(
                f"Encoder: bias= cannot be combined with posenc={self.posenc!r} (which is itself a bias); "
                "use another posenc or fold the positional bias into yours"
            )
        match self.posenc:
            case "sinusoidal":
                x = x + positional.sinusoidal(T, self.features)
            case "learned":
                x = x + self.pos_table[...][:T]
            case "rope":
                rotary = positional.rope  # positions 0 .. T-1 of q and k
            case "alibi":
                bias = positional.alibi(self.num_heads)  # bias(q_idx, k_idx) -> [N, T', S']
            case "t5":
                bias = positional.T5Bias(self.t5_table[...], bidirectional=True, max_distance=self.t5_max_distance)
            case "sinusoidal_2d":
                x = x + positional.sinusoidal_2d(*self.grid, self.features)
            case "none":
                pass
        keys = _split(dropout_key, len(self.blocks) + 1)
        x = dropout(x, self.dropout_rate, keys[0])
        softmax = self.attention == "softmax"
        own = self.mask(lengths, T) if softmax else None
        mask = own if mask is None else (mask if own is None else own & mask)
        kv_lengths = None if softmax else lengths
        weights = []
        for block, k in zip(self.blocks, keys[1:], strict=True):
            x = block(
                x,
                mask=mask,
                dropout_key=k,
                return_weights=return_weights,
                bias=bias,
                rotary=rotary,
                kv_lengths=kv_lengths,
            )
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

    def __call__(self, inputs, lengths=None, *, dropout_key=None, **backbone_kwargs):
        """``backbone_kwargs`` (e.g. ``adjacency=`` for a graph backbone) go to the backbone."""
        return self.head(self.backbone(inputs, lengths, dropout_key=dropout_key, **backbone_kwargs))


class SequenceClassifier(nnx.Module):
    """Per-sequence head: mean over the real positions of the backbone output -> logits ``[B, C]``."""

    def __init__(self, backbone: nnx.Module, num_classes: int, *, rngs: nnx.Rngs):
        self.backbone = backbone
        self.head = nnx.Linear(backbone.features, num_classes, rngs=rngs)

    def __call__(self, inputs, lengths=None, *, dropout_key=None, **backbone_kwargs):
        """``backbone_kwargs`` (e.g. ``adjacency=`` for a graph backbone) go to the backbone."""
        h = self.backbone(inputs, lengths, dropout_key=dropout_key, **backbone_kwargs)  # [B, T, D]
        valid = sequence_mask(lengths, h.shape[1])
        if valid is None:
            pooled = h.mean(axis=1)
        else:
            w = valid[..., None].astype(h.dtype)  # [B, T, 1]
            pooled = (h * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
        return self.head(pooled)
