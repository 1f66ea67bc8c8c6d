"""The Encoder's seams: injected positional-encoding, attention and mask objects.

Each object must build exactly the model assembled by hand from flax layers and attnlab's pure
functions (same rngs -> same parameters -> same outputs), and a new object written outside
attnlab must reach every layer.
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
from attnlab import efficient, masks, nn, positional

COMMON = dict(vocab_sizes=30, d_model=16, num_layers=2, num_heads=4)
IDS = jax.random.randint(jax.random.key(1), (2, 9), 0, 30)
LENGTHS = jnp.array([9, 5])


def _enc(**kw):
    return nn.Encoder(**(COMMON | kw), rngs=nnx.Rngs(0))


def _same(a, b):
    """Same parameters (state by state) and same outputs."""
    chex.assert_trees_all_equal(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))
    chex.assert_trees_all_close(a(IDS, LENGTHS), b(IDS, LENGTHS), atol=1e-6, rtol=1e-6)


def _hand_built(*, table_init=None, added=None, rotary=None, bias=None, structure=None, attend=None, features=None):
    """The Encoder assembled by hand from flax layers and attnlab's pure functions (COMMON, nnx.Rngs(0)).

    Parameters are drawn in the Encoder's order (embeddings, the positional table, then per layer
    LayerNorm, attention params, a Performer projection, LayerNorm, MLP; the final LayerNorm), so
    the same seed must give the same values: checkpoints keep loading. Returns (params, forward).
    """
    rngs = nnx.Rngs(0)
    d, n = COMMON["d_model"], COMMON["num_heads"]
    embed = nn.TokenEmbedding(d, vocab_sizes=COMMON["vocab_sizes"], rngs=rngs)
    table = None if table_init is None else table_init(rngs.params())
    layers = []
    for _ in range(COMMON["num_layers"]):
        ln1 = nnx.LayerNorm(d, rngs=rngs)
        p = attnlab.init_multi_head_params(rngs.params(), d, n)
        proj = None if features is None else efficient.performer_projection(rngs.params(), features, d // n)
        ln2 = nnx.LayerNorm(d, rngs=rngs)
        mlp_in, mlp_out = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        layers.append((ln1, p, proj, ln2, mlp_in, mlp_out))
    ln_f = nnx.LayerNorm(d, rngs=rngs)

    def forward(ids, lengths):
        T = ids.shape[1]
        x = embed(ids)  # [B, T, D]
        if added is not None:
            x = x + added(T, table)
        mask = masks.padding(lengths, lengths)
        mask = mask if structure is None else mask & structure
        b = None if bias is None else bias(table)
        for ln1, p, proj, ln2, mlp_in, mlp_out in layers:
            h = ln1(x)
            if attend is None:
                a = attnlab.multi_head_attention(p, h, mask=mask, bias=b, rotary=rotary, implementation="reference")
            else:  # the O(N) kinds: padding as kv_lengths
                a = attnlab.multi_head_attention(p, h, rotary=rotary, attention_fn=attend(lengths, proj))
            x = x + a
            x = x + mlp_out(jax.nn.gelu(mlp_in(ln2(x))))
        return ln_f(x)

    params = {"embed": nnx.state(embed, nnx.Param), "table": table, "ln_f": nnx.state(ln_f, nnx.Param)}
    params["layers"] = [
        (
            nnx.state(ln1, nnx.Param),
            p,
            proj,
            nnx.state(ln2, nnx.Param),
            nnx.state(mi, nnx.Param),
            nnx.state(mo, nnx.Param),
        )
        for ln1, p, proj, ln2, mi, mo in layers
    ]
    return params, forward


def _params_of(enc):
    """The Encoder's parameters in ``_hand_built``'s layout."""
    pe = enc.posenc
    layers = []
    for blk in enc.blocks:
        proj = blk.attn.projection[...] if blk.attn.kind.state_name else None
        layers.append(
            (
                nnx.state(blk.ln1, nnx.Param),
                blk.attn.params(),
                proj,
                nnx.state(blk.ln2, nnx.Param),
                nnx.state(blk.mlp_in, nnx.Param),
                nnx.state(blk.mlp_out, nnx.Param),
            )
        )
    table = getattr(enc, pe.param_name)[...] if pe.param_name else None
    return {
        "embed": nnx.state(enc.embed, nnx.Param),
        "table": table,
        "ln_f": nnx.state(enc.ln_f, nnx.Param),
        "layers": layers,
    }


def _linear(lengths, proj):
    return functools.partial(efficient.linear_attention, kv_lengths=lengths)


def _performer(lengths, proj):
    return functools.partial(efficient.performer_attention, projection=proj, kv_lengths=lengths)


def _t5_bias(table, max_distance):  # T5's bias from its bucket function: bias[n, i, j] = table[bucket(j - i), n]
    def bias(q_idx, k_idx):
        buckets = positional.t5_bucket(
            k_idx[None, :] - q_idx[:, None], num_buckets=table.shape[0], max_distance=max_distance
        )
        return jnp.moveaxis(table[buckets], -1, 0)  # [T', S', N] -> [N, T', S']

    return bias


def _sin(T, table):
    return positional.sinusoidal(T, 16)  # the Encoder's default, Sinusoidal(512)


# (the Encoder's arguments, how _hand_built builds the same model from the pure functions)
SPELLINGS = [
    (dict(posenc=positional.NoPosition()), dict()),
    (dict(posenc=positional.Sinusoidal(32)), dict(added=lambda T, _: positional.sinusoidal(T, 16))),
    (
        dict(posenc=positional.Learned(16)),
        dict(table_init=lambda key: positional.init_learned(key, 16, 16), added=lambda T, table: table[:T]),
    ),
    (dict(posenc=positional.Rope()), dict(rotary=positional.rope)),
    (dict(posenc=positional.Alibi()), dict(bias=lambda _: positional.Alibi().bias(4))),
    (
        dict(posenc=positional.T5(8, 16)),
        dict(
            table_init=lambda key: 0.02 * jax.random.normal(key, (8, 4)),  # [buckets, N], as T5 draws it
            bias=lambda table: _t5_bias(table, max_distance=16),
        ),
    ),
    (dict(posenc=positional.Sinusoidal2D(3, 3)), dict(added=lambda T, _: positional.sinusoidal_2d(3, 3, 16))),
    (dict(attention_mask=masks.window(2, 2)), dict(added=_sin, structure=masks.window(2, 2))),
    (
        dict(attention_mask=masks.window(1, 1) & masks.chunks(4)),
        dict(added=_sin, structure=masks.window(1, 1) & masks.chunks(4)),
    ),
    (dict(attention=nn.Linear()), dict(added=_sin, attend=_linear)),
    (dict(attention=nn.Performer(32)), dict(added=_sin, attend=_performer, features=32)),
    (dict(attention=nn.Softmax("reference")), dict(added=_sin)),
]


# ids from the object spelling only (the hand-built side holds lambdas, whose reprs differ between processes)
SPELLING_IDS = ["-".join(f"{k}={v}" for k, v in kw.items())[:40] for kw, _ in SPELLINGS]


@pytest.mark.parametrize("kw, hand", SPELLINGS, ids=SPELLING_IDS)
def test_each_object_builds_the_hand_built_model(kw, hand):
    enc = _enc(**kw)
    want_params, forward = _hand_built(**hand)
    chex.assert_trees_all_equal(_params_of(enc), want_params)
    chex.assert_trees_all_close(enc(IDS, LENGTHS), forward(IDS, LENGTHS), atol=1e-5, rtol=1e-5)


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
    got = _enc(attention=fn, posenc=positional.Alibi(), attention_mask=masks.window(2, 2))
    want = _enc(attention=nn.Softmax("reference"), posenc=positional.Alibi(), attention_mask=masks.window(2, 2))
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
        (dict(posenc="xpos"), "posenc must be one of"),
        (dict(posenc=32), "posenc must be an attnlab.positional.Encoding"),
        (dict(posenc="sinusoidal_2d"), r"needs \['height', 'width'\]"),
        (dict(attention=nn.Linear(), attention_mask=masks.chunks(2)), "takes no attention_mask"),
        (dict(attention="cosine"), "kind must be one of"),
        (dict(posenc=positional.Rope(), num_heads=16), "even head dim"),
    ],
)
def test_bad_seams(kw, match):
    with pytest.raises(ValueError, match=match):
        _enc(**kw)


@pytest.mark.parametrize(
    "kw, instead",
    [
        (dict(max_len=32), r"for max_len= pass posenc=positional.Sinusoidal\(max_len\) or positional.Learned"),
        (dict(t5_buckets=8, t5_max_distance=16), r"for t5_buckets= pass posenc=positional.T5\(num_buckets"),
        (dict(grid=(3, 3)), r"for grid= pass posenc=positional.Sinusoidal2D\(height, width\)"),
        (dict(window=2), r"for window= pass attention_mask=masks.window\(w, w\)"),
        (dict(implementation="xla"), r"for implementation= pass attention=nn.Softmax\(implementation\)"),
        (dict(num_features=32), r"for num_features= pass attention=nn.Performer\(num_features\)"),
    ],
)
def test_keywords_that_are_objects_say_which_object(kw, instead):
    with pytest.raises(ValueError, match="are not Encoder arguments") as e:
        _enc(**kw)
    assert e.match(instead)


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['windw'\]"):
        _enc(windw=2)
