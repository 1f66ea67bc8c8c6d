"""The implementation registry: what each attention kernel supports, the per-backend order, ``explain``.

Each implementation declares ``supports(q, k, v, *, mask, bias, score, backend) -> None | reason``
from shapes and static structure only (``jax.ShapeDtypeStruct`` inputs work, and ``backend`` need
not be the one this process runs on), and ``run(q, k, v, *, mask, bias, score)``.
``attention(..., implementation=None)`` takes the first implementation in ``ORDER[backend]`` that
supports the call *and* pays off there; ``implementation="name"`` or a sequence of names takes
the first that supports it (no pay-off rule). ``explain`` says which one would run and why the
others were skipped::

    >>> import jax, jax.numpy as jnp
    >>> from attnlab import masks
    >>> x = jax.ShapeDtypeStruct((2, 4096, 16, 64), jnp.bfloat16)        # [B, T, N, H]
    >>> explain(x, x, x, mask=masks.causal(), backend="gpu").implementation
    'cudnn'

Per-backend order (``ORDER``):

* cpu: sparse -> blockwise (from 512 x 512 pairs, or when the mask has an EMPTY tile) -> xla -> reference
* gpu: sparse -> cudnn -> pallas -> xla (where the dense fp32 logits fit in ``XLA_MAX_LOGITS_BYTES``)
  -> blockwise (the portable fallback) -> reference
* tpu: sparse -> splash -> xla (where the logits fit) -> blockwise -> reference

The Pallas kernels (``attnlab.kernels.pallas_flash``, ``attnlab.kernels.splash``) are registered
lazily: when their module is missing, their reason says so and dispatch moves on.

Shape legend: q ``[..., T, N, H]``, k ``[..., S, K, H]``, v ``[..., S, K, Hv]``; B = prod(...).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence

import jax

from attnlab import masks as masks_lib
from attnlab import scores as scores_lib
from attnlab.kernels import blockwise as blockwise_lib
from attnlab.kernels import cudnn as cudnn_lib

__all__ = ["Implementation", "IMPLEMENTATIONS", "ORDER", "Explanation", "explain", "choose", "normalize_backend"]

# implementation=None on CPU sends dot-product attention with at least this many (query, key) pairs
# to the blockwise kernel: on the 2-core CPU it ran the forward 1.3x faster than jax.nn at
# T = S = 256 and 512 and 2.3x at 1K, fwd+bwd 1.2x at 1K (`make bench`; it compiles ~3x longer).
BLOCKWISE_MIN_PAIRS = 512 * 512

# On GPU/TPU, implementation=None uses dense XLA only while its fp32 [B, N, T, S] logits take at most
# this many bytes (XLA keeps logits and probabilities, and the backward more): beyond, the tiled kernels.
XLA_MAX_LOGITS_BYTES = 2 * 2**30

Supports = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation.

    Attributes:
        name: the ``implementation=`` string.
        supports: ``(q, k, v, *, mask, bias, score, backend) -> None | reason`` (shapes only;
            ``mask`` an attnlab mask or None, ``score`` an ``attnlab.scores.Score``).
        run: ``(q, k, v, *, mask, bias, score) -> [..., T, N, Hv]``.
        pays_off: like ``supports``, consulted only by ``implementation=None``: None when the
            kernel is worth choosing on this backend for this call, else why not.
        features: what ``run`` can do beyond plain attention: ``"dropout"`` (``dropout_rate`` and
            ``dropout_key``) and ``"lse"`` (``return_lse=True``); a call that needs one goes to an
            implementation that has it.
    """

    name: str
    supports: Supports
    run: Callable
    pays_off: Supports | None = None
    features: frozenset = frozenset()


def normalize_backend(backend: str | None) -> str:
    """None -> ``jax.default_backend()``; ``"cuda"``/``"rocm"`` -> ``"gpu"``."""
    backend = jax.default_backend() if backend is None else str(backend).lower()
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
    if backend not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"backend must be 'cpu', 'gpu', 'tpu' or None, got {backend!r}")
    return backend


def _is_callable_bias(bias) -> bool:
    return callable(bias) and not hasattr(bias, "shape")


def _lead_size(q) -> int:
    return math.prod(q.shape[:-3])


# ------------------------------------------------------------------------------------------
# reference, xla, blockwise, sparse


def _attention_module():
    # attention.py imports this module, so import it late (and by path: attnlab.attention is the function)
    return importlib.import_module("attnlab.attention")


def _supports_reference(q, k, v, *, mask, bias, score, backend):
    return None


def _run_reference(q, k, v, *, mask, bias, score, **extras):
    return _attention_module().attention_reference(q, k, v, mask=mask, bias=bias, score=score, **extras)


def _supports_xla(q, k, v, *, mask, bias, score, backend):
    if not score.is_dot:
        return f"supports score='dot' only (got score {type(score).__name__})"
    if v.shape[-1] != q.shape[-1]:
        return f"needs Hv == H (jax.nn), got q {tuple(q.shape)} and v {tuple(v.shape)}"
    return None


def _logits_bytes(q, k) -> int:
    return 4 * _lead_size(q) * q.shape[-2] * q.shape[-3] * k.shape[-3]


def _xla_pays_off(q, k, v, *, mask, bias, score, backend):
    if backend == "cpu":
        return None
    size = _logits_bytes(q, k)
    if size > XLA_MAX_LOGITS_BYTES:
        limit = XLA_MAX_LOGITS_BYTES / 2**30
        return f"dense fp32 logits [B, N, T, S] take {size / 2**30:.1f} GiB > XLA_MAX_LOGITS_BYTES = {limit:.0f} GiB"
    return None


def _run_xla(q, k, v, *, mask, bias, score):
    return _attention_module()._attention_xla(q, k, v, mask=mask, bias=bias, scale=score.scale, fn="attention")


def _supports_blockwise(q, k, v, *, mask, bias, score, backend):
    if not score.is_dot:
        return f"supports score='dot' only (got score {type(score).__name__})"
    return None  # bias: None, a callable of positions, or an array (sliced per tile)


def _blockwise_pays_off(q, k, v, *, mask, bias, score, backend):
    if bias is not None and not _is_callable_bias(bias):
        # the kernel takes an array bias (sliced per tile) when asked, but its backward adds each
        # tile's bias gradient into a full [T, S] buffer: not a default choice
        return "an array bias is O(T*S) already and its blockwise backward is slow: xla (or pass a callable bias)"
    if backend != "cpu":
        return None  # the portable fallback after the fused kernels and XLA
    T, S = q.shape[-3], k.shape[-3]
    if T * S >= BLOCKWISE_MIN_PAIRS:
        return None
    bs = blockwise_lib.default_block_sizes(backend, sparse=True)
    bq, bk = min(bs.block_q, T), min(bs.block_k, S)
    # The layout is always safe, so it counts even when the mask holds traced data (padding
    # lengths under jit): its structural part (window, causal, BigBird) still has EMPTY tiles.
    sparse_mask = mask is not None and not isinstance(mask, masks_lib.Full) and T and S
    if sparse_mask and (mask.block_layout(T, S, bq, bk) == masks_lib.EMPTY).any():
        return None
    return (
        f"pays off on cpu from {BLOCKWISE_MIN_PAIRS} (query, key) pairs or with an EMPTY {bq} x {bk} tile "
        f"(here {T} x {S}, none empty)"
    )


def _run_blockwise(q, k, v, *, mask, bias, score, **extras):
    m = mask
    if isinstance(m, masks_lib.GraphEdges):
        m = masks_lib.graph(m.adjacency())  # the dense adjacency, evaluated per tile
    return blockwise_lib.blockwise_attention(q, k, v, mask=m, bias=bias, scale=score.scale, **extras)


def _supports_sparse(q, k, v, *, mask, bias, score, backend):
    if not isinstance(mask, masks_lib.GraphEdges):
        got = "None" if mask is None else type(mask).__name__
        return f"needs mask=masks.graph_edges(...) (an edge list), got mask {got}"
    if bias is not None:
        return "takes no bias (per-edge biases are not supported yet)"
    if not score.has_edge_form:
        return f"needs a score with a per-edge form (Dot, Additive), got score {type(score).__name__}"
    T, S = q.shape[-3], k.shape[-3]
    if (mask.num_nodes, mask.num_nodes) != (T, S):
        return f"mask: graph_edges has num_nodes={mask.num_nodes} but attention is {T}x{S}"
    return None


def _run_sparse(q, k, v, *, mask, bias, score):
    from attnlab.kernels import sparse

    return sparse.sparse_attention(q, k, v, mask=mask, bias=bias, score=score)


# ------------------------------------------------------------------------------------------
# cuDNN, and the Pallas kernels (registered lazily)


def _supports_cudnn(q, k, v, *, mask, bias, score, backend):
    return cudnn_lib.supports(q, k, v, mask=mask, bias=bias, score=score, backend=backend)


def _run_cudnn(q, k, v, *, mask, bias, score):
    return cudnn_lib.cudnn_attention(q, k, v, mask=mask, scale=score.scale)


def _lazy(module: str, fn: str):
    """supports/run for a kernel module that may not exist (yet): its absence is the reason."""
    path = f"attnlab.kernels.{module}"
    state = {}

    def load():
        if "mod" not in state:
            try:
                state["mod"], state["why"] = importlib.import_module(path), None
            except ImportError as e:
                missing = e.name is not None and path.startswith(e.name)
                # absent: "not available"; present but its own imports fail (a jax without that
                # Pallas backend): say what failed, and let dispatch move on either way
                state["mod"], state["why"] = None, f"{path} not available" + ("" if missing else f" ({e})")
        return state["mod"]

    def supports(q, k, v, *, mask, bias, score, backend):
        mod = load()
        if mod is None:
            return state["why"]
        if not score.is_dot:
            return f"supports score='dot' only (got score {type(score).__name__})"
        return mod.supports(q, k, v, mask=mask, bias=bias, score=score, backend=backend)

    def run(q, k, v, *, mask, bias, score):
        mod = load()
        if mod is None:
            raise ValueError(f"implementation={module!r}: {state['why']}")
        return getattr(mod, fn)(q, k, v, mask=mask, bias=bias, scale=score.scale)

    return supports, run


_pallas_supports, _pallas_run = _lazy("pallas_flash", "pallas_attention")
_splash_supports, _splash_run = _lazy("splash", "splash_attention")

IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation("reference", _supports_reference, _run_reference, features=frozenset({"dropout", "lse"})),
        Implementation("xla", _supports_xla, _run_xla, _xla_pays_off),
        Implementation(
            "blockwise",
            _supports_blockwise,
            _run_blockwise,
            _blockwise_pays_off,
            features=frozenset({"dropout", "lse"}),
        ),
        Implementation("sparse", _supports_sparse, _run_sparse),
        Implementation("cudnn", _supports_cudnn, _run_cudnn),
        Implementation("pallas", _pallas_supports, _pallas_run),
        Implementation("splash", _splash_supports, _splash_run),
    )
}

ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("sparse", "blockwise", "xla", "reference"),
    "gpu": ("sparse", "cudnn", "pallas", "xla", "blockwise", "reference"),
    "tpu": ("sparse", "splash", "xla", "blockwise", "reference"),
}


# ------------------------------------------------------------------------------------------
# Choosing and explaining


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What ``attention`` would run, and why each other candidate was skipped.

    Attributes:
        backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        implementation: the chosen implementation's name.
        candidates: ``(name, reason)`` in the order tried; reason None for the chosen one and for
            supported candidates after it (``"not reached"`` in the table).
        automatic: True for ``implementation=None`` (pay-off rules applied).
    """

    backend: str
    implementation: str
    candidates: tuple[tuple[str, str | None], ...]
    automatic: bool = True

    def reason(self, name: str) -> str | None:
        """Why ``name`` was skipped (None when it was chosen or supported but not reached)."""
        return dict(self.candidates)[name]

    def __str__(self) -> str:
        width = max(len(n) for n, _ in self.candidates)
        lines = [f"backend {self.backend}: {self.implementation}"]
        seen = False
        for name, reason in self.candidates:
            if name == self.implementation:
                status, seen = "<- chosen", True
            elif reason is None:
                status = "supported, not reached" if seen else "supported"
            else:
                status = "skipped: " + reason
            lines.append(f"  {name:<{width}}  {status}")
        return "\n".join(lines)


def _candidates(implementation, backend) -> tuple[tuple[str, ...], bool]:
    if implementation is None:
        return ORDER[backend], True
    expected = f"implementation must be one of {tuple(IMPLEMENTATIONS)}, a sequence of them, or None"
    if not isinstance(implementation, (str, Sequence)) or not implementation:
        raise ValueError(f"{expected}, got {implementation!r}")
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    for n in names:
        if n not in IMPLEMENTATIONS:
            raise ValueError(f"{expected}, got {n!r}")
    return names, False


_FEATURES = {
    "dropout": ("draws no attention dropout", "dropout_rate > 0"),
    "lse": ("does not return the log-sum-exp", "return_lse=True"),
}


def _feature_reason(feature: str) -> str:
    what, call = _FEATURES[feature]
    having = " or ".join(repr(n) for n, impl in IMPLEMENTATIONS.items() if feature in impl.features)
    return f"{what}: {call} needs implementation {having}"


def _explain(q, k, v, *, mask, bias, score, backend, implementation, needs=frozenset()) -> Explanation:
    names, automatic = _candidates(implementation, backend)
    rows, chosen = [], None
    for name in names:
        impl = IMPLEMENTATIONS[name]
        missing = sorted(needs - impl.features)
        reason = "; ".join(_feature_reason(f) for f in missing) if missing else None
        if reason is None:
            reason = impl.supports(q, k, v, mask=mask, bias=bias, score=score, backend=backend)
        if reason is None and automatic and impl.pays_off is not None:
            reason = impl.pays_off(q, k, v, mask=mask, bias=bias, score=score, backend=backend)
        if reason is None and chosen is None:
            chosen = name
        rows.append((name, reason))
    return Explanation(backend, chosen, tuple(rows), automatic)


def choose(q, k, v, *, mask, bias, score, backend=None, implementation=None, fn="attention", needs=frozenset()) -> str:
    """The implementation ``attention`` runs (``mask`` an attnlab mask or None, ``score`` a Score;
    ``needs`` a set of ``Implementation.features`` the call uses).

    Raises:
        ValueError: an unknown name, or none of the requested implementations supports the call
            (the message gives each one's reason).
    """
    ex = _explain(
        q, k, v, mask=mask, bias=bias, score=score, backend=normalize_backend(backend), implementation=implementation,
        needs=needs,
    )  # fmt: skip
    if ex.implementation is None:
        why = "; ".join(f"implementation={n!r} {r}" for n, r in ex.candidates)
        raise ValueError(f"{fn}: {why}")
    return ex.implementation


def explain(
    q, k, v, *, mask=None, bias=None, score="dot", scale=None, backend=None, implementation=None
) -> Explanation:
    """Which implementation ``attention(q, k, v, ...)`` would run on ``backend``, and why not the others.

    Shapes only: q, k, v (and an array bias) may be ``jax.ShapeDtypeStruct``; ``backend`` may be
    one this process does not have, so the GPU and TPU choices can be checked on a CPU.

    Args:
        q, k, v: ``[..., T, N, H]``, ``[..., S, K, H]``, ``[..., S, K, Hv]`` arrays or shape structs.
        mask, bias, score, scale, implementation: as in ``attnlab.attention``.
        backend: ``"cpu"``, ``"gpu"`` (or ``"cuda"``), ``"tpu"``; default ``jax.default_backend()``.

    Returns:
        an ``Explanation``; ``str()`` of it is a small table.

    Example:
        >>> x = jax.ShapeDtypeStruct((1024, 8, 64), "float32")
        >>> explain(x, x, x, mask=masks_lib.window(128, 0), backend="cpu").implementation
        'blockwise'
    """
    score = scores_lib.as_score(score, scale, fn="explain")
    m = masks_lib.as_mask(mask, "mask")
    return _explain(
        q, k, v, mask=m, bias=bias, score=score, backend=normalize_backend(backend), implementation=implementation
    )


def _demo() -> str:
    """The explain tables of docs/backends.md: ``python -m attnlab.dispatch``."""
    bf16 = jax.ShapeDtypeStruct((2, 4096, 16, 64), "bfloat16")  # [B, T, N, H]
    f32 = jax.ShapeDtypeStruct((1, 32768, 16, 64), "float32")
    small = jax.ShapeDtypeStruct((1, 256, 8, 64), "float32")
    calls = [
        ("bf16 [2, 4096, 16, 64], causal", bf16, dict(mask=masks_lib.causal())),
        ("bf16 [2, 4096, 16, 64], window(128, 128)", bf16, dict(mask=masks_lib.window(128, 128))),
        ("fp32 [1, 32768, 16, 64], no mask", f32, dict()),
        (
            "fp32 [1, 256, 8, 64], causal & padding",
            small,
            dict(mask=masks_lib.causal() & masks_lib.padding(kv_lengths=[200])),
        ),
    ]
    out = []
    for title, x, kw in calls:
        for backend in ("cpu", "gpu", "tpu"):
            out.append(f"# {title}\n{explain(x, x, x, backend=backend, **kw)}\n")
    return "\n".join(out)


if __name__ == "__main__":
    print(_demo())
