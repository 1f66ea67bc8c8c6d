"""attnlab.data.brown: parser, tag maps, split, vocabulary, batches; the loader on a slice."""

import numpy as np
import pytest

from attnlab.data import brown

TEXT = "\n\n\tThe/at Fulton/np-tl jury/nn said/vbd it/pps didn't/dod* ./.\n\n\n\tHe'll/pps+md go/vb ./.\n"


def test_parse_tagged():
    sents = brown.parse_tagged(TEXT)
    assert [len(s) for s in sents] == [7, 3]
    assert sents[0][1] == ("Fulton", "np-tl") and sents[1][0] == ("He'll", "pps+md")
    assert brown.parse_tagged("\ta/b/c/nn\n") == [[("a/b/c", "nn")]]  # the tag follows the last '/'
    with pytest.raises(ValueError, match="word/tag"):
        brown.parse_tagged("\tnotag\n")


@pytest.mark.parametrize(
    "raw, base, universal",
    [
        ("nn-tl", "nn", "NOUN"),
        ("np$-tl-hl", "np$", "NOUN"),
        ("fw-in", "in", "X"),
        ("dod*", "dod", "VERB"),
        ("*", "*", "ADV"),
        ("pps+md", "pps+md", "PRT"),
        ("pp$", "pp$", "DET"),
        ("ppss", "ppss", "PRON"),
        ("to", "to", "PRT"),
        ("cs", "cs", "ADP"),
        ("od", "od", "ADJ"),
        ("``", "``", "."),
        ("cd-nc", "cd", "NUM"),
        ("ql", "ql", "ADV"),
        ("bez-hl", "bez", "VERB"),
    ],
)
def test_tag_maps(raw, base, universal):
    assert brown.base_tag(raw) == base
    assert brown.universal_tag(raw) == universal


def test_split_is_fixed_80_10_10():
    parts = brown.split(list(range(25)))
    assert parts["dev"] == [8, 18] and parts["test"] == [9, 19]
    assert len(parts["train"]) == 21


def test_vocab_oov_suffix_shape():
    sents = brown.parse_tagged("\tthe/at dog/nn ran/vbd ./.\n\n\tThe/at dog/nn 1961/cd ./.\n")
    v = brown.Vocab.build(sents, min_count=2, suffix_min_count=1)
    ids = v.ids(["the", "Dog", "cat", "1961"])
    assert ids.shape == (4, 3)
    assert ids[0, 0] == v.words["the"] and ids[1, 0] == v.words["dog"]  # lowercased
    assert ids[2, 0] == 1 and ids[3, 0] == 1  # unseen, and seen once (< min_count): OOV id
    assert ids[1, 2] != ids[0, 2]  # capitalised vs lower case shape
    assert "ran" in v.train_words and "cat" not in v.train_words
    assert v.sizes[0] == len(v.words) + 2


def test_pad_batch_and_epoch_batches():
    ex = [(np.full((n, 3), n, np.int32), np.full(n, n, np.int32)) for n in (3, 17, 5)]
    b = brown.pad_batch(ex)
    assert b["inputs"].shape == (3, 32, 3) and b["tags"].shape == (3, 32)  # bucket 32 >= 17
    assert b["lengths"].tolist() == [3, 17, 5]
    assert (b["tags"][0, 3:] == 0).all() and (b["tags"][1, :17] == 17).all()
    lengths = np.arange(1, 101)
    e0 = brown.epoch_batches(lengths, 8, seed=0, epoch=0)
    assert sorted(np.concatenate(e0).tolist()) == list(range(100))
    again = brown.epoch_batches(lengths, 8, seed=0, epoch=0)
    assert all((a == b).all() for a, b in zip(e0, again, strict=True))
    e1 = brown.epoch_batches(lengths, 8, seed=0, epoch=1)
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(e0, e1, strict=False))


@pytest.fixture(scope="module")
def slice_sentences():
    try:
        return brown.load_sentences(max_files=2)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_loader_on_a_slice(slice_sentences):
    sents = slice_sentences  # ca01 + ca02
    assert 150 < len(sents) < 400
    assert sents[0][:3] == [("The", "at"), ("Fulton", "np-tl"), ("County", "nn-tl")]
    tags = {brown.universal_tag(t) for s in sents for _, t in s}
    assert tags <= set(brown.UNIVERSAL_TAGS) and {"NOUN", "VERB", "DET", "."} <= tags
    parts = brown.split(sents)
    tm = brown.TagMap.build("universal")
    enc = brown.encode(parts["dev"], brown.Vocab.build(parts["train"]), tm)
    assert len(enc) == len(parts["dev"])
    x, y = enc[0]
    assert x.shape == (len(parts["dev"][0]), 3) and y.dtype == np.int32
    assert [tm.tags[i] for i in y] == [brown.universal_tag(t) for _, t in parts["dev"][0]]
