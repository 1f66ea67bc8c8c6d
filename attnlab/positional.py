"""Positional encodings: every scheme the course note points at, as pure functions.

Self-attention alone is blind to order: permuting the inputs permutes the outputs. The note's fix
is a hand-made vector e_i added to each input, and it adds that "there are many methods and no
clear best one". attnlab has them all, in three families:

* **absolute, added to the inputs**: ``sinusoidal`` (Vaswani et al. 2017, arXiv 1706.03762),
  a learned table (``init_learned``), and ``sinusoidal_2d`` for images as sequences of patches;
* **rotary, applied to q and k**: ``rope`` (Su et al. 2021, arXiv 2104.09864) and ``rope_2d``;
  after rotation the dot product <rope(q, i), rope(k, j)> depends only on i - j;
* **relative, added to the logits** as functions of (query index, key index): ALiBi (``Alibi``,
  Press et al. 2021, arXiv 2108.12409; slopes ``alibi_slopes``) and T5's bucketed bias (``T5``,
  Raffel et al. 2019, arXiv 1910.10683; buckets ``t5_bucket``). Their ``bias(N, ...)`` is a callable
  ``bias(q_idx, k_idx) -> [N, T', S']`` that a blockwise kernel evaluates one block at a time, and
  ``.dense(T, S)`` gives the ``[N, T, S]`` array for ``attention(..., bias=...)``.

Each scheme has one name, its class, an ``Encoding``: ``NoPosition``, ``Sinusoidal``, ``Learned``,
``Rope``, ``Alibi``, ``T5``, ``Sinusoidal2D``. What it does is what its methods return (``inputs``,
``rotary``, ``bias``, ``init``): what ``attnlab.nn.Encoder(posenc=...)`` asks. The lower-case
functions above are the arithmetic they use. ``SCHEMES`` maps each ``--posenc`` flag value
(``none | sinusoidal | learned | rope | alibi | t5 | sinusoidal_2d``, the class's ``name``) to its
class; ``scheme(name)`` validates a flag and ``encoding(name, **options)`` builds its object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import _pytree, scores  # _pytree: register_dataclass with the class in the treedef

__all__ = [
    "SCHEMES",
    "scheme",
    "sinusoidal",
    "sinusoidal_2d",
    "init_learned",
    "rope",
    "rope_2d",
    "alibi_slopes",
    "t5_bucket",
    "Encoding",
    "NoPosition",
    "Sinusoidal",
    "Learned",
    "Rope",
    "Alibi",
    "T5",
    "Sinusoidal2D",
    "encoding",
]


def _positive_int(fn, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")
    return int(value)


# ------------------------------------------------------------------------------------------
# Absolute encodings (added to the inputs)


def sinusoidal(num_positions: int, d_model: int, *, base: float = 10000.0) -> jax.Array:
    """The hand-made encoding of Vaswani et al.: ``PE[p, 2i] = sin(p / base^(2i/D))``, ``PE[p, 2i+1] = cos(...)``.

    Args:
        num_positions: P, number of positions (0 .. P-1).
        d_model: D, width of the inputs it is added to (odd D: the last column is a sine).
        base: wavelength scale; wavelengths run from 2*pi to base*2*pi.

    Returns:
        fp32 ``[P, D]``.

    Example:
        >>> pe = sinusoidal(4, 6)
        >>> pe.shape, float(pe[0, 1]), round(float(pe[1, 0]), 4)   # cos(0) = 1, sin(1) = 0.8415
        ((4, 6), 1.0, 0.8415)
    """
    p = _positive_int("sinusoidal", "num_positions", num_positions)
    d = _positive_int("sinusoidal", "d_model", d_model)
    pos = np.arange(p, dtype=np.float64)[:, None]  # [P, 1]
    i = np.arange(0, d, 2, dtype=np.float64)[None, :]  # [1, ceil(D/2)]: 2i
    angles = pos / base ** (i / d)
    pe = np.zeros((p, d))
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles[:, : d // 2])
    return jnp.asarray(pe, jnp.float32)


def sinusoidal_2d(height: int, width: int, d_model: int, *, base: float = 10000.0) -> jax.Array:
    """2-D sinusoidal encoding for an image as a sequence of ``height x width`` patches (row-major).

    The first D/2 channels are ``sinusoidal`` of the row index, the last D/2 of the column index
    (as in ViT/MAE's fixed 2-D encoding), so patch (r, c) at sequence position ``r * width + c`` gets
    ``concat(sinusoidal(H, D/2)[r], sinusoidal(W, D/2)[c])``.

    Returns:
        fp32 ``[height * width, D]``; D must be even.
    """
    h = _positive_int("sinusoidal_2d", "height", height)
    w = _positive_int("sinusoidal_2d", "width", width)
    d = _positive_int("sinusoidal_2d", "d_model", d_model)
    if d % 2:
        raise ValueError(f"sinusoidal_2d: d_model must be even (half for rows, half for columns), got {d}")
    rows = jnp.repeat(sinusoidal(h, d // 2, base=base), w, axis=0)  # [H*W, D/2]: row r repeated W times
    cols = jnp.tile(sinusoidal(w, d // 2, base=base), (h, 1))  # [H*W, D/2]: columns cycle
    return jnp.concatenate([rows, cols], axis=-1)


def init_learned(key, num_positions: int, d_model: int, *, stddev: float = 0.02, dtype=jnp.float32) -> jax.Array:
    """A learned absolute table ``[P, D]``, normal(0, stddev) as in BERT/GPT-2; train it like any weight."""
    p = _positive_int("init_learned", "num_positions", num_positions)
    d = _positive_int("init_learned", "d_model", d_model)
    return (stddev * jax.random.normal(key, (p, d), jnp.float32)).astype(dtype)


# ------------------------------------------------------------------------------------------
# Rotary encodings (applied to q and k)


def _rotate(x, positions, base, fn):
    """Rotates consecutive pairs (x[2i], x[2i+1]) of x [..., T, N, H] by angle pos * base^(-2i/H)."""
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"{fn}: the rotated head dim must be even, got {h} (x shape {x.shape})")
    inv_freq = base ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    angles = positions.astype(jnp.float32)[..., :, None, None] * inv_freq  # [..., T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], h // 2, 2)  # [..., T, N, H] -> [..., T, N, H/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)  # [..., T, N, H/2, 2] -> [..., T, N, H]


def _positions(x, positions, fn, name="positions"):
    if not hasattr(x, "ndim") or x.ndim < 3:
        raise ValueError(f"{fn}: x must have shape [..., T, N, H], got {getattr(x, 'shape', type(x).__name__)}")
    t = x.shape[-3]
    if positions is None:
        return jnp.arange(t)
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer) and not jnp.issubdtype(positions.dtype, jnp.floating):
        raise ValueError(f"{fn}: {name} must be numeric, got dtype {positions.dtype}")
    if positions.ndim == 0 or positions.shape[-1] != t:
        raise ValueError(f"{fn}: {name} must have shape [..., T] with T={t} (x shape {x.shape}), got {positions.shape}")
    try:
        jnp.broadcast_shapes(positions.shape[:-1], x.shape[:-3])
    except ValueError:
        raise ValueError(f"{fn}: {name} batch dims {positions.shape[:-1]} do not match x {x.shape[:-3]}") from None
    return positions


def rope(x: jax.Array, positions=None, *, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding: rotate each pair of channels of q (or k) by an angle growing with position.

    Apply it to both q and k; then ``<rope(q, i), rope(k, j)>`` depends only on ``i - j``, and the
    rotation preserves norms.

    Args:
        x: ``[..., T, N, H]`` queries or keys, H even.
        positions: int ``[..., T]`` positions (default ``0 .. T-1``); pass offsets for a cache.
        base: frequency base, as in the paper.

    Returns:
        ``[..., T, N, H]`` in x's dtype (computed in fp32).

    Example:
        >>> q = jnp.ones((3, 1, 4))
        >>> bool(jnp.allclose(jnp.linalg.norm(rope(q), axis=-1), 2.0))
        True
    """
    return _rotate(x, _positions(x, positions, "rope"), base, "rope")


def rope_2d(x: jax.Array, rows, cols, *, base: float = 10000.0) -> jax.Array:
    """2-D rotary embedding for image patches: the first H/2 channels rotate with the row, the rest with the column.

    Args:
        x: ``[..., T, N, H]``, H divisible by 4; T = number of patches.
        rows, cols: int ``[..., T]`` row and column of each patch (e.g. ``divmod(arange(T), width)``).
    """
    rows = _positions(x, rows, "rope_2d", "rows")
    cols = _positions(x, cols, "rope_2d", "cols")
    h = x.shape[-1]
    if h % 4:
        raise ValueError(f"rope_2d: head dim must be divisible by 4, got {h}")
    first = _rotate(x[..., : h // 2], rows, base, "rope_2d")
    second = _rotate(x[..., h // 2 :], cols, base, "rope_2d")
    return jnp.concatenate([first, second], axis=-1)


# ------------------------------------------------------------------------------------------
# Relative encodings (functions of query and key index, added to the logits)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n = num_heads.

    For a head count that is not a power of two, Press et al. take the slopes of the closest
    smaller power of two m, then every other slope of 2m for the remaining heads.

    Example:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    n = _positive_int("alibi_slopes", "num_heads", num_heads)

    def geometric(m):
        return [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]

    m = 2 ** int(math.floor(math.log2(n)))
    slopes = geometric(m)
    if m < n:
        slopes += geometric(2 * m)[0::2][: n - m]
    return np.asarray(slopes, np.float32)


def _alibi_mod(s: jax.Array, q_idx: jax.Array, k_idx: jax.Array, slopes: jax.Array) -> jax.Array:
    """ALiBi as a ``scores.ScoreMod`` function: ``s - slopes[n] * |q_idx - k_idx|``; ``slopes`` ``[N]``."""
    dist = jnp.abs(q_idx - k_idx).astype(jnp.float32)  # [t, 1] - [1, s] -> [t, s]
    return s - jnp.asarray(slopes, jnp.float32)[:, None, None] * dist


_alibi_mod.head_axes = (0,)  # slopes [N]: a per-head kernel slices them (ScoreMod's default head_axes)


@dataclasses.dataclass(frozen=True)
class _AlibiBias:
    """``Alibi().bias(N)``: ``bias(q_idx [T'], k_idx [S']) -> fp32 [N, T', S']``, ``-slope[n] * |i - j|``."""

    num_heads: int

    @property
    def slopes(self) -> np.ndarray:
        return alibi_slopes(self.num_heads)

    def __call__(self, q_idx, k_idx):
        dist = jnp.abs(q_idx[:, None] - k_idx[None, :]).astype(jnp.float32)  # [T', S']
        return -jnp.asarray(self.slopes)[:, None, None] * dist  # [N, T', S']

    def dense(self, T: int, S: int) -> jax.Array:
        return self(jnp.arange(T), jnp.arange(S))


def t5_bucket(relative_position, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128):
    """T5's bucket of a relative position ``key index - query index``.

    Small distances get a bucket each; larger ones share logarithmically wider buckets up to
    ``max_distance``, beyond which everything shares the last bucket. Bidirectional: half the
    buckets are for keys after the query. Causal (``bidirectional=False``): keys after the query
    all fall in bucket 0.

    Example:
        >>> t5_bucket(jnp.array([-3, 3, -20, -200])).tolist()
        [3, 19, 10, 15]
    """
    rel = jnp.asarray(relative_position)
    n = -rel  # > 0: the key is before the query
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).astype(n.dtype) * num_buckets  # keys after the query: upper half
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2  # distances 0 .. exact-1 each have their own bucket
    log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).astype(n.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < exact, n, large)


@dataclasses.dataclass(frozen=True)
class _T5Bias:
    """``T5(...).bias(N, table)``: ``bias(q_idx [T'], k_idx [S']) -> fp32 [N, T', S']`` with
    ``bias[n, i, j] = table[bucket(k_j - q_i), n]``. A pytree: ``table`` ``[num_buckets, N]`` is its leaf."""

    table: Any  # [num_buckets, N]
    bidirectional: bool = True
    max_distance: int = 128

    def __call__(self, q_idx, k_idx):
        table = jnp.asarray(self.table)
        buckets = t5_bucket(
            k_idx[None, :] - q_idx[:, None],
            bidirectional=self.bidirectional,
            num_buckets=table.shape[0],
            max_distance=self.max_distance,
        )  # [T', S']
        return jnp.moveaxis(table[buckets], -1, 0).astype(jnp.float32)  # [T', S', N] -> [N, T', S']

    def dense(self, T: int, S: int) -> jax.Array:
        return self(jnp.arange(T), jnp.arange(S))


_pytree.register_dataclass(_T5Bias, data_fields=["table"], meta_fields=["bidirectional", "max_distance"])


# ------------------------------------------------------------------------------------------
# Encodings as objects: how a scheme enters a model (the seam attnlab.nn.Encoder calls)


class Encoding:
    """A positional scheme: how it enters a model. ``attnlab.nn.Encoder(posenc=...)`` asks it four things.

    * ``init(key, d_model=, num_heads=)``: its learned parameter (an array) or None; the Encoder keeps
      it as an ``nnx.Param`` named ``param_name`` and passes it back as ``param`` below;
    * ``inputs(T, d_model, param)``: a ``[T, D]`` array added to the token embeddings, or None;
    * ``rotary()``: a function applied to the projected q ``[..., T, N, H]`` and k in every layer, or None;
    * ``bias(num_heads, param)``: added to the logits of every layer, a callable
      ``bias(q_idx [T'], k_idx [S']) -> [N, T', S']`` (evaluated per tile by the blockwise kernel) or None.

    ``check(d_model=, num_heads=)`` raises ValueError for a model it cannot serve. Each shipped scheme
    also names itself: ``name`` (its ``--posenc`` flag value, its key in ``SCHEMES``), ``reference``
    (where it comes from) and ``grid`` (True: for a ``(height, width)`` grid of patches, not a 1-D
    sequence). Subclass it (a frozen dataclass; fields are static hyperparameters) for a new scheme;
    see docs/seams.md.
    """

    name: ClassVar[str | None] = None
    reference: ClassVar[str] = ""
    grid: ClassVar[bool] = False
    param_name: ClassVar[str | None] = None

    def check(self, *, d_model: int, num_heads: int) -> None:
        del d_model, num_heads

    def init(self, key, *, d_model: int, num_heads: int) -> jax.Array | None:
        del key, d_model, num_heads
        return None

    def inputs(self, T: int, d_model: int, param=None) -> jax.Array | None:
        del T, d_model, param
        return None

    def rotary(self) -> Callable[[jax.Array], jax.Array] | None:
        return None

    def bias(self, num_heads: int, param=None) -> Callable | None:
        del num_heads, param
        return None


@dataclasses.dataclass(frozen=True)
class NoPosition(Encoding):
    """No position information: attention is permutation-equivariant."""

    name: ClassVar[str] = "none"
    reference: ClassVar[str] = "no position information: attention is permutation-equivariant"


def _check_max_len(name, T, max_len):
    if T > max_len:
        raise ValueError(f"{name}: inputs length {T} exceeds max_len={max_len}")


@dataclasses.dataclass(frozen=True)
class Sinusoidal(Encoding):
    """``sinusoidal(T, D)`` added to the inputs (Vaswani et al. 2017); sequences up to ``max_len``."""

    max_len: int = 512
    base: float = 10000.0
    name: ClassVar[str] = "sinusoidal"
    reference: ClassVar[str] = "Vaswani et al. 2017, arXiv 1706.03762"

    def inputs(self, T, d_model, param=None):
        _check_max_len("Sinusoidal", T, self.max_len)
        return sinusoidal(T, d_model, base=self.base)


@dataclasses.dataclass(frozen=True)
class Learned(Encoding):
    """A learned ``[max_len, D]`` table (``init_learned``) added to the inputs (BERT, GPT-2)."""

    max_len: int = 512
    name: ClassVar[str] = "learned"
    reference: ClassVar[str] = "learned absolute table (BERT, GPT-2)"
    param_name: ClassVar[str] = "pos_table"

    def init(self, key, *, d_model, num_heads):
        return init_learned(key, self.max_len, d_model)

    def inputs(self, T, d_model, param=None):
        _check_max_len("Learned", T, self.max_len)
        return param[:T]


@dataclasses.dataclass(frozen=True)
class Rope(Encoding):
    """RoPE (Su et al. 2021): ``rope`` rotates q and k by their positions in every layer."""

    base: float = 10000.0
    name: ClassVar[str] = "rope"
    reference: ClassVar[str] = "Su et al. 2021, arXiv 2104.09864"

    def check(self, *, d_model, num_heads):
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"Rope needs an even head dim d_model/num_heads, got {d_model}/{num_heads}")

    def rotary(self):
        return rope if self.base == 10000.0 else _RopeWithBase(self.base)


@dataclasses.dataclass(frozen=True)
class _RopeWithBase:
    base: float

    def __call__(self, x):
        return rope(x, base=self.base)


@dataclasses.dataclass(frozen=True)
class Alibi(Encoding):
    """ALiBi (Press et al. 2021): ``-slope[n] * |i - j|`` on the logits of every layer, no parameters.

    ``bias(N)`` is the callable bias (``.slopes``: ``alibi_slopes(N)``; ``.dense(T, S)`` the ``[N, T, S]``
    array), for ``attention(..., bias=...)`` or an Encoder; ``score(N)`` is the same ALiBi as a
    ``scores.ScoreMod`` on the scaled dot product, its slopes an array leaf (traced: learnable, and
    sliced per head by the Pallas kernel). With a causal mask ``|i - j| = i - j`` on every allowed pair,
    so this is exactly the paper's bias.

    Example:
        >>> Alibi().bias(2).slopes.tolist()
        [0.0625, 0.00390625]
        >>> Alibi().bias(2).dense(2, 3)[0].tolist()   # head 0: -|i - j| / 16
        [[-0.0, -0.0625, -0.125], [-0.0625, -0.0, -0.0625]]
    """

    name: ClassVar[str] = "alibi"
    reference: ClassVar[str] = "Press et al. 2021, arXiv 2108.12409"

    def bias(self, num_heads, param=None):
        return _AlibiBias(_positive_int("Alibi.bias", "num_heads", num_heads))

    def score(self, num_heads: int | None = None, *, slopes=None):
        """ALiBi as ``scores.ScoreMod``: ``s - slopes[n] * |q_idx - k_idx|`` on the scaled dot product.

        Args:
            num_heads: N: the paper's slopes ``alibi_slopes(N)``.
            slopes: or your own ``[N]`` (an array leaf: traced values reuse the program, learned ones
                get gradients); give one of the two.

        Example:
            >>> q = k = jnp.ones((3, 2, 4))                              # [T, N, H]
            >>> Alibi().score(slopes=jnp.array([1.0, 0.5]))(q, k)[1].round(2).tolist()  # 2 - 0.5 |t - s|
            [[2.0, 1.5, 1.0], [1.5, 2.0, 1.5], [1.0, 1.5, 2.0]]
        """
        if (num_heads is None) == (slopes is None):
            raise ValueError("Alibi.score: give num_heads (the paper's slopes) or slopes [N], not both")
        if slopes is None:
            slopes = jnp.asarray(alibi_slopes(_positive_int("Alibi.score", "num_heads", num_heads)), jnp.float32)
        elif len(getattr(slopes, "shape", np.shape(slopes))) != 1:  # an array or a ShapeDtypeStruct
            raise ValueError(f"Alibi.score: slopes must have shape [N], got {getattr(slopes, 'shape', slopes)}")
        return scores.ScoreMod(_alibi_mod, slopes)


@dataclasses.dataclass(frozen=True)
class T5(Encoding):
    """T5 bucketed relative bias: a learned ``t5_table [num_buckets, N]`` shared by all layers (Raffel 2019).

    ``init(key, num_heads=N)`` draws the table (normal(0, stddev)); ``bias(N, table)`` is the callable
    bias, a pytree whose leaf is ``.table`` (``jax.grad`` reaches it), with
    ``bias[n, i, j] = table[t5_bucket(j - i), n]`` and ``.dense(T, S)``.

    Example:
        >>> t5 = T5(num_buckets=8, max_distance=16)
        >>> t5.bias(2, t5.init(jax.random.key(0), num_heads=2)).dense(3, 3).shape
        (2, 3, 3)
    """

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    stddev: float = 0.02
    name: ClassVar[str] = "t5"
    reference: ClassVar[str] = "Raffel et al. 2019, arXiv 1910.10683"
    param_name: ClassVar[str] = "t5_table"

    def __post_init__(self):
        b = _positive_int("T5", "num_buckets", self.num_buckets)
        if b < (4 if self.bidirectional else 2):
            raise ValueError(f"T5: num_buckets must be >= {4 if self.bidirectional else 2}, got {b}")
        _positive_int("T5", "max_distance", self.max_distance)

    def init(self, key, *, num_heads, d_model=None):
        n = _positive_int("T5.init", "num_heads", num_heads)
        return self.stddev * jax.random.normal(key, (self.num_buckets, n), jnp.float32)

    def bias(self, num_heads, param=None):
        return _T5Bias(param, bool(self.bidirectional), int(self.max_distance))


@dataclasses.dataclass(frozen=True)
class Sinusoidal2D(Encoding):
    """``sinusoidal_2d`` over a ``(height, width)`` grid added to the inputs (cells row-major, T = height * width)."""

    height: int
    width: int
    name: ClassVar[str] = "sinusoidal_2d"
    reference: ClassVar[str] = "2-D sinusoidal for patch grids (ViT, MAE)"
    grid: ClassVar[bool] = True

    def __post_init__(self):
        _positive_int("Sinusoidal2D", "height", self.height)
        _positive_int("Sinusoidal2D", "width", self.width)

    def inputs(self, T, d_model, param=None):
        if T != self.height * self.width:
            raise ValueError(f"Sinusoidal2D: inputs length {T} != grid {self.height} x {self.width}")
        return sinusoidal_2d(self.height, self.width, d_model)


# ------------------------------------------------------------------------------------------
# One place that names them all

SCHEMES: dict[str, type[Encoding]] = {
    cls.name: cls for cls in (NoPosition, Sinusoidal, Learned, Rope, Alibi, T5, Sinusoidal2D)
}


def scheme(name: str) -> type[Encoding]:
    """The ``Encoding`` class of a ``--posenc`` flag value; ValueError lists the choices.

    Example:
        >>> scheme("rope").reference
        'Su et al. 2021, arXiv 2104.09864'
    """
    if name not in SCHEMES:
        raise ValueError(f"posenc must be one of {sorted(SCHEMES)}, got {name!r}")
    return SCHEMES[name]


def encoding(name: str, **options) -> Encoding:
    """The ``Encoding`` for a ``--posenc`` flag value, built by its ``SCHEMES`` class.

    Args:
        name: a key of ``SCHEMES``.
        **options: hyperparameters, by field name (``max_len``, ``base``, ``num_buckets``,
            ``max_distance``, ``bidirectional``, ``stddev``, ``height``, ``width``). Each scheme takes
            the ones its class has and ignores the rest, so one set of flag values configures every scheme.

    Raises:
        ValueError: an unknown name, an option no scheme has, or a required one missing
            (``"sinusoidal_2d"`` needs ``height`` and ``width``).

    Example:
        >>> encoding("t5", num_buckets=8, max_len=64)   # T5 has no max_len: ignored
        T5(num_buckets=8, max_distance=128, bidirectional=True, stddev=0.02)
    """
    cls = scheme(name)
    known = {f.name for c in SCHEMES.values() for f in dataclasses.fields(c)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"encoding: unknown options {unknown}; the schemes take {sorted(known)}")
    fields = dataclasses.fields(cls)
    missing = [
        f.name
        for f in fields
        if f.name not in options and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"encoding: posenc={name!r} needs {missing}, e.g. {cls.__name__}({', '.join(missing)})")
    return cls(**{f.name: options[f.name] for f in fields if f.name in options})


# ------------------------------------------------------------------------------------------
# Deprecated names (one name per scheme since 2026-12-06; see CHANGELOG.md)


def _deprecated_alibi(num_heads: int):
    return Alibi().bias(num_heads)


def _deprecated_init_t5_bias(key, num_heads, *, num_buckets=32, max_distance=128, bidirectional=True, stddev=0.02):
    t5 = T5(num_buckets, max_distance, bidirectional, stddev)
    return t5.bias(num_heads, t5.init(key, num_heads=num_heads))


_DEPRECATED = {  # old name -> (its replacement, what to use instead)
    "alibi": (_deprecated_alibi, "positional.Alibi().bias(num_heads)"),
    "AlibiBias": (Alibi, "positional.Alibi()"),
    "T5Bias": (_T5Bias, "positional.T5(...).bias(num_heads, table)"),
    "init_t5_bias": (
        _deprecated_init_t5_bias,
        "positional.T5(num_buckets, max_distance, bidirectional, stddev): "
        ".init(key, num_heads=N) draws the table, .bias(N, table) is the bias",
    ),
    "Scheme": (Encoding, "positional.Encoding: a scheme is its class, positional.SCHEMES[name] = scheme(name)"),
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        value, instead = _DEPRECATED[name]
        warnings.warn(f"attnlab.positional.{name} is deprecated: use {instead}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module 'attnlab.positional' has no attribute {name!r}")
