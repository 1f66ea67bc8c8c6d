"""The speech experiment end to end on the smoke config (espeak-ng synthesis, training, decoding, report)."""

import json

import numpy as np
import pytest

from attnlab.data import speech
from experiments import common
from experiments import speech as exp

pytestmark = pytest.mark.skipif(
    not speech.espeak_available(),
    reason="espeak-ng is not installed (run `make data-speech` as root, or `sudo apt-get install -y espeak-ng`)",
)


def test_smoke_run_and_report(tmp_path, monkeypatch):
    monkeypatch.setattr(speech, "DEFAULT_DIR", tmp_path / "data")
    cfg = common.load_config("experiments/configs/speech.py:smoke")
    out = tmp_path / "out"
    recs = exp.run(cfg, out, verbose=False)
    assert [r["window"] for r in recs] == ["2"]
    for r in recs:
        for k in ("test_greedy_cer", "test_beam2_cer", "new_voice_greedy_cer", "test_greedy_wer"):
            assert 0.0 <= r[k] <= 5.0  # an untrained model: any error rate, but computed
    # the truncated encoder's maps are zero beyond ±2 frames; rows sum to 1
    enc = np.load(out / "maps-2.npz")["encoder"]
    far = np.abs(np.subtract.outer(np.arange(len(enc)), np.arange(len(enc)))) > 2
    assert (enc[far] == 0).all()
    np.testing.assert_allclose(enc.sum(-1), 1.0, atol=1e-5)
    # cached and recomputed decoding emit the same tokens
    np.testing.assert_array_equal(np.load(out / "decoding-cached.npy"), np.load(out / "decoding-recompute.npy"))
    scaling = common.read_jsonl(out / "scaling.jsonl")
    assert {(r["window"], r["frames"]) for r in scaling} == {("full", 64), ("2", 64)}
    r = recs[0]  # the alignment over every test utterance: a correlation per utterance
    assert r["test_alignment_utterances"] == cfg.data.num_test
    assert -1.0 <= r["test_alignment_min"] <= r["test_alignment_mean"] <= 1.0
    text = exp.report(out)
    assert "identical tokens: True" in text and "±2" in text
    assert "over every test utterance" in text
    for png in ("cer_vs_window.png", "scaling.png", "alignment.png", "encoder_maps.png"):
        assert (out / png).stat().st_size > 0
    # a rerun resumes: nothing is trained again
    monkeypatch.setattr(exp, "run_one", lambda *a, **k: pytest.fail("ran again"))
    exp.run(cfg, out, verbose=False)
    assert len(common.read_jsonl(out / "results.jsonl")) == 1
    assert json.loads((out / "config.json").read_text())["variant"] == "smoke"


def test_alignments_batched_equal_each_utterance_alone(tmp_path, monkeypatch):
    # the batched, padded alignment of each test utterance equals the monotonicity of that utterance's
    # cross-attention captured alone (_maps: batch of one, no padding beyond its own length)
    import dataclasses

    monkeypatch.setattr(speech, "DEFAULT_DIR", tmp_path / "data")
    cfg = common.load_config("experiments/configs/speech.py:smoke")
    opts = cfg.data.to_dict()
    opts.pop("cmvn")
    test = speech.load(**opts, progress=False)["test"]
    model = exp.build_model(cfg, "2", 0)
    batched = exp.alignments(model, test, batch_size=3)  # 4 utterances: batches of 3 and 1
    assert batched.shape == (len(test.lengths),)
    for i in range(len(test.lengths)):
        one = dataclasses.replace(
            test,
            **{k: getattr(test, k)[i : i + 1] for k in ("features", "lengths", "targets", "target_lengths")},
            texts=test.texts[i : i + 1],
        )
        alone = exp.monotonicity(exp._maps(model, one)["cross"])
        np.testing.assert_allclose(batched[i], alone, atol=1e-4)


def test_error_rates_against_hand_counts():
    # jiwer's CER on a hand-made pair: one substitution in 5 characters
    import jiwer

    assert jiwer.cer(["seven"], ["seren"]) == pytest.approx(0.2)
