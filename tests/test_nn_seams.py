"""The Encoder's seams: injected positional-encoding and attention objects, and the old keyword spellings.

The objects must build exactly the model the old string switches built (same rngs -> same
parameters -> same outputs), and a new object written outside attnlab must reach every layer.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import masks, nn, positional

COMMON = dict(vocab_sizes=30, d_model=16, num_layers=2, num_heads=4)
IDS = jax.random.randint(jax.random.key(1), (2, 9), 0, 30)
LENGTHS = jnp.array([9, 5])


def _enc(**kw):
    return nn.Encoder(**(COMMON | kw), rngs=nnx.Rngs(0))


def _same(a, b):
    """Same parameters (state by state) and same outputs."""
    chex.assert_trees_all_equal(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))
    chex.assert_trees_all_close(a(IDS, LENGTHS), b(IDS, LENGTHS), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "legacy, obj",
    [
        (dict(posenc="none"), dict(posenc=positional.NoPosition())),
        (dict(posenc="sinusoidal", max_len=32), dict(posenc=positional.Sinusoidal(32))),
        (dict(posenc="learned", max_len=16), dict(posenc=positional.Learned(16))),
        (dict(posenc="rope"), dict(posenc=positional.Rope())),
        (dict(posenc="alibi"), dict(posenc=positional.AlibiBias())),
        (dict(posenc="t5", t5_buckets=8, t5_max_distance=16), dict(posenc=positional.T5(8, 16))),
        (dict(posenc="sinusoidal_2d", grid=(3, 3)), dict(posenc=positional.Sinusoidal2D(3, 3))),
        (dict(window=2), dict(attention_mask=masks.window(2, 2))),
        (dict(window=1, attention_mask=masks.chunks(4)), dict(attention_mask=masks.window(1, 1) & masks.chunks(4))),
        (dict(attention="linear"), dict(attention=nn.Linear())),
        (dict(attention="performer", num_features=32), dict(attention=nn.Performer(32))),
        (dict(implementation="reference"), dict(attention=nn.Softmax("reference"))),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items())[:40],
)
def test_objects_build_the_model_the_old_keywords_built(legacy, obj):
    _same(_enc(**legacy), _enc(**obj))


def test_state_names_are_kept():
    # Checkpoints and tests reach the tables by their old names.
    assert _enc(posenc=positional.T5(8, 16)).t5_table.shape == (8, 4)
    assert _enc(posenc=positional.Learned(16)).pos_table.shape == (16, 16)
    assert _enc(attention=nn.Performer(32)).blocks[0].attn.projection.shape == (32, 4)


@dataclasses.dataclass(frozen=True)
class DistancePenalty(positional.Encoding):
    """A scheme attnlab does not ship: bias[n, i, j] = -rate |i - j| for every head, no parameters."""

    rate: float = 0.5

    def bias(self, num_heads, param=None):
        def fn(q_idx, k_idx):
            d = jnp.abs(q_idx[:, None] - k_idx[None, :]).astype(jnp.float32)
            return jnp.broadcast_to(-self.rate * d, (num_heads, *d.shape))

        return fn


@dataclasses.dataclass(frozen=True)
class Shifted(positional.Encoding):
    """A learned scalar per model dim added at every position (tests init/param plumbing)."""

    param_name = "shift"

    def init(self, key, *, d_model, num_heads):
        return jax.random.normal(key, (d_model,))

    def inputs(self, T, d_model, param=None):
        return jnp.broadcast_to(param, (T, d_model))


def test_a_custom_bias_encoding_reaches_every_layer():
    enc = _enc(posenc=DistancePenalty(0.5))
    ref = _enc(posenc="none")  # same rngs: same params; the bias is given by hand instead
    i = np.arange(9)
    bias = jnp.asarray(-0.5 * np.abs(i[:, None] - i[None, :]), jnp.float32)[None, None]  # [1, 1, T, T]
    chex.assert_trees_all_close(enc(IDS, LENGTHS), ref(IDS, LENGTHS, bias=bias), atol=1e-5)
    assert not np.allclose(enc(IDS, LENGTHS), ref(IDS, LENGTHS), atol=1e-3)  # the bias matters


def test_a_custom_learned_input_encoding_owns_its_param():
    enc = _enc(posenc=Shifted())
    assert enc.shift.shape == (16,)
    h = enc.embed(IDS) + enc.shift[...]
    mask = masks.padding(LENGTHS, LENGTHS)
    for blk in enc.blocks:
        h = blk(h, mask=mask)
    chex.assert_trees_all_close(enc(IDS, LENGTHS), enc.ln_f(h), atol=1e-5)
    grads = nnx.grad(lambda m: jnp.sum(m(IDS, LENGTHS) ** 2))(enc)
    assert float(jnp.abs(grads.shift[...]).sum()) > 0  # trained like any parameter


def test_an_injected_attention_function():
    # A plain callable taking the full mask and bias: the blockwise kernel instead of the dispatcher.
    fn = functools.partial(attnlab.attention, implementation="blockwise")
    got = _enc(attention=fn, posenc="alibi", window=2)
    want = _enc(attention=nn.Softmax("reference"), posenc="alibi", window=2)
    _same(got, want)


@dataclasses.dataclass(frozen=True)
class Tempered(nn.AttentionFn):
    """Softmax at temperature tau, through the reference (a new AttentionFn subclass)."""

    tau: float = 2.0

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        return attnlab.attention_reference(q, k, v, mask=mask, bias=bias, scale=1 / (self.tau * q.shape[-1] ** 0.5))


def test_an_attention_subclass_by_hand():
    enc = _enc(attention=Tempered(2.0), num_layers=1)
    blk = enc.blocks[0]
    x = enc.embed(IDS) + positional.sinusoidal(9, 16)
    p = blk.attn.params()
    q, k, v = attnlab.heads.project_qkv(p, blk.ln1(x))
    o = attnlab.attention_reference(q, k, v, mask=masks.padding(LENGTHS, LENGTHS), scale=1 / (2.0 * 2.0))
    h = x + jnp.einsum("btnh,nhd->btd", o, p["wo"]) + p["bo"]
    h = h + blk.mlp_out(jax.nn.gelu(blk.mlp_in(blk.ln2(h))))
    chex.assert_trees_all_close(enc(IDS, LENGTHS), enc.ln_f(h), atol=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(posenc=positional.Sinusoidal(32), max_len=32), "configure a posenc name"),
        (dict(windw=2), "unknown keyword arguments"),
        (dict(posenc="xpos"), "posenc must be one of"),
        (dict(attention=nn.Linear(), attention_mask=masks.chunks(2)), "takes no window or attention_mask"),
        (dict(attention="cosine"), "kind must be one of"),
        (dict(posenc=positional.Rope(), num_heads=16), "even head dim"),
    ],
)
def test_bad_seams(kw, match):
    with pytest.raises(ValueError, match=match):
        _enc(**kw)
