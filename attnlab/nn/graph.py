"""Graph backbones: attention over nodes (no edges, bond-masked, distance-biased) and a GIN baseline.

The course note's claim: restrict attention to a graph's edges and self-attention *is* a graph
network (node i attends to its neighbours only). Three ways to give an ``Encoder`` the graph:

* ``GraphEncoder(encoder, graph="none")``: full attention over all nodes, the bonds unseen
  (a set of atoms);
* ``graph="mask"``: ``masks.graph(adjacency, self_loops=True)``: a node attends to its
  neighbours and itself (graph attention, Veličković et al. 2018, arXiv 1710.10903, with
  dot-product scores);
* ``graph="distance"``: full attention plus a learned per-head scalar indexed by the shortest-path
  distance, shared by all layers (Graphormer's spatial encoding, Ying et al. 2021, arXiv 2106.05234).

and the message-passing baseline ``GIN`` (sum aggregation, Xu et al. 2019, arXiv 1810.00826) as
pure functions. Every backbone has the call ``backbone(inputs, lengths=None, *, adjacency=None,
distances=None, dropout_key=None) -> [B, T, D]`` so ``SequenceClassifier`` / ``TokenClassifier``
wrap any of them and forward ``adjacency=`` / ``distances=``.

Legend: B batch, T nodes (padded), F input features, D model dim, N heads, M MLP width,
R = max_distance + 2 distance buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import masks as masks_lib
from attnlab.nn.layers import Encoder, TokenEmbedding, dropout, split_key

__all__ = ["GRAPH_MODES", "distance_buckets", "distance_bias", "GraphEncoder", "gin_layer", "GIN"]

GRAPH_MODES = ("none", "mask", "distance")


def distance_buckets(distances: jax.Array, max_distance: int) -> jax.Array:
    """Hop distances -> bucket ids: d for 0 <= d < max_distance, max_distance for d >= max_distance,
    max_distance + 1 for unreachable / padding (d < 0). int ``[..., T, S]`` -> int32 ``[..., T, S]``."""
    d = jnp.asarray(distances)
    return jnp.where(d < 0, max_distance + 1, jnp.minimum(d, max_distance)).astype(jnp.int32)


def distance_bias(table: jax.Array, distances: jax.Array) -> jax.Array:
    """Graphormer's spatial bias ``b[n, t, s] = table[bucket(d[t, s]), n]``.

    Args:
        table: float ``[R, N]``: one learned scalar per distance bucket and head, R = max_distance + 2.
        distances: int ``[B, T, S]`` hop distances (-1: unreachable or padding).

    Returns:
        float32 ``[B, N, T, S]``, to pass as ``attention(..., bias=...)``.

    Example:
        >>> table = jnp.array([[0.0, 1.0], [-1.0, 2.0], [-5.0, 3.0], [-9.0, 4.0]])  # R = 4, N = 2
        >>> distance_bias(table, jnp.array([[[0, 1], [5, -1]]]))[0, 0].tolist()
        [[0.0, -1.0], [-5.0, -9.0]]
    """
    if table.ndim != 2:
        raise ValueError(f"distance_bias: table must be [R, N], got shape {table.shape}")
    if distances.ndim != 3:
        raise ValueError(f"distance_bias: distances must be int [B, T, S], got shape {distances.shape}")
    buckets = distance_buckets(distances, table.shape[0] - 2)
    bias = jnp.take(table.astype(jnp.float32), buckets, axis=0)  # [B, T, S, N]
    return jnp.moveaxis(bias, -1, -3)  # [B, T, S, N] -> [B, N, T, S]


class GraphEncoder(nnx.Module):
    """An ``Encoder`` told about the graph: by nothing, a neighbour mask or a distance bias.

    Args:
        encoder: the ``attnlab.nn.Encoder`` (use ``posenc="none"``: nodes have no order).
        graph: ``"none"`` | ``"mask"`` | ``"distance"`` (see the module docstring).
        num_heads: N (the encoder's), for the distance table.
        max_distance: distances >= this share one bucket (``"distance"`` only).

    Call: ``(inputs, lengths=None, *, adjacency=None, distances=None, dropout_key=None,
    return_weights=False)``; ``adjacency`` bool ``[B, T, T]`` (no self loops) for ``"mask"``,
    ``distances`` int ``[B, T, T]`` for ``"distance"``.
    """

    def __init__(self, encoder: Encoder, *, graph: str, num_heads: int = 1, max_distance: int = 8, rngs: nnx.Rngs):
        if graph not in GRAPH_MODES:
            raise ValueError(f"GraphEncoder: graph must be one of {GRAPH_MODES}, got {graph!r}")
        self.encoder = encoder
        self.features = encoder.features
        self.graph = graph
        if graph == "distance":
            # Zero init: training starts from plain full attention.
            self.distance_table = nnx.Param(jnp.zeros((max_distance + 2, num_heads), jnp.float32))

    def __call__(self, inputs, lengths=None, *, adjacency=None, distances=None, dropout_key=None, return_weights=False):
        mask = bias = None
        match self.graph:
            case "mask":
                if adjacency is None:
                    raise ValueError("GraphEncoder(graph='mask'): pass adjacency= bool [B, T, T]")
                mask = masks_lib.graph(jnp.asarray(adjacency), self_loops=True)
            case "distance":
                if distances is None:
                    raise ValueError("GraphEncoder(graph='distance'): pass distances= int [B, T, T]")
                bias = distance_bias(self.distance_table[...], jnp.asarray(distances))
            case "none":
                pass
        return self.encoder(
            inputs, lengths, mask=mask, bias=bias, dropout_key=dropout_key, return_weights=return_weights
        )


def gin_layer(params: dict, h: jax.Array, adjacency: jax.Array) -> jax.Array:
    """One GIN update with a pre-norm residual: ``h + MLP((1 + eps) h~ + A h~)``, ``h~ = LN(h)``.

    Args:
        params: ``eps`` scalar, ``ln_scale``/``ln_bias`` ``[D]``, ``w1`` ``[D, M]``, ``b1`` ``[M]``,
            ``w2`` ``[M, D]``, ``b2`` ``[D]``.
        h: float ``[B, T, D]`` node states.
        adjacency: bool or float ``[B, T, T]``; ``A[b, i, j]`` = 1 when j sends to i. Padded nodes
            must have no edges; then they never reach real nodes.

    Returns:
        ``[B, T, D]``.
    """
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    x = (h - mu) * jax.lax.rsqrt(var + 1e-6) * params["ln_scale"] + params["ln_bias"]
    agg = (1.0 + params["eps"]) * x + jnp.einsum("bts,bsd->btd", adjacency.astype(x.dtype), x)  # sum over neighbours
    m = jax.nn.relu(agg @ params["w1"] + params["b1"])  # [B, T, M]
    return h + m @ params["w2"] + params["b2"]


class GIN(nnx.Module):
    """Message-passing baseline: embedding, L ``gin_layer`` updates (sum aggregation), final LayerNorm.

    Args:
        d_model: D.  num_layers: L.  mlp_dim: M (default 2 D).
        vocab_sizes / input_dim: see ``TokenEmbedding``.
        dropout_rate: on the embedding and on each layer's update.

    Call: ``gin(inputs, lengths=None, *, adjacency, distances=None, dropout_key=None) -> [B, T, D]``
    (``lengths`` and ``distances`` are unused: padding is carried by the adjacency).
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int,
        mlp_dim: int | None = None,
        vocab_sizes: int | Sequence[int] | None = None,
        input_dim: int | None = None,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.features = d_model
        self.embed = TokenEmbedding(d_model, vocab_sizes=vocab_sizes, input_dim=input_dim, rngs=rngs)
        M = mlp_dim or 2 * d_model
        init = jax.nn.initializers.lecun_normal()
        self.layers = nnx.List(
            [
                nnx.Dict(
                    eps=nnx.Param(jnp.zeros(())),
                    ln_scale=nnx.Param(jnp.ones((d_model,))),
                    ln_bias=nnx.Param(jnp.zeros((d_model,))),
                    w1=nnx.Param(init(rngs.params(), (d_model, M))),
                    b1=nnx.Param(jnp.zeros((M,))),
                    w2=nnx.Param(init(rngs.params(), (M, d_model))),
                    b2=nnx.Param(jnp.zeros((d_model,))),
                )
                for _ in range(num_layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.dropout_rate = dropout_rate

    def layer_params(self, i: int) -> dict[str, jax.Array]:
        """The params dict of layer i for ``gin_layer``."""
        return {k: v[...] for k, v in self.layers[i].items()}

    def __call__(self, inputs, lengths=None, *, adjacency=None, distances=None, dropout_key=None):
        del lengths, distances
        if adjacency is None:
            raise ValueError("GIN: pass adjacency= bool [B, T, T]")
        keys = split_key(dropout_key, len(self.layers) + 1)
        h = dropout(self.embed(inputs), self.dropout_rate, keys[0])  # [B, T, D]
        adjacency = jnp.asarray(adjacency)
        for i, k in enumerate(keys[1:]):
            new = gin_layer(self.layer_params(i), h, adjacency)
            h = h + dropout(new - h, self.dropout_rate, k)
        return self.ln_f(h)
