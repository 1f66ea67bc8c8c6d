"""Spoken numbers, synthesized offline with espeak-ng, as 80-bin log-mel frames.

``make data-speech`` installs espeak-ng (Debian package; as root with apt-get, otherwise it prints the
command). ``load(...)`` synthesizes a seeded corpus once into ``data/speech/`` and reuses it:

- ``numbers``: integers 0..999999 read as English words ("four hundred and twelve thousand three
  hundred and six"), the transcript in characters. Test numbers never occur in training.
- ``sentences``: short sentences of the Brown corpus (3-12 words, only letters once punctuation
  tokens are dropped: ``sentence_texts``), lowercased; test sentences never occur in training.
- speakers: espeak-ng voices (accents) x variants (m1..m7, f1..f4), with speed and pitch drawn per
  utterance; the variant ``HELD_OUT_VARIANT`` never occurs in training: the ``new_voice`` split is a
  new speaker reading test numbers.
- features: ``log_mel``: 25 ms Hann windows every 10 ms, power spectrum, 80 Slaney mel bins (the
  usual ASR front end; tested against librosa's filterbank), ``log(mel + 1e-6)``. A 4 s
  utterance is ~400 frames. ``cmvn`` normalises each utterance's bins to zero mean, unit variance
  over its own frames (padding stays zero), the usual per-utterance CMVN.

Characters map to ids with ``PAD = 0``, ``BOS = 1``, ``EOS = 2`` reserved (``encode_text``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ALPHABET",
    "BOS",
    "EOS",
    "PAD",
    "Split",
    "cmvn",
    "decode_ids",
    "encode_text",
    "espeak_available",
    "load",
    "log_mel",
    "mel_filterbank",
    "number_words",
    "sentence_texts",
    "synthesize",
]

PAD, BOS, EOS = 0, 1, 2
ALPHABET = " abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 3 + len(ALPHABET)
VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp")
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "f1", "f2", "f3", "f4")
HELD_OUT_VARIANT = "m7"
DEFAULT_DIR = Path(os.environ.get("ATTNLAB_SPEECH_DIR", "data/speech"))

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]  # noqa: E501
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
        if n:
            words.append("and")
    if n >= 20:
        words.append(_TENS[n // 10])
        if n % 10:
            words.append(_ONES[n % 10])
    elif n or not words:
        words.append(_ONES[n])
    return words


def number_words(n: int) -> str:
    """0..999999 in British English words: ``number_words(412306)`` -> "four hundred and twelve
    thousand three hundred and six"; ``number_words(1005)`` -> "one thousand and five"."""
    if not isinstance(n, int | np.integer) or not 0 <= n <= 999_999:
        raise ValueError(f"number_words: n must be an int in [0, 999999], got {n!r}")
    n = int(n)
    high, low = divmod(n, 1000)
    if not high:
        return " ".join(_below_thousand(low))
    words = _below_thousand(high) + ["thousand"]
    if low:
        words += (["and"] if low < 100 else []) + _below_thousand(low)
    return " ".join(words)


def encode_text(text: str) -> np.ndarray:
    """Characters -> int ids (``3 + ALPHABET.index(c)``); ValueError on a character outside ALPHABET."""
    bad = sorted(set(text) - set(ALPHABET))
    if bad:
        raise ValueError(f"encode_text: text has characters outside {ALPHABET!r}: {bad}")
    return np.array([3 + ALPHABET.index(c) for c in text], np.int32)


def decode_ids(ids) -> str:
    """Ids -> text, stopping at the first EOS and skipping PAD/BOS."""
    out = []
    for i in np.asarray(ids).tolist():
        if i == EOS:
            break
        if i >= 3:
            out.append(ALPHABET[i - 3])
    return "".join(out)


# ------------------------------------------------------------------------------------------
# Front end


def _hz_to_mel(f):
    """Slaney's mel scale (librosa's default, htk=False): linear below 1 kHz, log above."""
    f = np.asarray(f, np.float64)
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    lin = f / f_sp
    return np.where(f >= min_log_hz, min_log_hz / f_sp + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, lin)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_filterbank(sr: int, n_fft: int, n_mels: int = 80, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters, equally spaced in Slaney mel, area-normalised."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    lower = (fft_freqs[None, :] - edges[:-2, None]) / np.diff(edges)[:-1, None]
    upper = (edges[2:, None] - fft_freqs[None, :]) / np.diff(edges)[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return (weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


def log_mel(samples: np.ndarray, sr: int, *, n_mels: int = 80, win_ms: float = 25.0, hop_ms: float = 10.0):
    """Mono samples ``[N]`` -> log-mel frames ``[num_frames, n_mels]`` (float32; no centering).

    Frames of ``n_fft`` (the power of two >= the window) samples every ``hop_ms``, the Hann window of
    ``win_ms`` centred in each, power spectrum, mel filterbank, ``log(mel + 1e-6)``. A signal
    shorter than one frame is zero-padded to one frame.
    """
    x = np.asarray(samples, np.float32)
    if x.ndim != 1:
        raise ValueError(f"log_mel: samples must be 1-D (mono), got shape {x.shape}")
    win = int(round(sr * win_ms / 1000))
    hop = int(round(sr * hop_ms / 1000))
    n_fft = 1 << (win - 1).bit_length()
    if len(x) < n_fft:
        x = np.pad(x, (0, n_fft - len(x)))
    n = 1 + (len(x) - n_fft) // hop
    window = np.zeros(n_fft, np.float32)
    left = (n_fft - win) // 2
    window[left : left + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)  # periodic Hann
    idx = np.arange(n)[:, None] * hop + np.arange(n_fft)[None, :]
    power = np.abs(np.fft.rfft(x[idx] * window, axis=-1)) ** 2  # [n, n_fft/2+1]
    mel = power @ mel_filterbank(sr, n_fft, n_mels).T
    return np.log(mel + 1e-6).astype(np.float32)


def cmvn(features: np.ndarray, lengths: np.ndarray, *, eps: float = 1e-5) -> np.ndarray:
    """Per-utterance cepstral mean and variance normalisation of padded frames.

    Args:
        features: ``[N, T, F]`` frames, utterance i valid in ``[:lengths[i]]``.
        lengths: int ``[N]``, each in ``1..T``.
        eps: added to the variance.

    Returns:
        float32 ``[N, T, F]``: each utterance's bins minus their mean over its valid frames, divided by
        their standard deviation; padded frames are zero (as they were).
    """
    x = np.asarray(features, np.float32)
    n = np.asarray(lengths)
    if x.ndim != 3:
        raise ValueError(f"cmvn: features must be [N, T, F], got shape {x.shape}")
    if n.shape != (x.shape[0],) or not np.issubdtype(n.dtype, np.integer):
        raise ValueError(f"cmvn: lengths must be an int array of shape ({x.shape[0]},), got {n.dtype} {n.shape}")
    if n.size and (n.min() < 1 or n.max() > x.shape[1]):
        raise ValueError(f"cmvn: lengths must lie in 1..{x.shape[1]} (frames of features), got {n.min()}..{n.max()}")
    valid = (np.arange(x.shape[1])[None, :] < n[:, None])[..., None]  # [N, T, 1]
    count = n[:, None, None].astype(np.float32)
    mean = np.where(valid, x, 0.0).sum(1, keepdims=True) / count
    var = np.where(valid, (x - mean) ** 2, 0.0).sum(1, keepdims=True) / count
    return np.where(valid, (x - mean) / np.sqrt(var + eps), 0.0).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Synthesis


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def synthesize(text: str, *, voice: str = "en-us", variant: str = "m3", speed: int = 160, pitch: int = 50):
    """Speak ``text`` with espeak-ng -> ``(samples float32 in [-1, 1], sample_rate)``."""
    if not espeak_available():
        raise RuntimeError(
            "espeak-ng is not installed: run `make data-speech` (as root) or `sudo apt-get install -y espeak-ng`"
        )
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        cmd = ["espeak-ng", "-v", f"{voice}+{variant}", "-s", str(speed), "-p", str(pitch), "-w", f.name, text]
        subprocess.run(cmd, check=True, capture_output=True)
        with wave.open(f.name) as w:
            sr, raw = w.getframerate(), w.readframes(w.getnframes())
    return np.frombuffer(raw, np.int16).astype(np.float32) / 32768.0, sr


@dataclass(frozen=True)
class Split:
    """One split: ``features [N, T_max, 80]`` (zero-padded), ``lengths [N]``, ``targets [N, U_max]``
    (char ids + EOS, PAD after), ``target_lengths [N]`` (EOS included), ``texts``, ``speakers``."""

    features: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    target_lengths: np.ndarray
    texts: tuple[str, ...]
    speakers: tuple[str, ...]

    def __len__(self):
        return len(self.texts)


def sentence_texts(*, max_words: int = 12, min_words: int = 3, data_dir=None) -> list[str]:
    """Brown sentences as lowercase letters and spaces, unique, in corpus order.

    Punctuation tokens (no letter or digit) are dropped; a sentence with any other token that is
    not purely letters (digits, hyphens, apostrophes, abbreviations) is skipped, as is one with
    fewer than ``min_words`` or more than ``max_words`` words. Needs the Brown corpus (``make data``).
    """
    from attnlab.data import brown

    if not 1 <= min_words <= max_words:
        raise ValueError(f"sentence_texts: need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    out = {}
    for sent in brown.load_sentences(data_dir):
        words = [w.lower() for w, _ in sent if any(c.isalnum() for c in w)]
        if min_words <= len(words) <= max_words and all(w.isascii() and w.isalpha() for w in words):
            out.setdefault(" ".join(words), None)
    return list(out)


def _texts(corpus, num_train, num_test, rng):
    """(train texts, test texts) of a corpus; test texts never occur in training."""
    if corpus == "sentences":
        texts = sentence_texts()
        if num_train + num_test > len(texts):
            raise ValueError(f"speech.load: {num_train} + {num_test} sentences asked, the corpus has {len(texts)}")
        texts = [texts[i] for i in rng.permutation(len(texts))[: num_train + num_test]]
        return texts[num_test:], texts[:num_test]
    numbers = rng.choice(1_000_000, size=2 * (num_train + num_test), replace=False)
    # numbers of 1-6 digits in equal shares, so short and long readings both occur
    digits = rng.integers(1, 7, size=numbers.size)
    numbers = numbers % (10**digits)
    numbers = list(dict.fromkeys(int(n) for n in numbers))  # unique, order kept
    test = set(numbers[:num_test])
    train = [n for n in numbers[num_test:] if n not in test][:num_train]
    return [number_words(n) for n in train], [number_words(n) for n in numbers[:num_test]]


def _plan(num_train, num_test, num_new_voice, seed, corpus="numbers"):
    rng = np.random.default_rng(seed)
    train, test = _texts(corpus, num_train, num_test, rng)

    def speak(texts, variants):
        return [
            dict(
                text=text,
                voice=str(rng.choice(VOICES)),
                variant=str(rng.choice(variants)),
                speed=int(rng.integers(140, 200)),
                pitch=int(rng.integers(30, 70)),
            )
            for text in texts
        ]

    new_voice = test[:num_new_voice]
    return {
        "train": speak(train, VARIANTS),
        "test": speak(test, VARIANTS),
        "new_voice": speak(new_voice, (HELD_OUT_VARIANT,)),
    }


def _pack(items, feats) -> Split:
    lengths = np.array([f.shape[0] for f in feats], np.int32)
    out = np.zeros((len(feats), max(lengths), feats[0].shape[1]), np.float32)
    for i, f in enumerate(feats):
        out[i, : len(f)] = f
    ids = [np.append(encode_text(it["text"]), EOS) for it in items]
    tl = np.array([len(t) for t in ids], np.int32)
    targets = np.full((len(ids), max(tl)), PAD, np.int32)
    for i, t in enumerate(ids):
        targets[i, : len(t)] = t
    return Split(
        out,
        lengths,
        targets,
        tl,
        tuple(it["text"] for it in items),
        tuple(f"{it['voice']}+{it['variant']}" for it in items),
    )


def load(
    *,
    num_train: int = 3000,
    num_test: int = 300,
    num_new_voice: int = 150,
    seed: int = 0,
    corpus: str = "numbers",
    directory: str | Path | None = None,
    workers: int = 2,
    progress: bool = True,
) -> dict[str, Split]:
    """A corpus (``"numbers"`` or ``"sentences"``): ``{"train", "test", "new_voice"}`` splits,
    synthesized once and cached.

    The cache file name hashes the arguments (and the front end's settings), so a rerun with the
    same arguments reads ``data/speech/<corpus>-<hash>.npz`` instead of synthesizing again.
    """
    if corpus not in ("numbers", "sentences"):
        raise ValueError(f"speech.load: corpus must be 'numbers' or 'sentences', got {corpus!r}")
    for name, value in (("num_train", num_train), ("num_test", num_test), ("num_new_voice", num_new_voice)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"speech.load: {name} must be an int >= 1, got {value!r}")
    if num_new_voice > num_test:
        raise ValueError(f"speech.load: num_new_voice ({num_new_voice}) must be <= num_test ({num_test})")
    directory = Path(directory or DEFAULT_DIR)
    plan = _plan(num_train, num_test, num_new_voice, seed, corpus)
    key = hashlib.sha256(json.dumps([plan, "logmel80-25ms-10ms-v1"], sort_keys=True).encode()).hexdigest()[:12]
    path = directory / f"{corpus}-{key}.npz"
    if path.exists():
        z = np.load(path, allow_pickle=False)
        return {s: _pack(plan[s], [z[f"{s}/{i}"] for i in range(len(plan[s]))]) for s in ("train", "test", "new_voice")}
    items = [(s, i, it) for s in ("train", "test", "new_voice") for i, it in enumerate(plan[s])]

    def features(item):
        _, _, it = item
        samples, sr = synthesize(
            it["text"], voice=it["voice"], variant=it["variant"], speed=it["speed"], pitch=it["pitch"]
        )
        return log_mel(samples, sr)

    feats = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for n, (item, f) in enumerate(zip(items, pool.map(features, items), strict=True), 1):
            feats[f"{item[0]}/{item[1]}"] = f
            if progress and (n % max(1, len(items) // 20) == 0 or n == len(items)):
                print(f"\rspeech: synthesized {n}/{len(items)} utterances", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **feats)
    os.replace(tmp, path)
    return {s: _pack(plan[s], [feats[f"{s}/{i}"] for i in range(len(plan[s]))]) for s in ("train", "test", "new_voice")}
