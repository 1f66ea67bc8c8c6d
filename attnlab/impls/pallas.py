"""The Pallas (Triton) flash kernel as an implementation: ``attnlab.kernels.pallas_flash``, loaded lazily.

GPU: block-sparse flash attention in Triton, every attnlab mask, fp32/bf16/fp16, no bias; scores with
a one-head tile form (the dot product, SoftCap, a ScoreMod with ``head_axes``, Additive). Interpret
mode when planned for a CPU (slow: for tests). Its whole protocol is here: ``supports`` (shapes
only, no Pallas import: when Pallas is missing it says so) and ``pays_off``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from attnlab import scores as scores_lib
from attnlab import tuning
from attnlab.call import Call
from attnlab.impls.base import LazyImplementation, static_scale_reason
from attnlab.kernels import tile_core

__all__ = ["PALLAS", "Pallas"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256

# primitives Pallas' Triton lowering lacks (a table lookup is a gather, its gradient a scatter-add)
_NO_TRITON = frozenset({"gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice", "dynamic_update_slice",
                        "sort", "cumsum", "cumprod", "cummax", "argsort"})  # fmt: skip


def one_head_reason(kernel: str, call: Call) -> str | None:
    """None when the score has a tile form a one-head kernel can run (the dot product, a mod whose
    ``head_axes`` are known, a pair form with a one-head form), else why not."""
    form = call.score.tile_form()
    if isinstance(form, scores_lib.DotTile):
        return None
    if isinstance(form, scores_lib.ModTile) and form.head_axes is None:
        return (
            f"{kernel}: a ScoreMod needs head_axes (one axis or None per array) for this kernel, which works on "
            f"one head at a time and must slice the arrays per head"
        )
    if isinstance(form, scores_lib.ModTile) or (isinstance(form, scores_lib.PairTile) and form.head_pair_vjp):
        return None
    return (
        f"{kernel}: dot-product score, SoftCap, ScoreMod (with head_axes) and Additive only "
        f"(got score {type(call.score).__name__})"
    )


def dtype_reason(kernel: str, call: Call, dtypes) -> str | None:
    names = [jnp.dtype(d).name for d in dtypes]
    wanted = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    return None if call.dtype in dtypes else f"{kernel}: q dtype {call.dtype.name} (needs {wanted})"


def _leaves_reason(call: Call, backend: str) -> str | None:
    """Why the score's array leaves cannot be kernel inputs, or None (shapes only)."""
    if call.score.is_dot:
        return None
    for i, (shape, _, a) in enumerate(tile_core.leaf_layout(call.score)):
        if a is not None and shape[a] != call.N:
            return f"pallas: score array {i} has {shape[a]} entries on head axis {a} (shape {shape}), not N={call.N}"
        block = list(shape)
        if a is not None:
            block[a] = call.N // call.K  # the dk/dv kernel reads the G query heads of one kv head
        if backend != "cpu" and any(d & (d - 1) for d in block):
            return (
                f"pallas: Triton blocks are powers of two: score array {i} of shape {shape} (head axis {a}) "
                f"would need a block {tuple(block)}"
            )
    form = call.score.tile_form()
    if isinstance(form, scores_lib.ModTile) and form.elementwise:
        return None
    try:
        jaxpr = _one_head_jaxpr(call)
    except Exception as e:  # noqa: BLE001 (a probe: fn assumes all N heads; the full-head kernels still run it)
        what = "one-head pair form" if isinstance(form, scores_lib.PairTile) else "fn"
        return (
            f"pallas: the score's {what} fails on one head's tile [1, t, s] with its arrays sliced per head "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        )
    used = _primitives(jaxpr) & (_NO_TRITON if backend != "cpu" else frozenset())  # a ClosedJaxpr has .eqns
    if used:
        return (
            f"pallas: the score's fn uses {', '.join(sorted(used))} (forward or backward), which the Triton "
            f"backend cannot lower; index tables arithmetically (e.g. a sum of table[j] * (rel == j)) or use "
            f"'blockwise'"
        )
    return None


def _one_head_jaxpr(call: Call):
    """The score's one-head tile form on a 16 x 16 tile, forward and backward, traced on shapes (a
    ClosedJaxpr): the mod and its vjp, or the pair form's ``head_pair_vjp``."""
    treedef = jax.tree_util.tree_structure(call.score)
    specs = [
        jax.ShapeDtypeStruct(shape if a is None else shape[:a] + (1,) + shape[a + 1 :], dtype)
        for shape, dtype, a in tile_core.leaf_layout(call.score)
    ]
    pos = jnp.arange(16, dtype=jnp.int32)
    tile = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    if isinstance(call.score.tile_form(), scores_lib.PairTile):
        rows = jax.ShapeDtypeStruct((16, max(16, 1 << max(0, call.H - 1).bit_length())), call.dtype)

        def pair(q, k, *ls):
            s, back = treedef.unflatten(ls).tile_form().head_pair_vjp(q, k)
            return s, back(s)

        return jax.make_jaxpr(pair)(rows, rows, *specs)

    def f(s, *ls):
        return treedef.unflatten(ls).tile_form().mod(s[None], pos, pos)[0]

    def fwd_bwd(s, *ls):
        out, vjp = jax.vjp(lambda s: f(s, *ls), s)
        return out, vjp(out)

    return jax.make_jaxpr(fwd_bwd)(tile, *specs)


def _primitives(jaxpr) -> set[str]:
    """The names of every primitive in ``jaxpr`` and in the jaxprs of its equations' params."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


class Pallas(LazyImplementation):
    """Block-sparse flash attention in Pallas/Triton (``attnlab.kernels.pallas_flash``)."""

    def __init__(self):
        super().__init__("pallas", "attnlab.kernels.pallas_flash")

    def check(self, call, backend):
        """None when the kernel can run the bound call on ``backend``, else the reason it cannot.

        Shapes and dtypes only, so it works on ``jax.ShapeDtypeStruct``s and for a backend other than
        this process's (``"gpu"``: the Triton kernel; ``"cpu"``: the same kernel in Pallas interpret
        mode, slow, for tests; ``"tpu"``: not this kernel, use splash). Every attnlab mask works:
        in-kernel arithmetic, tile bitmaps and padding lengths (``pallas_mask_info``).
        """
        if (reason := static_scale_reason("pallas", call)) is not None:
            return reason
        if backend == "tpu":
            return "pallas: the Triton kernel is for GPUs; on TPU use 'splash'"
        if backend not in ("gpu", "cuda", "rocm", "cpu"):
            return f"pallas: unknown backend {backend!r}"
        reason = one_head_reason("pallas", call)
        if reason is None and call.bias is not None:
            reason = "pallas: no bias (use 'blockwise' for a callable bias)"
        reason = reason or dtype_reason("pallas", call, _DTYPES)
        if reason is not None:
            return reason
        if max(call.H, call.Hv) > _MAX_HEAD_DIM:
            return f"pallas: head dims up to {_MAX_HEAD_DIM} (got H={call.H}, Hv={call.Hv})"
        return _leaves_reason(call, backend)

    def pays_off(self, call, backend):
        """``implementation=None`` only: on a GPU, additive (tanh) scores go on to blockwise, which ran them
        faster than this kernel's one-head pair form on an H200 (T = 4K, H = 128; docs/pallas.md has the
        runs). ``implementation="pallas"`` still runs them."""
        if backend in ("gpu", "cuda", "rocm") and isinstance(call.score.tile_form(), scores_lib.PairTile):
            return (
                "pallas: additive (tanh) scores ran faster in blockwise on an H200 (docs/pallas.md); "
                "implementation='pallas' still runs them"
            )
        return None

    def run_with(self, call, config):
        """Runs the call with a given ``PallasConfig`` (None: the tuned one, else the kernel's default)."""
        mod = self.kernel.load()
        if mod is None:
            raise ValueError(f"implementation={self.name!r}: {self.kernel.why}")
        return mod.attend(call, config=config)

    def run(self, call):
        mod = self.kernel.load()
        if mod is None:
            raise ValueError(f"implementation={self.name!r}: {self.kernel.why}")
        return mod.attend(call, config=tuning.lookup(self.name, call))


class PallasTuning:
    """The Pallas kernel's tunable parameters (``pallas_flash.PallasConfig``): tiles, warps, stages.

    On a GPU: tile rows 64 or 128 by columns 32 to 128, 4 or 8 warps, 2 to 4 stages (a candidate that asks
    for more shared memory than the device has fails to compile and is recorded as such). Elsewhere the
    kernel runs in interpret mode, where only the tiles matter: 16 to 64 square.
    """

    def _config(self):
        from attnlab.kernels.pallas_flash import PallasConfig  # noqa: PLC0415 (loaded lazily)

        return PallasConfig

    def space(self, call, backend):
        config = self._config()
        cap_q = max(16, 1 << max(0, call.T - 1).bit_length())
        cap_k = max(16, 1 << max(0, call.S - 1).bit_length())
        if backend != "gpu":
            grid = [(b, b, 4, 2) for b in (16, 32, 64)]
        else:
            grid = [(bq, bk, w, s) for bq in (64, 128) for bk in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
        seen, out = set(), []
        for bq, bk, w, s in grid:
            c = (min(bq, cap_q), min(bk, cap_k), w, s)
            if c not in seen:
                seen.add(c)
                out.append(config(*c))
        return out

    def run(self, call, config):
        return PALLAS.run_with(call, config)

    def to_json(self, config):
        return {"block_q": config.block_q, "block_k": config.block_k, "num_warps": config.num_warps,
                "num_stages": config.num_stages}  # fmt: skip

    def from_json(self, d):
        return self._config()(**{k: int(v) for k, v in d.items()})


Pallas.tunable = PallasTuning()
PALLAS = Pallas()
