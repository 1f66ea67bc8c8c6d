"""attnlab.tuning: autotune on this device, the JSON table, and the implementations reading it."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlab
from attnlab import kernels, masks, tuning
from attnlab.call import bind
from attnlab.testing import assert_close


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("ATTNLAB_TUNING_CACHE", str(path))
    return path


def _x(T=256, N=2, H=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (1, T, N, H), jnp.float32)


def test_key_names_device_dtype_heads_mask_direction_and_length():
    x = jax.ShapeDtypeStruct((2, 300, 4, 32), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 300, 4, 16), jnp.bfloat16)
    call = bind(x, x, v, mask=masks.causal() & masks.padding(kv_lengths=[200, 300]))
    key = tuning.key_of("pallas", call, "cpu", "fwd")
    assert key.implementation == "pallas" and key.dtype == "bfloat16" and key.head_dims == (32, 16)
    assert key.mask == "causal&padding" and key.direction == "fwd" and key.length == 512
    assert key.device.startswith("cpu: ") and key.device == tuning.device_kind("cpu")
    assert tuning.mask_family(None) == tuning.mask_family(masks.full()) == "full"
    assert tuning.key_of("pallas", call, "cuda").device == "gpu: unknown"  # a backend this process lacks
    with pytest.raises(ValueError, match="direction"):
        tuning.key_of("pallas", call, "cpu", "backward")


def test_autotune_times_every_candidate_keeps_the_fastest_and_blockwise_then_uses_it(table, monkeypatch):
    q, k, v = _x(seed=1), _x(seed=2), _x(seed=3)
    m = masks.causal()
    candidates = [kernels.BlockSizes(64, 64), kernels.BlockSizes(128, 64), kernels.BlockSizes(64, 128)]
    result = attnlab.autotune(
        q,
        k,
        v,
        mask=m,
        implementation="blockwise",
        candidates=candidates,
        repeats=1,
        verbose=False,
        compile_workers=2,  # compiled ahead in two threads, timed one by one in order
    )
    assert all(r["compile_s"] > 0 and r["error"] is None for r in result.rows)
    assert [r["config"] for r in result.rows] == [{"block_q": c.block_q, "block_k": c.block_k} for c in candidates]
    times = [r["ms"] for r in result.rows]
    assert all(t is not None and t > 0 for t in times) and result.best_ms == min(times)
    assert result.best == candidates[int(np.argmin(times))]
    stored = json.loads(table.read_text())["entries"]
    assert len(stored) == 1 and stored[0]["key"] == result.key.as_json()
    assert tuning.lookup("blockwise", bind(q, k, v, mask=m)) == result.best
    # the blockwise implementation runs the call with the tuned tiles, and the result is still the reference's
    seen = []
    attend = kernels.blockwise.attend
    monkeypatch.setattr(
        kernels.blockwise,
        "attend",
        lambda call, block_sizes=None: seen.append(block_sizes) or attend(call, block_sizes=block_sizes),
    )
    out = attnlab.attention(q, k, v, mask=m, implementation="blockwise")
    assert seen == [result.best]
    assert_close(out, attnlab.attention_reference(q, k, v, mask=m), jnp.float32)
    assert "| ms |" in result.table()


def test_fwd_bwd_candidates_are_timed_on_the_gradients_for_a_normal_cotangent():
    """The tuner's forward+backward is training's: the gradients of q, k, v for a passed output cotangent,
    normal and fixed (not ones, whose backward XLA simplifies); they equal the reference's vjp of it."""
    q, k, v = _x(T=96, seed=1), _x(T=96, seed=2), _x(T=96, H=8, seed=3)
    m = masks.causal() & masks.padding(kv_lengths=[80])
    call = bind(q, k, v, mask=m)
    args = tuning._args(call, "fwd_bwd")
    ct = args[-1]
    assert len(args) == 4 and ct.shape == (1, 96, 2, 8) and ct.dtype == q.dtype
    assert 0.8 < float(jnp.std(ct)) < 1.2 and abs(float(jnp.mean(ct))) < 0.2  # a standard normal, not ones
    assert jnp.array_equal(ct, tuning._args(call, "fwd_bwd")[-1])  # fixed: every candidate gets the same
    assert tuning._args(call, "fwd") == (call.q, call.k, call.v)
    tunable = attnlab.dispatch.IMPLEMENTATIONS["blockwise"].tunable
    grads = tuning._program(tunable, call, kernels.BlockSizes(64, 32), "fwd_bwd")(*args)
    _, pull = jax.vjp(lambda q, k, v: attnlab.attention_reference(q, k, v, mask=m), q, k, v)
    for g, g_ref in zip(grads, pull(ct), strict=True):
        np.testing.assert_allclose(g, g_ref, atol=2e-5, rtol=2e-5)


def test_lookup_prefers_fwd_bwd_then_the_nearest_length(table):
    x = jax.ShapeDtypeStruct((1, 512, 2, 16), jnp.float32)
    call = bind(x, x, x, mask=masks.causal())
    key = tuning.key_of("blockwise", call, "cpu", "fwd")
    for length, bq in ((256, 64), (4096, 256)):
        tuning.store(key.__class__(**{**key.__dict__, "length": length}), {"block_q": bq, "block_k": 64}, table)
    assert tuning.lookup("blockwise", call) == kernels.BlockSizes(64, 64)  # 256 is one octave away, 4096 three
    assert tuning.lookup("blockwise", call, direction="fwd_bwd") is None
    train = key.__class__(**{**key.__dict__, "direction": "fwd_bwd", "length": 8192})
    tuning.store(train, {"block_q": 512, "block_k": 256}, table)
    assert tuning.lookup("blockwise", call) == kernels.BlockSizes(512, 256)  # tuned for training first
    assert tuning.lookup("blockwise", call, direction="fwd") == kernels.BlockSizes(64, 64)
    other = bind(x, x, x, mask=masks.window(8, 8))
    assert tuning.lookup("blockwise", other) is None  # no entry for the family: the kernel's defaults
    assert tuning.lookup("reference", call) is None  # nothing to tune


def test_autotune_errors(table):
    x = _x(T=64)
    with pytest.raises(ValueError, match="implementation must be one of"):
        attnlab.autotune(x, x, x, implementation="xla")
    with pytest.raises(ValueError, match="tile form"):
        attnlab.autotune(x, x, x, score=lambda q, k: attnlab.scores.dot_product(q, k), implementation="blockwise")
    result = attnlab.autotune(x, x, x, implementation="blockwise", budget_s=0.0, save=False, verbose=False)
    assert result.rows == [] and result.best is None and not table.exists()


def test_pallas_autotune_in_interpret_mode_and_the_kernel_reads_the_table(table):
    q, k, v = _x(T=48, seed=4), _x(T=48, seed=5), _x(T=48, seed=6)
    result = attnlab.autotune(q, k, v, mask=masks.causal(), implementation="pallas", repeats=1, verbose=False)
    assert {r["config"]["block_q"] for r in result.rows} == {16, 32, 64}  # interpret mode: square tiles 16..64
    assert tuning.lookup("pallas", bind(q, k, v, mask=masks.causal())) == result.best
    out = attnlab.attention(q, k, v, mask=masks.causal(), implementation="pallas")
    assert_close(out, attnlab.attention_reference(q, k, v, mask=masks.causal()), jnp.float32)


def test_committed_table_is_what_its_gpu_check_results_give():
    """Every entry of attnlab/tuning_table.json names its source, and the source regenerates it
    (``python -m benchmarks.tuning_table --from_gpu_check <source>``)."""
    committed = json.loads(Path(tuning.__file__).with_name("tuning_table.json").read_text())["entries"]
    assert committed, "the committed table holds the devices we measured"
    root = Path(__file__).resolve().parents[1]
    for source in {e["source"] for e in committed}:
        regenerated = tuning.entries_from_gpu_check(json.loads((root / source).read_text()))
        mine = {json.dumps(e["key"], sort_keys=True): e["config"] for e in committed if e["source"] == source}
        assert mine == {json.dumps(key.as_json(), sort_keys=True): config for key, config, _ in regenerated}
    for e in committed:
        assert tuning.Key.from_json(e["key"]).device == "NVIDIA H200"
        attnlab.dispatch.IMPLEMENTATIONS["pallas"].tunable.from_json(e["config"])  # a valid PallasConfig
