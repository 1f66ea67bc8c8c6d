"""The Makefile against the docs: every `make X` the docs name exists, `make help` lists every target,
and INSTALL=0 runs no package manager (a machine with no registry)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")

# where targets are named for a reader
DOC_FILES = ["README.md", "CHANGELOG.md", "pyproject.toml", "docs/*.md", "experiments/**/*.py", "benchmarks/*.py"]


def _targets() -> dict[str, str]:
    """Explicit targets of the Makefile -> their `## ` help line ('' when none); no file or pattern rules."""
    targets = {}
    text = re.sub(r"^define .*?^endef$", "", (ROOT / "Makefile").read_text(), flags=re.MULTILINE | re.DOTALL)
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_-]*)\s*:(?!=)([^#]*)(?:## (.*))?$", line)
        if m and m[1] not in (".PHONY", ".DEFAULT_GOAL"):
            targets[m[1]] = targets.get(m[1]) or (m[3] or "")
    return targets


def _named_in_docs() -> dict[str, list[str]]:
    """`make X` as written in the docs (in backticks, or a line of a code block) -> the files naming it."""
    named: dict[str, list[str]] = {}
    for pattern in DOC_FILES:
        for path in ROOT.glob(pattern):
            if ".venv" in path.parts:
                continue
            text = path.read_text()
            found = re.findall(r"`make ([a-z][a-z0-9_-]*)", text)
            found += re.findall(r"^\s*make ([a-z][a-z0-9_-]*)", text, re.MULTILINE) if path.suffix == ".md" else []
            for target in found:
                named.setdefault(target, []).append(str(path.relative_to(ROOT)))
    return named


def _make(*args, cwd=ROOT, stdin=None) -> str:
    env = dict(os.environ, MAKEFLAGS="", INSTALL="")
    env.pop("INSTALL")
    out = subprocess.run(
        [MAKE, "--no-print-directory", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _variable(name: str, *args, cwd=ROOT) -> str:
    """The value of a Makefile variable (multi-line ones too), as make would export it."""
    rule = f"print-var:\n\t@printf '%s\\n' \"$${name}\"\n"
    return _make("-s", "-f", str(ROOT / "Makefile"), "-f", "-", "print-var", *args, cwd=cwd, stdin=rule)


def test_parser_sees_the_targets():
    targets = _targets()
    # targets named by hand (README "The two commands") and a file rule that must not be a target
    assert {"test", "sweep", "help", "install", "data", "bench"} <= set(targets)
    assert not any(t.startswith("$") for t in targets)


def test_every_make_target_named_in_the_docs_exists():
    targets = _targets()
    named = _named_in_docs()
    assert "sweep" in named and "test" in named  # the parser does find the README's commands
    missing = {t: files for t, files in named.items() if t not in targets}
    assert not missing, f"`make X` named in the docs but not in the Makefile: {missing}"


def test_one_data_rule():
    rules = [line for line in (ROOT / "Makefile").read_text().splitlines() if re.match(r"^data\s*:(?!=)", line)]
    assert len(rules) == 1, rules


def test_every_target_has_a_help_line_and_make_help_lists_it():
    targets = _targets()
    undocumented = [t for t, doc in targets.items() if not doc]
    assert not undocumented, f"targets without a `## ` line: {undocumented}"
    listed = dict(re.findall(r"^  make (\S+)\s+(.*)$", _make("help"), re.MULTILINE))
    assert listed == targets


def test_help_is_the_default_goal():
    assert _make() == _make("help")


def _commands(dry_run: str) -> list[str]:
    """The shell commands of a `make -n` listing that run a package manager (quoted text, as in the
    messages that say what to run, excluded)."""
    joined = dry_run.replace("\\\n", " ")
    runs = []
    for command in joined.splitlines():
        bare = re.sub(r"\"[^\"]*\"|'[^']*'", "", command)
        if re.search(r"pip install|-m pip|npm install|apt-get install", bare):
            runs.append(command)
    return runs


def test_commands_finds_package_managers_outside_quotes():
    dry = 'echo "run npm install x"\nif [ -e f ]; then :; \\\nelse apt-get install -y p; fi\npython -m pip install -e .'
    assert _commands(dry) == ["if [ -e f ]; then :;  else apt-get install -y p; fi", "python -m pip install -e ."]


_PRINT_PY = "print-py:\n\t@echo $(PY)\n"


@pytest.mark.parametrize("target", ["test", "sweep", "bench", "molecules", "pos", "images", "install", "data"])
def test_install_0_runs_no_package_manager(target, tmp_path):
    # a copy without .venv, as on a fresh clone of a machine whose packages are already installed
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    dry = _make("-n", target, "INSTALL=0", cwd=tmp_path)
    runs = _commands(dry)
    assert not runs, runs
    python = _make("-s", "-f", "Makefile", "-f", "-", "print-py", "INSTALL=0", cwd=tmp_path, stdin=_PRINT_PY)
    assert python.strip() not in ("", ".venv/bin/python")  # no .venv there: the system's python3


def test_default_installs_on_a_fresh_machine(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    dry = _make("-n", "test", cwd=tmp_path)
    assert "-m venv .venv" in dry
    assert re.search(r'pip install .*-e "\.\[dev,experiments,zh,speech\]"', dry)
    assert re.search(r'pip install .*-e "\.\[molecules\]"', dry)
    assert re.search(r'pip install .*-e "\.\[docs\]"', dry)  # the docs site's builder, for its test
    assert "npm install --prefix data" in dry
    assert "pytest -q" in dry


def _have(tmp_path, *extras) -> subprocess.CompletedProcess:
    """Runs the Makefile's HAVE_PY check (are pyproject's packages installed?) with this interpreter."""
    script = _variable("HAVE_PY", cwd=tmp_path)
    return subprocess.run([sys.executable, "-c", script, *extras], cwd=tmp_path, capture_output=True, text=True)


def test_have_check_accepts_what_is_installed_and_rejects_what_is_not(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _have(tmp_path, "dev", "experiments").returncode == 0  # what this test session runs on
    text = (ROOT / "pyproject.toml").read_text()
    too_new = text.replace('"numpy>=', '"attnlab-no-such-package>=1", "numpy>=99.0,>=')
    (tmp_path / "pyproject.toml").write_text(too_new)
    out = _have(tmp_path, "dev")
    assert out.returncode == 1
    assert "attnlab-no-such-package>=1" in out.stdout and "numpy>=99.0" in out.stdout


def test_default_skips_pip_when_everything_is_installed(tmp_path):
    """INSTALL=auto with a stale stamp and every package present: the stamp is renewed, pip not run."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    if _have(tmp_path, "dev", "experiments", "zh").returncode != 0:
        pytest.skip("this interpreter lacks some extra: make would (rightly) run pip")
    (tmp_path / ".venv").mkdir()
    out = _make(".venv/.installed-stamp", f"PY={sys.executable}", "PIP=false", cwd=tmp_path)
    assert "already has every package" in out
    assert (tmp_path / ".venv/.installed-stamp").exists()
