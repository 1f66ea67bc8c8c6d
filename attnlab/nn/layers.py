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
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import masks as masks_lib
from attnlab import positional
from attnlab.data import packing
from attnlab.heads import init_multi_head_params, multi_head_attention, resolve_score
from attnlab.nn.attention import KINDS, AttentionFn, as_attention

__all__ = [
    "split_key",
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

ATTENTION_KINDS = KINDS  # softmax: attnlab.attention; linear, performer: attnlab.efficient


def split_key(key: jax.Array | None, n: int) -> tuple:
    """``n`` keys from ``key`` (``jax.random.split``) as a tuple, or ``n`` Nones when ``key`` is None.

    The models' dropout keys: ``dropout_key=None`` means evaluation, and then every layer gets None.

    Example:
        >>> split_key(None, 2)
        (None, None)
        >>> len(split_key(jax.random.key(0), 3))
        3
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"split_key: n must be an int >= 0, got {n!r}")
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``key`` is None or ``rate == 0``."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


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
        kind: the attention between the projections, an ``attnlab.nn.attention`` object:
            ``Softmax(implementation)`` (``attnlab.attention``, any mask; the default),
            ``Linear()`` (elu+1 linear attention), ``Performer(M)`` (FAVOR+ with M random features,
            drawn once at init from ``rngs`` and kept fixed: a non-trainable ``projection``
            variable ``[M, H]``), any ``AttentionFn`` or a callable ``fn(q, k, v, *, mask, bias)``;
            or a name ``"softmax" | "linear" | "performer"``, configured by ``implementation`` and
            ``num_features``. The O(N) kinds take padding as ``kv_lengths`` instead of a mask
            (see ``attnlab.efficient``).

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
        kind: str | AttentionFn = "softmax",
        implementation: str | None = None,
        num_features: int = 256,
        rngs: nnx.Rngs,
    ):
        try:
            attn = as_attention(kind, implementation=implementation, num_features=num_features)
        except ValueError as e:
            raise ValueError(f"MultiHeadAttention: {e}") from None
        if not attn.takes_score and score != "dot":
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
        self.kind = attn
        state = attn.init(rngs.params(), head_dim=params["wq"].shape[-1]) if attn.state_name else None
        if state is not None:
            setattr(self, attn.state_name, nnx.Variable(state))

    def params(self) -> dict[str, jax.Array]:
        """The params pytree for ``attnlab.heads.multi_head_attention``."""
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(self, x_q, x_kv=None, *, mask=None, bias=None, return_weights=False, rotary=None, kv_lengths=None):
        """``[..., T, D]`` (and ``[..., S, Dkv]``) -> ``[..., T, D]`` (, weights ``[..., N, T, S]``).

        ``bias`` (an array or a callable ``bias(q_idx, k_idx)`` such as ``positional.Alibi().bias(N)``) and
        ``rotary`` (e.g. ``positional.rope``, applied to q and k) are as in ``multi_head_attention``.
        ``kv_lengths`` (int ``[...]``) is the padding of the O(N) kinds; softmax takes a mask instead.
        """
        name = self.kind.state_name
        state = getattr(self, name)[...] if name else None
        params = self.params()
        score = {"score": resolve_score(self.score, params)} if self.kind.takes_score else {}
        kw = self.kind.mha_kwargs(mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, **score)
        return multi_head_attention(
            params, x_q, x_kv, score=self.score, return_weights=return_weights, rotary=rotary, **kw
        )


class TransformerBlock(nnx.Module):
    """Pre-norm block: ``x + drop(MHA(LN(x)))``, then ``x + drop(MLP(LN(x)))`` (MLP: D -> M -> D, GELU).

    Pre-norm as in Xiong et al. 2020 (arXiv 2002.04745): stable without learning-rate warmup.
    ``attention`` is ``MultiHeadAttention``'s ``kind`` (an object or a name; ``implementation`` and
    ``num_features`` configure the names only).
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
        attention: str | AttentionFn = "softmax",
        implementation: str | None = None,
        num_features: int = 256,
        rngs: nnx.Rngs,
    ):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = MultiHeadAttention(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            score=score,
            kind=attention,
            implementation=implementation,
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
        k1, k2, k3 = split_key(dropout_key, 3)
        a = self.attn(
            self.ln1(x), mask=mask, return_weights=return_weights, bias=bias, rotary=rotary, kv_lengths=kv_lengths
        )
        a, w = a if return_weights else (a, None)
        x = x + dropout(a, self.dropout_rate, k1)
        h = dropout(jax.nn.gelu(self.mlp_in(self.ln2(x))), self.dropout_rate, k2)
        x = x + dropout(self.mlp_out(h), self.dropout_rate, k3)
        return (x, w) if return_weights else x


# Keywords the Encoder does not take, each with what to pass instead (a ValueError says so).
_NOT_KEYWORDS = {
    "max_len": "posenc=positional.Sinusoidal(max_len) or positional.Learned(max_len)",
    "t5_buckets": "posenc=positional.T5(num_buckets, max_distance)",
    "t5_max_distance": "posenc=positional.T5(num_buckets, max_distance)",
    "grid": "posenc=positional.Sinusoidal2D(height, width)",
    "window": "attention_mask=masks.window(w, w)",
    "implementation": "attention=nn.Softmax(implementation)",
    "num_features": "attention=nn.Performer(num_features)",
}


class Encoder(nnx.Module):
    """Token embedding (or input projection) + positional encoding + L pre-norm blocks + final LayerNorm.

    Args:
        d_model: D.  num_layers: L.  num_heads: N.  mlp_dim: M (default 4 D).
        vocab_sizes / input_dim / chars: see ``TokenEmbedding``.
        posenc: an ``attnlab.positional.Encoding``, which says what to add to the inputs, how to
            rotate q and k, and what bias to add to the logits of every layer:
            ``NoPosition()``, ``Sinusoidal(max_len=512)`` (Vaswani 2017, added; the default ``"sinusoidal"``),
            ``Learned(max_len=512)`` (a ``[max_len, D]`` table ``pos_table``, added), ``Rope()``
            (``positional.rope`` on q and k), ``Alibi()`` (``Alibi().bias(N)``, a callable
            bias), ``T5(num_buckets=32, max_distance=128)`` (bucketed relative bias, a learnable
            ``t5_table [num_buckets, N]`` shared by all layers), ``Sinusoidal2D(height, width)`` (for
            grids of image patches or pixels, T = height * width), or your own subclass. Callable
            biases are evaluated per tile by the blockwise kernel: no ``[T, S]`` array is built
            there. Or a name of ``positional.SCHEMES``, built with its defaults by
            ``positional.encoding(name)`` (use ``positional.encoding(name, **options)`` to configure it).
        attention: an ``attnlab.nn.attention`` object: ``Softmax(implementation=None)`` (the default ``"softmax"``),
            ``Linear()``, ``Performer(num_features=256)``, any ``AttentionFn``, or a callable ``fn(q,
            k, v, *, mask, bias)``; or a name ``"softmax" | "linear" | "performer"`` (its defaults).
            The O(N) kinds take padding as ``kv_lengths``.
        attention_mask: a structural mask ANDed with padding for attention that takes masks, or its
            ``masks.from_spec`` string (``"window:4:4"``, ``"chunks:64 & causal"``), e.g.
            ``masks.window(w, w)``, ``masks.chunks(c)`` (LRA's local attention),
            ``masks.bigbird(max_len, ...)`` or ``masks.window_2d(width, r)``; it is static module
            structure, so it holds no arrays (not padding or a dense mask).
        dropout_rate, num_kv_heads, score: passed to each block.

    Raises:
        ValueError: a bad posenc, attention or attention_mask, a keyword of ``_NOT_KEYWORDS``
            (``max_len``, ``window``, ...: the message says which object to pass instead).

    Call: ``encoder(inputs, lengths=None, *, dropout_key=None, return_weights=False)`` with inputs
    ``[B, T]`` / ``[B, T, F]`` and lengths int ``[B]`` -> ``[B, T, D]`` (, list of L weights
    ``[B, N, T, T]``). Positions t >= lengths[b] are padding: no real token attends to them.
    Optional ``mask=`` (an extra mask, e.g. ``masks.graph(adjacency)``, and-ed with the padding and
    structural masks) and ``bias=`` (added to the logits of every layer, e.g. a Graphormer distance
    bias ``[B, N, T, T]``) let a caller restrict or bias attention per batch.

    Example:
        >>> enc = Encoder(vocab_sizes=100, d_model=16, num_layers=2, num_heads=4, rngs=nnx.Rngs(0))
        >>> enc(jnp.zeros((2, 7), int), jnp.array([7, 3])).shape
        (2, 7, 16)
        >>> enc = Encoder(vocab_sizes=100, d_model=16, num_layers=1, num_heads=4, posenc=positional.Rope(),
        ...               attention_mask=masks_lib.window(2, 2), rngs=nnx.Rngs(0))
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
        posenc: positional.Encoding | str = "sinusoidal",
        attention: AttentionFn | str = "softmax",
        attention_mask: masks_lib.Mask | str | None = None,
        dropout_rate: float = 0.0,
        num_kv_heads: int | None = None,
        score: str = "dot",
        rngs: nnx.Rngs,
        **not_keywords,
    ):
        if not_keywords:
            self._refuse(not_keywords)
        posenc = self._encoding(posenc)
        try:
            attention = as_attention(attention)
        except ValueError as e:
            raise ValueError(f"Encoder: {e}") from None
        attention_mask = self._structure(attention_mask)
        if not attention.takes_mask and attention_mask is not None:
            raise ValueError(
                f"Encoder: attention={attention!r} takes no attention_mask (it takes padding as kv_lengths)"
            )
        posenc.check(d_model=d_model, num_heads=num_heads)
        self.features = d_model
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, chars=chars, rngs=rngs)
        self.posenc = posenc
        if posenc.param_name:  # e.g. pos_table, t5_table: drawn here, after the embeddings
            init = posenc.init(rngs.params(), d_model=d_model, num_heads=num_heads)
            setattr(self, posenc.param_name, nnx.Param(init))
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
                    attention=attention,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.dropout_rate = dropout_rate
        self.attention = attention
        self.attention_mask = attention_mask

    @staticmethod
    def _refuse(kwargs):
        unknown = sorted(set(kwargs) - set(_NOT_KEYWORDS))
        if unknown:
            raise TypeError(f"Encoder.__init__() got unexpected keyword arguments {unknown}")
        instead = "; ".join(f"for {n}= pass {_NOT_KEYWORDS[n]}" for n in sorted(kwargs))
        raise ValueError(f"Encoder: {sorted(kwargs)} are not Encoder arguments: {instead}")

    @staticmethod
    def _encoding(posenc) -> positional.Encoding:
        if isinstance(posenc, positional.Encoding):
            return posenc
        if not isinstance(posenc, str):
            raise ValueError(
                f"Encoder: posenc must be an attnlab.positional.Encoding or a name of positional.SCHEMES, "
                f"got {type(posenc).__name__}"
            )
        try:
            return positional.encoding(posenc)
        except ValueError as e:
            raise ValueError(f"Encoder: {e}") from None

    @staticmethod
    def _structure(attention_mask) -> masks_lib.Mask | None:
        if isinstance(attention_mask, str):
            attention_mask = masks_lib.from_spec(attention_mask)  # e.g. "window:4:4", "chunks:64 | global:0"
        if attention_mask is not None and not isinstance(attention_mask, masks_lib.Mask):
            raise ValueError(
                f"Encoder: attention_mask must be an attnlab.masks Mask, got {type(attention_mask).__name__}"
            )
        return attention_mask

    @staticmethod
    def _check_packed(x, batch_time, name, fn="Encoder"):
        x = jnp.asarray(x)
        if tuple(x.shape) != tuple(batch_time) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: {name} must be an integer array [B, T] = {list(batch_time)} like the inputs, "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        return x

    def mask(self, lengths):
        """The attention mask for a batch: padding(lengths) & attention_mask (None when neither)."""
        m = None if lengths is None else masks_lib.padding(lengths, lengths)
        extra = self.attention_mask
        return extra if m is None else (m if extra is None else m & extra)

    def __call__(
        self,
        inputs,
        lengths=None,
        *,
        segment_ids=None,
        positions=None,
        mask=None,
        bias=None,
        dropout_key=None,
        return_weights=False,
    ):
        """``inputs [B, T, ...]`` -> ``[B, T, D]`` (and the weights of every layer with ``return_weights``).

        A packed batch (``attnlab.data.packing.pack``): pass ``segment_ids`` ``[B, T]`` (``PAD_SEGMENT``
        on padding) and each document attends only within itself (``masks.document``), with its
        positions restarting at 0 (``positions`` ``[B, T]``, default ``packing.segment_positions``) for
        the schemes added to the inputs (sinusoidal, learned, 2-D); the relative schemes (RoPE, ALiBi,
        T5) depend on ``q_idx - k_idx`` only, which is the same inside a document packed or alone.
        """
        T = inputs.shape[1]
        pe = self.posenc
        param = getattr(self, pe.param_name)[...] if pe.param_name else None
        added = pe.inputs(T, self.features, param)  # [T, D] or None; checks T against the scheme
        x = self.embed(inputs)  # [B, T, D]
        if segment_ids is not None:
            segment_ids = self._check_packed(segment_ids, inputs.shape[:2], "segment_ids")
            if positions is None:
                positions = packing.segment_positions(segment_ids)
            doc = masks_lib.document(segment_ids, padding_id=packing.PAD_SEGMENT)
            mask = doc if mask is None else doc & mask
        if positions is not None:
            positions = self._check_packed(positions, inputs.shape[:2], "positions")
            if added is not None:
                added = jnp.take(added, positions, axis=0)  # [B, T, D]: each document from position 0
        if added is not None:
            x = x + added
        rotary = pe.rotary()  # applied to q and k in every layer
        pos_bias = pe.bias(self.num_heads, param)  # bias(q_idx, k_idx) -> [N, T', S']
        if pos_bias is not None:
            if bias is not None:
                raise ValueError(
                    f"Encoder: bias= cannot be combined with posenc={pe!r} (which is itself a bias); "
                    "use another posenc or fold the positional bias into yours"
                )
            bias = pos_bias
        keys = split_key(dropout_key, len(self.blocks) + 1)
        x = dropout(x, self.dropout_rate, keys[0])
        takes_mask = self.attention.takes_mask
        if segment_ids is not None and not takes_mask:
            raise ValueError(
                f"Encoder: segment_ids (a packed batch) need an attention that takes a mask; "
                f"attention={self.attention!r} takes padding lengths only"
            )
        own = self.mask(lengths) if takes_mask else None
        mask = own if mask is None else (mask if own is None else own & mask)
        kv_lengths = None if takes_mask else lengths
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
