"""The claims experiment: per-head statistics against loops, model surgery, and the smoke run end to end."""

import numpy as np
import pytest

from experiments import claims
from experiments.configs import claims as claims_config


def _random_weights(rng, B, N, T, lengths):
    """Row-stochastic attention over the real keys of each real query; zero rows for padded queries."""
    w = np.zeros((B, N, T, T))
    for b, n in enumerate(lengths):
        x = rng.random((N, n, n)) ** 4
        w[b, :, :n, :n] = x / x.sum(-1, keepdims=True)
    return w


def _loop_statistics(w, lengths, R):
    """The statistics of ``claims.layer_statistics`` by plain loops over (b, t, s): every real query row
    (each has a nonzero weight here) and its real keys."""
    B, N, T, _ = w.shape
    rows = sum(lengths)
    mass = {}
    pairs = {}  # offset -> list of weights (per head)
    for b in range(B):
        n = lengths[b]
        for t in range(n):
            for s in range(n):
                mass.setdefault(s - t, np.zeros(N))
                mass[s - t] += w[b, :, t, s] / rows
                pairs.setdefault(s - t, []).append(w[b, :, t, s])
    everything = np.concatenate([np.stack(v) for v in pairs.values()])  # [pairs, N]
    resid = sum(((np.stack(v) - np.stack(v).mean(0)) ** 2).sum(0) for v in pairs.values())
    r2 = 1 - resid / ((everything - everything.mean(0)) ** 2).sum(0)
    ent = np.zeros(N)
    for b in range(B):
        p = w[b, :, : lengths[b], : lengths[b]]
        ent -= np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum((1, 2)) / rows
    table = np.stack([mass.get(d, np.zeros(N)) for d in range(-R, R + 1)], axis=1)
    best = {h: max(sorted(mass), key=lambda d: mass[d][h]) for h in range(N)}
    return table, ent, r2, best, mass


def test_layer_statistics_match_loops():
    # claims' per-head statistics are attnlab.inspect's (summarise + offset_profile), in fp32: checked
    # against float64 loops at the tolerance of the summaries' own test (tests/test_inspect.py)
    rng = np.random.default_rng(0)
    lengths = [5, 3, 6]
    w = _random_weights(rng, 3, 2, 6, lengths)
    got = claims.layer_statistics(w, np.array(lengths), max_offset=2)
    table, ent, r2, best, mass = _loop_statistics(w, lengths, 2)
    np.testing.assert_allclose(got["offset_mass"], table, atol=1e-5)
    np.testing.assert_allclose(got["entropy"], ent, atol=1e-5)
    np.testing.assert_allclose(got["r2_offset"], r2, atol=1e-5)
    assert got["top_offset"].tolist() == [best[0], best[1]]
    np.testing.assert_allclose(got["top_offset_mass"], [mass[best[h]][h] for h in range(2)], atol=1e-5)
    uniform = np.mean(np.concatenate([[np.log(n)] * n for n in lengths]))
    np.testing.assert_allclose(got["uniform_entropy"], [uniform, uniform], atol=1e-5)


def test_convolution_head_scores_one():
    # a "shift by -1" head (each query attends its left neighbour; the first query has none and a row of
    # zeros, as attnlab returns: not counted) is a convolution head: all mass on one offset, exact fit
    T, lengths = 5, np.array([5, 4])
    w = np.zeros((2, 1, T, T))
    for b, n in enumerate(lengths):
        for t in range(1, n):
            w[b, 0, t, t - 1] = 1.0
    got = claims.layer_statistics(w, lengths, max_offset=1)
    # 9 real rows, 7 of them have a left neighbour; the 2 empty ones do not count
    np.testing.assert_allclose(got["offset_mass"][0], [1.0, 0, 0])
    assert got["top_offset"][0] == -1 and got["top_offset_mass"][0] == 1.0
    np.testing.assert_allclose(got["r2_offset"][0], 1.0)
    np.testing.assert_allclose(got["entropy"][0], 0.0)
    # rows t >= 1 of lengths 5 and 4: 4 rows with log 5 keys, 3 rows with log 4
    np.testing.assert_allclose(got["uniform_entropy"][0], (4 * np.log(5) + 3 * np.log(4)) / 7, rtol=1e-6)


def test_pca_and_nearest_by_hand():
    x = np.array([[1.0, 0, 0], [-1.0, 0, 0], [0, 2.0, 0], [0, -2.0, 0]])
    xy = claims.pca_2d(x)
    # the leading component is the y axis (variance 2) then x (variance 0.5): projections +-2 and +-1
    np.testing.assert_allclose(np.abs(xy[:, 0]), [0, 0, 2, 2], atol=1e-12)
    np.testing.assert_allclose(np.abs(xy[:, 1]), [1, 1, 0, 0], atol=1e-12)
    table = np.array([[1.0, 0], [0.9, 0.1], [0, 1], [-1, 0]])
    assert claims.nearest(table, np.arange(4), 0, 2) == [1, 2]  # cosine 0.99, 0, then -1


def test_one_hot_codes_are_fixed_and_near_orthogonal():
    c = claims.one_hot_codes(500, 64, seed=0)
    np.testing.assert_array_equal(c, claims.one_hot_codes(500, 64, seed=0))
    assert set(np.unique(c)) == {-1.0, 1.0}
    cos = (c @ c.T) / 64
    off = cos[~np.eye(500, dtype=bool)]
    assert abs(off.mean()) < 0.01 and off.std() < 1.5 / np.sqrt(64)


def test_cells_cover_each_part_once():
    cfg = claims_config.get_config("default")
    cells = claims.cells(cfg)
    keys = [tuple(sorted(c.items())) for c in cells]
    assert len(keys) == len(set(keys))
    pos = [c for c in cells if c["task"] == "pos"]
    assert sorted({c["heads"] for c in pos if c["input"] == "features"}) == [1, 2, 4, 8]
    assert {c["score"] for c in pos} == {"dot", "additive"}
    assert {c["input"] for c in pos} == {"features", "word_learned", "word_onehot"}
    assert not any(c["input"].startswith("word") for c in cells if c["task"] == "shift")
    with pytest.raises(ValueError, match="unknown claims variant"):
        claims_config.get_config("nope")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("claims")
    cfg = claims_config.get_config("smoke")
    return cfg, out, claims.run(cfg, out, verbose=False)


def test_smoke_records(smoke):
    cfg, out, results = smoke
    assert len(results) == len(claims.cells(cfg))
    for r in results:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["step_s"] > 0
        assert set(r["dispatch"]) == {"cpu", "gpu", "tpu"}
        n_layers = (cfg.shift if r["task"] == "shift" else cfg.pos).model.num_layers
        assert len(r["heads_analysis"]) == n_layers * r["heads"]
        for h in r["heads_analysis"]:
            assert len(h["offset_mass"]) == 2 * cfg.analysis.max_offset + 1
            assert 0.0 <= h["top_offset_mass"] <= 1.0 + 1e-6 and sum(h["offset_mass"]) <= 1.0 + 1e-4
            assert 0.0 <= h["entropy"] <= h["uniform_entropy"] + 1e-6
    onehot = next(r for r in results if r["input"] == "word_onehot")
    learned = next(r for r in results if r["input"] == "word_learned")
    assert "neighbours" in learned and "pca" in learned and "pca" not in onehot
    assert len(learned["pca"]) == cfg.analysis.pca_words


def test_smoke_weights_statistics_recomputed(smoke):
    # rebuild the trained shift model from its final checkpoint is not needed: recompute the stored
    # statistics of a fresh model by loops, through the same analyse_heads path
    from experiments import posenc

    cfg, _, _ = smoke
    model = posenc.build_model(cfg.shift, cfg.shift.posenc, 0)
    sets = posenc.eval_sets(cfg.shift)
    L = cfg.shift.task.train_length
    x, lengths = sets[L]["inputs"][:4], sets[L]["lengths"][:4]
    heads, weights = claims.analyse_heads(model, x, lengths, 2, lambda m: 0.5)
    for layer, w in enumerate(weights):
        table, ent, r2, _, _ = _loop_statistics(np.asarray(w, np.float64), lengths.tolist(), 2)
        got = [h for h in heads if h["layer"] == layer]
        np.testing.assert_allclose([h["offset_mass"] for h in got], table, atol=1e-5)
        np.testing.assert_allclose([h["entropy"] for h in got], ent, rtol=1e-5)
        np.testing.assert_allclose([h["r2_offset"] for h in got], r2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_analyse_heads_on_inspect_matches_the_previous_computation(score):
    """analyse_heads (weights from inspect.capture, ablation by inspect.ablated) against what it computed
    before: the weights of ``backbone(..., return_weights=True)`` and the accuracy of a copy of the
    model with the head's slice ``wo[head]`` zeroed by hand; the model itself is left untouched."""
    import jax.numpy as jnp
    from flax import nnx

    from experiments import posenc

    cfg = claims_config.get_config("smoke")
    model = claims.with_score(posenc.build_model(cfg.shift, cfg.shift.posenc, 0), score, 0)
    L = cfg.shift.task.train_length
    evalset = {L: posenc.eval_sets(cfg.shift)[L]}
    x, lengths = evalset[L]["inputs"], evalset[L]["lengths"]
    before = np.asarray(model(jnp.asarray(x), jnp.asarray(lengths)))

    def accuracy(m):
        return posenc.evaluate(m, evalset, L)[f"acc@{L}"]

    heads, weights = claims.analyse_heads(model, x, lengths, cfg.analysis.max_offset, accuracy)
    _, old_weights = model.backbone(jnp.asarray(x), jnp.asarray(lengths), return_weights=True)
    for w, old in zip(weights, old_weights, strict=True):
        np.testing.assert_allclose(w, np.asarray(old), atol=1e-6)
    for h in heads:
        by_hand = nnx.clone(model)
        attn = by_hand.backbone.blocks[h["layer"]].attn
        attn.wo[...] = attn.wo[...].at[h["head"]].set(0.0)
        assert h["ablated_accuracy"] == accuracy(by_hand), h
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(x), jnp.asarray(lengths))), before)


def test_frozen_table_is_not_trained(smoke):
    # the one-hot run's word table is an nnx.Variable, not an nnx.Param: the trainer's param split leaves it out
    from flax import nnx

    cfg, _, _ = smoke
    from experiments import pos_tagging

    model = pos_tagging.build_model(cfg.pos, (50,), 12)
    codes = claims.one_hot_codes(50, cfg.pos.model.d_model, 0)
    claims.freeze_word_table(model, codes)
    params = nnx.state(model, nnx.Param)
    table = model.backbone.embed.embeds[0].embedding
    assert not isinstance(table, nnx.Param)
    np.testing.assert_array_equal(np.asarray(table[...]), codes)
    assert all(np.asarray(v).shape != codes.shape for v in __import__("jax").tree.leaves(params))


def test_report(smoke):
    _, out, results = smoke
    text = claims.report(out)
    for section in ("Heads ablation", "Per-head analysis", "Distance from a convolution", "dot product vs additive",
                    "One-hot vs learned"):  # fmt: skip
        assert section in text
    shift = [r for r in results if r["task"] == "shift" and r["score"] == "dot"]
    r = next(r for r in shift if r["heads"] == 2)
    assert f"| shift | 2 | {r['d_model'] // 2} | {100 * r['accuracy']:.1f} ± 0.0 | 1 |" in text
    for name in ("heads_shift.png", "heads_pos.png", "heads_accuracy.png", "embedding_pca.png", "summary.md"):
        assert (out / name).exists()
