"""Chinese POS tagging: the PKU loader (attnlab.data.pku), the char view (attnlab.nn.Chars), the smoke config."""

import json

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from flax import nnx
from matplotlib import font_manager, ft2font

from attnlab import nn
from attnlab.data import pku

# Two paragraphs in the PKU format, the first with a bracketed compound (outer tag nt) and a
# literal "[" punctuation token; hand-checked below.
TEXT = "[中央/n  人民/n  广播/vn  电台/n]nt  播出/v  [/w  意思/v  一下/m  。/w  小/a  意思/n\n\n好/a  ！/w\n"


def test_parse_tagged_bracketed_compound():
    paras = pku.parse_tagged(TEXT)
    assert paras == [
        [
            ("中央", "n"),  # the compound's inner words keep their own tags; the outer nt is dropped
            ("人民", "n"),
            ("广播", "vn"),
            ("电台", "n"),
            ("播出", "v"),
            ("[", "w"),  # a lone bracket is a word
            ("意思", "v"),
            ("一下", "m"),
            ("。", "w"),
            ("小", "a"),
            ("意思", "n"),
        ],
        [("好", "a"), ("！", "w")],
    ]
    assert pku.parse_tagged("1/2/m") == [[("1/2", "m")]]  # the tag follows the last '/'
    with pytest.raises(ValueError, match="word/tag"):
        pku.parse_tagged("意思")


def test_split_sentences():
    para = pku.parse_tagged(TEXT)[0]
    sents = pku.split_sentences(para)
    assert [len(s) for s in sents] == [9, 2]  # cut after 。
    assert sents[1] == [("小", "a"), ("意思", "n")]
    assert [len(s) for s in pku.split_sentences(para, max_len=4)] == [4, 4, 1, 2]
    with pytest.raises(ValueError, match="max_len"):
        pku.split_sentences(para, max_len=0)


def test_vocab_ids_chars_and_shapes():
    sents = pku.parse_tagged("意思/n  意思/v  １９９８年/t  ，/w  ＷＴＯ/nx  不好意思/a")
    v = pku.Vocab.build(sents, min_count=2, num_chars=4)
    ids = v.ids(["意思", "不好意思", "马克思主义者", "１８月"])
    assert ids.shape == (4, pku.NUM_WORD_FEATURES + 4)
    c = v.chars
    assert ids[0, 0] == v.words["意思"] and ids[1, 0] == 1  # 不好意思 seen once < min_count: OOV id
    assert ids[0, 1:3].tolist() == [c["意"], c["思"]]  # first and last character
    assert ids[0, 4:].tolist() == [c["意"], c["思"], 0, 0]  # characters, padded with 0
    # 6 characters > 4: keep the first 2 (马 克) and the last 2 (义 者), all unseen in train -> 1
    assert ids[2, 4:].tolist() == [1, 1, 1, 1]
    assert ids[3, 4:].tolist() == [c["１"], c["８"], 1, 0]  # 月 not in train
    shapes = [pku._shape(w) for w in ["１９９８年", "，", "ＷＴＯ", "意思", "１２", "ＡＢ１"]]
    assert shapes == [5, 2, 3, 4, 1, 6]
    assert v.sizes == (len(v.words) + 2, len(c) + 2, len(c) + 2, pku.NUM_SHAPES)


@pytest.fixture(scope="module")
def paragraphs():
    try:
        path = pku.corpus_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return pku.load_paragraphs(path, max_paragraphs=400)


def test_corpus_slice(paragraphs):
    assert len(paragraphs) == 400
    # The file's first line, by hand: 迈向/v  充满/v  希望/n  的/u  新/a  世纪/n  ——/w  一九九八年/t ...
    assert paragraphs[0][:8] == [
        ("迈向", "v"),
        ("充满", "v"),
        ("希望", "n"),
        ("的", "u"),
        ("新", "a"),
        ("世纪", "n"),
        ("——", "w"),
        ("一九九八年", "t"),
    ]
    tags = {t for p in paragraphs for _, t in p}
    assert {"n", "v", "w", "u", "nr", "ns"} <= tags and all(t.isalpha() for t in tags)


def test_split_is_fixed_and_disjoint(paragraphs):
    parts = pku.split(paragraphs)
    again = pku.split(pku.load_paragraphs(max_paragraphs=400))
    assert parts == again  # the same paragraphs on every call
    assert parts["dev"] == paragraphs[8::10] and parts["test"] == paragraphs[9::10]
    assert [len(parts[k]) for k in ("train", "dev", "test")] == [320, 40, 40]
    ids = {k: {id(p) for p in parts[k]} for k in parts}
    assert not ids["train"] & ids["dev"] and not ids["train"] & ids["test"] and not ids["dev"] & ids["test"]
    sents = pku.load_sentences(max_paragraphs=400, max_len=64)
    for k in parts:  # sentences are the split's paragraphs, cut: the same tokens in the same order
        assert [tok for s in sents[k] for tok in s] == [tok for p in parts[k] for tok in p]
        assert max(len(s) for s in sents[k]) <= 64


# ------------------------------------------------------------------------------------------
# The char view of attnlab.nn.TokenEmbedding


def _np_gelu(x):  # tanh approximation, as jax.nn.gelu's default
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_char_view(emb, char_ids, pool):
    """The char view in numpy, one token at a time."""
    E = np.asarray(emb.char_embed.embedding[...])
    out = np.zeros((*char_ids.shape[:-1], E.shape[1]))
    for idx in np.ndindex(*char_ids.shape[:-1]):
        ids = char_ids[idx]
        e = E[ids] * (ids > 0)[:, None]  # [C, D], padding rows zeroed
        if not (ids > 0).any():
            continue
        if pool == "mean":
            out[idx] = e[ids > 0].mean(0)
            continue
        W = np.asarray(emb.char_conv.kernel[...])  # [k, D, D]
        b = np.asarray(emb.char_conv.bias[...])
        k, C = W.shape[0], len(ids)
        lo = (k - 1) // 2  # SAME padding
        h = np.stack(
            [sum(e[c + j - lo] @ W[j] for j in range(k) if 0 <= c + j - lo < C) + b for c in range(C)]
        )  # [C, D]
        out[idx] = _np_gelu(h)[ids > 0].max(0)
    return out


@pytest.mark.parametrize("pool", ["mean", "cnn"])
def test_char_view_matches_numpy_and_is_additive(pool):
    sizes = (10, 3)
    emb = nn.TokenEmbedding(8, vocab_sizes=sizes, chars=nn.Chars(20, pool=pool), rngs=nnx.Rngs(0))
    words = nn.TokenEmbedding(8, vocab_sizes=sizes, rngs=nnx.Rngs(1))
    for a, b in zip(words.embeds, emb.embeds, strict=True):
        a.embedding[...] = b.embedding[...]
    x = np.array(
        [
            [[4, 1, 7, 9, 3, 0], [2, 2, 5, 0, 0, 0], [1, 0, 0, 0, 0, 0]],
            [[9, 1, 19, 19, 19, 19], [0, 0, 0, 0, 0, 0], [3, 1, 0, 8, 0, 0]],
        ]
    )  # [B=2, T=3, F=2 + C=4]; a token with no characters, one with a gap (0 inside)
    got = jax.jit(lambda m, x: m(x))(emb, jnp.asarray(x))
    want = np.asarray(words(jnp.asarray(x[..., :2]))) + _np_char_view(emb, x[..., 2:], pool)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    # padding characters never matter: more trailing padding, same result
    wider = np.concatenate([x, np.zeros((*x.shape[:-1], 2), x.dtype)], -1)
    np.testing.assert_allclose(np.asarray(emb(jnp.asarray(wider))), np.asarray(got), atol=1e-6)
    # vmap over an unbatched call gives the batched result
    np.testing.assert_allclose(np.asarray(jax.vmap(emb)(jnp.asarray(x))), np.asarray(got), atol=1e-6)


def test_char_view_errors_and_backbones():
    with pytest.raises(ValueError, match="pool"):
        nn.Chars(10, pool="max")
    with pytest.raises(ValueError, match="vocab_size"):
        nn.Chars(1)
    with pytest.raises(ValueError, match="chars needs vocab_sizes"):
        nn.TokenEmbedding(8, vocab_sizes=10, chars=nn.Chars(5), rngs=nnx.Rngs(0))
    emb = nn.TokenEmbedding(8, vocab_sizes=(10, 3), chars=nn.Chars(5), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="at least 1 character"):
        emb(jnp.zeros((1, 2, 2), jnp.int32))
    common = dict(vocab_sizes=(10, 3), d_model=8, chars=nn.Chars(5), rngs=nnx.Rngs(0))
    backbones = [  # (the Encoder with chars runs in test_smoke_end_to_end)
        nn.TokenMLP(**common),
        nn.CNN(**common),
        nn.BiRNN(cell="gru", **common),
    ]
    for backbone in backbones:  # each backbone passes chars to its embedding
        assert backbone.embed.chars == nn.Chars(5) and isinstance(backbone.embed.char_conv, nnx.Conv)
    x = jnp.array([[[4, 1, 2, 3, 0], [5, 2, 1, 0, 0]]])  # [1, 2, 2 + 3]
    assert backbones[0](x).shape == (1, 2, 8)


# ------------------------------------------------------------------------------------------
# The experiment's smoke config end to end


def _cjk_font_file():
    """The path of an installed font that has Chinese glyphs (the cmap holds 意), or None."""
    for path in sorted(font_manager.findSystemFonts()):
        try:
            if ord("意") in ft2font.FT2Font(path).get_charmap():
                return path
        except (OSError, RuntimeError):  # a file FreeType cannot read
            continue
    return None


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path, paragraphs):
    from experiments import pos_tagging
    from experiments.configs import pos_zh

    cfg = pos_zh.get_config("smoke")
    result = pos_tagging.run(cfg, tmp_path, verbose=False)
    run_dir = tmp_path / "smoke"
    for name in ("config.json", "metrics.jsonl", "result.json", "attention_map.json"):
        assert (run_dir / name).exists(), name
    assert result["tagset"] == "pku" and 0.0 < result["test_accuracy"] <= 1.0
    assert result["example"]["words"] == ["意思", "一下", "，", "小", "意思"]
    assert len(result["example"]["pred"]) == 5 and result["example"]["gold"] == ["v", "m", "w", "a", "n"]
    parts = pku.split(paragraphs[:300])  # count 意思 in dev + test independently of the experiment
    tokens = [w for k in ("dev", "test") for p in parts[k] for w, _ in p]
    assert result["focus_tokens"] == tokens.count("意思")
    assert result["focus_substring_tokens"] == sum("意思" in w for w in tokens)
    assert 0 <= result["focus_correct"] <= result["focus_tokens"]
    amap = json.loads((run_dir / "attention_map.json").read_text())
    assert np.asarray(amap["weights"]).shape == (1, 5, 5)
    np.testing.assert_allclose(np.asarray(amap["weights"]).sum(-1), 1.0, atol=1e-3)
    font = _cjk_font_file()
    with matplotlib.rc_context():  # the report's font choice stays inside this test
        if font is not None:  # the Chinese labels in an installed CJK font (the report prefers the ones it knows)
            font_manager.fontManager.addfont(font)
            name = font_manager.FontProperties(fname=font).get_name()
            matplotlib.rcParams["font.sans-serif"] = [name, *matplotlib.rcParams["font.sans-serif"]]
            table = pos_tagging.report(tmp_path)
        else:  # none installed (`make zh-font` installs one): the labels are boxes, and matplotlib says so
            with pytest.warns(UserWarning, match="missing from font"):
                table = pos_tagging.report(tmp_path)
    assert "| smoke |" in table and "意思/" in table
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "attention_map.png").exists()
    with pytest.raises(ValueError, match="unknown pos_zh variant"):
        pos_zh.get_config("nope")
