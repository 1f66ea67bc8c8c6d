"""The implementation registry: what each attention kernel supports, the per-backend order, ``explain``.

Each implementation (``attnlab.impls``: one object per file) declares ``supports(call, backend) ->
None | reason`` from shapes and static structure only (a call bound from ``jax.ShapeDtypeStruct``
inputs works, and ``backend`` need not be the one this process runs on), ``pays_off(call,
backend)`` and ``run(call)``; ``call`` is the ``attnlab.call.Call`` that ``bind`` checked once.
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

* cpu: sparse (where the blockwise kernel's non-empty tiles hold at least ``min_pairs_per_edge(H)`` pairs per
  edge, from 16 at H <= 16 to 64 from H = 64: its ``pays_off``) -> blockwise (from 512 x 512 pairs, or when
  the mask has an EMPTY tile, unless its non-empty tiles still cover more than half the pairs, with K == N or
  below 256 x 256 pairs) -> xla -> reference
* gpu: sparse -> cudnn -> mosaic (where a tuning table times it faster than pallas: its ``pays_off``) -> pallas
  (but additive scores: its ``pays_off``) -> xla (where the dense fp32 logits
  fit in ``XLA_MAX_LOGITS_BYTES``)
  -> blockwise (the portable fallback) -> reference
* tpu: sparse -> splash -> xla (where the logits fit) -> blockwise -> reference

The Pallas kernels (``attnlab.kernels.pallas_flash``, ``attnlab.kernels.splash``) are loaded
lazily: when their module is missing, their reason says so and dispatch moves on. This module
holds only the order, the choice and the explanation.

Shape legend: q ``[..., T, N, H]``, k ``[..., S, K, H]``, v ``[..., S, K, Hv]``; B = prod(...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from attnlab import impls, platform
from attnlab import masks as masks_lib
from attnlab import scores as scores_lib
from attnlab.call import Call, bind

__all__ = ["IMPLEMENTATIONS", "ORDER", "Explanation", "explain", "explain_call", "choose", "normalize_backend"]

IMPLEMENTATIONS: dict[str, impls.Implementation] = {impl.name: impl for impl in impls.ALL}

ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("sparse", "blockwise", "xla", "reference"),
    "gpu": ("sparse", "cudnn", "mosaic", "pallas", "xla", "blockwise", "reference"),
    "tpu": ("sparse", "splash", "xla", "blockwise", "reference"),
}


def normalize_backend(backend: str | None) -> str:
    """None -> ``attnlab.platform.target()`` (the backend the trace is for); ``"cuda"``/``"rocm"`` -> ``"gpu"``."""
    return platform.normalize(backend)


# ------------------------------------------------------------------------------------------
# Choosing and explaining


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What ``attention`` would run, and why each other candidate was skipped.

    Attributes:
        backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        implementation: the chosen implementation's name; None when no candidate supports the call
            (``attention`` would raise).
        candidates: ``(name, reason)`` in the order tried; reason None for the chosen one and for
            supported candidates after it (``"not reached"`` in the table).
        automatic: True for ``implementation=None`` (pay-off rules applied).
    """

    backend: str
    implementation: str | None
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


def explain_call(call: Call, *, backend=None, implementation=None) -> Explanation:
    """``explain`` for a bound call (``attnlab.call.bind``)."""
    backend = normalize_backend(backend)
    names, automatic = _candidates(implementation, backend)
    rows, chosen = [], None
    for name in names:
        impl = IMPLEMENTATIONS[name]
        missing = sorted(call.needs - impl.features)
        reason = "; ".join(_feature_reason(f) for f in missing) if missing else None
        if reason is None:
            reason = impl.supports(call, backend)
        if reason is None and automatic:
            reason = impl.pays_off(call, backend)
        if reason is None and chosen is None:
            chosen = name
        rows.append((name, reason))
    return Explanation(backend, chosen, tuple(rows), automatic)


def choose(call: Call, *, backend=None, implementation=None) -> impls.Implementation:
    """The implementation ``attention`` runs for the bound ``call`` (the first of ``implementation``
    (a name or a sequence of names) that supports it, or with None the first in ``ORDER[backend]``
    that supports it and pays off).

    Raises:
        ValueError: an unknown name, or none of the requested implementations supports the call
            (the message gives each one's reason).
    """
    ex = explain_call(call, backend=backend, implementation=implementation)
    if ex.implementation is None:
        why = "; ".join(f"implementation={n!r} {r}" for n, r in ex.candidates)
        raise ValueError(f"{call.fn}: {why}")
    return IMPLEMENTATIONS[ex.implementation]


def explain(
    q, k, v, *, mask=None, bias=None, score="dot", scale=None, backend=None, implementation=None,
    dropout_rate=0.0, dropout_key=None, return_lse=False,
) -> Explanation:  # fmt: skip
    """Which implementation ``attention(q, k, v, ...)`` would run on ``backend``, and why not the others.

    Shapes only: q, k, v (and an array bias) may be ``jax.ShapeDtypeStruct``; ``backend`` may be
    one this process does not have, so the GPU and TPU choices can be checked on a CPU.

    Args:
        q, k, v: ``[..., T, N, H]``, ``[..., S, K, H]``, ``[..., S, K, Hv]`` arrays or shape structs.
        mask, bias, score, scale, implementation, dropout_rate, dropout_key, return_lse: as in
            ``attnlab.attention`` (the checks are the same: a bad argument raises here too).
        backend: ``"cpu"``, ``"gpu"`` (or ``"cuda"``), ``"tpu"``; default ``attnlab.platform.target()``.

    Returns:
        an ``Explanation``; ``str()`` of it is a small table.

    Example:
        >>> x = jax.ShapeDtypeStruct((1024, 8, 64), "float32")
        >>> explain(x, x, x, mask=masks_lib.window(128, 0), backend="cpu").implementation
        'blockwise'
    """
    call = bind(
        q, k, v, mask=mask, bias=bias, score=score, scale=scale, dropout_rate=dropout_rate,
        dropout_key=dropout_key, return_lse=return_lse, fn="explain",
    )  # fmt: skip
    return explain_call(call, backend=backend, implementation=implementation)


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
        (
            "bf16 [2, 4096, 16, 64], causal, additive (tanh) score, w [16, 64]",
            bf16,
            dict(mask=masks_lib.causal(), score=scores_lib.Additive(jax.ShapeDtypeStruct((16, 64), "float32"))),
        ),
    ]
    out = []
    for title, x, kw in calls:
        for backend in ("cpu", "gpu", "tpu"):
            out.append(f"# {title}\n{explain(x, x, x, backend=backend, **kw)}\n")
    return "\n".join(out)


if __name__ == "__main__":
    print(_demo())
