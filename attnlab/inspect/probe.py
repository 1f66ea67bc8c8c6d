"""The seam: what inspection records, how it names layers and heads, and the probe around a layer's kind.

Every attention layer of ``attnlab.nn`` is a ``MultiHeadAttention`` whose ``kind`` (an
``attnlab.nn.AttentionFn``) runs between the projections: it receives the per-head queries, keys and
values and returns the per-head outputs ``o [..., T, N, Hv]`` before ``Wo``. ``probed(model, session)``
clones the model and wraps each layer's kind in a ``Probe``, which calls the kind exactly as the module
would, records what the session asks (the kind's own ``weights`` and ``lse`` for the weights) and may
replace chosen heads' outputs.

Legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim, Hv value head
dim, L attention layers, R captured query rows, P head sets.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import _pytree  # register_dataclass with the class in the treedef
from attnlab.nn.attention import AttentionFn
from attnlab.nn.layers import MultiHeadAttention

__all__ = [
    "Capture",
    "Inputs",
    "LayerCapture",
    "Probe",
    "head_mask",
    "inputs",
    "layers",
    "num_heads",
    "single_heads",
]

DENSE_MAX_PAIRS = 4096 * 4096  # capture(rows=None) refuses more T * S pairs per head: pass rows=


# ------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True)
class LayerCapture:
    """What one attention layer saw and did (a pytree: it passes through ``jit`` and ``vmap``).

    Attributes:
        name: the layer's path in the model, e.g. ``"backbone.blocks.0.attn"``.
        kind: the attention kind's name (``"Softmax"``, ``"Linear"``, ``"Performer"``, ...).
        rows: the captured query rows (a tuple of ints), or None for all rows.
        q: ``[..., T, N, H]`` queries, after any rotary encoding; k ``[..., S, K, H]``; v ``[..., S, K, Hv]``.
        out: ``[..., T, N, Hv]`` the per-head outputs, before the output projection (and before
            any ablation or patching of this run).
        weights: fp32 ``[..., N, T, S]`` (``[..., N, R, S]`` with rows): the kind's ``weights`` (softmax
            weights, or the effective weights of linear attention / Performer); None for a kind whose
            weights attnlab does not know (a plain callable).
        lse: fp32 ``[..., T, N]``, every row's log-sum-exp (a softmax kind, with ``rows`` only), else None.
    """

    name: str
    kind: str
    rows: tuple[int, ...] | None
    q: Any = None
    k: Any = None
    v: Any = None
    out: Any = None
    weights: Any = None
    lse: Any = None


_pytree.register_dataclass(
    LayerCapture, data_fields=["q", "k", "v", "out", "weights", "lse"], meta_fields=["name", "kind", "rows"]
)


@dataclasses.dataclass(frozen=True)
class Capture:
    """The model's output and one ``LayerCapture`` per attention layer, in ``layers(model)`` order."""

    output: Any
    layers: tuple[LayerCapture, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.layers)

    @property
    def weights(self) -> tuple:
        """Every layer's ``weights``, in order (what the models' ``return_weights=True`` lists)."""
        return tuple(c.weights for c in self.layers)

    def select(self, pattern: str) -> tuple[LayerCapture, ...]:
        """The layers whose name matches the glob ``pattern``, in order: ``cap.select("*cross_attn")``,
        ``cap.select("encoder.*")``."""
        return tuple(c for c in self.layers if fnmatch.fnmatchcase(c.name, pattern))

    def __getitem__(self, layer: int | str) -> LayerCapture:
        """A layer by index or by name."""
        if isinstance(layer, str):
            if layer not in self.names:
                raise ValueError(f"Capture: layer must be one of {self.names}, got {layer!r}")
            return self.layers[self.names.index(layer)]
        return self.layers[layer]


_pytree.register_dataclass(Capture, data_fields=["output", "layers"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One set of model inputs, ``model(*args, **kwargs)`` (a pytree), for ``patch`` and ``source=``."""

    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


_pytree.register_dataclass(Inputs, data_fields=["args", "kwargs"], meta_fields=[])


def inputs(*args, **kwargs) -> Inputs:
    """``Inputs(args, kwargs)``: e.g. ``inspect.inputs(tokens, lengths, adjacency=adj)``."""
    return Inputs(tuple(args), dict(kwargs))


def as_inputs(x, name: str, fn: str) -> Inputs:
    if isinstance(x, Inputs):
        return x
    if isinstance(x, tuple):
        return Inputs(x, {})
    raise ValueError(f"{fn}: {name} must be inspect.inputs(*args, **kwargs) or a tuple of positional args, got {x!r}")


# ------------------------------------------------------------------------------------------
# The layers and heads of a model


def attention_layers(model, fn: str) -> list[tuple[str, MultiHeadAttention]]:
    """``(path, module)`` of every ``MultiHeadAttention`` of ``model``, in ``nnx.iter_graph`` order."""
    if not isinstance(model, nnx.Module):
        raise ValueError(f"{fn}: model must be an attnlab.nn model (a flax nnx.Module), got {type(model).__name__}")
    found = [
        (".".join(str(p) for p in path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, MultiHeadAttention)
    ]
    if not found:
        raise ValueError(f"{fn}: model has no attnlab.nn.MultiHeadAttention layer to inspect")
    return found


def layers(model) -> tuple[str, ...]:
    """The paths of the model's attention layers, in the order inspect numbers them.

    Example:
        >>> from attnlab import nn
        >>> enc = nn.Encoder(vocab_sizes=10, d_model=8, num_layers=2, num_heads=2, rngs=nnx.Rngs(0))
        >>> layers(enc)
        ('blocks.0.attn', 'blocks.1.attn')
    """
    return tuple(name for name, _ in attention_layers(model, "inspect.layers"))


def num_heads(model) -> tuple[int, ...]:
    """N of each attention layer, in ``layers(model)`` order."""
    return tuple(m.wq[...].shape[1] for _, m in attention_layers(model, "inspect.num_heads"))


def head_mask(model, heads) -> jax.Array:
    """A set of heads as bool ``[L, N]`` (N the largest head count; True = chosen).

    Args:
        heads: pairs ``(layer, head)`` with ``layer`` an index or a path of ``layers(model)``, or
            an array ``[L, N]`` (bool or 0/1; returned as bool, may be traced).

    Raises:
        ValueError: an unknown layer or head, or an array of the wrong shape (names ``heads``).

    Example:
        >>> from attnlab import nn
        >>> enc = nn.Encoder(vocab_sizes=10, d_model=8, num_layers=2, num_heads=2, rngs=nnx.Rngs(0))
        >>> head_mask(enc, [(1, 0)]).tolist()
        [[False, False], [True, False]]
    """
    names, counts = layers(model), num_heads(model)
    shape = (len(names), max(counts))
    if hasattr(heads, "shape"):
        if tuple(heads.shape) != shape:
            raise ValueError(f"inspect: heads must be bool [L, N] = {list(shape)} for this model, got {heads.shape}")
        return jnp.asarray(heads).astype(bool)
    out = np.zeros(shape, bool)
    try:
        pairs = [tuple(p) for p in heads]
    except TypeError:
        raise ValueError(f"inspect: heads must be (layer, head) pairs or a bool [L, N] array, got {heads!r}") from None
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"inspect: heads must be (layer, head) pairs, got {pair!r}")
        layer, head = pair
        if isinstance(layer, str):
            if layer not in names:
                raise ValueError(f"inspect: heads names layer {layer!r}, not one of {names}")
            layer = names.index(layer)
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < len(names):
            raise ValueError(f"inspect: heads: layer must be in [0, {len(names)}) or a name, got {layer!r}")
        if not isinstance(head, (int, np.integer)) or not 0 <= head < counts[layer]:
            raise ValueError(f"inspect: heads: layer {layer} has heads [0, {counts[layer]}), got head {head!r}")
        out[layer, head] = True
    return jnp.asarray(out)


def single_heads(model) -> jax.Array:
    """Every head alone: bool ``[P, L, N]``, one set per (layer, head) in row-major order."""
    counts = num_heads(model)
    sets = [head_mask(model, [(layer, h)]) for layer, n in enumerate(counts) for h in range(n)]
    return jnp.stack(sets)


# ------------------------------------------------------------------------------------------
# The probe


class Session:
    """One run's instructions and records (plain Python, alive for one trace).

    Args:
        record: which of ``q``, ``k``, ``v``, ``out``, ``weights`` the probes keep.
        rows: None or the query rows of the weights (a tuple of ints).
        edits: layer index -> (chosen bool ``[N]``, replacement broadcastable to ``o``).
        fn: the public function's name, for error messages.
    """

    def __init__(self, *, record=(), rows=None, edits=None, fn="inspect"):
        self.fn = fn
        self.record = frozenset(record)
        self.rows = rows
        self.edits = edits or {}
        self.layers: dict[int, LayerCapture] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Probe(AttentionFn):
    """Wraps a layer's attention kind: same result, plus records and per-head replacements.

    Built by ``capture`` / ``ablate`` / ``patch`` on a clone of the model; not meant to be
    constructed by hand. ``index`` and ``name`` identify the layer. The module hands the probe its
    score at every call (``takes_score``: ``"dot"`` or a score object such as ``scores.Additive(w)``
    with the layer's current ``w_score``), so a probed model stays a pure function of its parameters,
    under ``jit`` and in training; the probe passes it on to a kind that ``takes_score``.
    """

    inner: AttentionFn
    index: int
    name: str
    session: Session
    takes_score: ClassVar[bool] = True  # always handed the module's score; passed on only to a kind that takes it

    @property
    def takes_mask(self) -> bool:  # type: ignore[override]
        return self.inner.takes_mask

    @property
    def state_name(self) -> str | None:  # type: ignore[override]
        return self.inner.state_name  # the module hands the probe the wrapped kind's state

    def _score(self, score) -> dict:
        return {"score": score} if self.inner.takes_score else {}

    def mha_kwargs(self, *, mask, bias, kv_lengths, state, score="dot"):
        self.inner.mha_kwargs(mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, **self._score(score))
        kw = dict(mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, score=score)
        return {"attention_fn": lambda q, k, v: self(q, k, v, **kw)}

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None, score="dot"):
        kw = dict(mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, **self._score(score))
        o = self.inner(q, k, v, **kw)
        s = self.session
        if s.record:
            s.layers[self.index] = self._record(q, k, v, o, kw)
        if self.index in s.edits:
            chosen, replacement = s.edits[self.index]
            replacement = jnp.asarray(replacement)
            try:
                ok = jnp.broadcast_shapes(replacement.shape, o.shape) == o.shape
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{s.fn}: the replacement head outputs of layer {self.name} have shape {replacement.shape}, "
                    f"the run's are {o.shape}: source must have the inputs' shapes"
                )
            n = o.shape[-2]
            o = jnp.where(chosen[:n, None], replacement.astype(o.dtype), o)  # [N, 1] over [..., T, N, Hv]
        return o

    def _record(self, q, k, v, o, kw: dict) -> LayerCapture:
        s, rows = self.session, self.session.rows
        weights = lse = None
        if "weights" in s.record:
            T, S = q.shape[-3], k.shape[-3]
            if rows is None and T * S > DENSE_MAX_PAIRS:
                raise ValueError(
                    f"inspect.capture: layer {self.name} has {T} x {S} pairs per head, more than dense capture "
                    f"takes ({DENSE_MAX_PAIRS}); pass rows= (the query rows to keep)"
                )
            if rows is not None and max(rows) >= T:
                raise ValueError(f"inspect.capture: rows must be < T = {T} (layer {self.name}), got {list(rows)}")
            weights = self.inner.weights(q, k, v, rows=rows, **kw)  # the kind says what its weights are
            lse = None if rows is None else self.inner.lse(q, k, v, **kw)
        keep = {n: x for n, x in (("q", q), ("k", k), ("v", v), ("out", o)) if n in s.record}
        rows_meta = None if rows is None else tuple(int(r) for r in rows)
        return LayerCapture(self.name, type(self.inner).__name__, rows_meta, weights=weights, lse=lse, **keep)


def probed(model, session: Session, fn: str):
    """A clone of ``model`` whose attention layers carry probes reporting to ``session``."""
    clone = nnx.clone(model)
    for i, (name, mha) in enumerate(attention_layers(clone, fn)):
        mha.kind = Probe(mha.kind, i, name, session)
    return clone


def run(model, session: Session, ins: Inputs, fn: str):
    """``model(*ins)`` through probes reporting to ``session``: (the output, the session)."""
    out = probed(model, session, fn)(*ins.args, **ins.kwargs)
    return out, session
