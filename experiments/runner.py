"""How a cell of an experiment runs and is written, for runners that want more than ``run_grid``'s
append: a lock on the results folder, an atomic rewrite of a results file, and each cell in a
subprocess killed at a hard timeout. ``experiments.common`` re-exports every name here.

    with runner.lock_out(out):                        # one writer per folder (OutLockedError else)
        worker = runner.CellWorker(time_cell)         # a module-level ``cell, isolated=..., **kw -> record``
        rec = worker.run(cell, hard_timeout_s=60, repeats=3)   # status "timeout" past 60 s
        runner.write_jsonl(path, records)             # readers see the old file or the new one
        worker.close()

``experiments/sweep.py`` runs on these; ``docs/harness.md`` says what each guards against.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable

__all__ = ["OutLockedError", "lock_out", "write_jsonl", "failure_record", "CellWorker"]


class OutLockedError(RuntimeError):
    """Another process holds the lock on this results folder."""


@contextlib.contextmanager
def lock_out(out: str):
    """Holds an exclusive lock on `<out>/.lock` (flock) for the duration; one writer per folder.

    The kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a
    crashed run leaves no stale lock. Raises OutLockedError, naming the holder, when another
    process (or another run in this one) holds it.
    """
    path = os.path.join(out, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise OutLockedError(
            f"another run is writing into {out} ({holder}); two runs in one folder would lose each "
            "other's cells. Wait for it to finish (then rerun: its cells are kept and yours are "
            "added), or use another --out."
        ) from None
    try:
        me = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}, "
        me += "command: " + " ".join(sys.argv)[:500]
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    """Rewrites `path` with one JSON line per record, atomically: readers see the old file or the
    new one, never half of one (a temporary file, then ``os.replace``)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def failure_record(e: BaseException) -> dict:
    """The record of a cell that raised: status oom (out of memory) or error, with the message."""
    msg = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
    oom = isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    return dict(status="oom" if oom else "error", error=msg[:2000])


def _worker_main(conn, runner, host_devices, isolated):
    """Body of a cell subprocess: says it is ready (imports done), then runs cells until told to stop."""
    if host_devices > 1:
        from attnlab import parallel

        parallel.use_host_devices(host_devices)
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        cell, kwargs = msg
        try:
            rec = runner(cell, isolated=isolated, **kwargs)
        except Exception as e:  # noqa: BLE001  (sent to the parent, which records it)
            rec = failure_record(e)
        conn.send(("done", rec))
    conn.close()


class CellWorker:
    """Runs cells in a subprocess and kills it when a cell passes its deadline.

    The subprocess (spawned: a fresh interpreter) is reused from cell to cell, so JAX starts once,
    and replaced after a cell that was killed or crashed. With ``fresh=True`` every cell gets a
    new process: slower (JAX starts each time) but the device's peak memory is then the cell's own.
    ``runner(cell, isolated=..., **kwargs) -> record`` must be importable (a module-level
    function); ``isolated`` is ``fresh``. ``host_devices`` > 1: the subprocess presents that many
    CPU host devices (``attnlab.parallel.use_host_devices``).
    """

    def __init__(
        self, runner: Callable[..., dict], *, host_devices: int = 1, fresh: bool = False, startup_timeout_s=300.0
    ):
        self.runner = runner
        self.host_devices, self.fresh, self.startup_timeout_s = host_devices, fresh, startup_timeout_s
        self.proc = self.conn = None

    def _start(self) -> str | None:
        """Starts the subprocess; -> None when ready, else why not."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked JAX runtime
        self.conn, child = ctx.Pipe()
        args = (child, self.runner, self.host_devices, self.fresh)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.proc.start()
        child.close()  # the child holds the other end; EOF here when it dies
        try:
            if self.conn.poll(self.startup_timeout_s) and self.conn.recv()[0] == "ready":
                return None
        except EOFError:
            pass
        why = f"did not start within {self.startup_timeout_s:g} s" if self.proc.is_alive() else self._death()
        self.close(kill=True)
        return f"cell process {why}"

    def _death(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else ""
        return f"died: {how}{hint}"

    def run(self, cell, *, hard_timeout_s: float, **kwargs) -> dict:
        """The cell's record; status "timeout" if it ran past ``hard_timeout_s`` (counted from when
        the process is ready: building, compiling and timing the cell), "error" if its process died."""
        if self.proc is not None and not self.proc.is_alive():  # died while idle: start anew
            self.close(kill=True)
        if self.proc is None and (why := self._start()):
            return dict(status="error", error=why)
        self.conn.send((cell, kwargs))
        t0 = time.perf_counter()
        try:
            if self.conn.poll(hard_timeout_s):
                rec = self.conn.recv()[1]
            else:
                rec = dict(
                    status="timeout",
                    error=f"hard timeout: cell process killed after {time.perf_counter() - t0:.1f} s "
                    f"(cell_hard_timeout_s={hard_timeout_s:g})",
                )
                self.close(kill=True)
        except EOFError:  # the process died before sending its record
            rec = dict(status="error", error=f"cell process {self._death()}")
            self.close(kill=True)
        if self.fresh:
            self.close()
        return rec

    def close(self, *, kill: bool = False) -> None:
        """Stops the subprocess: asks it to finish (or kills it at once with ``kill``)."""
        if self.proc is None:
            return
        if self.proc.is_alive() and not kill:
            with contextlib.suppress(OSError):
                self.conn.send(None)  # ask it to stop; killed below if it does not
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = self.conn = None
