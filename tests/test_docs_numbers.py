"""The number tracer (experiments/docs_numbers.py): every measurement in README.md and docs/*.md is
generated or traced to a committed file by docs/numbers.toml, and the traced value equals the file's."""

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from experiments import docs_numbers

ROOT = Path(__file__).resolve().parent.parent


def _copy(tmp_path: Path) -> Path:
    """The pages, the manifest and every committed results file, in a scratch root."""
    for rel in ("README.md", "docs", "benchmarks/results"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return tmp_path


def test_every_measurement_in_the_docs_is_generated_or_traced():
    errors = docs_numbers.check(ROOT)
    assert errors == [], "\n".join(errors)


def test_the_rule_on_examples():
    text = (
        "It took 12.5 min and 3 s, 4.07 GiB, 6.5-7.8x faster, R² 0.94, error 1.6e-7 and 95% of tokens.\n"
        "Settings and names are not measurements: `lr 0.001`, jax 0.10.2, 0.11.x, AP@0.5, acc@32, 28 x 28,\n"
        "arXiv 2010.11929, 8 heads, 1e-3, [a link](docs/x-1.5.md).\n"
        "```\nms = 3.14  # code\n```\n"
        "<!-- begin generated: t -->\n| 9.99 ms |\n<!-- end generated: t -->\n"
    )
    found = [n.text for n in docs_numbers.measurements(text)]
    assert found == ["12.5", "3", "4.07", "6.5", "7.8", "0.94", "1.6e-7", "95"]


def test_a_number_nothing_backs_fails(tmp_path):
    root = _copy(tmp_path)
    page = root / "docs/sweep.md"
    page.write_text(page.read_text() + "\nAn earlier run took 14 min 55 s.\n")
    errors = docs_numbers.check(root)
    assert errors == [
        f"docs/sweep.md:{page.read_text().count(chr(10))}: 14: not traced (generate it, add it to docs/numbers.toml, "
        "or remove it)",
        f"docs/sweep.md:{page.read_text().count(chr(10))}: 55: not traced (generate it, add it to docs/numbers.toml, "
        "or remove it)",
    ]


def test_a_prose_number_that_differs_from_its_file_fails(tmp_path):
    """The karate runs' time, 153 s in karate.json: the page saying 172 s is caught, naming both."""
    root = _copy(tmp_path)
    assert json.loads((root / "docs/results/molecules/karate.json").read_text())["time_s"] == 153.0
    page = root / "docs/molecules.md"
    page.write_text(page.read_text().replace("took 153 s\n", "took 172 s\n"))
    manifest = root / "docs/numbers.toml"
    manifest.write_text(manifest.read_text().replace("took 153 s\\n", "took 172 s\\n"))
    errors = docs_numbers.check(root)
    assert len(errors) == 1
    assert "the page says 172, docs/results/molecules/karate.json gives 153.00 (d['time_s'])" in errors[0]


def test_a_changed_results_file_unmasks_the_prose(tmp_path):
    root = _copy(tmp_path)
    run = root / "docs/results/speech/run.json"
    data = json.loads(run.read_text())
    data["wall_s"] = 2400  # 40.0 min, where README.md and docs/speech.md say 34.6
    run.write_text(json.dumps(data))
    errors = docs_numbers.check(root)
    assert any(e.startswith("README.md: '34.6 min of wall time': the page says 34.6") for e in errors)
    assert any(e.startswith("docs/speech.md:") and "34.6" in e for e in errors)


def test_a_manifest_entry_whose_text_left_the_page_fails(tmp_path):
    root = _copy(tmp_path)
    page = root / "docs/kernels.md"
    page.write_text(page.read_text().replace("from 4 to 64 documents the work falls 18x", "the work falls"))
    errors = docs_numbers.check(root)
    assert (
        "docs/kernels.md: 'from 4 to 64 documents the work falls 18x and the time 4x': this text is not on the page"
        in errors
    )


def test_a_number_copied_from_the_generated_table_beside_it_is_traced(tmp_path):
    """A prose copy of a cell of the page's generated table needs no entry, and is caught once the cell changes."""
    root = _copy(tmp_path)
    page = root / "docs/molecules.md"
    page.write_text(page.read_text() + "\nThe GIN reaches 76.0% (a copy of its table cell).\n")
    assert docs_numbers.check(root) == []
    page.write_text(page.read_text().replace("| 76.0 ± 0.7 |", "| 75.0 ± 0.7 |"))
    assert any("76.0: not traced" in e for e in docs_numbers.check(root))


def test_every_entry_is_well_formed_and_names_a_committed_file():
    manifest = tomllib.loads((ROOT / "docs/numbers.toml").read_text())
    assert len(manifest["number"]) >= 50
    for entry in manifest["number"]:
        assert {"page", "text", "values"} <= set(entry), entry
        files = [entry["file"]] if "file" in entry else list(entry["files"].values())
        for rel in files:
            assert (ROOT / rel).is_file(), rel
            tracked = subprocess.run(["git", "ls-files", "--error-unmatch", rel], cwd=ROOT, capture_output=True)
            assert tracked.returncode == 0, f"{rel} is not committed"
    for entry in manifest["setting"]:
        assert entry["why"].strip(), entry


def test_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "experiments.docs_numbers"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every measurement in the docs is generated or traced" in out.stdout


FOLDERS = ["claims", "posenc", "detr", "detr-pilots", "speech", "speech-budget", "sweep", "lra", "inspect", "lm"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_results_folders_say_what_made_them(folder):
    """Each of these committed results folders has a run.json naming its command (or why it is unknown)."""
    run = json.loads((ROOT / "docs/results" / folder / "run.json").read_text())
    assert "command" in run or "commands" in run
    assert run.get("command") or run.get("commands") or "not recorded" in run.get("source", "")
