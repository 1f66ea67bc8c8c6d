"""The one way an experiment runs: flags and configs, a grid of runs resumed by key, logging,
batched prediction, the standard losses and ``mean ± std`` summaries; re-exported here, the markdown
table writer and cell formats (``experiments.tables``) and the compiled-memory and step-timing
helpers (``experiments.measure``).

An experiment module keeps only its task: data, model, metrics, figures. It writes

    def run(cfg, out, *, verbose=True): ...      # trains; records go through run_grid
    def report(folder) -> str: ...               # tables + figures from the JSONL alone

    if __name__ == "__main__":
        common.launch(run, report, config="experiments/configs/<name>.py:default", out="results/<name>")

and gets ``--config file.py:variant`` (any field overridable: ``--config.train.num_steps=50``),
``--out`` and ``--report``. ``docs/experiments.md`` walks through it.

A runner that needs more than an append (the sweep) takes the pieces of ``experiments.runner``,
re-exported here: ``lock_out`` (one writer per results folder), ``write_jsonl`` (an atomic
rewrite), ``CellWorker`` (each cell in a subprocess, killed at a hard timeout) and
``failure_record``.

Resume: a grid's records live in one JSONL file, one line per finished cell; a cell whose key
fields match a line is not run again. Lines are appended with one ``write`` of the whole line
(``append_jsonl``); a line cut short by a crash (a torn line) is skipped with a warning when read
(``read_jsonl``), and a later append starts on a fresh line, so the cell simply runs again.
"""

from __future__ import annotations

import importlib.util
import logging as py_logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging

from attnlab import train as train_lib
from experiments.figures import pyplot, save_figure
from experiments.measure import compiled_memory, measure_train_step, memory_record, memory_stats, time_steps
from experiments.runner import CellWorker, OutLockedError, failure_record, lock_out, write_jsonl
from experiments.tables import markdown_table, mean_std

__all__ = [
    "launch",
    "load_config",
    "setup_logging",
    "log",
    "read_jsonl",
    "append_jsonl",
    "pending",
    "run_grid",
    "lock_out",
    "OutLockedError",
    "write_jsonl",
    "failure_record",
    "CellWorker",
    "predict",
    "classification_loss",
    "summarize",
    "mean_std",
    "markdown_table",
    "compiled_memory",
    "memory_stats",
    "memory_record",
    "time_steps",
    "measure_train_step",
    "save_config",
    "train_time",
    "head_mean",
    "names",
    "ints",
    "env",
    "pyplot",
    "save_figure",
]

FLAGS = flags.FLAGS

# ------------------------------------------------------------------------------------------
# Flags, configs, entry point


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``"path/to/file.py:variant"`` -> that file's ``get_config(variant)`` (no variant: ``get_config()``).

    Raises:
        ValueError: naming ``config`` when the spec, the file or its ``get_config`` is wrong.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"config must be 'file.py' or 'file.py:variant', got {spec!r}")
    path, _, variant = spec.partition(":")
    if not path.endswith(".py"):
        raise ValueError(f"config must name a .py file as 'file.py:variant', got {spec!r}")
    if not Path(path).is_file():
        raise ValueError(f"config file {path!r} (from config={spec!r}) does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_config_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {path!r} (from config={spec!r}) has no get_config(variant) function")
    return module.get_config(variant) if variant else module.get_config()


class _DropOrbaxInfo(py_logging.Filter):
    def filter(self, record):  # orbax logs every checkpoint step at INFO
        return record.levelno >= py_logging.WARNING or "orbax" not in record.pathname


def setup_logging() -> None:
    """absl logging at INFO for the experiments' progress, without orbax's per-checkpoint INFO lines."""
    logging.set_verbosity(logging.INFO)
    logger = logging.get_absl_logger()
    if not any(isinstance(f, _DropOrbaxInfo) for f in logger.filters):
        logger.addFilter(_DropOrbaxInfo())


def log(verbose: bool, msg: str, *args) -> None:
    """``logging.info(msg, *args)`` when ``verbose`` (the experiments' ``verbose=False`` keeps tests quiet)."""
    if verbose:
        logging.info(msg, *args)


def launch(
    run: Callable[..., Any],
    report: Callable[[Path], str],
    *,
    config: str,
    out: str,
    extra_flags: Callable[[], None] | None = None,
    configure: Callable[[ml_collections.ConfigDict], None] | None = None,
) -> None:
    """Defines the shared flags and runs the experiment as a program.

    ``--config file.py:variant`` (default ``config``), ``--out`` (default ``out``), ``--report
    FOLDER`` (only redraw the tables and figures of FOLDER). Without ``--report``: ``run(cfg,
    Path(out))`` then ``report(Path(out))``, whose table is printed. ``extra_flags()`` defines an
    experiment's own flags; ``configure(cfg)`` applies them to the config before the run.
    """
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", config, "experiment config, file.py:variant")
    flags.DEFINE_string("out", out, "results folder")
    flags.DEFINE_string("report", None, "only draw figures + tables from the results in this folder")
    if extra_flags is not None:
        extra_flags()

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
        setup_logging()
        if not FLAGS.report:
            cfg = FLAGS.config
            if configure is not None:
                configure(cfg)
            run(cfg, Path(FLAGS.out))
        print(report(Path(FLAGS.report or FLAGS.out)))

    app.run(main)


def save_config(cfg: ml_collections.ConfigDict, path) -> None:
    """Writes the run's config as JSON next to its results (``path``'s folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg.to_json_best_effort(indent=2))


def train_time(records: list[dict], default: float = 0.0) -> float:
    """Seconds of training of a run: the last ``time_s`` of the trainer's train records."""
    return max((r["time_s"] for r in records if r["split"] == "train"), default=default)


def head_mean(weights: Sequence[jax.Array], row: int = 0) -> list:
    """Per-layer attention ``L x [B, N, T, S]`` -> ``L x [T, S]`` of example ``row``, averaged over
    heads, rounded to 4 decimals (JSON for the attention-map figures)."""
    return [np.asarray(w[row].mean(0)).round(4).tolist() for w in weights]


def names(spec) -> list[str]:
    """``"a,b"`` or ``("a", "b")`` -> ``["a", "b"]`` (configs give lists as comma-separated strings)."""
    return [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if str(s).strip()]


def ints(spec) -> list[int]:
    """``"0,1,2"`` or ``(0, 1, 2)`` -> ``[0, 1, 2]``."""
    return [int(v) for v in names(spec if isinstance(spec, str) else [str(v) for v in spec])]


def env() -> dict:
    """The fields every result record carries about where it ran: backend, device kind and count,
    jax and jaxlib versions, host CPUs, Python version and OS platform."""
    import jaxlib

    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------------------------
# Results: atomic JSONL, a grid resumed by key


def read_jsonl(path) -> list[dict]:
    """The records of a JSONL file (none if it does not exist); every torn or bad line is skipped with
    a warning (``attnlab.train.read_jsonl(path, skip_bad=True)``), so its cell runs again."""
    return train_lib.read_jsonl(path, skip_bad=True)


append_jsonl = train_lib.append_jsonl


def _matches(record: dict, cell: dict) -> bool:
    return all(k in record and record[k] == v for k, v in cell.items())


def pending(path, cells: Iterable[dict]) -> list[dict]:
    """The cells (dicts of key fields) with no record in ``path`` yet."""
    done = read_jsonl(path)
    return [c for c in cells if not any(_matches(r, c) for r in done)]


def run_grid(
    path, cells: Sequence[dict], run_cell: Callable[[dict], dict], *, verbose: bool = True, name: str = ""
) -> list[dict]:
    """Runs every cell without a record in ``path`` and appends ``{**cell, **run_cell(cell)}``.

    Args:
        path: the grid's JSONL file.
        cells: one dict of key fields per run, e.g. ``{"model": "gru", "seed": 0}``, in run order.
        run_cell: ``cell -> record`` (the record may repeat the key fields).
        verbose: log each cell and the ETA.
        name: prefix of the log lines.

    Returns:
        The record of each cell, in the order of ``cells`` (as read back from ``path``).
    """
    todo = pending(path, cells)
    t0 = time.perf_counter()
    for i, cell in enumerate(todo):
        if not pending(path, [cell]):  # done meanwhile by another process writing to this file
            continue
        label = " ".join(f"{k}={v}" for k, v in cell.items())
        log(verbose, "[%s %d/%d] %s", name, i + 1, len(todo), label)
        record = {**cell, **run_cell(cell)}
        append_jsonl(path, record)
        eta = (time.perf_counter() - t0) / (i + 1) * (len(todo) - i - 1)
        log(verbose, "[%s %d/%d] %s done (ETA %.0f s)", name, i + 1, len(todo), label, eta)
    records = read_jsonl(path)
    return [next(r for r in records if _matches(r, c)) for c in cells]


# ------------------------------------------------------------------------------------------
# Prediction and losses


def predict(apply: Callable[..., jax.Array], arrays: Sequence[np.ndarray | None], batch_size: int, *, pad=True):
    """``apply(*batch)`` over the rows of ``arrays`` in batches, concatenated: ``[n, ...]`` numpy.

    ``pad=True`` fills the last batch with rows from the start (one compiled shape) and drops
    their outputs; ``pad=False`` runs a shorter last batch. ``None`` entries are passed as is.
    """
    n = len(next(a for a in arrays if a is not None))
    outs = []
    for i in range(0, n, batch_size):
        idx = np.arange(i, i + batch_size) % n if pad else np.arange(i, min(i + batch_size, n))
        batch = [None if a is None else jnp.asarray(a[idx]) for a in arrays]
        outs.append(np.asarray(apply(*batch))[: min(batch_size, n - i)])
    return np.concatenate(outs)


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict]:
    """Mean softmax cross-entropy (in fp32) and accuracy. logits ``[B, C]``, int labels ``[B]``."""
    logits32 = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits32, labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


# ------------------------------------------------------------------------------------------
# Summaries and tables


def summarize(records: Iterable[dict], by: Sequence[str], value: str, *, ddof: int = 0) -> dict:
    """``{group: (mean, std, n)}`` of ``record[value]`` over records grouped by the fields ``by``.

    ``group`` is the tuple of the ``by`` values, in the order first seen. Records without
    ``value`` are left out; a record repeated with the same group and ``seed`` counts once.
    ``std`` is numpy's with ``ddof`` (0: population); 0.0 for a single value.
    """
    groups: dict[tuple, list] = {}
    seen = set()
    for r in records:
        if value not in r:
            continue
        group = tuple(r[k] for k in by)
        if "seed" in r:
            if (group, r["seed"]) in seen:
                continue
            seen.add((group, r["seed"]))
        groups.setdefault(group, []).append(r[value])
    out = {}
    for group, vals in groups.items():
        v = np.asarray(vals, np.float64)
        std = float(v.std(ddof=ddof)) if len(v) > ddof else 0.0
        out[group] = (float(v.mean()), std, len(v))
    return out
