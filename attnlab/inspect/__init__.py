"""Look inside any ``attnlab.nn`` model: capture, ablate and patch every attention head.

Every attention layer of ``attnlab.nn`` (``Encoder``, ``GraphEncoder``, ``EncoderDecoder``, ``DETR``,
the classifiers over them) is a ``MultiHeadAttention`` whose ``kind`` (an ``attnlab.nn.AttentionFn``)
is what runs between the projections: it receives the per-head queries, keys and values (after
any rotary encoding) and returns the per-head outputs ``o [..., T, N, Hv]``, before the output
projection ``Wo``. That is the seam. Each function here works on a clone of the model
(``nnx.clone``: the caller's model is never changed) whose layers' ``kind`` is wrapped in a
``Probe``: the probe calls the wrapped attention exactly as the module would (same arguments, same
implementation, so the outputs are identical), records what was asked, and may replace chosen
heads' outputs before ``Wo``. A normal run never meets a probe: it costs nothing when unused. What a
kind's attention weights are, the kind says itself (``AttentionFn.weights`` and ``lse``): inspect
knows no kind by name.

Three rooms:

* ``probe`` and ``surgery`` (capture and interventions):
  ``capture(model, *args, rows=None, **kwargs) -> Capture``: per layer, q, k, v, the per-head
  outputs and the attention weights: dense ``[..., N, T, S]``, or with ``rows=`` the weights of
  those query rows ``[..., N, R, S]`` and the log-sum-exp of every row ``[..., T, N]`` (softmax),
  so no ``[T, S]`` array is formed; linear attention and Performer give their effective weights.
  ``ablate(model, heads, *args, kind="zero" | "mean" | "resample", ...)``: the model's output with
  the chosen heads' outputs replaced by zeros, their mean over a reference batch, or their values
  on other inputs; ``ablated(model, heads)`` a model that does it in every call;
  ``patch(model, heads, source, target)``: activation patching; ``head_sweep(model, head_sets,
  *args, ...)``: ``ablate`` ``vmap``-ed over a stack of head sets (``single_heads(model)``: every
  head alone), one compiled call under ``jit``.
* ``stats``: ``summarise(weights, ...)``: per head, entropy (and that of uniform attention), mean
  attended distance, mass on fixed offsets, on the diagonal, on the first token, on graph edges vs
  non-edges; ``offset_profile(weights, ...)``: the offset with the most mass and the R² of the best
  offset-only fit (how convolution-like a head is).
* ``view``: ``html_view(weights, tokens)``: a self-contained interactive HTML view of one layer's heads.

Heads are named by layer index (the order of ``layers(model)``, the modules' paths in
``nnx.iter_graph`` order) and head index; a set of heads is a bool ``[L, N]`` array
(``head_mask``), which may be traced: a new set is not a new program.

Legend: B batch, T query length, S key length, N query heads, K kv heads, H head dim, Hv value head
dim, L attention layers, R captured query rows, P head sets.
"""

from attnlab.inspect.probe import (
    Capture,
    Inputs,
    LayerCapture,
    Probe,
    Session,
    head_mask,
    inputs,
    layers,
    num_heads,
    single_heads,
)
from attnlab.inspect.stats import offset_profile, summarise
from attnlab.inspect.surgery import ABLATIONS, RECORDS, ablate, ablated, capture, head_sweep, patch
from attnlab.inspect.view import html_view

__all__ = [
    "ABLATIONS",
    "RECORDS",
    "Capture",
    "Inputs",
    "LayerCapture",
    "Probe",
    "Session",  # a Probe's instructions and records (Probe.session)
    "ablate",
    "ablated",
    "capture",
    "head_mask",
    "head_sweep",
    "html_view",
    "inputs",
    "layers",
    "num_heads",
    "offset_profile",
    "patch",
    "single_heads",
    "summarise",
]
