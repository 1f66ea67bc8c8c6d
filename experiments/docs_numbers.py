"""The number tracer: every measurement quoted in README.md and docs/*.md is generated or traced to a file.

Commands::

    python -m experiments.docs_numbers          # each untraced or wrong number, exit 1 if any (in make docs-check)
    python -m experiments.docs_numbers --list   # every measurement number found, traced or not

**What counts as a number that reports a measurement.** In the prose of a page, that is outside fenced
code blocks, inline code spans (`` `...` ``: flags, config values, commands), link targets, HTML
comments and generated blocks (``<!-- begin generated: NAME -->`` ... ``<!-- end generated: NAME -->``,
checked by ``experiments/docs.py``), a number is a measurement when

- it carries a unit of a measured quantity: ``%``, ``x``/``×`` (a ratio, as in ``6.5x``), a time
  (``ms``, ``µs``, ``s``, ``min``, ``h``, ``seconds``, ``minutes``, ``hours``) or a size (``KiB``,
  ``MiB``, ``GiB``, ``KB``, ``MB``, ``GB``), or ``steps/s``; or
- it is a decimal fraction without such a unit (``0.85``, ``R^2 0.94``, ``1.6e-7``), which in prose is
  a loss, an error, an accuracy, a correlation or an average precision (``1e-3`` without a decimal
  point is a learning rate or a tolerance: a setting).

Ranges count as one number per end (``6.5-7.8x``: both 6.5 and 7.8). Integers without a unit (counts of
seeds, cells, layers, steps), versions (``0.10.2``, ``jax 0.11``, ``0.11.x``) and the numbers in a metric's name
(``AP@0.5``, ``acc@32``) are not measurements.

**How a number is traced.** Either it is written, as it is written on the page, in one of the same
page's generated blocks and has a decimal point or at least three digits (a prose number that repeats a
cell of the generated table beside it: ``make docs`` keeps the cell true, and a changed cell unmasks
the prose copy); or ``docs/numbers.toml`` lists ``[[number]]`` entries::

    [[number]]
    page = "docs/detr.md"                                 # the page
    text = "had reached 0.594 (10,000 steps, 16.0 min"    # an exact piece of it holding the number(s)
    file = "docs/results/detr/long_lr1e-3/items1-2/result.json"   # the committed file that backs them
    values = ["d['ap50']", "d['train_time_s_last_session'] / 60"] # one expression per measurement in `text`
    scale = 1      # optional: shown = value * scale (100 for %, 1/60 for minutes)
    tol = 0        # optional: allowed |shown - value * scale| beyond the rounding the page shows

With several files, ``files = { vit = "a.jsonl", pixel = "b.jsonl" }`` loads each under its name (the
rows of a JSONL file, the object of a JSON file, the text of any other) instead of one ``file``.

Each expression sees the file loaded as ``d`` (JSON), ``rows`` (a JSONL file: a list of dicts) or
``text`` (any other file), and helpers: ``mean``, ``sd`` (population), ``sd1`` (ddof = 1),
``pick(rows, **where)`` (the rows whose fields equal the given values), ``one(rows, **where)`` (the
single such row), ``after(text, marker, start='')`` (the first number after ``marker``, searched
from ``start``: for a page's generated block or a summary file), ``min``, ``max``, ``len``, ``sum``,
``abs``, ``round``, ``sorted``, ``int``, ``float``. The check evaluates it and fails unless the
number on the page equals the value rounded to the decimals the page shows (plus ``tol``).
A ``[[setting]]`` entry (``page``, ``text``, ``why``) declares that the
numbers in ``text`` are not measurements but settings or derived from settings (a window of ±32
frames is 1280 ms): they are excused with a written reason and no file.

To trace a new number: add an entry (same ``page``/``text``/``file``/``values``) and run
``python -m experiments.docs_numbers``; better, put the table between generated markers
(``experiments/docs.py``). ``tests/test_docs_numbers.py`` runs the check in the suite.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = Path("docs/numbers.toml")
PAGES = ("README.md", "docs/*.md")

_UNITS = (
    r"(?:%|x\b(?!\s?\d)|×(?!\s?\d)|ms\b|µs\b|s\b|min\b|h\b|seconds?\b|minutes?\b|hours?\b"
    r"|KiB\b|MiB\b|GiB\b|KB\b|MB\b|GB\b|steps/s\b)"
)
# a number: digits with optional thousands commas and decimals, not part of a word or a version number
_NUM = r"(?<![\w.])(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?!(?!x\b)\w|\.\d)"
# a range's first end takes the unit of its second: 6.5-7.8x, 0.85-0.95
_RANGE = re.compile(_NUM + r"(?=\s*(?:-|–|to)\s*\d[\d,.]*\s?" + _UNITS + ")")
_WITH_UNIT = re.compile(_NUM + r"(?=\s?" + _UNITS + ")")
_SCIENTIFIC = re.compile(r"(?<![\w.])(?P<num>\d+\.\d+e[-+]?\d+)\b")
_DECIMAL = re.compile(r"(?<![\w.])(?P<num>\d+\.\d+)(?!(?!x\b)\w|\.\d)")

_MASKED = [
    re.compile(r"<!-- begin generated: (?P<name>[\w.-]+) -->.*?<!-- end generated: (?P=name) -->", re.DOTALL),
    re.compile(r"^(?P<fence>```|~~~).*?^(?P=fence)", re.DOTALL | re.MULTILINE),  # fenced code
    re.compile(r"<!--.*?-->", re.DOTALL),  # comments
    re.compile(r"`[^`\n]+`"),  # inline code
    re.compile(r"\]\([^)\s]*\)"),  # link targets
    re.compile(r"!\[[^\]]*\]"),  # image alt text
    re.compile(r"\b(?:arXiv:?\s?)?\d{4}\.\d{4,5}\b"),  # arXiv identifiers
    re.compile(r"@\d+(?:\.\d+)?"),  # a metric's name: AP@0.5, acc@32
    re.compile(r"\b(?:jax|jaxlib|torch|Python|python)\s+\d+(?:\.\d+)+(?:\.x)?|\b\d+\.\d+\.x\b"),  # versions
    re.compile(r"\d+\s?[x×]\s?\d+(?:\s?[x×]\s?\d+)*"),  # shapes: 28 x 28, 4×4×3
]


@dataclass(frozen=True)
class Number:
    page: str
    start: int
    end: int
    text: str
    line: int

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def prose(text: str) -> str:
    """`text` with everything that is not prose blanked out (same length, newlines kept)."""
    out = list(text)
    for pattern in _MASKED:
        for m in pattern.finditer("".join(out)):
            for i in range(m.start(), m.end()):
                if out[i] != "\n":
                    out[i] = " "
    return "".join(out)


def measurements(text: str, page: str = "") -> list[Number]:
    """Every number in the prose of `text` that reports a measurement (the rule in this module's docstring)."""
    visible = prose(text)
    spans = {}
    for pattern in (_SCIENTIFIC, _WITH_UNIT, _RANGE, _DECIMAL):
        for m in pattern.finditer(visible):
            spans.setdefault(m.start("num"), m.end("num"))
    return [Number(page, s, e, text[s:e], text.count("\n", 0, s) + 1) for s, e in sorted(spans.items())]


def table_numbers(text: str) -> set[str]:
    """The numbers written inside the generated blocks of a page, as they are written there."""
    return {
        m[0]
        for block in _MASKED[0].finditer(text)
        for m in re.finditer(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])\d+(?:\.\d+)?", block[0])
    }


def to_float(s: str) -> float:
    return float(s.replace(",", ""))


def after(text: str, marker: str, start: str = "") -> float:
    """The first number after `marker` (itself after `start`) in `text`: a summary.md, a generated block."""
    i = text.index(marker, text.index(start)) + len(marker)
    return to_float(re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", text[i:])[0])


def pick(rows: list[dict], **where) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def one(rows: list[dict], **where) -> dict:
    """The one row whose fields equal `where` (an error if none or several)."""
    found = pick(rows, **where)
    if len(found) != 1:
        raise ValueError(f"{len(found)} rows match {where}")
    return found[0]


def _load(path: Path) -> dict:
    if path.suffix == ".jsonl":
        return {"rows": [json.loads(line) for line in path.read_text().splitlines() if line.strip()]}
    if path.suffix == ".json":
        return {"d": json.loads(path.read_text())}
    return {"text": path.read_text()}


_ENV = {
    "mean": statistics.fmean,
    "sd": statistics.pstdev,
    "sd1": statistics.stdev,
    "pick": pick,
    "one": one,
    "after": after,
    "min": min,
    "max": max,
    "len": len,
    "sum": sum,
    "abs": abs,
    "round": round,
    "sorted": sorted,
    "int": int,
    "float": float,
}


def load_manifest(root: Path = ROOT) -> dict:
    return tomllib.loads((root / MANIFEST).read_text())


def _occurrences(text: str, piece: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(piece), text)]


def _shown(value: float, decimals: int, exponent: str) -> str:
    """`value` with two more digits than the page shows."""
    return f"{value:.{decimals + 2}e}" if exponent else f"{value:.{decimals + 2}f}"


def check_entry(entry: dict, text: str, root: Path) -> list[str]:
    """What is wrong with one [[number]] entry: missing text, a wrong count of numbers, a wrong value."""
    where = f"{entry['page']}: {entry['text']!r}"
    if not _occurrences(text, entry["text"]):
        return [f"{where}: this text is not on the page"]
    shown = [n.text for n in measurements(entry["text"])]
    values = entry["values"]
    if len(shown) != len(values):
        return [f"{where}: {len(shown)} measurement(s) {shown} but {len(values)} value(s) in the manifest"]
    files = {"": entry["file"]} if "file" in entry else {}
    files |= entry.get("files", {})
    env = dict(_ENV)
    for name, rel in files.items():
        path = root / rel
        if not path.exists():
            return [f"{where}: {rel} does not exist"]
        loaded = _load(path)
        env |= loaded if not name else {name: next(iter(loaded.values()))}
    scale, tol = float(entry.get("scale", 1)), float(entry.get("tol", 0))
    errors = []
    for s, expr in zip(shown, values, strict=True):
        try:
            value = float(eval(expr, {"__builtins__": {}, **env})) * scale  # noqa: S307 (the repository's own manifest)
        except Exception as e:  # a wrong field or file shape: reported with the entry, the other entries still run
            errors.append(f"{where}: {expr} fails: {type(e).__name__}: {e}")
            continue
        mantissa, _, exponent = s.partition("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        half_unit = 0.5 * 10.0 ** (int(exponent or 0) - decimals)  # half the last digit shown
        if abs(to_float(s) - value) > half_unit * (1 + 1e-9) + tol:
            got = _shown(value, decimals, exponent)
            errors.append(f"{where}: the page says {s}, {', '.join(files.values())} gives {got} ({expr})")
    return errors


def check(root: Path = ROOT) -> list[str]:
    """Every problem: measurements no entry covers, entries whose text is gone, values that differ."""
    manifest = load_manifest(root)
    numbers, settings = manifest.get("number", []), manifest.get("setting", [])
    errors = []
    for entry in settings:
        if not entry.get("why"):
            errors.append(f"{entry['page']}: {entry['text']!r}: a [[setting]] needs a `why`")
    pages = sorted({p for pattern in PAGES for p in root.glob(pattern)})
    for path in pages:
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        covered: set[int] = set()
        for entry in [*numbers, *settings]:
            if entry["page"] != rel:
                continue
            starts = _occurrences(text, entry["text"])
            if entry in numbers:
                errors += check_entry(entry, text, root)
            elif not starts:
                errors.append(f"{rel}: {entry['text']!r}: this text is not on the page")
            for s in starts:
                covered.update(range(s, s + len(entry["text"])))
        shown = table_numbers(text)
        for n in measurements(text, rel):
            if n.start not in covered and not (n.text in shown and re.search(r"\.|\d{3}", n.text)):
                errors.append(f"{n}: not traced (generate it, add it to {MANIFEST}, or remove it)")
    known = {p.relative_to(root).as_posix() for p in pages}
    errors += [f"{e['page']}: no such page" for e in [*numbers, *settings] if e["page"] not in known]
    return errors


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for path in sorted({p for pattern in PAGES for p in ROOT.glob(pattern)}):
            rel = path.relative_to(ROOT).as_posix()
            for n in measurements(path.read_text(), rel):
                print(n)
        return 0
    errors = check()
    print("\n".join(errors) or f"every measurement in the docs is generated or traced ({MANIFEST})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
