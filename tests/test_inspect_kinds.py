"""What an attention kind exposes to attnlab.inspect comes from the kind (``AttentionFn.weights`` / ``lse``,
``takes_score``): a new kind is inspected with no change to inspect, and inspect names no kind."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import heads, inspect, nn

B, T, V, D, N = 2, 7, 13, 16, 4


@dataclasses.dataclass(frozen=True)
class Tempered(nn.AttentionFn):
    """Softmax at temperature tau through the reference; says what its weights are."""

    tau: float = 2.0

    def _scale(self, q):
        return 1 / (self.tau * q.shape[-1] ** 0.5)

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        return attnlab.attention_reference(q, k, v, mask=mask, bias=bias, scale=self._scale(q))

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        w = attnlab.attention_weights(q, k, mask=mask, bias=bias, scale=self._scale(q))  # [..., N, T, S]
        return w if rows is None else w[..., jnp.asarray(rows), :]


@dataclasses.dataclass(frozen=True)
class Scored(nn.AttentionFn):
    """The reference with the module's score (dot or additive), handed to it because it takes_score."""

    takes_score: ClassVar[bool] = True

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot"):
        return attnlab.attention_reference(q, k, v, mask=mask, bias=bias, score=score)

    def weights(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot", rows=None):
        return attnlab.attention_weights(q, k, mask=mask, bias=bias, score=score)


def _model(attention, **kw):
    enc = nn.Encoder(vocab_sizes=V, d_model=D, num_layers=2, num_heads=N, attention=attention, rngs=nnx.Rngs(0), **kw)
    return nn.TokenClassifier(enc, 3, rngs=nnx.Rngs(1))


def _batch():
    return jax.random.randint(jax.random.key(0), (B, T), 0, V), jnp.array([T, 4])


def test_a_new_kind_is_captured_through_its_own_weights():
    model = _model(Tempered(2.0))
    x, lengths = _batch()
    cap = inspect.capture(model, x, lengths)
    np.testing.assert_array_equal(cap.output, model(x, lengths))  # the probe calls the kind as the module does
    mask = model.backbone.mask(lengths)
    for c in cap.layers:
        assert c.kind == "Tempered"
        scale = 1 / (2.0 * (D // N) ** 0.5)
        want = attnlab.attention_weights(c.q, c.k, mask=mask, scale=scale)  # by hand, from the captured q, k
        chex.assert_trees_all_close(c.weights, want, atol=1e-6)
        chex.assert_trees_all_close(jnp.einsum("bnts,bsnh->btnh", c.weights, c.v), c.out, atol=1e-5)
    rows = inspect.capture(model, x, lengths, rows=[1, 5], record=("weights",))
    chex.assert_trees_all_close(rows[1].weights, cap[1].weights[:, :, [1, 5]], atol=1e-6)
    assert rows[1].lse is None  # not a softmax that says its lse: nothing recorded


def test_a_plain_function_has_no_weights():
    model = _model(lambda q, k, v, *, mask, bias: attnlab.attention(q, k, v, mask=mask, bias=bias))
    x, lengths = _batch()
    cap = inspect.capture(model, x, lengths)
    np.testing.assert_array_equal(cap.output, model(x, lengths))
    assert all(c.weights is None and c.kind == "Function" for c in cap.layers)


def test_a_kind_that_takes_the_score_gets_the_modules_additive_score():
    x, lengths = _batch()
    scored = _model(Scored(), score="additive", posenc="none")
    softmax = _model(nn.Softmax("reference"), score="additive", posenc="none")
    chex.assert_trees_all_close(scored(x, lengths), softmax(x, lengths), atol=1e-5)  # same params (same seeds)
    cap = inspect.capture(scored, x, lengths, record=("q", "k", "weights"))
    mask = scored.backbone.mask(lengths)
    for i, c in enumerate(cap.layers):
        p = scored.backbone.blocks[i].attn.params()
        want = attnlab.attention_weights(c.q, c.k, mask=mask, score=heads.resolve_score("additive", p))
        chex.assert_trees_all_close(c.weights, want, atol=1e-6)
    with pytest.raises(ValueError, match="needs score='dot'"):
        _model(Tempered(), score="additive")  # a kind that does not take the score computes the dot product


def test_linear_kinds_rows_are_their_dense_rows():
    for kind in (nn.Linear(), nn.Performer(16)):
        model = _model(kind)
        x, lengths = _batch()
        dense = inspect.capture(model, x, lengths, record=("weights",))
        rows = inspect.capture(model, x, lengths, rows=[0, 3], record=("weights",))
        for d, r in zip(dense.layers, rows.layers, strict=True):
            chex.assert_trees_all_close(r.weights, d.weights[:, :, [0, 3]], atol=1e-6)
            assert r.lse is None


def test_inspect_names_no_kind_and_no_score_parameter():
    """No isinstance chain over the kinds and no "w_score" / "additive" in attnlab/inspect: they come from
    the kinds (weights, lse, takes_score) and from the module (its resolved score)."""
    kinds = {"Softmax", "Linear", "Performer", "Function"}
    for path in sorted((Path(attnlab.__file__).parent / "inspect").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not kinds & {a.name for a in node.names}, f"{path.name} imports a kind"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in ("w_score", "additive"), f"{path.name} names {node.value!r}"
            if isinstance(node, ast.Name):
                assert node.id not in kinds, f"{path.name} uses {node.id}"
