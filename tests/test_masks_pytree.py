"""Every Mask subclass is a pytree by its dataclass fields: arrays declared leaf() are leaves, the rest static."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import dropin, masks, scores  # dropin: its ArrayMask is a shipped Mask subclass too

ADJ = np.random.default_rng(0).random((6, 6)) < 0.5


def _same_doc(q, k, ids):
    return (ids[..., q] == ids[..., k])[..., None, :, :]


IDS = jnp.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 2, 2, 2]])  # [B, 6]: the examples are used at 6 x 6
EXAMPLES = {
    masks.Full: masks.full(),
    masks.Causal: masks.causal(1),
    masks.Window: masks.window(2, 1),
    masks.Window2D: masks.window_2d(3, 1),
    masks.Padding: masks.padding(jnp.array([3, 6]), jnp.array([6, 2])),
    masks.PrefixLM: masks.prefix_lm(jnp.array([2, 5])),
    masks.Document: masks.document(IDS),
    masks.Predicate: masks.predicate(_same_doc, IDS),
    masks.Graph: masks.graph(ADJ),
    masks.GraphEdges: masks.graph_edges([0, 1], [1, 2], 6),
    masks.Dense: masks.as_mask(ADJ),
    dropin.ArrayMask: dropin.ArrayMask(ADJ),
    masks.Chunks: masks.chunks(2),
    masks.Dilated: masks.dilated(4, 0, 2),
    masks.GlobalTokens: masks.global_tokens([0]),
    masks.BlockBand: masks.bigbird(6, block_size=2, num_global=0, num_random=0),
    masks.RandomBlocks: masks.random_blocks(6, 2, 1),
    masks.And: masks.causal() & masks.padding(kv_lengths=jnp.array([4])),
    masks.Or: masks.window(1, 1) | masks.graph(ADJ),
}
# the array fields, as declared with leaf() beside each field
LEAVES = {
    masks.Padding: ("q_lengths", "kv_lengths"),
    masks.PrefixLM: ("prefix_lengths",),
    masks.Document: ("q_ids", "kv_ids"),
    masks.Predicate: ("arrays",),
    masks.Graph: ("adjacency",),
    masks.GraphEdges: ("senders", "receivers"),
    masks.Dense: ("array",),
    dropin.ArrayMask: ("array",),
    masks.And: ("a", "b"),
    masks.Or: ("a", "b"),
}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_each_class_is_its_own_treedef():
    """Masks (and scores) whose static fields hold equal values are still different trees: jax 0.10's own
    register_dataclass made causal(offset=8) and chunks(8) equal treedefs, and a jit cache then ran the
    causal program for the chunks mask (attnlab._pytree registers the class in the aux data)."""
    pairs = [(masks.causal(offset=8), masks.chunks(8)), (masks.window(2, 2), masks.dilated(2, 2, 1))]
    pairs.append((scores.Dot(0.5), scores.SoftCap(0.5)))
    for a, b in pairs:
        assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b), (a, b)
    structures = [jax.tree_util.tree_structure(m) for m in EXAMPLES.values()]
    assert all(s != t for i, s in enumerate(structures) for t in structures[i + 1 :])
    # one jitted function, the two masks as arguments: each gets its own program
    f = jax.jit(lambda m: m.dense(5, 5))
    np.testing.assert_array_equal(f(masks.causal(offset=3)), masks.causal(offset=3).dense(5, 5))
    np.testing.assert_array_equal(f(masks.chunks(3)), masks.chunks(3).dense(5, 5))


def test_every_mask_class_has_an_example():
    # A new Mask subclass must be added here, and so gets the round-trip check below.
    shipped = {c for c in _subclasses(masks.Mask) if c.__module__.startswith("attnlab.")}
    assert shipped == set(EXAMPLES)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_round_trip_through_tree_util(cls):
    m = EXAMPLES[cls]
    assert type(m) is cls
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert not any(isinstance(x, masks.Mask) for x in leaves)  # a mask is never itself a leaf
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is cls
    np.testing.assert_array_equal(np.asarray(back.dense(6, 6)), np.asarray(m.dense(6, 6)))
    declared = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("leaf"))
    assert declared == LEAVES.get(cls, ())
    for f in dataclasses.fields(cls):  # static fields live in the treedef and come back unchanged
        if f.name not in declared:
            assert getattr(back, f.name) == getattr(m, f.name)


def test_an_undecorated_mask_would_be_caught():
    class Forgotten(masks.Mask):  # not @mask_class: jax sees one opaque leaf
        def __call__(self, q_idx, k_idx):
            return q_idx[:, None] >= k_idx[None, :]

    m = Forgotten()
    assert jax.tree_util.tree_leaves(m) == [m]  # the mask itself as a leaf: what the round trip rejects


def test_a_new_mask_class_is_a_pytree_by_its_fields():
    @masks.mask_class
    class Stripes(masks.Mask):
        period: int = 2
        offsets: object = masks.leaf(default=None)

        def __call__(self, q_idx, k_idx):
            return (k_idx[None, :] + jnp.asarray(self.offsets)) % self.period == 0

    m = Stripes(3, jnp.array(1))
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 1 and int(leaves[0]) == 1
    traces = []

    @jax.jit
    def f(m):
        traces.append(1)
        return m.dense(2, 6)

    np.testing.assert_array_equal(f(m)[0], (np.arange(6) + 1) % 3 == 0)
    f(Stripes(3, jnp.array(2)))
    assert len(traces) == 1  # a leaf is data
    f(Stripes(2, jnp.array(2)))
    assert len(traces) == 2  # a static field is structure
