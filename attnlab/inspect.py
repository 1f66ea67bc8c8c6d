"""Look inside any ``attnlab.nn`` model: capture, ablate and patch every attention head.

Every attention layer of ``attnlab.nn`` (``Encoder``, ``GraphEncoder``, ``EncoderDecoder``, ``DETR``,
the classifiers over them) is a ``MultiHeadAttention`` whose ``kind`` (an ``attnlab.nn.AttentionFn``)
is what runs between the projections: it receives the per-head queries, keys and values (after
any rotary encoding) and returns the per-head outputs ``o [..., T, N, Hv]``, before the output
projection ``Wo``. That is the seam. Each function here works on a clone of the model
(``nnx.clone``: the caller's model is never changed) whose layers' ``kind`` is wrapped in a
``Probe``: the probe calls the wrapped attention exactly as the module would (same arguments, same
implementation, so the outputs are identical), records what was asked, and may replace chosen
heads' outputs before ``Wo``. A normal run never meets a probe: it costs nothing when unused.

* ``capture(model, *args, rows=None, **kwargs) -> Capture``: per layer, q, k, v, the per-head
  outputs and the attention weights: dense ``[..., N, T, S]`` (``attention_weights``), or with
  ``rows=`` the weights of those query rows ``[..., N, R, S]`` and the log-sum-exp of every row
  ``[..., T, N]`` (from ``attnlab.attention(..., return_lse=True)``, blockwise for long inputs), so
  no ``[T, S]`` array is formed. Linear attention and Performer give their effective weights
  (``attnlab.efficient.linear_attention_weights`` / ``performer_attention_weights``).
* ``ablate(model, heads, *args, kind="zero" | "mean" | "resample", ...)``: the model's output with
  the chosen heads' outputs replaced by zeros, their mean over a reference batch, or their values
  on other inputs.
* ``patch(model, heads, source, target)``: activation patching: the target run with the chosen
  heads' outputs taken from the source run.
* ``head_sweep(model, head_sets, *args, ...)``: ``ablate`` ``vmap``-ed over a stack of head sets
  (``single_heads(model)``: every head alone), one compiled call under ``jit``.
* ``summarise(weights, ...)``: per head: entropy, mean attended distance, mass on fixed offsets, on
  the diagonal, on the first token, and on graph edges vs non-edges.
* ``html_view(weights, tokens)``: a self-contained interactive HTML view of one layer's heads.

Heads are named by layer index (the order of ``layers(model)``, the modules' paths in
``nnx.iter_graph`` order) and head index; a set of heads is a bool ``[L, N]`` array
(``head_mask``), which may be traced: a new set is not a new program.

Legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim, Hv value head
dim, L attention layers, R captured query rows, P head sets.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import efficient
from attnlab.attention import attention, attention_weights
from attnlab.call import bind
from attnlab.heads import resolve_score
from attnlab.nn.attention import AttentionFn, Linear, Performer, Softmax
from attnlab.nn.layers import MultiHeadAttention

__all__ = [
    "ABLATIONS",
    "RECORDS",
    "Capture",
    "Inputs",
    "LayerCapture",
    "Probe",
    "ablate",
    "ablated",
    "capture",
    "head_mask",
    "head_sweep",
    "html_view",
    "inputs",
    "layers",
    "num_heads",
    "patch",
    "single_heads",
    "summarise",
]

ABLATIONS = ("zero", "mean", "resample")
RECORDS = ("q", "k", "v", "out", "weights")
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
        weights: fp32 ``[..., N, T, S]`` (``[..., N, R, S]`` with rows): softmax weights, or the
            effective weights of linear attention / Performer; None for an attention function
            whose weights attnlab does not know (a plain callable).
        lse: fp32 ``[..., T, N]``, every row's log-sum-exp (softmax with ``rows`` only), else None.
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


jax.tree_util.register_dataclass(
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


jax.tree_util.register_dataclass(Capture, data_fields=["output", "layers"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One set of model inputs, ``model(*args, **kwargs)`` (a pytree), for ``patch`` and ``source=``."""

    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


jax.tree_util.register_dataclass(Inputs, data_fields=["args", "kwargs"], meta_fields=[])


def inputs(*args, **kwargs) -> Inputs:
    """``Inputs(args, kwargs)``: e.g. ``inspect.inputs(tokens, lengths, adjacency=adj)``."""
    return Inputs(tuple(args), dict(kwargs))


def _as_inputs(x, name: str, fn: str) -> Inputs:
    if isinstance(x, Inputs):
        return x
    if isinstance(x, tuple):
        return Inputs(x, {})
    raise ValueError(f"{fn}: {name} must be inspect.inputs(*args, **kwargs) or a tuple of positional args, got {x!r}")


# ------------------------------------------------------------------------------------------
# The layers of a model


def _attention_layers(model, fn: str) -> list[tuple[str, MultiHeadAttention]]:
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
    return tuple(name for name, _ in _attention_layers(model, "inspect.layers"))


def num_heads(model) -> tuple[int, ...]:
    """N of each attention layer, in ``layers(model)`` order."""
    return tuple(m.wq[...].shape[1] for _, m in _attention_layers(model, "inspect.num_heads"))


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
# The probe: the seam


class _Session:
    """One run's instructions and records (plain Python, alive for one trace)."""

    def __init__(self, *, record=(), rows=None, edits=None, fn="inspect"):
        self.fn = fn
        self.record = frozenset(record)
        self.rows = rows
        self.edits = edits or {}  # layer index -> (chosen bool [N], replacement broadcastable to o)
        self.layers: dict[int, LayerCapture] = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Probe(AttentionFn):
    """Wraps a layer's attention kind: same result, plus records and per-head replacements.

    Built by ``capture`` / ``ablate`` / ``patch`` on a clone of the model; not meant to be
    constructed by hand. ``index`` and ``name`` identify the layer; ``score`` is the module's
    score name (``"dot"`` or ``"additive"``). An additive layer's ``w_score`` reaches the probe as its
    ``state`` (the module reads the variable that ``state_name`` names at every call), so a probed
    model stays a pure function of its parameters, under ``jit`` and in training.
    """

    inner: AttentionFn
    index: int
    name: str
    score: str
    session: _Session

    @property
    def takes_mask(self) -> bool:  # type: ignore[override]
        return self.inner.takes_mask

    @property
    def state_name(self) -> str | None:  # type: ignore[override]
        if self.inner.state_name is not None:
            return self.inner.state_name  # the module hands the probe the wrapped kind's state
        return "w_score" if self.score == "additive" else None

    def _resolved(self, state):
        return resolve_score(self.score, {"w_score": state}) if self.score == "additive" else self.score

    def mha_kwargs(self, *, mask, bias, kv_lengths, state):
        self.inner.mha_kwargs(mask=mask, bias=bias, kv_lengths=kv_lengths, state=state)  # its checks
        return {"attention_fn": lambda q, k, v: self(q, k, v, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state)}

    def __call__(self, q, k, v, *, mask=None, bias=None, kv_lengths=None, state=None):
        inner = self.inner
        score = self._resolved(state)
        if isinstance(inner, Softmax):  # what multi_head_attention itself calls on this path
            o = attention(q, k, v, mask=mask, bias=bias, score=score, implementation=inner.implementation)
        else:
            o = inner(q, k, v, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state)
        s = self.session
        if s.record:
            s.layers[self.index] = self._record(q, k, v, o, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state)
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

    def _record(self, q, k, v, o, *, mask, bias, kv_lengths, state):
        s, rows = self.session, self.session.rows
        weights = lse = None
        if "weights" in s.record:
            weights, lse = self._weights(q, k, v, mask=mask, bias=bias, kv_lengths=kv_lengths, state=state, rows=rows)
        keep = {n: x for n, x in (("q", q), ("k", k), ("v", v), ("out", o)) if n in s.record}
        rows_meta = None if rows is None else tuple(int(r) for r in rows)
        return LayerCapture(self.name, type(self.inner).__name__, rows_meta, weights=weights, lse=lse, **keep)

    def _weights(self, q, k, v, *, mask, bias, kv_lengths, state, rows):
        inner, score = self.inner, self._resolved(state)
        T, S = q.shape[-3], k.shape[-3]
        if rows is None and T * S > DENSE_MAX_PAIRS:
            raise ValueError(
                f"inspect.capture: layer {self.name} has {T} x {S} pairs per head, more than dense capture "
                f"takes ({DENSE_MAX_PAIRS}); pass rows= (the query rows to keep)"
            )
        if rows is not None and max(rows) >= T:
            raise ValueError(f"inspect.capture: rows must be < T = {T} (layer {self.name}), got {list(rows)}")
        qr = q if rows is None else jnp.take(q, jnp.asarray(rows), axis=-3)  # [..., R, N, H]
        if isinstance(inner, Linear):
            return efficient.linear_attention_weights(qr, k, kv_lengths=kv_lengths), None
        if isinstance(inner, Performer):
            return efficient.performer_attention_weights(qr, k, projection=state, kv_lengths=kv_lengths), None
        if not isinstance(inner, Softmax):
            return None, None
        if rows is None:
            return attention_weights(q, k, mask=mask, bias=bias, score=score), None
        # The chosen rows only: the mask and bias evaluated at (rows, all keys), O(R S).
        call = bind(q, k, v, mask=mask, bias=bias, score=score, fn="inspect.capture")
        r, keys = jnp.asarray(rows), jnp.arange(call.S)
        row_mask = None if call.mask is None else call.mask(r, keys)
        row_bias = call.bias
        if call.bias_kind == "callable":
            row_bias = call.bias(r, keys)
        elif row_bias is not None:
            b = jnp.asarray(row_bias)
            row_bias = b if b.ndim < 2 or b.shape[-2] == 1 else jnp.take(b, r, axis=-2)
        w = attention_weights(qr, k, mask=row_mask, bias=row_bias, score=score)  # [..., N, R, S]
        _, lse = attention(q, k, v, mask=mask, bias=bias, score=score, return_lse=True)  # [..., T, N], O(T)
        return w, lse


def _probed(model, session: _Session, fn: str):
    """A clone of ``model`` whose attention layers carry probes reporting to ``session``."""
    clone = nnx.clone(model)
    for i, (name, mha) in enumerate(_attention_layers(clone, fn)):
        if not isinstance(mha.score, str) or mha.score not in ("dot", "additive"):
            raise ValueError(f"{fn}: layer {name} has score {mha.score!r}; inspect takes 'dot' or 'additive'")
        mha.kind = Probe(mha.kind, i, name, mha.score, session)
    return clone


def _run(model, session: _Session, ins: Inputs, fn: str):
    out = _probed(model, session, fn)(*ins.args, **ins.kwargs)
    return out, session


# ------------------------------------------------------------------------------------------
# Capture


def _check_rows(rows):
    if rows is None:
        return None
    try:
        r = np.asarray(rows)
    except Exception:  # a traced array: rows are structure here (their count shapes the result)
        raise ValueError("inspect.capture: rows must be concrete ints (a list or numpy array), not traced") from None
    if r.ndim != 1 or r.size == 0 or not np.issubdtype(r.dtype, np.integer):
        raise ValueError(f"inspect.capture: rows must be a non-empty 1-D sequence of ints, got {rows!r}")
    if (r < 0).any():
        raise ValueError(f"inspect.capture: rows must be >= 0, got {r.tolist()}")
    return tuple(int(x) for x in r)


def capture(model, *args, rows=None, record: Sequence[str] = RECORDS, **kwargs) -> Capture:
    """Runs ``model(*args, **kwargs)`` and returns its output and what every attention layer saw.

    Pure in (model, inputs): call it inside ``nnx.jit`` (or ``jax.jit`` over ``nnx.split``) as any
    model call; the model is not changed.

    Args:
        model: an ``attnlab.nn`` model with at least one ``MultiHeadAttention``.
        *args, **kwargs: the model's inputs, e.g. ``(tokens, lengths)``, ``adjacency=``.
        rows: None (dense weights ``[..., N, T, S]``; refused beyond 4096 x 4096 pairs) or the query
            rows to keep (ints): then softmax layers give ``weights [..., N, R, S]`` of those rows and
            ``lse [..., T, N]`` of all rows, without any ``[T, S]`` array. The same rows are taken in
            every layer (each layer's T must exceed them).
        record: which of ``RECORDS`` = ("q", "k", "v", "out", "weights") to keep.

    Returns:
        ``Capture(output, layers)``, one ``LayerCapture`` per layer of ``layers(model)`` that ran.

    Raises:
        ValueError: a bad ``rows`` or ``record``, or a model without attention layers.

    Example:
        >>> from attnlab import nn
        >>> enc = nn.Encoder(vocab_sizes=10, d_model=8, num_layers=2, num_heads=2, rngs=nnx.Rngs(0))
        >>> cap = capture(enc, jnp.zeros((1, 5), int))
        >>> cap[1].weights.shape, cap[1].out.shape      # [B, N, T, S], [B, T, N, Hv]
        ((1, 2, 5, 5), (1, 5, 2, 4))
    """
    if isinstance(record, str) or not set(record) <= set(RECORDS) or not record:
        raise ValueError(f"inspect.capture: record must be a non-empty subset of {RECORDS}, got {record!r}")
    rows = _check_rows(rows)
    session = _Session(record=record, rows=rows)
    out, session = _run(model, session, Inputs(args, kwargs), "inspect.capture")
    caps = [session.layers[i] for i in sorted(session.layers)]  # the layers that ran, in layers(model) order
    return Capture(out, tuple(caps))


# ------------------------------------------------------------------------------------------
# Interventions


def _lead_axis(ins: Inputs):
    leaves = [x for x in jax.tree_util.tree_leaves(ins) if hasattr(x, "ndim") and x.ndim >= 1]
    if not leaves:
        raise ValueError("inspect.ablate: kind='resample' without source= needs batched array inputs")
    return leaves[0].shape[0]


def _rolled(ins: Inputs) -> Inputs:
    """The inputs with every batched array rolled by one example: each example gets another's."""
    b = _lead_axis(ins)
    if b < 2:
        raise ValueError("inspect.ablate: kind='resample' without source= needs a batch of >= 2 examples")
    return jax.tree_util.tree_map(
        lambda x: jnp.roll(x, 1, axis=0) if hasattr(x, "ndim") and x.ndim >= 1 and x.shape[0] == b else x, ins
    )


def _outputs(model, ins: Inputs, fn: str) -> dict[int, jax.Array]:
    session = _Session(record=("out",))
    _run(model, session, ins, fn)
    return {i: c.out for i, c in session.layers.items()}


def _replacements(model, kind, ins: Inputs, source, reference, fn: str) -> dict[int, Any]:
    """Layer index -> what replaces a chosen head's output there (broadcastable to ``[..., T, N, Hv]``)."""
    if kind not in ABLATIONS:
        raise ValueError(f"{fn}: kind must be one of {ABLATIONS}, got {kind!r}")
    if kind == "zero":
        if source is not None or reference is not None:
            raise ValueError(f"{fn}: kind='zero' takes no source= or reference=")
        return {i: jnp.zeros(()) for i in range(len(_attention_layers(model, fn)))}
    if kind == "mean":
        if source is not None:
            raise ValueError(f"{fn}: kind='mean' takes reference= (the batch to average over), not source=")
        ref = ins if reference is None else _as_inputs(reference, "reference", fn)
        outs = _outputs(model, ref, fn)  # [..., T, N, Hv] -> mean over every example and position: [N, Hv]
        return {i: o.astype(jnp.float32).reshape(-1, *o.shape[-2:]).mean(0) for i, o in outs.items()}
    if reference is not None:
        raise ValueError(f"{fn}: kind='resample' takes source= (the inputs to resample from), not reference=")
    src = _rolled(ins) if source is None else _as_inputs(source, "source", fn)
    return _outputs(model, src, fn)


def _intervened(model, chosen, replacements, ins: Inputs, fn: str):
    session = _Session(edits={i: (chosen[i], rep) for i, rep in replacements.items()}, fn=fn)
    out, _ = _run(model, session, ins, fn)
    return out


def ablate(model, heads, *args, kind: str = "zero", source=None, reference=None, **kwargs):
    """``model(*args, **kwargs)`` with the chosen heads' outputs replaced before the output projection.

    Args:
        model: an ``attnlab.nn`` model.
        heads: the heads to ablate: ``(layer, head)`` pairs or a bool ``[L, N]`` (see ``head_mask``).
        *args, **kwargs: the model's inputs.
        kind: ``"zero"`` (the output 0: the same as zeroing the head's slice ``wo[head]`` of the output
            projection), ``"mean"`` (the head's output averaged over every example and position of
            ``reference``, default the inputs themselves) or ``"resample"`` (the head's output on
            ``source``, default the same batch rolled by one example: each example gets another's).
        source: ``inspect.inputs(...)`` or a tuple of args, with the inputs' shapes (resample).
        reference: the same, any batch (mean).

    Returns:
        the model's output.

    Raises:
        ValueError: a bad ``heads`` or ``kind``, ``source`` / ``reference`` given to the wrong kind,
            or a ``source`` whose head outputs do not have the inputs' shapes.
    """
    ins = Inputs(args, kwargs)
    chosen = head_mask(model, heads)
    reps = _replacements(model, kind, ins, source, reference, "inspect.ablate")
    return _intervened(model, chosen, reps, ins, "inspect.ablate")


def ablated(model, heads, *, kind: str = "zero", reference=None):
    """A copy of ``model`` whose chosen heads' outputs are replaced in every call: any evaluation
    code that takes a model (an accuracy loop, ``nnx.jit``-ed prediction) then measures the ablation.

    Args:
        heads: ``(layer, head)`` pairs or a bool ``[L, N]`` (see ``head_mask``).
        kind: ``"zero"`` or ``"mean"`` (the mean over ``reference``, required: ``inspect.inputs(...)``
            or a tuple of args). Resampling depends on each call's inputs: use ``ablate``.

    Returns:
        a clone of the model (its parameters shared by value, the original untouched); its output
        equals ``ablate(model, heads, *args, kind=kind, reference=reference)``.
    """
    if kind not in ("zero", "mean"):
        raise ValueError(f"inspect.ablated: kind must be 'zero' or 'mean' (resample: use inspect.ablate), got {kind!r}")
    if kind == "mean" and reference is None:
        raise ValueError("inspect.ablated: kind='mean' needs reference= (the inputs to average the heads over)")
    chosen = head_mask(model, heads)
    reps = _replacements(model, kind, None, None, reference, "inspect.ablated")
    session = _Session(edits={i: (chosen[i], rep) for i, rep in reps.items()}, fn="inspect.ablated")
    return _probed(model, session, "inspect.ablated")


def patch(model, heads, source, target):
    """Activation patching: the ``target`` run with the chosen heads' outputs taken from the ``source`` run.

    Each chosen head's output ``o [..., T, N, Hv]`` (before the output projection) is replaced,
    at every position, by its value in a clean run of the model on ``source``; everything else in
    the target run (the other heads, the later layers) is computed as usual.

    Args:
        heads: ``(layer, head)`` pairs or a bool ``[L, N]`` (see ``head_mask``).
        source, target: ``inspect.inputs(*args, **kwargs)`` or tuples of positional args; the head
            outputs of both must have the same shapes (same batch and lengths).

    Returns:
        the model's output on ``target``, patched.
    """
    src = _as_inputs(source, "source", "inspect.patch")
    tgt = _as_inputs(target, "target", "inspect.patch")
    chosen = head_mask(model, heads)
    return _intervened(model, chosen, _outputs(model, src, "inspect.patch"), tgt, "inspect.patch")


def head_sweep(
    model, head_sets, *args, kind: str = "zero", fn: Callable | None = None, source=None, reference=None, **kwargs
):
    """``ablate`` for each of P head sets at once, ``jax.vmap``-ed: one program, one compiled call under jit.

    Args:
        head_sets: bool ``[P, L, N]``, e.g. ``single_heads(model)`` (every head alone).
        fn: optional ``fn(output) -> anything`` applied to each ablated output inside the vmap (a
            loss or an accuracy keeps the result small: ``[P]`` instead of ``[P, *output.shape]``).
        kind, source, reference, *args, **kwargs: as ``ablate``; the replacements (means, resampled
            outputs) are computed once for all sets.

    Returns:
        ``fn(output)`` (or the output) stacked over the sets: ``[P, ...]``.

    Raises:
        ValueError: ``head_sets`` not ``[P, L, N]``, and as ``ablate``.
    """
    L, N = len(layers(model)), max(num_heads(model))
    if not hasattr(head_sets, "shape") or len(head_sets.shape) != 3 or tuple(head_sets.shape[1:]) != (L, N):
        raise ValueError(
            f"inspect.head_sweep: head_sets must be bool [P, L, N] = [P, {L}, {N}] (e.g. single_heads(model)), "
            f"got {getattr(head_sets, 'shape', head_sets)}"
        )
    ins = Inputs(args, kwargs)
    reps = _replacements(model, kind, ins, source, reference, "inspect.head_sweep")
    graphdef, state = nnx.split(model)

    def one(chosen):
        out = _intervened(nnx.merge(graphdef, state), chosen, reps, ins, "inspect.head_sweep")
        return out if fn is None else fn(out)

    return jax.vmap(one)(jnp.asarray(head_sets).astype(bool))


# ------------------------------------------------------------------------------------------
# Summaries


def summarise(
    weights,
    *,
    offsets: Sequence[int] = (-1, 0, 1),
    rows=None,
    lengths=None,
    adjacency=None,
) -> dict[str, jax.Array]:
    """Per-head statistics of attention weights, averaged over the real query rows of a batch.

    A row counts when it has any nonzero weight (an empty row, e.g. a padded query, is all zeros)
    and, with ``lengths``, when its query is real.

    Args:
        weights: ``[..., N, T, S]`` (``LayerCapture.weights``; dense or the rows of ``rows``).
        offsets: the relative offsets d for ``offset_mass`` (the weight on key t + d).
        rows: the query positions of the T rows (a rows capture's ``rows``); default ``0 .. T-1``.
        lengths: int ``[...]`` real lengths per example: queries at or past them are left out.
        adjacency: bool ``[..., T, S]`` graph edges (True = edge; the same rows as ``weights``) for
            ``edge_mass`` / ``non_edge_mass``.

    Returns:
        dict of fp32 arrays: ``entropy [N]`` (nats), ``distance [N]`` (mean ``Σ_s w[t, s] |s - t|``),
        ``offset_mass [N, len(offsets)]``, ``diagonal [N]`` (weight on s = t), ``first [N]`` (on
        s = 0), ``rows [N]`` (rows counted) and with ``adjacency`` ``edge_mass [N]`` and
        ``non_edge_mass [N]``.

    Raises:
        ValueError: weights not ``[..., N, T, S]``, or ``rows`` / ``lengths`` / ``adjacency`` whose
            shapes do not fit them (the message names the argument).

    Example:
        >>> w = jnp.eye(3)[None]                          # one head attending to itself
        >>> {k: v.tolist() for k, v in summarise(w, offsets=(0,)).items() if k != "offset_mass"}
        {'entropy': [0.0], 'distance': [0.0], 'diagonal': [1.0], 'first': [0.3333333432674408], 'rows': [3.0]}
    """
    if not hasattr(weights, "ndim") or weights.ndim < 3:
        raise ValueError(
            "inspect.summarise: weights must be [..., N, T, S], "
            f"got {getattr(weights, 'shape', type(weights).__name__)}"
        )
    w = jnp.asarray(weights).astype(jnp.float32)
    *lead, n, t, s = w.shape
    lead = tuple(lead)
    pos = jnp.arange(t) if rows is None else jnp.asarray(rows)
    if pos.shape != (t,):
        raise ValueError(f"inspect.summarise: rows must be [T] = [{t}] query positions, got shape {pos.shape}")
    try:
        offsets = tuple(int(d) for d in offsets)
    except TypeError:
        raise ValueError(f"inspect.summarise: offsets must be a sequence of ints, got {offsets!r}") from None
    keys = jnp.arange(s)
    valid = jnp.any(w != 0, axis=-1)  # [..., N, T]
    if lengths is not None:
        lengths = jnp.asarray(lengths)
        if lengths.shape != lead:
            raise ValueError(f"inspect.summarise: lengths must have the batch shape {list(lead)}, got {lengths.shape}")
        valid = valid & (pos < lengths[..., None])[..., None, :]
    count = valid.sum(tuple(range(len(lead))) + (-1,)).astype(jnp.float32)  # [N]

    def mean(per_row):  # [..., N, T] -> [N]
        total = jnp.where(valid, per_row, 0.0).sum(tuple(range(len(lead))) + (-1,))
        return total / jnp.maximum(count, 1.0)

    plogp = jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0)
    dist = jnp.abs(keys[None, :] - pos[:, None]).astype(jnp.float32)  # [T, S]
    at = keys[None, :] - pos[:, None]  # [T, S]: the offset s - t of each pair
    out = {
        "entropy": mean(-plogp.sum(-1)),
        "distance": mean((w * dist).sum(-1)),
        "offset_mass": jnp.stack([mean((w * (at == d)).sum(-1)) for d in offsets], axis=-1)
        if offsets
        else jnp.zeros((n, 0)),
        "diagonal": mean((w * (at == 0)).sum(-1)),
        "first": mean(w[..., 0]),
        "rows": count,
    }
    if adjacency is not None:
        adj = jnp.asarray(adjacency)
        if adj.shape != (*lead, t, s) or adj.dtype != bool:
            raise ValueError(
                f"inspect.summarise: adjacency must be bool [..., T, S] = {[*lead, t, s]}, "
                f"got {adj.dtype}{list(adj.shape)}"
            )
        a = adj[..., None, :, :]  # [..., 1, T, S]
        out["edge_mass"] = mean(jnp.where(a, w, 0.0).sum(-1))
        out["non_edge_mass"] = mean(jnp.where(a, 0.0, w).sum(-1))
    return out


# ------------------------------------------------------------------------------------------
# An interactive view for notebooks

_VIEW_JS = """(function () {
  const root = document.getElementById("%(id)s");
  const W = JSON.parse(root.querySelector("script[type='application/json']").textContent);  // [N][T][S]
  const qs = root.querySelectorAll(".q"), ks = root.querySelectorAll(".k"), hs = root.querySelectorAll(".h");
  let head = 0, query = 0;
  function show() {
    qs.forEach((e, i) => { e.style.outline = i === query ? "2px solid #333" : "none"; });
    hs.forEach((e, i) => { e.style.fontWeight = i === head ? "bold" : "normal"; });
    const row = W[head][query];
    ks.forEach((e, s) => {
      e.style.background = "rgba(230, 85, 13, " + row[s] + ")";
      e.dataset.weight = row[s];
      e.title = row[s].toFixed(3);
    });
    root.dataset.head = head;
    root.dataset.query = query;
  }
  qs.forEach((e, i) => e.addEventListener("mouseenter", () => { query = i; show(); }));
  hs.forEach((e, i) => e.addEventListener("click", () => { head = i; show(); }));
  const q = /q=(\\d+)/.exec(location.hash), h = /h=(\\d+)/.exec(location.hash);
  if (q) query = Math.min(+q[1], qs.length - 1);
  if (h) head = Math.min(+h[1], hs.length - 1);
  show();
})();"""

_VIEW_COUNT = [0]


def html_view(weights, queries: Sequence[str], keys: Sequence[str] | None = None, *, title: str = "") -> str:
    """A self-contained HTML view of token-to-token attention: hover a query token, see its weights.

    The key tokens are shaded by the weight the hovered query gives them (one head at a time; click
    a head to switch). Plain HTML, CSS and a few lines of JavaScript, no external files: show it in
    a notebook with ``IPython.display.HTML(html_view(...))`` or write it to a file. The page's
    ``#q=3&h=1`` (a URL fragment) selects query 3 of head 1 when it opens.

    Args:
        weights: ``[T, S]`` or ``[N, T, S]`` (one example of one layer, e.g. ``cap[1].weights[0]``).
        queries: T query tokens (strings); keys: S key tokens (default: the queries, self-attention).
        title: a heading.

    Raises:
        ValueError: weights not ``[T, S]`` / ``[N, T, S]``, or token counts that do not match them.
    """
    w = np.asarray(weights, np.float32)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"inspect.html_view: weights must be [T, S] or [N, T, S], got shape {w.shape}")
    keys = queries if keys is None else keys
    n, t, s = w.shape
    if len(queries) != t:
        raise ValueError(f"inspect.html_view: queries must be T = {t} tokens (weights {w.shape}), got {len(queries)}")
    if len(keys) != s:
        raise ValueError(f"inspect.html_view: keys must be S = {s} tokens (weights {w.shape}), got {len(keys)}")
    import html as html_lib
    import json

    _VIEW_COUNT[0] += 1
    vid = f"attnlab-view-{_VIEW_COUNT[0]}"
    data = json.dumps(np.round(np.clip(w.astype(np.float64), -1.0, 1.0), 4).tolist()).replace("</", "<\\/")

    def spans(tokens, cls):
        return " ".join(f'<span class="{cls}" style="padding:1px 3px;margin:1px;cursor:default">'
                        f"{html_lib.escape(str(x))}</span>" for x in tokens)  # fmt: skip

    head_buttons = " ".join(
        f'<span class="h" style="cursor:pointer;padding:0 4px;border:1px solid #999">head {i}</span>' for i in range(n)
    )
    return (
        f'<div id="{vid}" style="font-family:monospace;line-height:2">'
        + (f"<div><b>{html_lib.escape(title)}</b></div>" if title else "")
        + f"<div>{head_buttons}</div>"
        + f"<div>queries (hover): {spans(queries, 'q')}</div>"
        + f"<div>keys: {spans(keys, 'k')}</div>"
        + f'<script type="application/json">{data}</script>'
        + f"<script>{_VIEW_JS % {'id': vid}}</script></div>"
    )
