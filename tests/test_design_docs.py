"""docs/design.md and docs/seams.md against the code: every name and file they cite exists, and the
tables that say what a seam asks and who answers it say what the classes do."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from attnlab import impls, positional

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/design.md", "docs/seams.md")
# short module names the pages use in backticks (`masks.from_spec`, `tile_core.logits`) -> their module
SHORT = {
    "masks": "attnlab.masks",
    "scores": "attnlab.scores",
    "positional": "attnlab.positional",
    "nn": "attnlab.nn",
    "heads": "attnlab.heads",
    "kernels": "attnlab.kernels",
    "dispatch": "attnlab.dispatch",
    "efficient": "attnlab.efficient",
    "tuning": "attnlab.tuning",
    "platform": "attnlab.platform",
    "tile_core": "attnlab.kernels.tile_core",
    "inspect": "attnlab.inspect",
    "common": "experiments.common",
    "experiments": "experiments",
    # what the pages call an instance: `mask.for_tiles()`, `score.tile_form()`, `call.tile_mask`
    "mask": "attnlab.masks.Mask",
    "score": "attnlab.scores.Score",
    "call": "attnlab.call.Call",
}
SOURCE_DIRS = ("attnlab", "experiments", "benchmarks", "tests")


def _text(page):
    return (ROOT / page).read_text(encoding="utf-8")


def _code_spans(text):
    return re.findall(r"`([^`\n]+)`", text)


def _resolve(dotted):
    """Imports the longest module prefix of ``a.b.c`` and reads the rest as attributes; raises if any is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            fields = (
                {f.name for f in dataclasses.fields(obj)}
                if inspect.isclass(obj) and dataclasses.is_dataclass(obj)
                else ()
            )
            obj = getattr(obj, attr) if attr not in fields else None
        return obj
    raise ModuleNotFoundError(dotted)


def _dotted_names(text):
    """Every ``attnlab.x.y`` in the page, and every backticked ``mod.name`` whose ``mod`` is a module of ``SHORT``."""
    names = set(re.findall(r"\battnlab(?:\.[A-Za-z_]\w*)+", text))
    for span in _code_spans(text):
        for m in re.finditer(r"(?<![\w.])([a-z_]+)((?:\.[A-Za-z_]\w*)+)", span):
            if m.group(1) in SHORT:
                names.add(SHORT[m.group(1)] + m.group(2))
    return sorted(n for n in names if not n.endswith(".py"))  # a file (attnlab/x.py) is checked as a file


def _cited_files(text):
    """Every ``path/file.py`` in the page, with the name it cites in it: ``file.py:function`` or
    ```file.py`'s `NAME``` (else ""); templates with ``<name>`` are skipped."""
    found = set(re.findall(r"(?<![\w<>/.-])((?:[\w-]+/)*[\w-]+\.py)(?::(\w+))?", text))
    found |= set(re.findall(r"`((?:[\w-]+/)*[\w-]+\.py)`'s\s+`(\w+)`", text))
    return sorted(found)


def _find(path):
    """The files a citation can mean: as written from the repository root, under attnlab/, or (a bare file
    name, as in the tree's lists) anywhere in the source folders."""
    for candidate in (ROOT / path, ROOT / "attnlab" / path):
        if candidate.is_file():
            return [candidate]
    if "/" in path:
        return []
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob(path)]


@pytest.mark.parametrize("page", PAGES)
def test_every_dotted_name_imports(page):
    names = _dotted_names(_text(page))
    assert len(names) > 10, names  # the collector finds them
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    assert not missing, f"{page} cites names the code does not have: {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_file_exists(page):
    cited = _cited_files(_text(page))
    assert len(cited) > 3, cited
    missing = []
    for path, function in cited:
        found = _find(path)
        if not found:
            missing.append(path)
        elif function and not any(
            re.search(rf"^(def|class) {function}\b|^{function}\b.*=", p.read_text(), re.M) for p in found
        ):
            missing.append(f"{path}:{function}")
    assert not missing, f"{page} cites files or functions that do not exist: {missing}"


def test_the_collectors_catch_a_drifted_name(tmp_path):
    text = "`attnlab.masks.no_such_mask`, `scores.NoSuchScore`, `attnlab/no_such.py`, `experiments/sweep.py:nope`"
    assert "attnlab.masks.no_such_mask" in _dotted_names(text)
    assert "attnlab.scores.NoSuchScore" in _dotted_names(text)
    with pytest.raises(AttributeError):
        _resolve("attnlab.masks.no_such_mask")
    assert _find("attnlab/no_such.py") == []
    assert ("experiments/sweep.py", "nope") in _cited_files(text)
    assert ("tests/conformance.py", "CASES") in _cited_files("`tests/conformance.py`'s `CASES`")
    assert _dotted_names("`scores_lib.x`, `w.score`") == []  # not modules of SHORT
    assert _dotted_names("`score.tile_form()`") == ["attnlab.scores.Score.tile_form"]  # an instance: its class
    with pytest.raises(AttributeError):
        _resolve("attnlab.call.Call.no_such_field")


def test_the_tree_names_every_module():
    """The repository map in design.md names every module of attnlab and experiments (or its pattern)."""
    text = _text("docs/design.md")
    tree = text[text.index("## The repository") : text.index("## From an experiment flag")]
    unnamed = []
    for folder in ("attnlab", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or "/configs/" in rel or path.name.endswith("_report.py"):
                continue  # a package, the configs folder, the <name>_report.py pattern
            if path.name not in tree:
                unnamed.append(rel)
    assert not unnamed, f"docs/design.md's repository map does not name {unnamed}"


def _encoding_table():
    """seams.md's table of Encoding methods: {method: [classes named as answering it]}."""
    rows = {}
    for line in _text("docs/seams.md").splitlines():
        m = re.match(r"\| `(\w+)\(([^`]*)\)` \|.*\| (.*) \|$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`(\w+)`", m.group(3))
    return rows


def test_seams_encoding_table_is_what_the_schemes_do():
    rows = _encoding_table()
    assert set(rows) == {"init", "inputs", "rotary", "bias"}
    for method, named in rows.items():
        assert callable(getattr(positional.Encoding, method))
        overriding = sorted(n for n, cls in vars(positional).items() if _overrides(cls, method))
        assert sorted(c for c in named if c in vars(positional)) == overriding, method


def _overrides(cls, method):
    return (
        inspect.isclass(cls)
        and issubclass(cls, positional.Encoding)
        and cls is not positional.Encoding
        and cls.__name__ in positional.__all__
        and method in vars(cls)
    )


def test_seams_mask_modules_hold_what_the_table_says():
    """Each row of seams.md's masks table names what that module defines, and every public name it defines."""
    import attnlab.masks as masks

    text = _text("docs/seams.md")
    rows = re.findall(r"^\| `masks/(\w+)\.py` \| (.*) \|$", text, re.M)
    modules = {p.stem for p in (ROOT / "attnlab" / "masks").glob("*.py") if p.stem != "__init__"}
    assert {r[0] for r in rows} == modules  # a row for every module of the package
    for module, cell in rows:
        mod = importlib.import_module(f"attnlab.masks.{module}")
        named = set(re.findall(r"`(\w+)(?:\(\))?`", cell)) - {"__call__", "block_layout"}
        absent = sorted(n for n in named if not hasattr(mod, n))
        assert not absent, f"seams.md: masks/{module}.py has no {absent}"
        defined = {
            n
            for n in masks.__all__
            if getattr(getattr(masks, n), "__module__", None) == mod.__name__
            and (inspect.isclass(getattr(masks, n)) or inspect.isfunction(getattr(masks, n)))
        }
        unlisted = sorted(defined - named)
        assert not unlisted, f"seams.md: the row of masks/{module}.py does not name {unlisted}"


def test_every_implementation_has_the_protocol_design_md_names():
    text = _text("docs/design.md")
    para = text[text.index("**A kernel.**") :]
    protocol = para[para.index("with the whole protocol:") : para.index("when it has parameters")]
    members, tunable = protocol.split("and `tunable`")
    members = re.findall(r"`(\w+)(?:\([^`]*\))?`", members)
    tunable = re.findall(r"`(\w+)`", tunable)
    assert {"name", "features", "supports", "pays_off", "run"} <= set(members), members
    assert tunable == ["space", "run", "to_json", "from_json"], tunable
    for impl in impls.ALL:
        missing = [m for m in members if not hasattr(impl, m)]
        assert not missing, f"{impl.name} lacks {missing}"
        if getattr(impl, "tunable", None) is not None:
            assert all(callable(getattr(impl.tunable, m, None)) for m in tunable), impl.name


def test_seams_lists_the_keywords_the_encoder_refuses():
    from attnlab.nn import layers

    text = " ".join(_text("docs/seams.md").split())
    sentence = text[text.index("The Encoder takes no keyword for a hyperparameter") :]
    sentence = sentence[: sentence.index("raise a `ValueError`")]
    assert set(re.findall(r"`(\w+)=`", sentence)) == set(layers._NOT_KEYWORDS)
