"""Model surgery through the probes: ``capture`` what every layer saw, ``ablate`` / ``ablated`` / ``patch``
chosen heads, ``head_sweep`` many head sets at once.

Each function runs the model once (twice for ablations whose replacements come from another run)
through ``attnlab.inspect.probe``'s probes on a clone: the caller's model is never changed. Legend:
B batch, T query length, S key length, N query heads, Hv value head dim, L attention layers, R
captured query rows, P head sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.inspect.probe import (
    Capture,
    Inputs,
    Session,
    as_inputs,
    attention_layers,
    head_mask,
    layers,
    num_heads,
    probed,
    run,
)

__all__ = ["ABLATIONS", "RECORDS", "ablate", "ablated", "capture", "head_sweep", "patch"]

ABLATIONS = ("zero", "mean", "resample")
RECORDS = ("q", "k", "v", "out", "weights")


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
    session = Session(record=record, rows=rows)
    out, session = run(model, session, Inputs(args, kwargs), "inspect.capture")
    caps = [session.layers[i] for i in sorted(session.layers)]  # the layers that ran, in layers(model) order
    return Capture(out, tuple(caps))


# ------------------------------------------------------------------------------------------
# Interventions


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
    session = Session(record=("out",))
    run(model, session, ins, fn)
    return {i: c.out for i, c in session.layers.items()}


def _replacements(model, kind, ins: Inputs, source, reference, fn: str) -> dict[int, Any]:
    """Layer index -> what replaces a chosen head's output there (broadcastable to ``[..., T, N, Hv]``)."""
    if kind not in ABLATIONS:
        raise ValueError(f"{fn}: kind must be one of {ABLATIONS}, got {kind!r}")
    if kind == "zero":
        if source is not None or reference is not None:
            raise ValueError(f"{fn}: kind='zero' takes no source= or reference=")
        return {i: jnp.zeros(()) for i in range(len(attention_layers(model, fn)))}
    if kind == "mean":
        if source is not None:
            raise ValueError(f"{fn}: kind='mean' takes reference= (the batch to average over), not source=")
        ref = ins if reference is None else as_inputs(reference, "reference", fn)
        outs = _outputs(model, ref, fn)  # [..., T, N, Hv] -> mean over every example and position: [N, Hv]
        return {i: o.astype(jnp.float32).reshape(-1, *o.shape[-2:]).mean(0) for i, o in outs.items()}
    if reference is not None:
        raise ValueError(f"{fn}: kind='resample' takes source= (the inputs to resample from), not reference=")
    src = _rolled(ins) if source is None else as_inputs(source, "source", fn)
    return _outputs(model, src, fn)


def _intervened(model, chosen, replacements, ins: Inputs, fn: str):
    session = Session(edits={i: (chosen[i], rep) for i, rep in replacements.items()}, fn=fn)
    out, _ = run(model, session, ins, fn)
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
    session = Session(edits={i: (chosen[i], rep) for i, rep in reps.items()}, fn="inspect.ablated")
    return probed(model, session, "inspect.ablated")


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
    src = as_inputs(source, "source", "inspect.patch")
    tgt = as_inputs(target, "target", "inspect.patch")
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
