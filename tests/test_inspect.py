"""attnlab.inspect: capture, ablation, patching and summaries, each against an independent computation.

The reference is a hand-run of the Encoder from its parts (embedding, ``heads.project_qkv``, the
rotary map, ``attnlab.attention`` / ``attention_weights``, the output projection, the MLP), with an
optional replacement of chosen heads' outputs; the summaries are checked against numpy loops.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import efficient, heads, inspect, masks, nn, positional

B, T, V, D, L, N = 3, 9, 17, 16, 2, 4


def make_model(**kw):
    kw = {"posenc": positional.Rope(), **kw}
    enc = nn.Encoder(vocab_sizes=V, d_model=D, num_layers=L, num_heads=N, rngs=nnx.Rngs(0), **kw)
    return nn.TokenClassifier(enc, 5, rngs=nnx.Rngs(1))


def batch(seed=0):
    x = jax.random.randint(jax.random.key(seed), (B, T), 0, V)
    lengths = jnp.array([T, 6, 3]) if seed == 0 else jnp.array([5, T, 7])
    return x, lengths


def hand_run(model, x, lengths, replace=None):
    """The TokenClassifier(Encoder) forward from its parts.

    ``replace(layer, o) -> o`` may change the per-head outputs [B, T, N, Hv] of a layer before Wo.
    Returns (logits, per-layer dicts of q, k, v, o (before replace), weights).
    """
    enc = model.backbone
    mask = enc.mask(lengths)
    rotary = enc.posenc.rotary()
    h = enc.embed(x)
    seen = []
    for i, block in enumerate(enc.blocks):
        p = block.attn.params()
        q, k, v = heads.project_qkv(p, block.ln1(h))
        if rotary is not None:
            q, k = rotary(q), rotary(k)
        o = attnlab.attention(q, k, v, mask=mask)
        seen.append(dict(q=q, k=k, v=v, out=o, weights=attnlab.attention_weights(q, k, mask=mask)))
        if replace is not None:
            o = replace(i, o)
        n, hv, d = p["wo"].shape
        h = h + o.reshape(*o.shape[:-2], n * hv) @ p["wo"].reshape(n * hv, d) + p["bo"]
        h = h + block.mlp_out(jax.nn.gelu(block.mlp_in(block.ln2(h))))
    return model.head(enc.ln_f(h)), seen


def test_capture_matches_a_hand_run_and_leaves_the_output_unchanged():
    model = make_model()
    x, lengths = batch()
    cap = inspect.capture(model, x, lengths)
    logits, seen = hand_run(model, x, lengths)
    assert cap.names == ("backbone.blocks.0.attn", "backbone.blocks.1.attn") == inspect.layers(model)
    np.testing.assert_array_equal(cap.output, model(x, lengths))  # the default path, exactly
    chex.assert_trees_all_close(cap.output, logits, atol=1e-5, rtol=1e-5)
    for c, s in zip(cap.layers, seen, strict=True):
        assert c.kind == "Softmax" and c.rows is None and c.lse is None
        chex.assert_shape(c.weights, (B, N, T, T))
        for name in ("q", "k", "v", "out", "weights"):
            chex.assert_trees_all_close(getattr(c, name), s[name], atol=1e-5, rtol=1e-5)
    # the model's own return_weights path (multi_head_attention's) agrees
    _, own = model.backbone(x, lengths, return_weights=True)
    chex.assert_trees_all_close([c.weights for c in cap.layers], own, atol=1e-6)


def test_rows_capture_gives_those_rows_and_every_rows_lse():
    model = make_model(posenc=positional.Alibi(), attention_mask=masks.window(3, 2))  # callable bias + mask
    x, lengths = batch()
    dense = inspect.capture(model, x, lengths)
    rows = (0, 4, 8)
    cap = inspect.capture(model, x, lengths, rows=rows, record=("q", "k", "weights"))
    enc = model.backbone
    bias = positional.Alibi().bias(N)(jnp.arange(T), jnp.arange(T))  # [N, T, S]
    mask = enc.mask(lengths).dense(T, T)
    for c, d in zip(cap.layers, dense.layers, strict=True):
        assert c.rows == rows and c.v is None and c.out is None
        chex.assert_trees_all_close(c.weights, d.weights[:, :, list(rows)], atol=1e-6)
        logits = np.einsum("btnh,bsnh->bnts", c.q, c.k) / np.sqrt(D // N) + np.asarray(bias)
        logits = np.where(np.broadcast_to(mask, logits.shape), logits, -np.inf)
        with np.errstate(divide="ignore"):
            m = logits.max(-1, keepdims=True)
            lse = (
                np.log(np.exp(logits - np.where(np.isfinite(m), m, 0)).sum(-1)) + np.where(np.isfinite(m), m, 0)[..., 0]
            )
        np.testing.assert_allclose(np.swapaxes(np.asarray(c.lse), -1, -2), lse, atol=1e-4)  # [B, T, N] vs [B, N, T]
        assert np.isneginf(np.asarray(c.lse)[2, 8]).all()  # query 8 of a length-3 example attends to nothing
        np.testing.assert_array_equal(np.asarray(c.weights)[2, :, 2], 0.0)  # its row is zeros, not NaN


def test_rows_capture_on_an_array_bias_of_a_graph_model():
    enc = nn.Encoder(vocab_sizes=V, d_model=D, num_layers=1, num_heads=N, posenc="none", rngs=nnx.Rngs(0))
    graph = nn.GraphEncoder(enc, graph="distance", num_heads=N, rngs=nnx.Rngs(1))
    graph.distance_table[...] = jax.random.normal(jax.random.key(3), graph.distance_table[...].shape)
    x, lengths = batch()
    dist = jax.random.randint(jax.random.key(4), (B, T, T), 0, 6)
    dense = inspect.capture(graph, x, lengths, distances=dist)
    cap = inspect.capture(graph, x, lengths, distances=dist, rows=[1, 2])
    chex.assert_trees_all_close(cap[0].weights, dense[0].weights[:, :, [1, 2]], atol=1e-6)
    np.testing.assert_array_equal(dense.output, graph(x, lengths, distances=dist))


def test_graph_mask_model_and_edge_mass():
    enc = nn.Encoder(vocab_sizes=V, d_model=D, num_layers=1, num_heads=N, posenc="none", rngs=nnx.Rngs(0))
    graph = nn.GraphEncoder(enc, graph="mask", rngs=nnx.Rngs(1))
    x, lengths = batch()
    adj = np.asarray(jax.random.bernoulli(jax.random.key(5), 0.3, (B, T, T)))
    cap = inspect.capture(graph, x, lengths, adjacency=adj)
    c = cap[0]
    mask = masks.graph(jnp.asarray(adj), self_loops=True) & masks.padding(lengths, lengths)
    chex.assert_trees_all_close(c.weights, attnlab.attention_weights(c.q, c.k, mask=mask), atol=1e-6)
    with_loops = adj | np.eye(T, dtype=bool)
    s = inspect.summarise(c.weights, lengths=lengths, adjacency=jnp.asarray(with_loops))
    np.testing.assert_allclose(s["edge_mass"], 1.0, atol=1e-5)  # a graph mask: all mass on edges
    np.testing.assert_allclose(s["non_edge_mass"], 0.0, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "performer"])
def test_effective_weights_of_the_linear_kinds(kind):
    model = make_model(attention=kind, posenc="none")
    x, lengths = batch()
    cap = inspect.capture(model, x, lengths)
    rows = inspect.capture(model, x, lengths, rows=[2, 5])
    for i, (c, r) in enumerate(zip(cap.layers, rows.layers, strict=True)):
        assert c.kind == kind.capitalize()
        chex.assert_trees_all_close(jnp.einsum("bnts,bsnh->btnh", c.weights, c.v), c.out, atol=1e-5)
        if kind == "linear":
            expect = efficient.linear_attention(c.q, c.k, c.v, kv_lengths=lengths)
        else:
            proj = model.backbone.blocks[i].attn.projection[...]
            expect = efficient.performer_attention(c.q, c.k, c.v, projection=proj, kv_lengths=lengths)
        chex.assert_trees_all_close(c.out, expect, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(c.weights)[2, :, :, 3:], 0.0)  # padded keys get nothing
        chex.assert_trees_all_close(r.weights, c.weights[:, :, [2, 5]], atol=1e-6)


def test_linformer_effective_weights():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 12, 4, 8)) for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: K = 2
    params = efficient.init_linformer(jax.random.key(9), 12, 5)
    lengths = jnp.array([12, 7])
    w = efficient.linformer_attention_weights(q, k, params, kv_lengths=lengths)
    out = efficient.linformer_attention(q, k, v, params, kv_lengths=lengths)
    vv = jnp.repeat(v, 2, axis=-2)  # query head n reads kv head n // 2
    chex.assert_trees_all_close(jnp.einsum("bnts,bsnh->btnh", w, vv), out, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(w)[1, :, :, 7:], 0.0)


def test_zero_ablation_equals_a_model_with_the_heads_output_projection_zeroed():
    model = make_model()
    x, lengths = batch()
    chosen = [(0, 1), (1, 3)]
    got = inspect.ablate(model, chosen, x, lengths)
    by_hand = nnx.clone(model)
    for layer, h in chosen:
        attn = by_hand.backbone.blocks[layer].attn
        attn.wo[...] = attn.wo[...].at[h].set(0.0)
    chex.assert_trees_all_close(got, by_hand(x, lengths), atol=1e-5, rtol=1e-5)
    assert not np.allclose(got, model(x, lengths), atol=1e-3)  # the ablation did something
    np.testing.assert_array_equal(model.backbone.blocks[0].attn.wo[...][1] != 0, True)  # model untouched


def test_mean_ablation_equals_a_hand_run_with_the_mean_head_output():
    model = make_model()
    x, lengths = batch()
    ref_x, ref_lengths = batch(seed=1)
    _, ref_seen = hand_run(model, ref_x, ref_lengths)
    mean = ref_seen[1]["out"].reshape(-1, N, D // N).mean(0)  # [N, Hv] over every example and position

    def replace(layer, o):
        return o.at[..., 2, :].set(mean[2]) if layer == 1 else o

    expect, _ = hand_run(model, x, lengths, replace)
    got = inspect.ablate(model, [(1, 2)], x, lengths, kind="mean", reference=(ref_x, ref_lengths))
    chex.assert_trees_all_close(got, expect, atol=1e-5, rtol=1e-5)


def test_patching_equals_a_hand_built_run():
    model = make_model()
    src, tgt = batch(seed=1), batch(seed=0)
    _, src_seen = hand_run(model, *src)
    patched = {(0, 0), (1, 2), (1, 3)}

    def replace(layer, o):
        for layer_, h in patched:
            if layer_ == layer:
                o = o.at[..., h, :].set(src_seen[layer]["out"][..., h, :])
        return o

    expect, _ = hand_run(model, *tgt, replace)
    got = inspect.patch(model, sorted(patched), inspect.inputs(*src), tgt)
    chex.assert_trees_all_close(got, expect, atol=1e-5, rtol=1e-5)
    # resampling is patching from other inputs; by default the batch rolled by one example
    rolled = (jnp.roll(tgt[0], 1, 0), jnp.roll(tgt[1], 1, 0))
    chex.assert_trees_all_close(
        inspect.ablate(model, sorted(patched), *tgt, kind="resample"),
        inspect.patch(model, sorted(patched), rolled, tgt),
        atol=1e-6,
    )


def test_head_sweep_is_one_trace_and_equals_a_loop_of_ablations():
    model = make_model()
    x, lengths = batch()
    sets = inspect.single_heads(model)
    assert sets.shape == (L * N, L, N)

    def loss(logits):
        return jnp.mean(logits**2)

    @chex.assert_max_traces(n=1)
    def sweep(graphdef, state, sets, x, lengths):
        m = nnx.merge(graphdef, state)
        return inspect.head_sweep(m, sets, x, lengths, fn=loss)

    graphdef, state = nnx.split(model)
    jitted = jax.jit(sweep, static_argnums=0)
    got = jitted(graphdef, state, sets, x, lengths)
    loop = jnp.stack([loss(inspect.ablate(model, [(i // N, i % N)], x, lengths)) for i in range(L * N)])
    chex.assert_trees_all_close(got, loop, atol=1e-6, rtol=1e-5)
    pairs = jnp.stack([inspect.head_mask(model, [(0, 0), (1, 1)]), inspect.head_mask(model, [])] * 4)
    jitted(graphdef, state, pairs, x, lengths)  # new head sets, same shapes: no new trace
    mean = inspect.head_sweep(model, sets[:2], x, lengths, kind="mean", fn=loss)
    chex.assert_trees_all_close(mean[1], loss(inspect.ablate(model, [(0, 1)], x, lengths, kind="mean")), atol=1e-6)


def test_capture_under_jit_traces_once():
    model = make_model()

    @chex.assert_max_traces(n=1)
    def f(graphdef, state, x, lengths):
        return inspect.capture(nnx.merge(graphdef, state), x, lengths, rows=[0, 1])

    graphdef, state = nnx.split(model)
    jitted = jax.jit(f, static_argnums=0)
    a = jitted(graphdef, state, *batch(0))
    jitted(graphdef, state, *batch(1))
    eager = inspect.capture(model, *batch(0), rows=[0, 1])
    chex.assert_trees_all_close(a, eager, atol=1e-6)


def test_encoder_decoder_cross_attention():
    model = nn.EncoderDecoder(
        input_dim=4, vocab_size=11, d_model=D, num_heads=2, encoder_layers=1, decoder_layers=1, rngs=nnx.Rngs(0)
    )
    feats = jax.random.normal(jax.random.key(0), (2, 8, 4))
    flen, toks, tlen = jnp.array([8, 5]), jnp.ones((2, 4), int), jnp.array([4, 2])
    cap = nnx.jit(inspect.capture)(model, feats, flen, toks, tlen)  # one program (op by op: ~200 small compiles)
    assert cap.names == ("blocks.0.cross_attn", "blocks.0.self_attn", "encoder.blocks.0.attn")

    @nnx.jit
    def own_weights(model, feats, flen, toks, tlen):
        memory, mlen = model.encode(feats, flen)
        return memory, model.decode(toks, memory, mlen, tlen, return_weights=True)[1]

    memory, own = own_weights(model, feats, flen, toks, tlen)
    chex.assert_trees_all_close(cap["blocks.0.cross_attn"].weights, own[0], atol=1e-6)
    chex.assert_shape(cap["blocks.0.cross_attn"].weights, (2, 2, 4, memory.shape[1]))
    assert [c.name for c in cap.select("*cross_attn")] == ["blocks.0.cross_attn"]
    assert [c.name for c in cap.select("encoder.*")] == ["encoder.blocks.0.attn"]
    assert len(cap.weights) == 3 and cap.weights[2] is cap["encoder.blocks.0.attn"].weights


def np_summary(w, offsets, lengths, adjacency, rows):
    """Loops over (example, head, row): the statistics of inspect.summarise."""
    b_, n_, t_, s_ = w.shape
    out = {k: np.zeros(n_) for k in ("entropy", "distance", "diagonal", "first", "edge", "non_edge", "rows")}
    off = np.zeros((n_, len(offsets)))
    for n in range(n_):
        for b in range(b_):
            for i in range(t_):
                t = rows[i]
                row = w[b, n, i]
                if t >= lengths[b] or not np.any(row != 0):
                    continue
                out["rows"][n] += 1
                out["entropy"][n] -= sum(p * np.log(p) for p in row if p > 0)
                out["distance"][n] += sum(row[s] * abs(s - t) for s in range(s_))
                out["diagonal"][n] += row[t] if t < s_ else 0.0
                out["first"][n] += row[0]
                out["edge"][n] += sum(row[s] for s in range(s_) if adjacency[b, i, s])
                out["non_edge"][n] += sum(row[s] for s in range(s_) if not adjacency[b, i, s])
                for j, d in enumerate(offsets):
                    if 0 <= t + d < s_:
                        off[n, j] += row[t + d]
        for k in out:
            if k != "rows":
                out[k][n] /= max(out["rows"][n], 1)
        off[n] /= max(out["rows"][n], 1)
    return out, off


@pytest.mark.parametrize("rows", [None, (1, 4, 6)])
def test_summarise_against_numpy_loops(rows):
    rng = np.random.default_rng(0)
    t_rows = 7 if rows is None else len(rows)
    w = rng.dirichlet(np.ones(7), size=(2, 3, t_rows)).astype(np.float32)  # [B, N, T, S]
    w[1, :, -1] = 0.0  # an empty row: not counted
    lengths = np.array([7, 5])
    adjacency = rng.random((2, t_rows, 7)) < 0.4
    offsets = (-2, 0, 1, 3)
    got = inspect.summarise(
        jnp.asarray(w), offsets=offsets, rows=rows, lengths=lengths, adjacency=jnp.asarray(adjacency)
    )
    expect, off = np_summary(w, offsets, lengths, adjacency, range(7) if rows is None else rows)
    for k, name in (("entropy",) * 2, ("distance",) * 2, ("diagonal",) * 2, ("first",) * 2, ("rows",) * 2):
        np.testing.assert_allclose(got[name], expect[k], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(got["edge_mass"], expect["edge"], atol=1e-5)
    np.testing.assert_allclose(got["non_edge_mass"], expect["non_edge"], atol=1e-5)
    np.testing.assert_allclose(got["offset_mass"], off, atol=1e-5)


def np_offset_profile(w, lengths, rows):
    """Loops over (example, head, row, key): the statistics of inspect.offset_profile and summarise's
    uniform_entropy. Counted rows: real queries with a nonzero weight; pairs: those rows' real keys."""
    b_, n_, t_, s_ = w.shape
    out = {k: np.zeros(n_) for k in ("top_offset", "top_offset_mass", "r2_offset", "uniform_entropy")}
    for n in range(n_):
        mass, pairs, counted = {}, {}, 0
        for b in range(b_):
            for i in range(t_):
                if rows[i] >= lengths[b] or not np.any(w[b, n, i] != 0):
                    continue
                counted += 1
                out["uniform_entropy"][n] += np.log(lengths[b])
                for s in range(lengths[b]):
                    d = s - rows[i]
                    mass[d] = mass.get(d, 0.0) + w[b, n, i, s]
                    pairs.setdefault(d, []).append(w[b, n, i, s])
        top = max(sorted(mass), key=lambda d: mass[d])
        everything = np.concatenate([np.asarray(v) for v in pairs.values()])
        resid = sum(((np.asarray(v) - np.mean(v)) ** 2).sum() for v in pairs.values())
        out["top_offset"][n], out["top_offset_mass"][n] = top, mass[top] / counted
        out["r2_offset"][n] = 1 - resid / ((everything - everything.mean()) ** 2).sum()
        out["uniform_entropy"][n] /= counted
    return out


@pytest.mark.parametrize("rows", [None, (1, 4, 6)])
def test_offset_profile_against_numpy_loops(rows):
    rng = np.random.default_rng(1)
    t_rows = 7 if rows is None else len(rows)
    w = (rng.dirichlet(np.ones(7), size=(2, 3, t_rows)) ** 3).astype(np.float32)  # [B, N, T, S], peaked rows
    lengths = np.array([7, 5])
    w[1, ..., 5:] = 0.0  # keys past the length carry nothing
    w[0, 1, 2] = 0.0  # an empty row: not counted
    positions = range(7) if rows is None else rows
    got = inspect.offset_profile(jnp.asarray(w), rows=rows, lengths=lengths)
    expect = np_offset_profile(w, lengths, positions)
    assert got["top_offset"].tolist() == expect["top_offset"].tolist()
    for k in ("top_offset_mass", "r2_offset"):
        np.testing.assert_allclose(got[k], expect[k], atol=1e-5, err_msg=k)
    uniform = inspect.summarise(jnp.asarray(w), rows=rows, lengths=lengths)["uniform_entropy"]
    np.testing.assert_allclose(uniform, expect["uniform_entropy"], atol=1e-5)
    with pytest.raises(ValueError, match="rows must be concrete"):
        jax.jit(lambda r: inspect.offset_profile(jnp.asarray(w), rows=r))(jnp.arange(t_rows))


def test_bad_arguments_raise_value_errors_naming_them():
    model = make_model()
    x, lengths = batch()
    with pytest.raises(ValueError, match="rows must be < T"):
        inspect.capture(model, x, lengths, rows=[T])
    with pytest.raises(ValueError, match="rows must be a non-empty"):
        inspect.capture(model, x, lengths, rows=[[0]])
    with pytest.raises(ValueError, match="record must be"):
        inspect.capture(model, x, lengths, record=("attention",))
    with pytest.raises(ValueError, match="heads must be bool"):
        inspect.ablate(model, jnp.zeros((3, N), bool), x, lengths)
    with pytest.raises(ValueError, match="layer 1 has heads"):
        inspect.ablate(model, [(1, N)], x, lengths)
    with pytest.raises(ValueError, match="kind must be one of"):
        inspect.ablate(model, [(0, 0)], x, lengths, kind="noise")
    with pytest.raises(ValueError, match="takes reference="):
        inspect.ablate(model, [(0, 0)], x, lengths, kind="mean", source=(x, lengths))
    with pytest.raises(ValueError, match="source must have the inputs' shapes"):
        inspect.patch(model, [(0, 0)], (x[:, :5], lengths), (x, lengths))
    with pytest.raises(ValueError, match="head_sets must be bool"):
        inspect.head_sweep(model, inspect.head_mask(model, [(0, 0)]), x, lengths)
    with pytest.raises(ValueError, match="source must be"):
        inspect.patch(model, [(0, 0)], [x, lengths], (x, lengths))
    with pytest.raises(ValueError, match="no attnlab.nn.MultiHeadAttention"):
        inspect.capture(nn.TokenMLP(vocab_sizes=V, d_model=D, rngs=nnx.Rngs(0)), x, lengths)
    with pytest.raises(ValueError, match="lengths must have the batch shape"):
        inspect.summarise(jnp.ones((2, 1, 3, 3)), lengths=jnp.ones(3, int))
    with pytest.raises(ValueError, match="weights must be"):
        inspect.summarise(jnp.ones((3, 3)))


def test_row_capture_builds_no_dense_weights_smoke():
    """benchmarks/inspect_memory.py at T = 2048 (compile only): one row costs far less than [N, T, S]."""
    from benchmarks import inspect_memory

    got = inspect_memory.analyse(2048)
    dense = 4 * 2048 * 2048 * 4  # N T S fp32
    assert 0 <= got["capture_row"]["extra_bytes"] < dense / 16, got
    assert got["capture_row_all"]["extra_bytes"] < dense / 4, got


def test_additive_score_and_an_ablated_model_under_jit():
    model = make_model(score="additive", posenc="none")
    x, lengths = batch()
    cap = inspect.capture(model, x, lengths, record=("q", "k", "weights"))
    mask = model.backbone.mask(lengths)
    for i, c in enumerate(cap.layers):
        w = model.backbone.blocks[i].attn.w_score[...]
        score = lambda q, k, w=w: attnlab.scores.additive(q, k, w)  # noqa: E731
        chex.assert_trees_all_close(c.weights, attnlab.attention_weights(c.q, c.k, mask=mask, score=score), atol=1e-6)
    np.testing.assert_array_equal(cap.output, model(x, lengths))
    by_hand = nnx.clone(model)
    by_hand.backbone.blocks[1].attn.wo[...] = by_hand.backbone.blocks[1].attn.wo[...].at[0].set(0.0)
    ablated = inspect.ablated(model, [(1, 0)])
    run = nnx.jit(lambda m, x, lengths: m(x, lengths))
    chex.assert_trees_all_close(run(ablated, x, lengths), by_hand(x, lengths), atol=1e-5, rtol=1e-5)
    # the probe reads w_score from the module at each call: a new value is seen, not a baked constant
    for m in (ablated, by_hand):
        m.backbone.blocks[0].attn.w_score[...] = 2.0 * m.backbone.blocks[0].attn.w_score[...]
    chex.assert_trees_all_close(run(ablated, x, lengths), by_hand(x, lengths), atol=1e-5, rtol=1e-5)
    ref = inspect.inputs(*batch(seed=1))
    chex.assert_trees_all_close(
        inspect.ablated(model, [(0, 2)], kind="mean", reference=ref)(x, lengths),
        inspect.ablate(model, [(0, 2)], x, lengths, kind="mean", reference=ref),
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="resample: use inspect.ablate"):
        inspect.ablated(model, [(0, 0)], kind="resample")


def test_grouped_query_heads():
    model = make_model(num_kv_heads=2)
    x, lengths = batch()
    cap = inspect.capture(model, x, lengths)
    _, seen = hand_run(model, x, lengths)
    chex.assert_shape(cap[0].k, (B, T, 2, D // N))
    chex.assert_trees_all_close([c.weights for c in cap.layers], [s["weights"] for s in seen], atol=1e-6)
    by_hand = nnx.clone(model)
    by_hand.backbone.blocks[0].attn.wo[...] = by_hand.backbone.blocks[0].attn.wo[...].at[3].set(0.0)
    chex.assert_trees_all_close(inspect.ablate(model, [(0, 3)], x, lengths), by_hand(x, lengths), atol=1e-5)


def _browser():
    import shutil

    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def test_html_view_data_and_errors():
    import json
    import re

    w = np.random.default_rng(0).dirichlet(np.ones(4), size=(2, 3))  # [N, T, S]
    page = inspect.html_view(w, ["a", "b", "</script>"], ["w", "x", "y", "z"], title="layer 1")
    data = re.search(r'<script type="application/json">(.*?)</script>', page, re.S)[1]
    np.testing.assert_allclose(json.loads(data.replace("<\\/", "</")), np.round(w, 4))
    assert "&lt;/script&gt;" in page and page.count('class="h"') == 2 and page.count('class="k"') == 4
    with pytest.raises(ValueError, match="queries must be T = 3"):
        inspect.html_view(w, ["a", "b"], ["w", "x", "y", "z"])
    with pytest.raises(ValueError, match="keys must be S = 4"):
        inspect.html_view(w, ["a", "b", "c"])
    with pytest.raises(ValueError, match="weights must be"):
        inspect.html_view(w[None], ["a", "b", "c"])


@pytest.mark.skipif(_browser() is None, reason="no headless chromium (Debian package chromium)")
def test_html_view_in_a_headless_browser(tmp_path):
    """The page's script runs in a real browser: #q=2&h=1 shades the keys with row 2 of head 1."""
    import re
    import subprocess

    w = np.random.default_rng(1).dirichlet(np.ones(5), size=(3, 4))
    path = tmp_path / "view.html"
    path.write_text("<html><body>" + inspect.html_view(w, list("abcd"), list("vwxyz")) + "</body></html>")
    cmd = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"{path.as_uri()}#q=2&h=1"]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    shown = [float(x) for x in re.findall(r'class="k"[^>]*data-weight="([^"]+)"', dom)]
    np.testing.assert_allclose(shown, np.round(w[1, 2], 4))
    assert 'data-head="1"' in dom and 'data-query="2"' in dom
