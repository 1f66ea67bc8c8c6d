"""The one markdown table writer, and the cell formats the reports and the docs' tables share.

Every markdown table in the repository (an experiment's ``summary.md``, a generated table of the
docs, a benchmark's printout) is written by ``markdown_table``; the cells come from the small
formatters beside it, so a number is written the same way wherever it appears.

Example:
    >>> print(markdown_table(["mask", "ms"], [["full", ms(1239.4)], ["causal", ms(64.21)]]))
    | mask | ms |
    |---|---|
    | full | 1239 |
    | causal | 64.2 |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["markdown_table", "mean_std", "ms", "size_label", "span"]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table: ``| a | b |``, ``|---|---|``, then one line per row; no trailing newline.

    Cells are written with ``str``; ``None`` is an empty cell. A row may be shorter than the header
    (its line then has fewer cells), never longer.

    Raises:
        ValueError: a row with more cells than the header.
    """
    header = [str(h) for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ["" if c is None else str(c) for c in row]
        if len(cells) > len(header):
            raise ValueError(f"markdown_table: a row has {len(cells)} cells, the header {len(header)}: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_std(stat: Sequence[float], *, scale: float = 1.0, digits: int = 1, sep: str = " ± ") -> str:
    """``(mean, std, n)`` (``experiments.common.summarize``'s values) -> ``"97.1 ± 0.4"``: times
    ``scale``, ``digits`` decimals.

    Example:
        >>> mean_std((0.9712, 0.0041, 3), scale=100)
        '97.1 ± 0.4'
    """
    return f"{scale * stat[0]:.{digits}f}{sep}{scale * stat[1]:.{digits}f}"


def ms(x: float) -> str:
    """A time in three significant figures, as the docs' tables write them: ``633``, ``71.6``, ``9.42``."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def size_label(n: int) -> str:
    """A sequence length as the tables write it: ``4096 -> "4K"``, ``3000 -> "3000"``."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def span(values: Iterable[float], fmt: Callable[[float], str] = ms, *, sep: str = "-") -> str:
    """Several runs' values of one cell: ``fmt(v)`` when they all read the same, else ``"lo-hi"``
    (the smallest and the largest, each through ``fmt``).

    Example:
        >>> span([838.2, 755.0, 803.1]), span([64.21]), span([23.71, 23.69])
        ('755-838', '64.2', '23.7')
    """
    values = sorted(values)
    if not values:
        raise ValueError("span: values must hold at least one number")
    lo, hi = fmt(values[0]), fmt(values[-1])
    return lo if lo == hi else f"{lo}{sep}{hi}"
