r"""Random attention calls against the dense reference: masks x scores x implementations x jit modes, forward and vjp.

Each case is drawn from its seed alone (``draw``): batch, lengths (T and S, often unequal; below
150, and in one case of eight below 700, for many tiles of a kind), heads
(GQA), head dim, a mask (every family, with random parameters, ANDed and ORed), a score (dot,
SoftCap, ALiBi, additive), an implementation (or None: dispatch chooses), a mode (eager, jit with
the mask closed over as constants, jit with the mask as an argument so its arrays are traced),
fp32 or bf16 inputs, sometimes a bias. ``check`` runs ``attnlab.attention`` and its vjp and
compares them with ``attnlab.attention_reference`` on the inputs upcast (to float64 under
``--x64``), on the error scaled by the reference's largest value (``scaled_error``; ``LIMITS`` per
dtype). A case fails on a crash, a mismatch, a non-finite value, or outputs / gradients that do
not keep the inputs' dtype; a ``ValueError`` that names the implementation (the call is one it
does not take) is a skip.

    PYTHONPATH=. python -m benchmarks.fuzz --seed 0 --cases 200 --out results/fuzz.json
    PYTHONPATH=. python -m benchmarks.fuzz --seed 1 --cases 200 --x64 --out results/fuzz_x64.json

Two bugs this found are conformance cases now (CHANGELOG.md: a repeated graph edge counted twice
by the sparse kernel). Re-run a failing case alone with ``--only SEED``.
"""

from __future__ import annotations

import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Case",
    "DropinCase",
    "MASK_KINDS",
    "LIMITS",
    "draw",
    "build",
    "check",
    "draw_dropin",
    "check_dropin",
    "scaled_error",
]

MASK_KINDS = (
    "none", "causal", "window", "document", "document_cross", "padding", "graph", "graph_edges", "prefix_lm",
    "chunks", "dilated", "predicate", "bigbird", "window_2d", "global_tokens", "dense", "and", "or",
)  # fmt: skip
SCORE_KINDS = ("dot", "dot", "softcap", "alibi", "additive")  # dot twice: the common case
IMPLEMENTATIONS = ("xla", "blockwise", "sparse", "pallas", None)
MODES = ("eager", "jit_closed", "jit_arg")
# the largest error scaled by the reference's largest value (plus SCALE_FLOOR) that passes, per input dtype
LIMITS = {"float32": 2e-4, "bfloat16": 8e-2}
SCALE_FLOOR = 1e-2
LONG, LONG_SHARE = 700, 0.125  # one case in eight draws its lengths below LONG instead of 150


@dataclasses.dataclass(frozen=True)
class Case:
    """One fuzz case; every field follows from ``seed`` (``draw``)."""

    seed: int
    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    mask: str
    score: str
    implementation: str | None
    mode: str
    dtype: str
    bias: bool


def draw(seed: int) -> Case:
    """The case of ``seed``: the same on every machine (numpy's PCG64)."""
    r = np.random.default_rng(seed)
    top = LONG if np.random.default_rng([seed, 4]).random() < LONG_SHARE else 150  # many tiles, some full
    T = int(r.integers(1, top))
    S = T if r.random() < 0.6 else int(r.integers(1, top))
    K = int(r.choice([1, 2]))
    c = Case(
        seed=seed, B=int(r.integers(1, 3)), T=T, S=S, N=K * int(r.choice([1, 2])), K=K, H=int(r.choice([8, 16, 32])),
        mask=str(r.choice(MASK_KINDS)), score=str(r.choice(SCORE_KINDS)),
        implementation=IMPLEMENTATIONS[int(r.integers(len(IMPLEMENTATIONS)))], mode=str(r.choice(MODES)),
        dtype="float32" if r.random() < 0.7 else "bfloat16", bias=bool(r.random() < 0.1),
    )  # fmt: skip
    # the sparse kernel takes an edge list only: give it one (else every sparse case would be a skip)
    return dataclasses.replace(c, mask="graph_edges", S=T) if c.implementation == "sparse" else c


def _ids(r, B, L):
    return np.sort(r.integers(0, 4, (B, L)), -1).astype(np.int32)


def _mask(kind: str, r, c: Case):
    """A mask of family ``kind`` with random parameters for ``c``'s shapes (None for ``"none"``).

    Families that need T == S (a square graph, bigbird) draw a causal mask otherwise.
    """
    from attnlab import masks  # noqa: PLC0415 (after --x64 is set)

    B, T, S = c.B, c.T, c.S
    square = T == S
    if kind == "none":
        return None
    if kind == "causal" or (kind in ("graph_edges", "bigbird", "window_2d") and not square):
        return masks.causal(offset=int(r.integers(-3, 4)))
    if kind == "window":
        return masks.window(int(r.integers(0, 20)), int(r.integers(0, 20)))
    if kind in ("document", "document_cross"):
        q = _ids(r, B, T)
        kv = None if kind == "document" and square else _ids(r, B, S)
        if r.random() < 0.3:  # ids in any order
            q = r.permutation(q.T).T.copy()
        return masks.document(q, kv, padding_id=int(r.integers(0, 4)) if r.random() < 0.3 else None)
    if kind == "padding":
        return masks.padding(r.integers(0, T + 1, (B,)).astype(np.int32), r.integers(0, S + 1, (B,)).astype(np.int32))
    if kind == "graph":
        return masks.graph(r.random((T, S)) < 0.2)
    if kind == "graph_edges":  # repeats and self-loops included
        E = int(r.integers(1, 4 * T))
        return masks.graph_edges(r.integers(0, T, E), r.integers(0, T, E), T)
    if kind == "prefix_lm":
        return masks.prefix_lm(r.integers(0, T + 1, (B,)).astype(np.int32))
    if kind == "chunks":
        return masks.chunks(int(r.integers(1, 20)))
    if kind == "dilated":
        return masks.dilated(int(r.integers(1, 20)), int(r.integers(0, 5)), int(r.integers(1, 4)))
    if kind == "predicate":
        return masks.predicate(lambda qi, ki: (qi + ki) % 3 != 0, in_kernel=bool(r.random() < 0.5))
    if kind == "bigbird":
        return masks.bigbird(T, block_size=int(r.integers(2, 9)), num_random=1, num_global=1)
    if kind == "window_2d":
        width = int(r.integers(1, 12))
        return masks.window_2d(width, int(r.integers(0, 3)), int(r.integers(0, 3)))
    if kind == "global_tokens":
        return masks.global_tokens(np.unique(r.integers(0, min(T, S), int(r.integers(1, 4)))))
    if kind == "dense":
        return masks.as_mask(jnp.asarray(r.random((B, 1, T, S)) < 0.5))
    a, b = _mask(str(r.choice(MASK_KINDS[:-2])), r, c), _mask(str(r.choice(MASK_KINDS[:-2])), r, c)
    if a is None or b is None:
        return a if b is None else b
    return a & b if kind == "and" else a | b


def _score(kind: str, r, c: Case):
    from attnlab import positional, scores  # noqa: PLC0415

    if kind == "dot":
        return "dot"
    if kind == "softcap":
        return scores.SoftCap(float(r.uniform(2, 30)))
    if kind == "alibi":
        return positional.Alibi().score(slopes=jnp.asarray(2.0 ** -np.arange(1, c.N + 1), jnp.float32))
    return scores.Additive(jnp.asarray(r.normal(size=(c.N, c.H)) * 0.3, jnp.float32))


def build(c: Case):
    """``(mask, score, bias, q, k, v, cotangent)`` of case ``c``."""
    r = np.random.default_rng([c.seed, 1])
    mask, score = _mask(c.mask, r, c), _score(c.score, r, c)
    dt = jnp.dtype(c.dtype)

    def normal(*shape, dtype=dt):  # numpy draws: no compile per shape, as jax.random would need
        return jnp.asarray(r.standard_normal(shape, np.float32), dtype)

    q, k, v = normal(c.B, c.T, c.N, c.H), normal(c.B, c.S, c.K, c.H), normal(c.B, c.S, c.K, c.H)
    bias = normal(c.B, c.N, c.T, c.S, dtype=jnp.float32) if c.bias else None
    return mask, score, bias, q, k, v, normal(c.B, c.T, c.N, c.H, dtype=jnp.float32)


def scaled_error(actual, expected) -> float:
    """``max |a - e| / (max |e| + SCALE_FLOOR)`` in float64; inf where ``actual`` is not finite.

    Scaled by the largest value rather than elementwise: a gradient whose reference is near zero
    where few keys are allowed is compared at the scale of the whole array, not flagged for its noise.
    """
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.max(np.abs(a - e), initial=0.0) / (np.max(np.abs(e), initial=0.0) + SCALE_FLOOR))


def _run(c: Case, attention, mask, score, bias, q, k, v, ct):
    def f(q, k, v, m):
        return attention(q, k, v, mask=m, bias=bias, score=score, implementation=c.implementation)

    if c.mode == "eager":
        out, pull = jax.vjp(lambda q, k, v: f(q, k, v, mask), q, k, v)
    elif c.mode == "jit_closed":
        out, pull = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: f(q, k, v, mask), q, k, v))(q, k, v)
    else:
        out, pull = jax.jit(lambda q, k, v, m: jax.vjp(lambda q, k, v: f(q, k, v, m), q, k, v))(q, k, v, mask)
    return out, pull(ct.astype(out.dtype))


def check(c: Case, attention=None) -> dict:
    """Runs case ``c`` (through ``attention``, default ``attnlab.attention``) against the reference.

    Returns the case's fields and ``status``: ``ok``, ``skip`` (the implementation does not take the
    call), ``mismatch`` (``errors``: output, dq, dk, dv over ``LIMITS``), ``dtype`` (the output or a
    gradient changed dtype) or ``crash`` (``error``: the exception).
    """
    import attnlab  # noqa: PLC0415

    attention = attention or attnlab.attention
    row = dataclasses.asdict(c)
    mask, score, bias, q, k, v, ct = build(c)
    try:
        out, grads = _run(c, attention, mask, score, bias, q, k, v, ct)
    except Exception as e:  # noqa: BLE001 (every exception but a refusal is a finding)
        return _failed(row, e, c.implementation)
    wide = _wide()
    ref, ref_pull = jax.vjp(
        lambda q, k, v: attnlab.attention_reference(q, k, v, mask=mask, bias=bias, score=score),
        *(x.astype(wide) for x in (q, k, v)),
    )
    return _judge(row, (out, *grads), (ref, *ref_pull(ct.astype(wide))), (q, k, v), c.dtype)


def _wide():
    """The reference's dtype: float64 under ``jax_enable_x64``, else float32."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _failed(row: dict, e: BaseException, implementation) -> dict:
    """A ``ValueError`` that names the implementation asked for is a refusal (``skip``); anything else a ``crash``."""
    if isinstance(e, ValueError) and implementation is not None and implementation in str(e):
        return row | {"status": "skip", "reason": str(e).splitlines()[0][:200]}
    error = f"{type(e).__name__}: {e}"[:500]
    return row | {"status": "crash", "error": error, "trace": traceback.format_exc()[-1500:]}


def _judge(row: dict, got, refs, inputs, dtype: str) -> dict:
    """``row`` with the scaled ``errors`` of ``got`` (output, then gradients) against ``refs`` (a None
    reference is skipped) and its status: ``dtype`` when the output or a gradient of ``inputs`` changed
    dtype, else ``ok`` or ``mismatch`` by ``LIMITS[dtype]``."""
    errors = [scaled_error(a, e) for a, e in zip(got, refs, strict=True) if e is not None]
    row = row | {"errors": [round(e, 8) for e in errors]}
    expected = (inputs[0].dtype, *(x.dtype for x in inputs))  # the output has the queries' dtype
    kept = got[: len(expected)]
    if tuple(x.dtype for x in kept) != expected:
        return row | {"status": "dtype", "dtypes": [str(x.dtype) for x in kept]}
    return row | {"status": "ok" if max(errors) <= LIMITS[dtype] else "mismatch"}


# ------------------------------------------------------------------------------------------
# The drop-in: attnlab.dot_product_attention against jax.nn.dot_product_attention itself


@dataclasses.dataclass(frozen=True)
class DropinCase:
    """One drop-in case: jax.nn's arguments, drawn from ``seed`` (``draw_dropin``)."""

    seed: int
    batched: bool
    T: int
    S: int
    N: int
    K: int
    H: int
    bias: str | None  # the shape of the bias: "BNTS", "1NTS", "B1TS", "NTS", "TS", "1TS" or None
    mask: str | None  # the same for a bool mask array
    is_causal: bool
    q_lengths: bool
    kv_lengths: bool
    window: tuple[int, int] | int | None
    scale: float | None
    implementation: str | None
    mode: str
    dtype: str


BROADCASTS = (None, "BNTS", "1NTS", "B1TS", "NTS", "TS", "1TS")


def draw_dropin(seed: int) -> DropinCase:
    """The drop-in case of ``seed``: GQA, T != S, every broadcast of bias and mask, lengths, windows."""
    r = np.random.default_rng([seed, 2])
    T = int(r.integers(1, 100))
    K = int(r.choice([1, 2]))
    window = [None, None, int(r.integers(0, 12)), (int(r.integers(0, 12)), int(r.integers(0, 12)))][int(r.integers(4))]
    return DropinCase(
        seed=seed, batched=bool(r.random() < 0.8), T=T, S=T if r.random() < 0.6 else int(r.integers(1, 100)),
        N=K * int(r.choice([1, 2, 4])), K=K, H=int(r.choice([8, 16, 32])),
        bias=BROADCASTS[int(r.integers(len(BROADCASTS)))], mask=BROADCASTS[int(r.integers(len(BROADCASTS)))],
        is_causal=bool(r.random() < 0.4), q_lengths=bool(r.random() < 0.3), kv_lengths=bool(r.random() < 0.4),
        window=window, scale=float(r.uniform(0.05, 0.5)) if r.random() < 0.3 else None,
        implementation=(None, "xla", "blockwise", "reference", "pallas")[int(r.integers(5))],
        mode=str(r.choice(["eager", "jit"])), dtype="float32" if r.random() < 0.7 else "bfloat16",
    )  # fmt: skip


def _broadcast_shape(form, c: DropinCase):
    sizes = {"B": 2, "N": c.N, "T": c.T, "S": c.S, "1": 1}
    shape = tuple(sizes[a] for a in form)
    return shape if c.batched or len(form) < 4 else shape[1:]  # unbatched: no batch axis


def build_dropin(c: DropinCase):
    """``(q, k, v, cotangent, keywords)``: jax.nn's arguments of case ``c``."""
    r = np.random.default_rng([c.seed, 3])
    dt = jnp.dtype(c.dtype)
    lead = (2,) if c.batched else ()

    def normal(*shape, dtype=dt):
        return jnp.asarray(r.standard_normal(shape, np.float32), dtype)

    q, k, v = normal(*lead, c.T, c.N, c.H), normal(*lead, c.S, c.K, c.H), normal(*lead, c.S, c.K, c.H)
    kw = {"is_causal": c.is_causal, "local_window_size": c.window, "scale": c.scale}
    if c.bias:
        kw["bias"] = normal(*_broadcast_shape(c.bias, c), dtype=jnp.float32)
    if c.mask:
        kw["mask"] = jnp.asarray(r.random(_broadcast_shape(c.mask, c)) < 0.7)
    if c.q_lengths:
        kw["query_seq_lengths"] = jnp.asarray(r.integers(0, c.T + 1, lead or (1,)), jnp.int32)
    if c.kv_lengths:
        kw["key_value_seq_lengths"] = jnp.asarray(r.integers(0, c.S + 1, lead or (1,)), jnp.int32)
    return q, k, v, normal(*lead, c.T, c.N, c.H, dtype=jnp.float32), kw


def check_dropin(c: DropinCase, attention=None) -> dict:
    """``attnlab.dot_product_attention(..., empty_rows="mean")`` (or ``attention``) against
    ``jax.nn.dot_product_attention`` on the inputs upcast: outputs and the gradients of q, k, v and
    the bias. Statuses as ``check``'s, and ``skip`` where jax.nn rejects the call and attnlab raises a
    ``ValueError`` too (``lenient`` where attnlab takes it)."""
    import attnlab  # noqa: PLC0415

    attention = attention or attnlab.dot_product_attention
    row = dataclasses.asdict(c)
    q, k, v, ct, kw = build_dropin(c)
    bias = kw.pop("bias", None)
    wide = _wide()

    def peer(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, b, implementation="xla", **kw)

    try:
        ref, ref_pull = jax.vjp(peer, *(x.astype(wide) for x in (q, k, v)), bias)
    except Exception as e:  # noqa: BLE001 (jax.nn rejects the call: so must attnlab)
        try:
            attention(q, k, v, bias, implementation=c.implementation, empty_rows="mean", **kw)
        except ValueError:
            return row | {"status": "skip", "reason": f"jax.nn: {type(e).__name__}: {e}"[:200]}
        return row | {"status": "lenient", "error": f"jax.nn rejects it ({type(e).__name__}: {e})"[:500]}

    def ours(q, k, v, b):
        return attention(q, k, v, b, implementation=c.implementation, empty_rows="mean", **kw)

    try:
        fn = jax.jit(lambda *a: jax.vjp(ours, *a)) if c.mode == "jit" else lambda *a: jax.vjp(ours, *a)
        out, pull = fn(q, k, v, bias)
        grads = pull(ct.astype(out.dtype))
    except Exception as e:  # noqa: BLE001
        return _failed(row, e, c.implementation)
    return _judge(row, (out, *grads), (ref, *ref_pull(ct.astype(wide))), (q, k, v), c.dtype)


TARGETS = {  # --target: (draw, check, what a progress line shows)
    "attention": (draw, check, ("mask", "score", "implementation", "mode", "dtype")),
    "dropin": (draw_dropin, check_dropin, ("bias", "mask", "is_causal", "window", "implementation", "mode", "dtype")),
}


def main(argv):
    del argv
    if _X64.value:
        jax.config.update("jax_enable_x64", True)
    from benchmarks import harness  # noqa: PLC0415

    seeds = _ONLY.value or range(_SEED.value * 1_000_000, _SEED.value * 1_000_000 + _CASES.value)
    grid = [(int(s),) for s in seeds]

    draw_case, check_case, shown = TARGETS[_TARGET.value]

    def line(seed, rec):
        what = " ".join(str(rec[f]) for f in shown)
        return f"seed {seed}: {rec['status']:8s} {what} {rec.get('errors') or rec.get('error') or ''}"

    records = harness.sweep(
        grid, lambda s: check_case(draw_case(s)), _OUT.value, line, x64=_X64.value, target=_TARGET.value
    )
    bad = [r for r in records if r["status"] not in ("ok", "skip")]
    counts = {
        s: sum(r["status"] == s for r in records) for s in ("ok", "skip", "mismatch", "dtype", "crash", "lenient")
    }
    print(f"{len(records)} cases: {counts}")
    for r in bad:
        print(f"FAILED seed {r['seed']} ({r['status']}): rerun with --only {r['seed']}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    from absl import app, flags

    _SEED = flags.DEFINE_integer("seed", 0, "Cases are seeds seed*1e6 .. seed*1e6 + cases - 1.")
    _CASES = flags.DEFINE_integer("cases", 200, "How many cases.")
    _ONLY = flags.DEFINE_multi_integer("only", [], "Run just these case seeds (a failing case's seed).")
    _X64 = flags.DEFINE_bool("x64", False, "jax_enable_x64 on (the reference in float64).")
    _TARGET = flags.DEFINE_enum("target", "attention", list(TARGETS), "attnlab.attention, or the jax.nn drop-in.")
    _OUT = flags.DEFINE_string("out", "results/fuzz.json", "The JSON file of every case.")
    app.run(main)
