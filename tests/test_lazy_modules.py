"""`import attnlab` gives the README's modules (attnlab.nn, decoding, train, data) on first use, without
loading flax, optax or orbax until one of them is used."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import attnlab
heavy = [m for m in ("flax", "optax", "orbax") if m in sys.modules]
assert not heavy, f"import attnlab loaded {heavy}"
assert {"nn", "decoding", "train", "data"} <= set(dir(attnlab))
from attnlab import nn as nn_direct
assert attnlab.nn is nn_direct and attnlab.nn.MultiHeadAttention is nn_direct.MultiHeadAttention
assert callable(attnlab.decoding.init_cache) and callable(attnlab.train.train)
assert callable(attnlab.data.packing.pack)
assert "flax" in sys.modules
try:
    attnlab.no_such_module
except AttributeError as e:
    assert "no_such_module" in str(e)
else:
    raise AssertionError("attnlab.no_such_module did not raise")
print("ok")
"""


def test_import_attnlab_loads_the_modules_on_first_use():
    """In a fresh interpreter: the test process has flax loaded already, so sys.modules would tell nothing."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")
