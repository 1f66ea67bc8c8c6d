r"""Executes the notebooks and commits them with their outputs, so they show their figures when browsed.

Command (``make notebooks``; a few minutes on the 2-core CPU)::

    python -m experiments.notebooks --write              # every notebooks/*.ipynb, in place
    python -m experiments.notebooks --write --only masks.ipynb

Each notebook runs top to bottom in a fresh kernel, in a temporary folder (``experiments/`` linked in,
so what it writes under ``results/`` does not land in the repository), and is written back with its
outputs; the volatile metadata (execution timestamps, the kernel's versions) is dropped so that a rerun
that prints the same text changes only the figures. ``tests/test_notebook.py`` executes every notebook
again and checks what its text says it shows, and checks that the committed copies carry outputs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def execute(path: Path, workdir: Path, timeout: int = 900):
    """The notebook at ``path`` executed in ``workdir`` (``experiments/`` linked in): an nbformat node."""
    import nbclient
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    link = workdir / "experiments"
    if not link.exists():
        os.symlink(ROOT / "experiments", link)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    return nb


def errors(nb) -> list[str]:
    """The error outputs of an executed notebook, as 'ename: evalue'."""
    return [
        f"{o.get('ename')}: {o.get('evalue')}"
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def clean(nb):
    """Drops the volatile metadata of an executed notebook (timestamps, kernel versions)."""
    nb.metadata.pop("widgets", None)
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


FLAGS = flags.FLAGS


def define_flags():
    """The command-line flags, defined only when run as a program (so importing this module is free)."""
    flags.DEFINE_bool("write", False, "Execute the notebooks and write them back with their outputs.")
    flags.DEFINE_list("only", None, "Notebook file names (default: every notebooks/*.ipynb).")


def main(argv):
    del argv
    import nbformat

    names = FLAGS.only or sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    for i, name in enumerate(names):
        print(f"[{i + 1}/{len(names)}] executing notebooks/{name}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            nb = execute(NOTEBOOKS / name, Path(tmp))
        if bad := errors(nb):
            raise SystemExit(f"notebooks/{name} failed: {bad}")
        if FLAGS.write:
            nbformat.write(clean(nb), str(NOTEBOOKS / name))
            print(f"  wrote notebooks/{name}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
