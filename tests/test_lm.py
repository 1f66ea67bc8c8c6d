"""The packed-LM experiment: the packed batch's mask and positions by hand, both layouts' loss against each
document run alone, the chunks, and the program's files at the smoke size."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import masks
from attnlab.data import brown, packing
from experiments import lm
from experiments.configs import lm as lm_config

ROW = 8
# (input, target) chunks of four documents: 5 + 3 + 6 + 2 = 16 tokens, two rows of 8 when packed
DOCS = [lm.chunks(ids, bos=1, eos=2, row_len=ROW)[0] for ids in ([3, 4, 5, 6], [7, 8], [9, 3, 4, 10, 11], [12])]


def test_chunks_by_hand():
    (c,) = lm.chunks([5, 6, 7], bos=1, eos=2, row_len=8)
    assert c.tolist() == [[1, 5], [5, 6], [6, 7], [7, 2]]  # BOS w1 w2 w3 -> w1 w2 w3 EOS
    pieces = lm.chunks(list(range(3, 13)), bos=1, eos=2, row_len=4)  # 11 pairs -> 4 + 4 + 3
    assert [len(p) for p in pieces] == [4, 4, 3]
    assert np.concatenate(pieces)[:, 1].tolist() == [*range(3, 13), 2]


def test_packed_mask_and_positions_by_hand():
    b = lm.packed_batch(DOCS, ROW, row_multiple=4)  # 2 rows of documents, 2 rows of padding
    seg = b["segment_ids"]
    assert seg.shape == (4, ROW) and (seg[2:] == packing.PAD_SEGMENT).all()
    want = np.zeros((4, ROW, ROW), bool)  # document & causal, written out
    pos = np.zeros((4, ROW), int)
    for r in range(4):
        for i in range(ROW):
            same = [j for j in range(i + 1) if seg[r, j] == seg[r, i] and seg[r, i] != packing.PAD_SEGMENT]
            want[r, i, same] = True
            pos[r, i] = i - min(same) if same else 0  # restarts at each document's first token
    got = np.asarray(lm.batch_mask(b).dense(ROW, ROW))  # [B, 1, T, S]
    np.testing.assert_array_equal(np.broadcast_to(got, (4, 1, ROW, ROW))[:, 0], want)
    np.testing.assert_array_equal(b["positions"], pos)
    # every document's tokens sit in one row, in order, with their targets
    for d in DOCS:
        row, start = next((r, s) for r in range(2) for s in range(ROW) if b["inputs"][r, s : s + len(d)].tolist()
                          == d[:, 0].tolist() and pos[r, s] == 0)  # fmt: skip
        assert b["targets"][row, start : start + len(d)].tolist() == d[:, 1].tolist()
    assert b["valid"].sum() == sum(map(len, DOCS))


def test_padded_mask_by_hand():
    b = lm.padded_batch(DOCS, ROW)
    lengths = [len(d) for d in DOCS]
    assert b["lengths"].tolist() == lengths
    want = np.array([[[j <= i < n for j in range(ROW)] for i in range(ROW)] for n in lengths])
    got = np.broadcast_to(np.asarray(lm.batch_mask(b).dense(ROW, ROW)), (4, 1, ROW, ROW))[:, 0]
    np.testing.assert_array_equal(got, want)


def _reference_loss(model, docs):
    """Each document alone (one row of its own length, causal only); numpy log-softmax cross-entropy."""
    total, count = 0.0, 0
    run = nnx.jit(lambda m, x: m(x, mask=masks.causal()))  # one program per length, not one per op
    for d in docs:
        logits = np.asarray(run(model, jnp.asarray(d[None, :, 0])), np.float64)[0]  # [n, V]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= logp[np.arange(len(d)), d[:, 1]].sum()
        count += len(d)
    return total / count


def test_packed_and_padded_losses_equal_each_document_alone():
    cfg = lm_config.get_config("smoke")
    cfg.data.row_len = ROW
    model = lm.build_model(cfg, 16, seed=0)
    ref = _reference_loss(model, DOCS)
    packed = lm.packed_batch(DOCS, ROW, row_multiple=3)  # with a row of padding
    padded = lm.padded_batch(DOCS, ROW)
    key = jax.random.key(0)
    loss_fn = nnx.jit(lambda m, b: lm.loss_fn(m, b, key)[0])  # as training runs it: jitted (op by op: 4x the time)
    for b in (packed, padded):
        np.testing.assert_allclose(float(loss_fn(model, b)), ref, rtol=1e-5)
    # packing without the document mask lets documents see each other: a different loss (the test can fail)
    leaky = dict(packed, segment_ids=np.where(packed["valid"], 0, packing.PAD_SEGMENT).astype(np.int32))
    assert abs(float(loss_fn(model, leaky)) - ref) > 1e-3
    # the gradients agree too: the two layouts train the same model
    grads = [nnx.jit(nnx.grad(loss_fn))(model, b) for b in (packed, padded)]
    for g, h in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-6)


def test_same_documents_per_step_in_both_layouts():
    cfg = lm_config.get_config("smoke")
    docs = [np.full((n, 2), i, np.int32) for i, n in enumerate([3, 9, 4, 20, 7, 1, 12, 5, 6, 2, 30, 8])]
    cfg.data.row_len, cfg.train.docs_per_step, cfg.train.num_steps = 32, 5, 4
    for p, q in zip(lm.batches(docs, "packed", cfg, 0), lm.batches(docs, "padded", cfg, 0), strict=True):
        assert sorted(p["inputs"][p["valid"]].tolist()) == sorted(q["inputs"][q["valid"]].tolist())
        assert q["inputs"].shape == (5, 32) and p["inputs"].shape[0] % cfg.train.row_multiple == 0


def test_paragraphs_flatten_to_the_sentences():
    paras = brown.load_paragraphs(max_files=2)
    assert [s for p in paras for s in p] == brown.load_sentences(max_files=2)
    assert len(paras) < len(brown.load_sentences(max_files=2)) and all(paras)


def test_config_variants():
    assert len(lm_config.get_config("default").seeds.split(",")) == 3
    with pytest.raises(ValueError, match="unknown lm variant"):
        lm_config.get_config("nope")


def test_smoke_writes_its_files(tmp_path):
    cfg = lm_config.get_config("smoke")
    results = lm.run(cfg, tmp_path, verbose=False)
    assert [(r["seed"], r["layout"]) for r in results] == [(0, "packed"), (0, "padded")]
    packed, padded = results
    assert abs(packed["heldout_loss"] - padded["heldout_loss"]) < 1e-4  # the same training, two layouts
    assert packed["train_tokens"] == padded["train_tokens"] and packed["padding_share"] < padded["padding_share"]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"].startswith("python -m experiments.lm") and "load" in run
    text = lm.report(tmp_path)
    assert (tmp_path / "summary.md").read_text() == text and (tmp_path / "lm.png").exists()
    assert f"| packed | {packed['heldout_loss']:.4f} ± 0.0000 |" in text
    bad = cfg.copy_and_resolve_references()
    bad.layouts = "packed,ragged"
    with pytest.raises(ValueError, match="layouts must be among"):
        lm.run(bad, tmp_path / "bad", verbose=False)
