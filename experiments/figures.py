"""The figure pieces the reports share: pyplot on the file-only backend, saving, and the common plots.

``pyplot()`` and ``save_figure`` (re-exported by ``experiments.common``) are how every report draws;
``lines`` is the plot most figures are (one line per series over a common x) and ``style`` an axis' scales,
labels and legend. Inside ``discarded()`` figures are closed unsaved: for a caller that keeps only a
report's text (``experiments.docs`` regenerates the docs' tables from reports run on a temporary copy).

Example:
    >>> plt = pyplot()
    >>> fig, ax = plt.subplots()
    >>> lines(ax, {"full": ([1024, 2048], [3.1, 0.8])}, xlog2=True, ylog=True, xlabel="N", ylabel="steps / s")
    >>> save_figure(fig, "/tmp/steps.png")
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["discarded", "lines", "pyplot", "save_figure", "style"]

_DISCARD = contextvars.ContextVar("attnlab_discard_figures", default=False)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (reports draw figures without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def discarded() -> Iterator[None]:
    """Within: ``save_figure`` closes each figure without laying it out or writing it (no file appears)."""
    token = _DISCARD.set(True)
    try:
        yield
    finally:
        _DISCARD.reset(token)


def save_figure(fig, path, *, dpi: int = 120) -> None:
    """Lays out, writes and closes a figure (only closes it inside ``discarded()``)."""
    import matplotlib.pyplot as plt

    if _DISCARD.get():
        plt.close(fig)
        return
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def style(
    ax,
    *,
    xlog2: bool = False,
    ylog: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    legend: float | None = None,
) -> None:
    """An axis' scales, labels, title and legend.

    Args:
        xlog2, ylog: a base-2 log x axis, a log y axis.
        xlabel, ylabel, title: the axis labels and title (None: left unset).
        legend: the legend's font size (None: no legend).
    """
    if xlog2:
        ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    if legend is not None:
        ax.legend(fontsize=legend)


def lines(ax, series: Mapping[str, tuple[Sequence, Sequence]], *, fmt: str = "o-", **axis) -> None:
    """One line per series on ``ax``: ``series`` maps a label to its (x values, y values), drawn in order
    with matplotlib's format ``fmt``; ``axis``: ``style``'s keywords."""
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), fmt, label=label)
    style(ax, **axis)
