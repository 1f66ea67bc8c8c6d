"""attnlab as a user installs it: the wheel built from this checkout, installed into a fresh virtual
environment, imported from outside the repository (docs/install.md).

No network: the wheel is built with this environment's setuptools (``--no-build-isolation
--no-deps --no-index``), and the fresh environment borrows this one's other packages (jax, flax, ...)
through a .pth file that names this environment's site-packages. That file is a plain path, so
site-packages' own .pth files (this checkout's editable install among them) are not run there: the
attnlab that the fresh environment imports is the wheel's.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import typing
import zipfile
from pathlib import Path

import pytest

import attnlab

ROOT = Path(__file__).resolve().parent.parent

# submodules the docs name that `import attnlab` does not load: the README's install section and
# docs/install.md say they need their own import (the dispatcher loads them when a GPU/TPU call needs them)
OWN_IMPORT = {"attnlab.kernels.pallas_flash", "attnlab.kernels.splash"}
# a benchmark row's label in docs/kernels.md ("attnlab.sparse (layer)"), not a Python name
LABELS = re.compile(r"attnlab\.\w+ \((?:attention|layer)\)")

SMOKE = r"""
import importlib.metadata, importlib.resources, json, pathlib, sys

import attnlab

# every attnlab.x.y the docs name, resolved after `import attnlab` alone (before anything else loads)
unresolved = []
for name in json.loads(sys.argv[1]):
    obj = attnlab
    for part in name.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            unresolved.append(name)
            break

import jax
import jax.numpy as jnp
import numpy as np
from attnlab import masks, testing

B, T, N, K, H = 2, 96, 4, 2, 16
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, T, N, H))
k = jax.random.normal(kk, (B, T, K, H))
v = jax.random.normal(kv, (B, T, K, H))
lengths = jnp.array([T, 57])
mask = masks.causal() & masks.padding(lengths, lengths)
out = attnlab.attention(q, k, v, mask=mask, implementation="blockwise")
ref = attnlab.attention_reference(q, k, v, mask=mask)
testing.assert_close(out, ref, jnp.float32)

# the same by hand in numpy: GQA (query head n reads key head n // (N / K)), causal & padding, empty rows 0
qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
hand = np.zeros((B, T, N, H))
for b in range(B):
    L = int(lengths[b])
    for n in range(N):
        kh = n // (N // K)
        s = qn[b, :L, n] @ kn[b, :L, kh].T / np.sqrt(H)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        hand[b, :L, n] = (p / p.sum(-1, keepdims=True)) @ vn[b, :L, kh]
testing.assert_close(out, hand, jnp.float32)

print(json.dumps({
    "file": str(pathlib.Path(attnlab.__file__).resolve()),
    "version": attnlab.__version__,
    "dist_version": importlib.metadata.version("attnlab"),
    "py_typed": importlib.resources.files("attnlab").joinpath("py.typed").is_file(),
    "tuning_entries": len(attnlab.tuning.load(str(importlib.resources.files("attnlab") / "tuning_table.json"))),
    "unresolved": unresolved,
    "padded_rows_zero": bool(jnp.all(out[1, 57:] == 0)),
    "max_abs_diff_vs_numpy": float(np.abs(np.asarray(out) - hand).max()),
}))
"""


def _documented_names() -> list[str]:
    """Every dotted ``attnlab.x...`` that README.md, docs/*.md and the notebooks name."""
    names = set()
    for path in [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "notebooks").glob("*.ipynb")),
    ]:
        text = LABELS.sub("", path.read_text())
        names |= set(re.findall(r"(?<![\w./-])attnlab(?:\.[A-Za-z_]\w*)+", text))
    return sorted(names)


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what the build reads (its scratch, build/ and *.egg-info,
    then lands in the copy, never in the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "attnlab", src / "attnlab", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*cmd, "--disable-pip-version-check", "-q", "-w", str(base / "dist"), str(src)])
    (found,) = (base / "dist").glob("attnlab-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; this environment's packages borrowed."""
    env = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    python = env / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--disable-pip-version-check", "-q"]
    _run([*pip, "--no-deps", "--no-index", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "zz_borrowed_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_its_type_marker(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"attnlab", f"attnlab-{attnlab.__version__}.dist-info"}, tops  # no tests, no experiments
    assert "attnlab/py.typed" in names
    assert "attnlab/tuning_table.json" in names  # the committed tile table attnlab.tuning reads
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "attnlab").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))  # every module, subpackages too
    assert f"Version: {attnlab.__version__}" in metadata and "Requires-Dist: jax" in metadata


@pytest.mark.slow
def test_the_installed_wheel_works_from_outside_the_repository(venv, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    names = _documented_names()
    assert {"attnlab.attention", "attnlab.scores.additive", "attnlab.nn.Encoder", "attnlab.inspect"} <= set(names)
    wanted = [n for n in names if n not in OWN_IMPORT]
    out = _run([str(venv / "bin" / "python"), "-c", SMOKE, json.dumps(wanted)], cwd=tmp_path, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(venv.resolve()), result["file"]  # the wheel's, not the checkout's
    assert result["version"] == result["dist_version"] == attnlab.__version__
    assert result["py_typed"]
    assert result["tuning_entries"] == len(attnlab.tuning.load(ROOT / "attnlab" / "tuning_table.json")) > 0
    assert result["unresolved"] == [], f"named in the docs but not there after `import attnlab`: {result['unresolved']}"
    assert result["padded_rows_zero"] and result["max_abs_diff_vs_numpy"] < 1e-4


def test_the_submodules_that_need_their_own_import_are_named_in_the_install_docs():
    readme, install = (ROOT / "README.md").read_text(), (ROOT / "docs" / "install.md").read_text()
    assert "pip install ." in readme and "pip install dist/attnlab-" in readme  # from the repo, and the wheel
    assert "[docs/install.md](docs/install.md)" in readme
    assert all(f"`{name}`" in install for name in OWN_IMPORT)


def test_every_extra_is_named_in_the_install_docs():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = (ROOT / "docs" / "install.md").read_text()
    assert not [e for e in extras if f"`{e}`" not in install], "extras missing from docs/install.md"


def _public_objects():
    """(dotted name, object) for each function and class of every public module's ``__all__``."""
    import importlib
    import pkgutil

    modules = {"attnlab": attnlab}
    for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            modules[info.name] = importlib.import_module(info.name)
    for modname, module in modules.items():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{modname}.{name}", obj


def test_every_public_annotation_resolves_to_a_real_name():
    """What a type checker reads through py.typed: each annotation of a public function, class and
    public method names something that exists (no stale forward reference)."""
    checked, broken = 0, []
    for name, obj in _public_objects():
        targets = [obj]
        if inspect.isclass(obj):
            targets += [
                f for n, f in vars(obj).items() if inspect.isfunction(f) and (not n.startswith("_") or n == "__call__")
            ]
        for target in targets:
            try:
                typing.get_type_hints(target)
                checked += 1
            except Exception as e:  # noqa: BLE001 (reported below, with the name)
                broken.append(f"{name}: {target.__qualname__}: {type(e).__name__}: {e}")
    assert checked > 300 and not broken, broken


def test_mask_classes_are_dataclasses_to_type_checkers():
    """``mask_class`` carries ``typing.dataclass_transform``, so a checker reading py.typed sees
    ``Window(left, right, offset)`` and not a constructor with no arguments."""
    from attnlab import masks

    transform = getattr(masks.mask_class, "__dataclass_transform__", None)
    assert transform is not None  # frozen_default: a keyword of its own from Python 3.12, in kwargs on 3.11
    assert transform.get("frozen_default", transform.get("kwargs", {}).get("frozen_default")) is True
    assert masks.Window(left=2, right=0) == masks.window(2, 0)
