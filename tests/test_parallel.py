"""attnlab.parallel: head-parallel and ring attention against attention_reference on 8 CPU devices.

JAX fixes the number of CPU devices when its backend starts, and this test session has already
started it with one. Forcing 8 for the whole session (conftest) would run every other test on a
backend split eight ways; instead the multi-device checks run once, in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``tests/parallel_checks.py``), and each
case below judges its numbers with the suite's tolerances. The subprocess compiles with XLA's
backend optimisation off (correctness does not need fast code; it halves compile time, which is
nearly all of its run time). Single-device behaviour (errors, static shard layouts, a 1-device
mesh) is tested here directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CHEAP_COMPILE_FLAGS, grad_tol, qkv, tol

import attnlab
from attnlab import masks, parallel
from attnlab.kernels import ring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    "ring-float32-T37-full",
    "ring-float32-T37-causal",
    "ring-float32-T37-window",
    "ring-float32-T37-padding",
    "ring-bfloat16-T32-window",
    "ring-bfloat16-T32-causal&padding",
    "ring-zigzag-sp8-float32-T37-causal",
    "ring-zigzag-sp8-float32-T37-causal&padding",
    "ring-float32-T37-document&causal",
    "ring-zigzag-sp4-float32-T21-causal",
    "ring-zigzag-sp4-float32-T21-causal&padding",
    "ring-zigzag-sp8-bfloat16-T32-causal&padding",
    "ring-zigzag-sp8-float32-T64-irregular",
    "heads-float32-T19-window&padding",
    "heads-bfloat16-T19-causal",
    "heads-blockwise-float32-T150-window&padding",
    "mha-heads2xsp4-float32-T21-causal&padding",
    "mha-heads2xsp4-zigzag-float32-T21-causal&padding",
]


@pytest.fixture(scope="module")
def checks():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=8", *CHEAP_COMPILE_FLAGS])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "parallel_checks.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        pytest.fail(f"parallel_checks.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ran_on_eight_devices_and_every_case(checks):
    assert checks["devices"] == 8
    assert sorted(checks["results"]) == sorted(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_output_and_grads_match_reference(checks, case):
    r = checks["results"][case]
    assert r["finite"]
    t, gt = tol(jnp.dtype(r["dtype"])), grad_tol(jnp.dtype(r["dtype"]))
    # |x - ref| <= atol + rtol * max|ref|, per array
    assert r["out_err"] <= t["atol"] + t["rtol"] * r["out_ref"], r
    for err, ref in zip(r["grad_err"], r["grad_ref"], strict=True):
        assert ref > 0  # the gradient reaches every input
        assert err <= gt["atol"] + gt["rtol"] * ref, r


@pytest.mark.slow
def test_ring_memory_per_device_does_not_grow_with_devices(checks):
    # Same 512-position shard per device, forward + backward, on 2 and on 8 devices (4x the
    # sequence): per-device buffers must not grow. A gathered sequence would grow them ~4x.
    m2, m8 = checks["memory"]["2"], checks["memory"]["8"]
    total = lambda m: m["temp"] + m["argument"] + m["output"]  # noqa: E731
    assert m8["argument"] == m2["argument"]  # the shards really are the same size
    assert total(m8) <= 1.05 * total(m2), checks["memory"]
    # The zig-zag ring's reordering (ppermutes of the same shard) must not grow them either.
    mz = checks["memory"]["8-zigzag"]
    assert mz["argument"] == m8["argument"]
    assert total(mz) <= 1.05 * total(m8), checks["memory"]


@pytest.mark.slow
def test_no_all_gather_in_compiled_programs(checks):
    assert checks["gathers"] == {"ring-sp2": False, "ring-sp8": False, "ring-zigzag-sp8": False, "heads4": False}


@pytest.mark.slow
def test_heads_must_divide_the_head_axis(checks):
    msg = checks["errors"]["heads_not_divisible"]
    assert msg is not None and "N=6" in msg and "divisible" in msg


# ------------------------------------------------------------------------------------------
# In this process (one device)


def test_parse_and_make_mesh_errors():
    assert parallel.parse_mesh("heads=4,sp=2") == {"heads": 4, "sp": 2}
    for bad in ("sp", "sp=0", "sp=x", "sp=2,sp=2", "4=sp"):
        with pytest.raises(ValueError, match="mesh"):
            parallel.parse_mesh(bad)
    n = jax.device_count()
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count") as err:
        parallel.make_mesh(f"sp={n + 1}")
    assert f'jax.config.update("jax_num_cpu_devices", {n + 1})' in str(err.value)


def test_bad_arguments():
    mesh = parallel.make_mesh("sp=1")
    q, k, v = qkv((8, 2, 4))
    with pytest.raises(ValueError, match="bias"):
        parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", bias=jnp.zeros((2, 8, 8)))
    with pytest.raises(ValueError, match="score"):
        parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", score="additive")
    with pytest.raises(ValueError, match="not an axis"):
        parallel.attention(q, k, v, mesh=mesh, seq_axis="ring")
    with pytest.raises(ValueError, match="different mesh axes"):
        parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", head_axis="sp")
    with pytest.raises(ValueError, match="Mesh"):
        parallel.attention(q, k, v, mesh="sp=1", seq_axis="sp")


def test_shard_layout_causal_and_window_by_hand():
    E, P, F = masks.EMPTY, masks.PARTIAL, masks.FULL
    # causal, T = S = 16 over 4 shards of 4: shards below the diagonal FULL, above EMPTY.
    expected = np.array([[P, E, E, E], [F, P, E, E], [F, F, P, E], [F, F, F, P]])
    np.testing.assert_array_equal(ring.shard_layout(masks.causal(), 16, 16, 4), expected)
    # window(4, 0): query t sees t-4..t; shard i (rows 4i..4i+3) meets key shards i-1 and i only.
    expected = np.array([[P, E, E, E], [P, P, E, E], [E, P, P, E], [E, E, P, P]])
    np.testing.assert_array_equal(ring.shard_layout(masks.window(4, 0), 16, 16, 4), expected)
    # full attention, S = 14 over 4 shards of 4: key shard 3 holds 2 real keys and 2 padded
    # ones (PARTIAL, so they are masked).
    expected = np.array([[F, F, F, P]] * 4)
    np.testing.assert_array_equal(ring.shard_layout(None, 14, 14, 4), expected)
    # T = S = 5 over 4 shards of 2: shard 3 is all padding (EMPTY); shard 2 half padding.
    expected = np.array([[F, F, P, E]] * 3 + [[E, E, E, E]])
    np.testing.assert_array_equal(ring.shard_layout(None, 5, 5, 4), expected)


def test_one_device_mesh_matches_reference():
    # The same code on a 1-device mesh (the ring has one step; T = 11 over tiles of 4).
    mesh, mask = parallel.make_mesh("sp=1"), masks.causal()
    q, k, v = qkv((2, 11, 2, 4), kv_heads=1)
    f = lambda q, k, v: parallel.attention(  # noqa: E731
        q, k, v, mesh=mesh, seq_axis="sp", mask=mask, block_sizes=attnlab.kernels.BlockSizes(4, 4)
    )
    out = jax.jit(f)(q, k, v)
    np.testing.assert_allclose(out, attnlab.attention_reference(q, k, v, mask=mask), **tol(jnp.float32))


def test_use_host_devices(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    have = len(jax.devices("cpu"))  # JAX has started in this process
    assert parallel.use_host_devices(have) == have  # already enough: nothing to do
    with pytest.raises(ValueError, match=f"already started with {have} CPU device"):
        parallel.use_host_devices(have + 1)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="n: expected a positive int"):
            parallel.use_host_devices(bad)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=5")
    assert parallel.use_host_devices(2) == 5  # XLA_FLAGS decides


def test_use_host_devices_in_a_fresh_process():
    code = "import jax; from attnlab import parallel; print(parallel.use_host_devices(3), len(jax.devices()))"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["3", "3"]


def test_chunking_whole_tiles_little_padding():
    # 5000 positions over 8 chunks: ceil = 625; tiles of at most 512 -> 2 tiles of 313 (C = 626),
    # not one tile of 512 and a second one mostly padding (C = 1024).
    assert ring.chunking(5000, 8, 512) == (626, 313)
    assert ring.chunking(37, 8, 3) == (6, 3)  # ceil = 5 -> 2 tiles of 3
    assert ring.chunking(4096, 16, 512) == (256, 256)  # a chunk smaller than the tile: one tile


def test_zigzag_positions_by_hand():
    # D = 4, chunks of 3: device 1 holds chunks 1 and 6 -> positions 3, 4, 5 and 18, 19, 20.
    idx = np.arange(6)
    np.testing.assert_array_equal(ring.global_positions(idx, 1, 3, 4, "zigzag"), [3, 4, 5, 18, 19, 20])
    np.testing.assert_array_equal(ring.global_positions(idx, 0, 3, 4, "zigzag"), [0, 1, 2, 21, 22, 23])
    np.testing.assert_array_equal(ring.global_positions(idx[:3], 2, 3, 4, "contiguous"), [6, 7, 8])


@pytest.mark.parametrize("D", [2, 4, 8])
def test_zigzag_balances_causal_tiles_by_hand(D):
    # One tile per chunk (T = 2D * 4, tiles of 4). Causal: query chunk a sees key chunks 0..a,
    # i.e. a + 1 tiles. Contiguous (D chunks of 2 tiles): device d's tile rows 2d, 2d+1 see
    # 2d+1 and 2d+2 tiles: 4d + 3. Zig-zag: device d holds chunks d and 2D-1-d:
    # (d + 1) + (2D - d) = 2D + 1 tiles, the same on every device.
    T, bs = 2 * D * 4, attnlab.kernels.BlockSizes(4, 4)
    contiguous, _, _ = ring.pair_layouts(masks.causal(), T, T, D, bs, "contiguous")
    zigzag, (Cq, bq), _ = ring.pair_layouts(masks.causal(), T, T, D, bs, "zigzag")
    assert (Cq, bq) == (4, 4)
    per_device = lambda lay: (lay != masks.EMPTY).sum((1, 2, 3))  # noqa: E731
    np.testing.assert_array_equal(per_device(contiguous), 4 * np.arange(D) + 3)
    np.testing.assert_array_equal(per_device(zigzag), np.full(D, 2 * D + 1))
    # ... and in every ring step after the first (device d holds key shard (d - r) mod D) every
    # device does 2 FULL tiles; step 0 (its own shard) 2 PARTIAL diagonal tiles + 1 FULL.
    for r in range(D):
        step = np.stack([zigzag[d, (d - r) % D] for d in range(D)])
        kinds = [sorted(x[x != masks.EMPTY].tolist()) for x in step]
        expected = [masks.PARTIAL, masks.PARTIAL, masks.FULL] if r == 0 else [masks.FULL, masks.FULL]
        assert kinds == [expected] * D, (r, kinds)


def test_pair_layouts_pad_keys_and_skip_padded_chunks():
    # Full attention, S = 10 over D = 2 zig-zag (4 chunks of 3, tiles of 3: padded to 12). Key
    # tile 3 holds key 9 and 2 padded keys: PARTIAL; tile 3 is device 0's second chunk.
    lay, _, (Ck, bk) = ring.pair_layouts(None, 10, 10, 2, attnlab.kernels.BlockSizes(3, 3), "zigzag")
    assert (Ck, bk) == (3, 3)
    F, P = masks.FULL, masks.PARTIAL
    np.testing.assert_array_equal(lay[1, 0], [[F, P], [F, P]])  # device 1's queries, keys 0-2 | 9-11
    np.testing.assert_array_equal(lay[0, 1], [[F, F], [F, F]])  # device 0's queries, keys 3-5 | 6-8


def test_layout_must_be_known():
    mesh = parallel.make_mesh("sp=1")
    q, k, v = qkv((8, 2, 4))
    with pytest.raises(ValueError, match="layout: expected one of"):
        parallel.attention(q, k, v, mesh=mesh, seq_axis="sp", layout="striped")
    with pytest.raises(ValueError, match="layout"):
        ring.pair_layouts(None, 8, 8, 1, attnlab.kernels.BlockSizes(4, 4), "diagonal")


def test_one_device_zigzag_matches_reference():
    # D = 1 zig-zag: chunks 0 and 1 on the one device (the reordering is the identity).
    mesh, mask = parallel.make_mesh("sp=1"), masks.causal() & masks.padding(np.array([11, 6]), np.array([11, 6]))
    q, k, v = qkv((2, 11, 2, 4), kv_heads=1)
    f = lambda q, k, v: parallel.attention(  # noqa: E731
        q, k, v, mesh=mesh, seq_axis="sp", mask=mask, block_sizes=attnlab.kernels.BlockSizes(4, 4), layout="zigzag"
    )
    out = jax.jit(f)(q, k, v)
    np.testing.assert_allclose(out, attnlab.attention_reference(q, k, v, mask=mask), **tol(jnp.float32))


def test_irregular_mask_compiles_few_pair_classes_and_drops_no_tile():
    # A random dense mask gives nearly every (device, key shard) pair its own tile layout; past
    # MAX_PAIR_CLASSES the ring coarsens them (all FULL or all PARTIAL) instead of compiling 64
    # branches, and no tile that may attend is dropped.
    T, D, bs = 64, 8, attnlab.kernels.BlockSizes(4, 4)
    kinds = np.random.default_rng(0).integers(0, 3, (T // 4, T // 4))  # per 4 x 4 tile: EMPTY, PARTIAL, FULL
    one = np.zeros((4, 4), bool)
    one[0, 0] = True
    dense = np.kron(kinds == masks.FULL, np.ones((4, 4), bool)) | np.kron(kinds == masks.PARTIAL, one)
    m = masks.as_mask(dense)
    exact, _, _ = ring.pair_layouts(m, T, T, D, bs)
    distinct = {exact[d, s].tobytes() for d in range(D) for s in range(D) if exact[d, s].any()}
    assert len(distinct) > ring.MAX_PAIR_CLASSES  # the case being tested
    rs = ring.make_static(
        m, axis="sp", D=D, T=T, S=T, lead=(1,), N=1, K=1, H=4, scale=1.0, compute_dtype=jnp.float32, block_sizes=bs
    )
    assert len(rs.classes) <= 2
    for d in range(D):
        for s in range(D):
            c = rs.table[d][s]
            if c == 0:
                assert not exact[d, s].any()
                continue
            # rebuild the class's tile layout from its schedule: visited tiles must cover the exact ones
            index, counts = np.array(rs.classes[c - 1].index), np.array(rs.classes[c - 1].counts)
            visited = np.zeros_like(exact[d, s], bool)
            full_tiles = np.zeros_like(visited)
            for i in range(index.shape[0]):
                n_full, n_partial = counts[i]
                visited[i, index[i][: n_full + n_partial]] = True
                full_tiles[i, index[i][:n_full]] = True  # a schedule row lists its FULL tiles first
            assert (visited | (exact[d, s] == masks.EMPTY)).all()
            assert (exact[d, s][full_tiles] == masks.FULL).all()  # FULL only where every pair attends
