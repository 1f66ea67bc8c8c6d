"""The attention cases a benchmark times on every contender: a mask and a score, as plain facts.

attnlab's implementations take a ``Case`` as mask and score objects (``attnlab_mask``,
``attnlab_score``); each peer (cuDNN through ``jax.nn``, torch's ``flex_attention`` and SDPA,
tokamax) translates the same facts into its own arguments, or says why it cannot. So "documents"
is one set of ids for everyone, "window ±128" one interval, "ALiBi" one set of slopes.

Example:
    >>> c = next(c for c in speed_cases() if c.name == "window")
    >>> c.mask, c.window, c.baseline
    ('window', (128, 128), 'causal_window')
    >>> doc_ids(10, 3).tolist()
    [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Case", "UnsupportedError", "speed_cases", "doc_ids", "alibi_slopes", "additive_weights"]


class UnsupportedError(Exception):
    """A contender that cannot run a case; the message says why."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One mask and one score.

    Attributes:
        name: the row key (``case`` in a result row).
        mask: ``"full"``, ``"causal"``, ``"window"`` (``t - left <= s <= t + right``) or
            ``"documents"`` (``docs`` packed documents of random lengths in each row, numpy seed 0).
        window: ``(left, right)`` of a window.
        docs: documents per row.
        score: ``"dot"``, ``"softcap"`` (``cap * tanh(s / cap)`` of the scaled dot product),
            ``"alibi"`` (``s - slope[n] * |t - s|``, Press et al. 2021, arXiv 2108.12409) or
            ``"additive"`` (``w . tanh(q + k)`` per head: Bahdanau et al., arXiv 1409.0473).
        cap: the soft cap.
        baseline: the case whose cuDNN time a row is compared with (``vs_cudnn``): its own where
            cuDNN takes it, else the nearest it takes (full attention; a causal window for ±w).
        only: ``((H, T), ...)`` where it runs, or None for every size (additive: one target size).
    """

    name: str
    mask: str = "full"
    window: tuple[int, int] | None = None
    docs: int = 0
    score: str = "dot"
    cap: float = 30.0
    baseline: str = "full"
    only: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        """The inverse of ``dataclasses.asdict`` through JSON (lists back to tuples)."""
        d = dict(d)
        d["window"] = None if d.get("window") is None else tuple(d["window"])
        d["only"] = None if d.get("only") is None else tuple(tuple(x) for x in d["only"])
        return cls(**d)

    def runs_at(self, H: int, T: int) -> bool:
        return self.only is None or (H, T) in self.only

    @property
    def mask_label(self) -> str:
        """The ``mask`` field of a row (the names earlier results used)."""
        if self.mask == "window":
            return f"window({self.window[0]},{self.window[1]})"
        return f"document{self.docs}" if self.mask == "documents" else self.mask

    @property
    def score_label(self) -> str:
        """The ``score`` field of a row."""
        return {"softcap": f"softcap:{self.cap:g}", "alibi": "alibi_mod"}.get(self.score, self.score)

    def ids(self, T: int) -> np.ndarray:
        """int32 ``[1, T]`` document ids of a ``documents`` case (at most T // 2 documents)."""
        return doc_ids(T, min(self.docs, max(1, T // 2)))[None]


def speed_cases(window: int = 128, docs: int = 16, additive_at: tuple = ((64, 4096),)) -> tuple[Case, ...]:
    """The cases of issue 41's speed table, in the order they run: what cuDNN takes, then the masks
    and scores it does not (documents, a two-sided window, SoftCap, ALiBi), then additive scores."""
    w = window
    return (
        Case("full"),
        Case("causal", "causal", baseline="causal"),
        Case("causal_window", "window", (w, 0), baseline="causal_window"),
        Case("window", "window", (w, w), baseline="causal_window"),
        Case("documents", "documents", docs=docs),
        Case("softcap", score="softcap"),
        Case("alibi", score="alibi"),
        Case("additive", score="additive", only=tuple(additive_at)),
    )


def doc_ids(T: int, docs: int, seed: int = 0) -> np.ndarray:
    """int32 ``[T]``: ``docs`` documents of random lengths (at least 1 token each) covering one row."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, T), size=docs - 1, replace=False))
    return np.repeat(np.arange(docs, dtype=np.int32), np.diff(np.concatenate([[0], cuts, [T]])))


def alibi_slopes(N: int) -> np.ndarray:
    """float32 ``[N]``: ALiBi's slopes (``attnlab.positional.alibi_slopes``), for every contender alike."""
    from attnlab.positional import alibi_slopes as slopes  # noqa: PLC0415

    return slopes(N)


def additive_weights(N: int, H: int, seed: int = 0) -> np.ndarray:
    """float32 ``[N, H]``: the additive score's per-head ``w`` (normal, scaled by ``H ** -0.5``)."""
    return (np.random.default_rng(seed).normal(size=(N, H)) * H**-0.5).astype(np.float32)


def random_graph(T: int, degree: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """int32 senders, receivers: ``degree * T`` distinct random edges among T nodes, and every self loop."""
    flat = np.random.default_rng(seed).choice(T * T, size=degree * T, replace=False)
    senders = np.concatenate([flat // T, np.arange(T)]).astype(np.int32)
    receivers = np.concatenate([flat % T, np.arange(T)]).astype(np.int32)
    return senders, receivers
