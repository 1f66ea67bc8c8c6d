"""Who is timed on a ``Case``, on the JAX side: attnlab's registered implementations and the JAX peers.

* **ours**: every implementation in ``attnlab.IMPLEMENTATIONS`` but the dense reference (the judge)
  and those a peer calls at its own API (cuDNN), through ``attnlab.attention(..., implementation=)``;
  a new registered implementation is timed with no change here. Each answers ``supports(call,
  backend)`` first; a reason becomes an ``unsupported`` row. Document ids are traced (a ``jax.jit``
  argument: the kernels refine their schedule on the device).
* **cudnn**: ``jax.nn.dot_product_attention(implementation="cudnn")`` with the case's flags.
* **tokamax**: ``tokamax.dot_product_attention`` (its own order of implementations) where it is
  installed: causal and windows as its flags, documents as a dense boolean mask, SoftCap as
  ``logits_soft_cap``.

The torch peers (compiled ``flex_attention``, SDPA) are ``benchmarks.torch_peers``.

``build(name, case, T, N, H, direction)`` returns ``(fn, args)`` (``fn`` to ``jax.jit``: the
output forward, the gradients of q, k and v for a fixed normal output cotangent forward+backward,
``harness.with_direction``, the cotangent passed as the last argument) or raises
``UnsupportedError`` with the reason.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import attnlab
from attnlab import masks, positional, scores
from benchmarks import harness
from benchmarks.cases import Case, UnsupportedError, additive_weights

__all__ = ["JUDGE", "JAX_PEERS", "TORCH_PEERS", "PEERS", "UnsupportedError", "registered", "ours", "build"]
__all__ += ["attnlab_mask", "attnlab_score", "inputs", "cost"]

JUDGE = "reference"  # the dense fp32 reference judges every implementation; it is not a contender
JAX_PEERS = ("cudnn", "tokamax")
TORCH_PEERS = ("flex", "sdpa")
PEERS = JAX_PEERS + TORCH_PEERS


def registered() -> tuple[str, ...]:
    """Every registered implementation but the judge: what the correctness and memory sections check
    (cuDNN's attnlab wrapper included)."""
    return tuple(n for n in attnlab.IMPLEMENTATIONS if n != JUDGE)


def ours() -> tuple[str, ...]:
    """attnlab's speed contenders, from the registry: all but the judge and the names a peer calls directly."""
    return tuple(n for n in registered() if n not in PEERS)


def attnlab_mask(case: Case, ids=None):
    """The case's mask as an attnlab mask (``ids``: the document ids, traced or not), or None."""
    if case.mask == "causal":
        return masks.causal()
    if case.mask == "window":
        return masks.window(*case.window)
    if case.mask == "documents":
        return masks.document(ids)
    return None


def attnlab_score(case: Case, N: int, H: int):
    if case.score == "softcap":
        return scores.SoftCap(case.cap)
    if case.score == "alibi":
        return positional.Alibi().score(N)
    if case.score == "additive":
        return scores.Additive(jnp.asarray(additive_weights(N, H)))
    return "dot"


@functools.lru_cache(maxsize=8)
def inputs(T: int, N: int, H: int, dtype=jnp.bfloat16, seed: int = 0) -> tuple:
    """q, k, v ``[1, T, N, H]``, normal (random values: zeros would time a different program); made once
    per shape and shared by every cell of it."""
    keys = jax.random.split(jax.random.key(seed + T + H), 3)
    return tuple(jax.random.normal(kk, (1, T, N, H), jnp.float32).astype(dtype) for kk in keys)


def build(name: str, case: Case, T: int, N: int, H: int, direction: str, dtype=jnp.bfloat16):
    """``(fn, args)`` of contender ``name`` on ``case``, or ``UnsupportedError``."""
    qkv = inputs(T, N, H, dtype)
    if name == "cudnn":
        return harness.with_direction(_cudnn(case), direction, qkv)
    if name == "tokamax":
        fwd, extra = _tokamax(case, T)
        return harness.with_direction(fwd, direction, qkv + extra)
    if name not in attnlab.IMPLEMENTATIONS:
        raise ValueError(f"contender must be one of {ours() + JAX_PEERS}, got {name!r}")
    return _ours(name, case, T, N, H, direction, qkv)


def _ours(name, case, T, N, H, direction, qkv):
    ids = jnp.asarray(case.ids(T)) if case.mask == "documents" else None
    score = attnlab_score(case, N, H)
    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv]
    why = attnlab.explain(*sds, mask=attnlab_mask(case, ids), score=score, implementation=(name,)).reason(name)
    if why is not None:
        raise UnsupportedError(why)

    def fwd(q, k, v, *ids):  # the ids are an argument: traced, as a training step's would be
        return attnlab.attention(q, k, v, mask=attnlab_mask(case, *ids), score=score, implementation=name)

    return harness.with_direction(fwd, direction, qkv + (() if ids is None else (ids,)))


def _cudnn(case: Case):
    if jax.default_backend() != "gpu":
        raise UnsupportedError(f"cuDNN needs a CUDA GPU (backend {jax.default_backend()})")
    if case.score != "dot":
        raise UnsupportedError("jax.nn's cuDNN attention takes the dot-product score only")
    if case.mask == "documents":
        raise UnsupportedError("jax.nn.dot_product_attention takes no segment ids (documents)")
    kw = {}
    if case.mask == "causal":
        kw = dict(is_causal=True)
    elif case.mask == "window":
        left, right = case.window
        if right != 0:
            raise UnsupportedError("cuDNN's sliding window is causal: (left, 0) only")
        kw = dict(is_causal=True, local_window_size=(left, 0))

    def fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)

    return fwd


def _tokamax(case: Case, T: int):
    try:
        tokamax = importlib.import_module("tokamax")
    except ImportError as e:  # a missing package, or one of its own needs
        raise UnsupportedError(f"tokamax not importable: {e}") from None
    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags and would parse sys.argv (a test runner's) itself
        flags.FLAGS.mark_as_parsed()
    if case.score == "alibi":
        raise UnsupportedError("tokamax takes no score_mod (ALiBi only as a dense [N, T, S] bias: not timed)")
    if case.score == "additive":
        raise UnsupportedError("tokamax has no additive (tanh) score")
    kw = dict(logits_soft_cap=case.cap) if case.score == "softcap" else {}
    if case.mask == "causal":
        kw["is_causal"] = True
    elif case.mask == "window":
        kw["local_window_size"] = tuple(case.window)
    if case.mask != "documents":
        return (lambda q, k, v: tokamax.dot_product_attention(q, k, v, **kw)), ()
    ids = case.ids(T)[0]
    dense = jnp.asarray((ids[:, None] == ids[None, :])[None, None])  # [1, 1, T, S] bool: its public mask form

    def fwd(q, k, v, mask):
        return tokamax.dot_product_attention(q, k, v, mask=mask, **kw)

    return fwd, (dense,)


def cost(case: Case, T: int, N: int, H: int, direction: str) -> tuple[int, float]:
    """(allowed pairs in one row, useful FLOPs) of a case (``harness.useful_flops``)."""
    pairs = _pairs(case, T)
    return pairs, harness.useful_flops(pairs, N, H, direction, case.score)


@functools.cache
def _pairs(case: Case, T: int) -> int:
    if case.mask == "documents":
        return int((np.bincount(case.ids(T)[0]).astype(np.int64) ** 2).sum())
    return harness.allowed_pairs(attnlab_mask(case), T)
