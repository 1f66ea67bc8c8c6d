"""The docs' results tables against the committed results they are generated from (experiments/docs.py)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import docs

ROOT = Path(__file__).resolve().parent.parent
# pages other branches add; linked from the README's map before they land
PENDING_PAGES: set[str] = set()  # pages linked before they exist (none now)


def _block(page: str, name: str) -> str:
    text = (ROOT / page).read_text()
    m = re.search(rf"<!-- begin generated: {name} -->\n(.*?)<!-- end generated: {name} -->", text, re.DOTALL)
    assert m, f"{page} has no generated block {name}"
    return m[1]


def _rows(table: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def test_every_generated_table_and_file_matches_its_results():
    """``python -m experiments.docs --check`` (what ``make docs-check`` and a reader run): every table and file
    equals its regeneration from the committed results (``docs.stale``); on failure it lists what differs."""
    out = subprocess.run(
        [sys.executable, "-m", "experiments.docs", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, "run `make docs` (python -m experiments.docs --write)\n" + out.stdout + out.stderr
    assert re.fullmatch(r"\d+ generated tables and \d+ files up to date\n", out.stdout), out.stdout


def test_every_table_is_on_a_page_and_every_block_is_known():
    used = {name for page in docs.pages(ROOT) for name in docs.blocks(page.read_text())}
    assert used == set(docs.TABLES)
    for page in docs.pages(ROOT):  # no block is empty: each was filled from its results
        for m in docs.MARKERS.finditer(page.read_text()):
            assert m["body"].strip(), f"{page}: {m['name']} is empty"


def test_sweep_table_against_the_jsonl():
    """Each cell of the README's sweep table is the min_ms of its JSONL line, to 3 significant figures; with
    several committed runs (docs/results/sweep/run<k>/), the smallest and largest over them ("755-838")."""
    from experiments import sweep_report

    cell: dict[tuple, list[dict]] = {}
    for folder in sweep_report.run_folders(ROOT / "docs/results/sweep"):
        for line in (folder / "results.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["seq_len"] == 2048 and r["num_heads"] == 8 and r["dtype"] == "float32":
                cell.setdefault((r["mask"], r["mode"], r["implementation"]), []).append(r)
    header, rows = _rows(_block("README.md", "sweep-n2048"))
    assert header[:2] == ["mask", "mode"]
    assert len(rows) * (len(header) - 2) == len(cell)  # every cell of N = 2048, 8 heads, shown once
    for row in rows:
        for impl, shown in zip(header[2:], row[2:], strict=True):
            rs = cell[(row[0], row[1], impl)]
            times = [r["min_ms"] for r in rs if r["status"] == "ok"]
            if not times:
                assert shown == "/".join(dict.fromkeys(r["status"] for r in rs))
                continue
            lo, _, hi = shown.partition("-")
            assert float(lo) == pytest.approx(min(times), rel=5e-3, abs=5e-3)
            assert float(hi or lo) == pytest.approx(max(times), rel=5e-3, abs=5e-3)
    assert _block("README.md", "sweep-n2048") == _block("docs/sweep.md", "sweep-n2048")
    assert _block("README.md", "sweep-reading") == _block("docs/sweep.md", "sweep-reading")


def test_sweep_run_line_counts_the_cells():
    records = (ROOT / "docs/results/sweep/results.jsonl").read_text().splitlines()
    line = _block("docs/sweep.md", "sweep-run")
    assert f"{len(records)} cells" in line
    run = json.loads((ROOT / "docs/results/sweep/run.json").read_text())
    minutes, seconds = divmod(round(run["wall_s"]), 60)
    assert f"{minutes} min {seconds:02d} s" in line


@pytest.mark.parametrize("name", ["bench-full", "bench-full-bwd", "bench-window", "bench-window-bwd"])
def test_bench_ratios_are_peer_time_over_attnlab_time(name):
    """The ratio columns against the ms columns of the same table (3-figure rounding allowed)."""
    header, rows = _rows(_block("docs/kernels.md", name))
    ms = {h.split(" ms")[0]: i for i, h in enumerate(header) if " ms" in h}
    checked = 0
    for i, h in enumerate(header):
        m = re.fullmatch(r"(attnlab \(.*\)) vs (.*)", h)
        if not m:
            continue
        ours, peer = m[1], m[2]
        for row in rows:
            if not row[i]:
                continue
            t_ours = float(row[ms[ours]].split()[0])
            t_peer = float(row[ms[peer]])
            assert float(row[i].rstrip("x")) == pytest.approx(t_peer / t_ours, rel=0.02)
            checked += 1
    assert checked >= 4


def test_ring_memory_ratio():
    header, rows = _rows(_block("docs/parallel.md", "ring-memory"))
    assert len(rows) == 6
    for row in rows:
        ring, one, ratio = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert ratio == pytest.approx(one / ring, abs=0.06)


def test_karate_table_against_the_json():
    """The report's mean ± std per model, recomputed from the committed runs with numpy."""
    runs = json.loads((ROOT / "docs/results/molecules/karate.json").read_text())["runs"]
    _, rows = _rows(_block("docs/molecules.md", "molecules-karate"))
    assert len(rows) == 2
    for row, model in zip(rows, ("graph", "full"), strict=True):
        accs = np.array([r["unlabeled_accuracy"] for r in runs if r["model"] == model])
        mean, std = (float(x) for x in row[1].split(" ± "))
        assert mean == pytest.approx(100 * accs.mean(), abs=0.05)
        assert std == pytest.approx(100 * accs.std(), abs=0.05)
        assert int(row[2]) == len(accs) == 5


def test_posenc_table_against_the_jsonl():
    """Each accuracy cell is the mean ± population std over seeds of its JSONL field, recomputed here."""
    runs = [json.loads(line) for line in (ROOT / "docs/results/posenc/results.jsonl").read_text().splitlines()]
    header, rows = _rows(_block("docs/positional.md", "posenc"))
    fields = {"acc @ 32 (1L)": "acc@32", "acc @ 64 (2L)": "acc@64", "acc @ 128 (4L)": "acc@128"}
    fields |= {"t >= L @ 2L": "acc_beyond_L@64", "t >= L @ 4L": "acc_beyond_L@128"}
    assert [row[0] for row in rows] == ["none", "sinusoidal", "learned", "rope", "alibi", "t5"]
    for row in rows:
        for column, field in fields.items():
            accs = 100 * np.array([r[field] for r in runs if r["scheme"] == row[0]])
            mean, std = (float(x) for x in row[header.index(column)].split(" ± "))
            assert mean == pytest.approx(accs.mean(), abs=0.05), (row[0], column)
            assert std == pytest.approx(accs.std(), abs=0.05), (row[0], column)
        assert int(row[header.index("seeds")]) == len(accs) == 3


def _copy_tree(tmp_path: Path) -> Path:
    for rel in ("README.md", "docs", "benchmarks/results"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return tmp_path


def _generate_each_once(monkeypatch):
    """Each table and file of ``docs.TABLES`` / ``docs.FILES`` generated on its first call for a root, then
    reused (~12 s a pass): for a test whose passes all read the same results."""
    for registry in (docs.TABLES, docs.FILES):
        for name, make in list(registry.items()):
            memo = {}

            def once(root, make=make, memo=memo):
                if root not in memo:
                    memo[root] = make(root)
                return memo[root]

            monkeypatch.setitem(registry, name, once)


def test_check_finds_a_changed_number_and_write_restores_it(tmp_path, monkeypatch):
    root = _copy_tree(tmp_path)
    # the test changes a page and docs/results/sweep/summary.md, neither read by any table or file, so
    # stale, write and stale again see the same results: each table is generated in the first pass only
    # (test_every_generated_table_and_file_matches_its_results generates afresh)
    _generate_each_once(monkeypatch)
    page = root / "docs/parallel.md"
    text = page.read_text()
    body = _block("docs/parallel.md", "ring-memory")
    ratio = re.search(r"\d+\.\dx", body).group()  # the first ratio in the table, whatever the results say
    page.write_text(text.replace(body, body.replace(ratio, f"{float(ratio[:-1]) + 0.2:.1f}x", 1)))
    (root / "docs/results/sweep/summary.md").write_text("stale\n")
    assert docs.stale(root) == ["docs/parallel.md: ring-memory", "docs/results/sweep/summary.md"]
    docs.write(root)
    assert page.read_text() == text
    assert docs.stale(root) == []


def test_an_unknown_block_is_an_error():
    text = "<!-- begin generated: no-such-table -->\n<!-- end generated: no-such-table -->\n"
    with pytest.raises(ValueError, match="no-such-table"):
        docs.regenerate(text, ROOT, page="x.md")


def test_text_outside_the_markers_is_kept():
    text = "before\n<!-- begin generated: ring-memory -->\nold\n<!-- end generated: ring-memory -->\nafter\n"
    out = docs.regenerate(text, ROOT)
    assert out.startswith("before\n<!-- begin generated: ring-memory -->\n| N |")
    assert out.endswith("<!-- end generated: ring-memory -->\nafter\n")


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path = (page.parent / target).resolve()
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if not path.exists() and rel not in PENDING_PAGES:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_python_blocks_are_valid_python():
    """Code blocks in the docs that are not doctests at least parse (the README's doctest runs in make test)."""
    compiled = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)):
            if not code.lstrip().startswith(">>>"):
                compile(code, f"{page.name} block {i}", "exec")
                compiled += 1
    assert compiled >= 3  # kernels.md and parallel.md have such blocks


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
