"""What a results folder records about the run that made it: its ``run.json``.

Every committed results folder (``docs/results/<experiment>/``) holds a ``run.json`` with the command,
the date, the machine, the wall and CPU time and the load, which the docs quote beside the results.
A program that writes one::

    start = provenance.start()
    ...                                            # the run
    provenance.write(out, provenance.finish(start, command=provenance.command("experiments.sweep")))

The fields are those of the folders written by hand before (``docs/results/lra/run.json``):
``command``, ``wall_s``, ``cpu_s``, ``machine``, ``date``, ``load``, plus ``host`` (the CPU model and
count) and whatever the caller adds.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path

__all__ = ["command", "cpu_model", "finish", "start", "write"]


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``platform.processor()`` where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that ran ``module`` as a program: ``python -m <module> <args>`` (args quoted)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *(shlex.quote(a) for a in args)])


def start() -> dict:
    """The marks ``finish`` measures from: wall clock, CPU seconds, load average, date."""
    return {"wall": time.perf_counter(), "cpu": _cpu_s(), "load": _load(), "date": time.strftime("%Y-%m-%d")}


def finish(started: dict, *, command: str, machine: str | None = None, **extra) -> dict:
    """The ``run.json`` record of a run begun at ``started``.

    Args:
        started: ``start()``'s marks.
        command: what ran (``command(module)``).
        machine: a description of the machine (e.g. "the 2-core development CPU, quiet"); default its
            CPU model and count.
        **extra: more fields (e.g. the cells run).
    """
    end = _load()
    load = "not available" if end is None else f"{started['load']:.1f} at the start, {end:.1f} at the end"
    host = f"{cpu_model()}, {os.cpu_count()} CPUs"
    return {
        "command": command,
        "wall_s": round(time.perf_counter() - started["wall"], 2),
        "cpu_s": round(_cpu_s() - started["cpu"], 2),
        "machine": machine or host,
        "date": started["date"],
        "load": load,
        "host": host,
        **extra,
    }


def write(folder, record: dict) -> Path:
    """Writes ``record`` to ``<folder>/run.json`` (indented JSON); returns the path."""
    path = Path(folder) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
