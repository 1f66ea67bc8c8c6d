"""Small modules: every module under experiments/ and attnlab/inspect/ holds at most 400 lines, and no
function there is longer than 80 (an experiment keeps its task; reports, tables and figures go through
the shared pieces; issue 43). A module that grows past them is split where its ideas part."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("experiments", "attnlab/inspect")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, start, node.end_lineno - start + 1


def test_the_folders_hold_modules():
    names = {str(p.relative_to(ROOT)) for p in _modules()}
    assert {"experiments/common.py", "experiments/docs.py", "attnlab/inspect/probe.py"} <= names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_lengths(path):
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_MODULE_LINES})"
    functions = _functions(ast.parse(text))
    long = [f"{name} (line {start}): {n} lines" for name, start, n in functions if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_check_counts_as_described(tmp_path):
    # a decorated 81-line function is over the limit; its decorator line counts
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    tree = ast.parse(f"@staticmethod\ndef f():\n{body}\n")
    assert list(_functions(tree)) == [("f", 1, 81)]
