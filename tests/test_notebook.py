"""The notebooks run top to bottom (so they cannot rot), and show what their text says they show."""

from __future__ import annotations

import os
import re

import pytest
from conftest import CHEAP_COMPILE_FLAGS  # the XLA flags the suite runs with (the kernel inherits them)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _execute(name: str, tmp_path, monkeypatch=None) -> tuple[str, int]:
    """Runs notebooks/<name> in tmp_path (experiments/ linked in); returns (its printed text, its images).

    With ``monkeypatch``, the notebook's kernel runs with XLA's default optimisation (as `make notebooks`
    does): for a notebook that trains for hundreds of steps the optimised steps save more than the
    dearer compiles cost (heads_and_positions: its 800 train steps ~2.5x faster)."""
    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from pathlib import Path

    from experiments import notebooks

    if monkeypatch is not None:  # the kernel is started with a copy of this process's environment
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in CHEAP_COMPILE_FLAGS]
        if flags:
            monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
        else:
            monkeypatch.delenv("XLA_FLAGS", raising=False)

    nb = notebooks.execute(Path(ROOT) / "notebooks" / name, tmp_path, timeout=600)
    assert not notebooks.errors(nb)
    return _text_and_images(nb)


def _text_and_images(nb) -> tuple[str, int]:
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    return text, images


@pytest.mark.parametrize("name", sorted(p for p in os.listdir(os.path.join(ROOT, "notebooks")) if p.endswith(".ipynb")))
def test_committed_notebooks_carry_their_outputs(name):
    """Committed executed (make notebooks), so a reader browsing the repository sees the figures."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), f"{name}: run make notebooks"
    text, images = _text_and_images(nb)
    assert images >= 1 and text, f"{name}: no figure or printed text committed: run make notebooks"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
    text, images = _execute("quickstart.ipynb", tmp_path)
    assert "padded rows are zero: True" in text
    assert images == 2  # the attention map and the sweep plot
    assert (tmp_path / "results" / "notebook_sweep" / "results.jsonl").exists()


@pytest.mark.slow
def test_masks_notebook(tmp_path):
    text, images = _execute("masks.ipynb", tmp_path)
    assert images == 1
    assert "every layout is safe" in text
    worst = float(re.search(r"worst \|difference\| over 11 masks: (\S+)", text)[1])
    assert worst < 1e-5
    rows = dict(re.findall(r"^(causal|chunks\(16\)) +[\d.]+% +(\d+ +\d+ +\d+)", text, re.M))
    # 8 x 8 tiles of 8: causal has 28 EMPTY, 8 PARTIAL (the diagonal), 28 FULL; chunks(16) 16 FULL 2 x 2 blocks
    assert rows["causal"].split() == ["28", "8", "28"]
    assert rows["chunks(16)"].split() == ["48", "0", "16"]
    assert "blockwise  <- chosen" in text


@pytest.mark.slow
def test_heads_and_positions_notebook(tmp_path, monkeypatch):
    text, images = _execute("heads_and_positions.ipynb", tmp_path, monkeypatch)
    assert images == 2
    assert "sinusoidal P P^T depends only on t - s: True" in text
    assert "RoPE q_t . k_s depends only on t - s: True" in text
    acc = {
        s: dict(re.findall(r"(acc@\d+) +([\d.]+)%", line))
        for s, line in re.findall(r"^(sinusoidal|rope) +(.*)$", text, re.M)
    }
    assert float(acc["sinusoidal"]["acc@32"]) > 95 and float(acc["rope"]["acc@32"]) > 95
    assert float(acc["rope"]["acc@64"]) > float(acc["sinusoidal"]["acc@64"]) + 20  # RoPE carries over to 2L
    focused = re.search(r"heads focused on offset -3: (\[.*\])", text)[1]
    assert focused != "[]"  # at least one head puts > half its weight on offset -3


@pytest.mark.slow
def test_inspect_notebook(tmp_path):
    text, images = _execute("inspect.ipynb", tmp_path)
    assert images == 2  # the attention grid and the head-importance heatmap
    assert "accuracy at length 32: 100.0%" in text
    diffs = [float(d) for d in re.findall(r"max \|difference\| (\S+)", text)]
    assert len(diffs) == 2 and max(diffs) < 1e-5  # the output unchanged; the rows capture = the dense rows
    assert "html view of 4 heads and 32 tokens" in text
    mass = {
        (int(a), int(b)): float(m) for a, b, m in re.findall(r"^layer (\d) head (\d):.*-3,-2,-1,0: (\S+)", text, re.M)
    }
    assert mass[(1, 0)] > 0.8 and mass[(1, 1)] > 0.8  # the two heads that fetch the token at t - 3
    together = float(re.search(r"heads 0 and 1 zeroed together: ([\d.]+)%", text)[1])
    assert together < 30
    follows = re.search(r"patch \[\(1, 0\), \(1, 1\)\]: answers the source's token +([\d.]+)%", text)
    assert float(follows[1]) > 90  # patched from the source, the model answers the source's tokens
