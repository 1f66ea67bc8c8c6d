r"""torch's attention as peers on a ``Case``: compiled ``flex_attention`` and ``scaled_dot_product_attention``.

* **flex**: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the case's ``mask_mod``
  (causal, a window, document ids; built once, outside the timed call: its build time is recorded)
  and its ``score_mod`` (SoftCap, ALiBi), the same facts attnlab's kernels get (``benchmarks.cases``);
  no block mask for full attention. torch 2.13 has no flex backward on a CPU: that cell says so.
* **sdpa**: ``torch.nn.functional.scaled_dot_product_attention``: full, ``is_causal``, and windows and
  documents as a dense boolean ``[T, S]`` mask; no score_mod.

Each cell's output is compared with a dense fp32 computation of the case in torch (``dense_reference``)
up to ``--check_len`` tokens, at the bf16 tolerance of ``attnlab.testing``, so a peer is timed on
the function attnlab computes.

``benchmarks.gpu_check`` runs these cells in worker processes (``launch``: ``python -m
benchmarks.torch_peers --cells cells.json ...``) started with the run: they compile while the main
process checks and times JAX (compiles are CPU work, under the shared hold of
``harness.DeviceLock``), and take its exclusive hold to time, so no timing shares the machine with a
compile or another timing. Rows are appended to one JSONL file as they finish; ``collect`` reads
them back. The same code runs on a CPU with torch's CPU build (``--smoke``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

from benchmarks import harness
from benchmarks.cases import Case, UnsupportedError, alibi_slopes

__all__ = ["Cell", "build", "mask_mod", "score_mod", "dense_reference", "run_cells", "launch", "collect", "finish"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One timed cell of a torch peer."""

    peer: str  # "flex" or "sdpa"
    case: Case
    T: int
    N: int
    H: int
    direction: str  # "fwd" or "fwd+bwd"

    def row(self) -> dict:
        c = self.case
        return dict(case=c.name, mask=c.mask_label, score=c.score_label, T=self.T, H=self.H, N=self.N, B=1,
                    dtype="bfloat16", implementation=self.peer, direction=self.direction)  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Cell:
        return cls(**(d | {"case": Case.from_dict(d["case"])}))


def mask_mod(torch, case: Case, ids):
    """The case's flex ``mask_mod`` (``ids``: the document ids as a tensor), or None for full attention."""
    if case.mask == "causal":
        return lambda b, h, q, k: q >= k
    if case.mask == "window":
        left, right = case.window
        return lambda b, h, q, k: (q - k <= left) & (k - q <= right)
    if case.mask == "documents":
        return lambda b, h, q, k: ids[q] == ids[k]
    return None


def score_mod(torch, case: Case, slopes):
    """The case's flex ``score_mod`` (``slopes``: ALiBi's as a tensor), or None for the dot product."""
    if case.score == "softcap":
        cap = case.cap
        return lambda s, b, h, q, k: cap * torch.tanh(s / cap)
    if case.score == "alibi":
        return lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()
    if case.score == "additive":
        raise UnsupportedError("additive (tanh) scores have no score_mod form: tanh(q + k) is over the head dim")
    return None


def _dense_mask(torch, case: Case, T: int, device):
    """bool ``[T, S]`` (True = attend), or None for full attention."""
    t = torch.arange(T, device=device)
    q, k = t[:, None], t[None, :]
    if case.mask == "causal":
        return q >= k
    if case.mask == "window":
        return (q - k <= case.window[0]) & (k - q <= case.window[1])
    if case.mask == "documents":
        ids = torch.as_tensor(case.ids(T)[0], device=device)
        return ids[:, None] == ids[None, :]
    return None


def dense_reference(torch, case: Case, q, k, v):
    """The case in fp32 on ``[B, N, T, H]`` tensors: logits, score, mask, softmax, weighted sum."""
    B, N, T, H = q.shape
    s = (q.float() @ k.float().transpose(-1, -2)) * H**-0.5  # [B, N, T, S]
    t = torch.arange(T, device=q.device)
    if case.score == "softcap":
        s = case.cap * torch.tanh(s / case.cap)
    elif case.score == "alibi":
        slopes = torch.as_tensor(alibi_slopes(N), device=q.device)
        s = s - slopes[:, None, None] * (t[:, None] - t[None, :]).abs()
    elif case.score != "dot":
        raise UnsupportedError(f"no dense torch form of score {case.score!r}")
    mask = _dense_mask(torch, case, T, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.float()


def build(torch, cell: Cell, device: str):
    """``(run, inputs, notes)``: ``run()`` does the cell's work and waits for the device; or ``UnsupportedError``."""
    case = cell.case
    q, k, v = _inputs(torch, cell.T, cell.N, cell.H, device)
    grad = cell.direction == "fwd+bwd"
    if grad:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    attend, notes = (_flex if cell.peer == "flex" else _sdpa)(torch, case, cell, device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if grad:
        ct = _cotangent(torch, q)

        def run():
            out = attend(q, k, v)
            torch.autograd.grad(out, (q, k, v), ct)  # for a fixed normal cotangent, as JAX's rows
            sync()

    else:

        def run():
            with torch.no_grad():
                attend(q, k, v)
            sync()

    return run, (q, k, v, attend), notes


_INPUTS: dict = {}


def _inputs(torch, T: int, N: int, H: int, device: str):
    """q, k, v ``[1, N, T, H]`` (torch's layout), bf16, normal; made once per shape and device."""
    key = (T, N, H, device)
    if key not in _INPUTS:
        gen = torch.Generator(device="cpu").manual_seed(T + H)
        xs = (torch.randn((1, N, T, H), generator=gen) for _ in range(3))
        _INPUTS[key] = tuple(x.to(device=device, dtype=torch.bfloat16) for x in xs)
    return _INPUTS[key]


def _cotangent(torch, like):
    """The output cotangent of a forward+backward cell: normal, fixed, ``like``'s shape, dtype and device
    (as ``harness.cotangent`` for the JAX rows; not ones, which lets XLA simplify its side)."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    return torch.randn(tuple(like.shape), generator=gen).to(device=like.device, dtype=like.dtype)


def _flex(torch, case: Case, cell: Cell, device: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    ids = torch.as_tensor(case.ids(cell.T)[0], device=device) if case.mask == "documents" else None
    slopes = torch.as_tensor(alibi_slopes(cell.N), device=device)
    mods = score_mod(torch, case, slopes), mask_mod(torch, case, ids)
    t0 = time.perf_counter()
    block_mask = None if mods[1] is None else create_block_mask(mods[1], None, None, cell.T, cell.T, device=device)
    notes = {"block_mask_s": round(time.perf_counter() - t0, 3)}
    flex = torch.compile(flex_attention, dynamic=False)
    return (lambda q, k, v: flex(q, k, v, score_mod=mods[0], block_mask=block_mask)), notes


def _sdpa(torch, case: Case, cell: Cell, device: str):
    if case.score != "dot":
        raise UnsupportedError(f"SDPA takes no score_mod ({case.score_label}; a dense [N, T, S] bias is not timed)")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if case.mask == "causal":
        return (lambda q, k, v: sdpa(q, k, v, is_causal=True)), {}
    mask = _dense_mask(torch, case, cell.T, device)
    notes = {} if mask is None else {"mask": "dense bool [T, S]"}
    return (lambda q, k, v: sdpa(q, k, v, attn_mask=mask)), notes


def _check(torch, case: Case, inputs, check_len: int, cell: Cell) -> dict:
    """A forward cell's output against ``dense_reference`` (bf16 tolerance of attnlab.testing), up to ``check_len``."""
    if cell.T > check_len or cell.direction != "fwd":
        return {}
    from attnlab import testing  # noqa: PLC0415

    q, k, v, attend = inputs
    with torch.no_grad():
        out = attend(q.detach(), k.detach(), v.detach()).float()
        ref = dense_reference(torch, case, q.detach(), k.detach(), v.detach())
    tol = testing.tolerance("bfloat16", backend="gpu" if q.is_cuda else "cpu")
    err = (out - ref).abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= tol["atol"] + tol["rtol"] * ref.abs()).all())
    return {"max_abs_err": float(err.max()), "matches_dense": ok}


def run_cells(cells, *, out, lock, deadline: float, repeats: int, max_cell_s: float, check_len: int, device: str):
    """Compiles every cell first (each under the lock's shared hold), then times them (a few per exclusive hold),
    appending each row to ``out`` (JSONL). Compiling stops in time to time what compiled before ``deadline``.

    One compile phase, then one timing phase: a timing waits for every compile in flight on the machine,
    so a worker that alternated would wait once per cell.
    """
    import torch  # noqa: PLC0415

    # every cell is a new graph of flex_attention's one code object: past dynamo's recompile limit (8) it would
    # silently run flex eagerly
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 4096
    if device == "cpu":  # a smoke run: one thread (spinning OpenMP threads on a shared CPU stalled whole calls)
        torch.set_num_threads(1)
    stop_compiling = deadline - min(60.0, max_cell_s * len(cells) / 2)
    ready = []
    for cell in cells:
        if time.time() > stop_compiling:
            _emit(out, cell.row() | dict(status="skipped", reason="time budget"))
            continue
        with _outcome(out, cell.row()) as row:
            with lock.compiling():  # side by side with the other compiles: CPU work
                run, inputs, notes = build(torch, cell, device)
                t0 = time.perf_counter()
                run()  # compiles (torch.compile, on first call)
            ready.append((cell, run, inputs, row | dict(compile_s=round(time.perf_counter() - t0, 2), **notes)))
            row.clear()  # timed below
    for start in range(0, len(ready), 8):
        with lock.exclusive():  # alone on the machine, a few cells per hold
            for cell, run, inputs, row in ready[start : start + 8]:
                if time.time() > deadline:
                    _emit(out, row | dict(status="skipped", reason="time budget"))
                    continue
                with _outcome(out, row) as row:
                    timing = harness.time_call(run, repeats=repeats, max_s=max_cell_s)
                    row |= dict(status="ok", **timing.record()) | _check(torch, cell.case, inputs, check_len, cell)
                    if row.get("matches_dense") is False:
                        row["status"] = "FAIL"


@contextlib.contextmanager
def _outcome(out, row: dict):
    """Yields ``row`` to fill; emits it afterwards (unless emptied), as unsupported or error if the block raised."""
    try:
        yield row
    except (UnsupportedError, NotImplementedError) as e:
        row |= dict(status="unsupported", reason=f"{type(e).__name__}: {e}"[:500])
    except Exception as e:  # noqa: BLE001  (one broken cell must not hide the others)
        row |= dict(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
    if row:
        _emit(out, row)


def _emit(out, row: dict) -> None:
    line = json.dumps(row) + "\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one append per row: lines of several workers do not interleave
    finally:
        os.close(fd)
    print(f"[torch {row['implementation']}] {line}", end="", flush=True)


def launch(cells, *, jobs: int, out, lock_path, deadline: float, repeats: int, max_cell_s: float, check_len: int,
           device: str, workdir) -> list:  # fmt: skip
    """Starts ``jobs`` worker processes (cells dealt round-robin, so each works down the list in its order);
    their cell lists go to ``workdir``, their rows to ``out``."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false")  # torch owns its device here
    # inductor compiles in a pool as large as the CPU count; the workers share half the cores
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // (2 * max(1, jobs)))))
    procs = []
    for i in range(min(jobs, len(cells))):
        spec = Path(workdir) / f"cells{i}.json"
        spec.write_text(json.dumps([dataclasses.asdict(c) for c in cells[i::jobs]]))
        cmd = [sys.executable, "-m", "benchmarks.torch_peers", f"--cells={spec}", f"--out={out}", f"--lock={lock_path}",
               f"--deadline={deadline}", f"--repeats={repeats}", f"--max_cell_s={max_cell_s}",
               f"--check_len={check_len}", f"--device={device}"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def finish(procs, *, deadline: float, grace_s: float = 20.0) -> list[str]:
    """Waits for the workers until ``deadline`` (+ grace), ends any still running; what went wrong with each."""
    problems = []
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline + grace_s - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            problems.append(f"torch worker {p.pid} ran past the deadline and was stopped")
        if p.returncode not in (0, None, -9):
            problems.append(f"torch worker {p.pid} exited with {p.returncode}")
    return problems


def collect(out) -> list[dict]:
    """The rows the workers appended (a line cut short by a killed worker is skipped)."""
    rows = []
    for line in Path(out).read_text().splitlines() if Path(out).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def main(argv):
    del argv
    cells = [Cell.from_dict(c) for c in json.loads(Path(FLAGS.cells).read_text())]
    try:
        import torch  # noqa: PLC0415, F401
    except ImportError as e:
        for c in cells:
            _emit(FLAGS.out, c.row() | dict(status="unsupported", reason=f"torch not importable: {e}"))
        return
    run_cells(
        cells, out=FLAGS.out, lock=harness.DeviceLock(FLAGS.lock), deadline=FLAGS.deadline, repeats=FLAGS.repeats,
        max_cell_s=FLAGS.max_cell_s, check_len=FLAGS.check_len, device=FLAGS.device,
    )  # fmt: skip


FLAGS = flags.FLAGS

if __name__ == "__main__":
    flags.DEFINE_string("cells", None, "JSON list of cells (written by launch).", required=True)
    flags.DEFINE_string("out", None, "JSONL file the rows are appended to.", required=True)
    flags.DEFINE_string("lock", None, "The device lock's file.")
    flags.DEFINE_float("deadline", float("inf"), "time.time() past which cells are skipped.")
    flags.DEFINE_integer("repeats", 5, "Timed calls per cell.")
    flags.DEFINE_float("max_cell_s", 3.0, "Seconds of timed calls per cell at most (fewer repeats).")
    flags.DEFINE_integer("check_len", 4096, "Compare outputs with the dense reference up to this length.")
    flags.DEFINE_string("device", "cuda", "torch device.")
    app.run(main)
