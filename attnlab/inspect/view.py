"""An interactive view for notebooks: ``html_view(weights, tokens)``, one layer's heads as self-contained
HTML (hover a query token, see its weights over the keys; click a head to switch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["html_view"]

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
