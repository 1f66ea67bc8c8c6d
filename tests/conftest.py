"""Shared test helpers: an independent numpy attention, tolerances per dtype, random inputs."""

from __future__ import annotations

import os

# The suite is bound by compile time: XLA:CPU's LLVM optimisation costs more than it saves on
# test-sized arrays (tests/test_hardening.py + tests/test_masks.py, one process: 126 s -> 96 s).
# XLA:CPU's MLIR fusion emitters cost more again: most of the suite's programs are small (op by op, or
# tiny shapes), and emitting their fusions the classic way compiles them in about half the time
# (tests/test_detr.py + tests/test_hardening.py, one process: 99 s -> 68 s).
# It is the same computation, checked against the same references; the subprocess tests
# (test_parallel, test_distributed) run this way too. ATTNLAB_TEST_XLA_OPT=1 keeps XLA's default.
CHEAP_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)
if os.environ.get("ATTNLAB_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *CHEAP_COMPILE_FLAGS]).strip()

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402  (after XLA_FLAGS: the CPU client reads them when it starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from attnlab.testing import tolerance  # noqa: E402


def _share_compiled_programs():
    """One compilation cache for this test session: a program compiled once is reused by every later test.

    Many tests compile the very same program (the reference's forward and gradients for each conformance
    case, once per implementation class; the same model in several tests); jax's persistent compilation
    cache finds an identical program (same HLO, XLA flags and options) by its hash and loads the executable
    compiled the first time instead of compiling it again. The directory is new for each session (made by
    the first process, the pytest-xdist controller, and inherited by its workers through the environment)
    and removed when that process exits, so every run starts cold. ATTNLAB_TEST_COMPILE_CACHE=0 turns it off.
    Subprocesses the tests start do not read it (only this file does)."""
    if os.environ.get("ATTNLAB_TEST_COMPILE_CACHE") == "0":
        return
    path = os.environ.get("_ATTNLAB_TEST_COMPILE_CACHE_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="attnlab-test-compile-cache-")
        os.environ["_ATTNLAB_TEST_COMPILE_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # Two workers share the directory: an entry is written under a temporary name and renamed, so the other
    # worker never reads half a file (jax's cache writes in place when it has no size limit, i.e. no locks).
    try:
        from jax._src import lru_cache
    except ImportError:
        return
    put = getattr(lru_cache.LRUCache, "put", None)
    if put is None or getattr(put, "_atomic", False):
        return

    def atomic_put(self, key, value):
        if getattr(self, "eviction_enabled", True):
            return put(self, key, value)
        target = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if target.exists():
            return
        tmp = self.path / f".{os.getpid()}-{threading.get_ident()}.tmp"  # short: the key can be long
        tmp.write_bytes(value)
        os.replace(tmp, target)

    atomic_put._atomic = True
    lru_cache.LRUCache.put = atomic_put


_share_compiled_programs()


def pytest_sessionfinish(session, exitstatus):
    """Collect garbage once and freeze what survives, before the session reports that it has finished.

    A pytest-xdist worker ends its session holding some 10**6 objects (jax's traces and compiled
    programs), and pytest collects garbage once more while it unconfigures. By then xdist's own
    ``pytest_sessionfinish`` (a wrapper around this one) has told the controller that the worker is
    done, and the controller has asked it to exit: execnet gives a worker 5 s for that and then sends
    it SIGINT, which, on a loaded machine, landed in jax's GC callback and printed a
    PytestUnraisableExceptionWarning traceback ending in KeyboardInterrupt after ``[100%]``. Walking the
    heap here, before that message goes out, and freezing the survivors (``gc.freeze``: later
    collections skip them; the process is about to exit) leaves the last collection nothing to walk.
    """
    gc.collect()
    gc.freeze()


def tol(dtype):
    """The output tolerance for ``dtype`` inputs on the CPU: ``attnlab.testing.tolerance`` (the one table)."""
    return tolerance(dtype)


def grad_tol(dtype):
    """The gradient tolerance for ``dtype`` inputs on the CPU: ``attnlab.testing.tolerance(dtype, "grad")``."""
    return tolerance(dtype, "grad")


def qkv(shape_q, s=None, kv_heads=None, dtype=jnp.float32, seed=0, hv=None):
    """Random q [..., T, N, H], k/v [..., S, K, H|Hv]."""
    *lead, t, n, h = shape_q
    s = t if s is None else s
    kh = n if kv_heads is None else kv_heads
    hv = h if hv is None else hv
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (*lead, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (*lead, s, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(k3, (*lead, s, kh, hv), jnp.float32).astype(dtype)
    return q, k, v


def np_attention(q, k, v, mask=None, bias=None, scale=None, logits=None):
    """Attention in float64 numpy, written independently of attnlab.

    q [..., T, N, H], k [..., S, K, H], v [..., S, K, Hv]; mask bool broadcastable to
    [..., N, T, S]. Query head n uses kv head n // (N // K). Rows with nothing allowed -> 0.
    Returns (out [..., T, N, Hv], weights [..., N, T, S]).
    """
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    n, kh = q.shape[-2], k.shape[-2]
    k = np.repeat(k, n // kh, axis=-2)  # [..., S, N, H]
    v = np.repeat(v, n // kh, axis=-2)
    if logits is None:
        scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        logits = scale * np.einsum("...tnh,...snh->...nts", q, k)
    logits = np.array(logits, np.float64)
    if bias is not None:
        logits = logits + np.asarray(jnp.asarray(bias, jnp.float32), np.float64)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed = np.broadcast_to(np.asarray(mask), logits.shape)
    allowed = allowed & (logits != -np.inf)
    out_w = np.zeros(logits.shape)
    it = np.ndindex(*logits.shape[:-1])
    for idx in it:  # one query row at a time, as written on paper
        a = allowed[idx]
        if a.any():
            z = logits[idx][a]
            e = np.exp(z - z.max())
            out_w[idx][a] = e / e.sum()
    out = np.einsum("...nts,...snh->...tnh", out_w, v)
    return out, out_w


@pytest.fixture(autouse=True)
def _no_x64():
    """Every test starts and ends in JAX's default 32-bit mode.

    A test that needs x64 (tests/conformance.py, test_x64_keeps_float32) turns it on inside its body with
    the scoped ``with jax.enable_x64(True):``, which cannot leak into the next test; a global
    ``jax.config.update("jax_enable_x64", True)`` would, and fails here.
    """
    assert not jax.config.jax_enable_x64
    yield
    assert not jax.config.jax_enable_x64, "a test left jax_enable_x64 on: use the scoped jax.enable_x64(True)"


def fwd_and_grads(fn, *args, seed=7):
    """(out, grads of every argument) of ``fn`` with a fixed random cotangent, in one jit."""
    out_shape = jax.eval_shape(fn, *args)
    ct = jax.random.normal(jax.random.key(seed), out_shape.shape, jnp.float32).astype(out_shape.dtype)

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct)

    return run(*args)


def compare(a, b, tolerance):
    """assert_allclose in fp32 (half-precision inputs upcast) with a tolerance dict."""
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tolerance)


def brute_layout(dense, T, S, bq, bk):
    """Block layout straight from a dense [..., T, S] array: the definition, written out."""
    d = np.asarray(dense)
    d = np.broadcast_to(d, d.shape[:-2] + (T, S)).reshape(-1, T, S)
    nq, nk = -(-T // bq), -(-S // bk)
    out = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = d[:, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            out[i, j] = 0 if not blk.any() else (2 if blk.all() else 1)
    return out
