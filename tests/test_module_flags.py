"""Every experiment and benchmark module can be imported beside every other in one process (a notebook,
one pytest worker): importing one defines no absl flag that another defines too."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib, sys
from pathlib import Path
from absl import flags
failed = []
for pkg in ("experiments", "benchmarks"):
    for path in sorted(Path(pkg).glob("*.py")):
        if path.name == "__init__.py":
            continue
        try:
            importlib.import_module(f"{pkg}.{path.stem}")
        except flags.DuplicateFlagError as e:
            failed.append(f"{pkg}.{path.stem}: {e}")
print("\\n".join(failed) or "ok")
"""


def test_every_module_imports_beside_every_other():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout
