"""Speech data: number words, the log-mel front end against librosa, espeak-ng synthesis and the cache."""

import numpy as np
import pytest

from attnlab.data import speech

librosa = pytest.importorskip("librosa", reason="librosa (speech extra) is the independent filterbank")


@pytest.mark.parametrize(
    "n,words",
    [
        (0, "zero"),
        (7, "seven"),
        (15, "fifteen"),
        (40, "forty"),
        (99, "ninety nine"),
        (100, "one hundred"),
        (105, "one hundred and five"),
        (1000, "one thousand"),
        (1005, "one thousand and five"),
        (1100, "one thousand one hundred"),
        (20013, "twenty thousand and thirteen"),
        (412306, "four hundred and twelve thousand three hundred and six"),
        (999999, "nine hundred and ninety nine thousand nine hundred and ninety nine"),
    ],
)
def test_number_words(n, words):
    assert speech.number_words(n) == words


@pytest.mark.parametrize("bad", [-1, 1_000_000, 2.5, "3"])
def test_number_words_range_named(bad):
    with pytest.raises(ValueError, match="number_words: n"):
        speech.number_words(bad)


def test_text_ids_round_trip():
    ids = speech.encode_text("four hundred")
    assert ids.min() >= 3
    assert speech.decode_ids(np.append(ids, [speech.EOS, 7, 8])) == "four hundred"
    with pytest.raises(ValueError, match="outside"):
        speech.encode_text("Four!")


@pytest.mark.parametrize("sr,n_fft", [(22050, 1024), (16000, 512)])
def test_mel_filterbank_matches_librosa(sr, n_fft):
    ours = speech.mel_filterbank(sr, n_fft, 80)
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=80, htk=False, norm="slaney")
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-7)


def test_log_mel_matches_librosa():
    rng = np.random.default_rng(0)
    sr = 22050
    t = np.arange(sr // 2) / sr
    x = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    ours = speech.log_mel(x, sr)
    mel = librosa.feature.melspectrogram(
        y=x, sr=sr, n_fft=1024, hop_length=220, win_length=551, window="hann", center=False, power=2.0, n_mels=80
    )
    assert ours.shape == mel.T.shape  # ~10 ms frames: 0.5 s -> ~46 frames
    np.testing.assert_allclose(ours, np.log(mel.T + 1e-6), atol=2e-3, rtol=1e-3)


def test_cmvn_normalises_each_utterance_over_its_own_frames():
    rng = np.random.default_rng(0)
    lengths = np.array([5, 2, 7])
    x = np.zeros((3, 7, 4), np.float32)
    for i, n in enumerate(lengths):
        x[i, :n] = rng.normal(3.0 * i, 1.0 + i, size=(n, 4))
    y = speech.cmvn(x, lengths)
    for i, n in enumerate(lengths):
        f = x[i, :n].astype(np.float64)
        np.testing.assert_allclose(y[i, :n], (f - f.mean(0)) / np.sqrt(f.var(0) + 1e-5), rtol=1e-4, atol=1e-5)
        assert (y[i, n:] == 0).all()  # padding stays zero
    # a longer padding does not change an utterance's result
    wide = np.concatenate([x, np.full((3, 5, 4), 9.0, np.float32)], axis=1)
    np.testing.assert_array_equal(speech.cmvn(wide, lengths)[:, :7], y)


@pytest.mark.parametrize(
    "features, lengths, match",
    [(np.zeros((2, 3)), np.array([1, 1]), "features must be"), (np.zeros((2, 3, 4)), np.array([1]), "lengths must be"),
     (np.zeros((2, 3, 4)), np.array([1, 4]), "lengths must lie"), (np.zeros((2, 3, 4)), np.array([1.0, 2.0]), "int")],
)  # fmt: skip
def test_cmvn_arguments_named(features, lengths, match):
    with pytest.raises(ValueError, match=match):
        speech.cmvn(features, lengths)


def test_log_mel_rejects_stereo():
    with pytest.raises(ValueError, match="mono"):
        speech.log_mel(np.zeros((2, 100)), 16000)


needs_espeak = pytest.mark.skipif(
    not speech.espeak_available(),
    reason="espeak-ng is not installed (run `make data-speech` as root, or `sudo apt-get install -y espeak-ng`)",
)


@needs_espeak
def test_synthesize_speaks():
    x, sr = speech.synthesize("seven", voice="en-us", variant="m3")
    assert sr > 8000 and 0.2 < len(x) / sr < 3.0  # a word lasts a fraction of a second
    assert np.abs(x).max() > 0.05


@needs_espeak
def test_load_small_slice_and_cache(tmp_path, monkeypatch):
    splits = speech.load(num_train=6, num_test=3, num_new_voice=2, directory=tmp_path, progress=False)
    train, test, new = splits["train"], splits["test"], splits["new_voice"]
    assert (len(train), len(test), len(new)) == (6, 3, 2)
    assert not set(train.texts) & set(test.texts)  # held-out numbers
    assert all(s.endswith("+" + speech.HELD_OUT_VARIANT) for s in new.speakers)
    assert not any(s.endswith("+" + speech.HELD_OUT_VARIANT) for s in train.speakers)
    assert train.features.shape[-1] == 80 and (train.lengths > 20).all()
    for i, text in enumerate(train.texts):
        assert speech.decode_ids(train.targets[i]) == text
        assert train.targets[i, train.target_lengths[i] - 1] == speech.EOS
    # a rerun reads the cache: no synthesis
    monkeypatch.setattr(speech, "synthesize", lambda *a, **k: pytest.fail("synthesized again"))
    again = speech.load(num_train=6, num_test=3, num_new_voice=2, directory=tmp_path, progress=False)
    np.testing.assert_array_equal(again["train"].features, train.features)


def _needs_brown():
    from attnlab.data import brown

    try:
        brown.brown_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_sentence_texts_are_short_lowercase_letter_sentences():
    _needs_brown()
    texts = speech.sentence_texts(max_words=12)
    assert len(texts) > 5000 and len(set(texts)) == len(texts)
    assert all(set(t) <= set(speech.ALPHABET) and 3 <= len(t.split()) <= 12 for t in texts)
    # a sentence of ca01 ("It urged that the city `` take steps to remedy '' this problem ."), lowercased
    assert "it urged that the city take steps to remedy this problem" in texts
    assert len(speech.sentence_texts(max_words=5)) < len(texts)
    with pytest.raises(ValueError, match="min_words"):
        speech.sentence_texts(min_words=4, max_words=3)


@needs_espeak
def test_load_sentences_small_slice(tmp_path):
    _needs_brown()
    splits = speech.load(corpus="sentences", num_train=3, num_test=2, num_new_voice=1, directory=tmp_path,
                         progress=False)  # fmt: skip
    train, test = splits["train"], splits["test"]
    assert not set(train.texts) & set(test.texts)
    assert set(train.texts) | set(test.texts) <= set(speech.sentence_texts())
    for i, text in enumerate(test.texts):
        assert speech.decode_ids(test.targets[i]) == text
    assert next(tmp_path.glob("sentences-*.npz"))  # cached under the corpus's name


def test_load_arguments_named(tmp_path):
    with pytest.raises(ValueError, match="num_new_voice"):
        speech.load(num_train=2, num_test=1, num_new_voice=2, directory=tmp_path)
    with pytest.raises(ValueError, match="corpus"):
        speech.load(corpus="poems", directory=tmp_path)
