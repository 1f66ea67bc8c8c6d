"""One small training loop for NNX models: jitted optax step, eval, JSONL metrics, orbax checkpoints.

The step is a pure function of (params, optimizer state, batch, key), where the batch for step s
comes from ``batch_fn(s)`` and the dropout key is ``fold_in(key(seed), s)``. So a run is a
function of the seed alone, and resuming from a checkpoint at step s replays exactly the same
steps s+1, s+2, ... as the uninterrupted run (``tests/test_train.py`` checks the loss curves are
identical).

Outputs in ``workdir``: ``metrics.jsonl`` (one JSON object per line: ``{"step", "split": "train",
"loss", ...}`` every ``log_every`` steps and ``{"step", "split": "dev", ...}`` every ``eval_every``
steps) and ``checkpoints/<step>/`` (orbax, every ``checkpoint_every`` steps and at the end).

Example:
    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
    >>> def loss_fn(m, b, key):
    ...     return ((m(b["x"]) - b["y"]) ** 2).mean(), {}
    >>> model, log = train(model, optax.sgd(0.1), loss_fn, lambda s: batch, num_steps=3, verbose=False)
    >>> [r["step"] for r in log if r["split"] == "train"]
    [1, 2, 3]
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["train", "make_step", "masked_cross_entropy", "read_jsonl", "append_jsonl", "num_params", "ByValue"]

LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict]]


class ByValue:
    """A static jit argument compared by what a function computes, not by object identity.

    Two optimizers built by the same call (``adamw_cosine(2e-3, 30, 200, 0.05)`` twice), or two
    loss closures of one ``def`` over equal values, get equal keys, so the compiled train step is
    reused instead of compiled again. The key of a function is its code, defaults and the keys of
    its closure cells; of a ``functools.partial``, bound method, tuple, list or dict, the keys of
    its parts; of another hashable object (a float, a dtype, a class, a module) the object; of
    anything unhashable (an array, a module instance), the object's identity, held here so that
    the identity cannot be reused by a new object.
    """

    __slots__ = ("fn", "key")

    def __init__(self, fn):
        self.fn = fn
        self.key = _value_key(fn, frozenset())

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, ByValue) and self.key == other.key


class _Identity:
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Identity) and self.obj is other.obj


def _value_key(obj, seen: frozenset):
    if id(obj) in seen:  # a recursive closure: its code identifies the cycle
        return ("cycle", getattr(obj, "__code__", None))
    seen = seen | {id(obj)}
    if isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(_value_key(cell.cell_contents, seen))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        return (
            "function", obj.__code__, obj.__module__, tuple(cells),
            _value_key(obj.__defaults__, seen), _value_key(obj.__kwdefaults__, seen),
        )  # fmt: skip
    if isinstance(obj, functools.partial):
        return ("partial", _value_key(obj.func, seen), _value_key(obj.args, seen), _value_key(obj.keywords, seen))
    if isinstance(obj, types.MethodType):
        return ("method", _value_key(obj.__func__, seen), _value_key(obj.__self__, seen))
    if isinstance(obj, (tuple, list)):  # also optax's GradientTransformation (a NamedTuple)
        return (type(obj), tuple(_value_key(x, seen) for x in obj))
    if isinstance(obj, dict):
        return (type(obj), tuple((k, _value_key(v, seen)) for k, v in obj.items()))
    try:
        hash(obj)
    except TypeError:
        return _Identity(obj)
    return (type(obj), obj)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6))
def _step(graphdef, params_def, tx, loss_fn, rest, params, opt_state, batch, key):
    def f(p):
        model = nnx.merge(graphdef, jax.tree.unflatten(params_def, p), rest)
        return loss_fn.fn(model, batch, key)

    (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
    updates, opt_state = tx.fn.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux


def make_step(graphdef, params_def, rest, tx: optax.GradientTransformation, loss_fn: LossFn):
    """The jitted train step ``(params, opt_state, batch, key) -> (params, opt_state, loss, aux)``.

    ``params`` is the flat list of the model's ``nnx.Param`` leaves (structure ``params_def``);
    ``rest`` the model's other state (held fixed). ``loss_fn(model, batch, key) -> (scalar loss,
    dict of scalar metrics)``. ``params`` and ``opt_state`` are donated (their buffers are reused
    for the outputs): pass arrays the caller no longer needs. The compiled step is cached on
    (graphdef, tx, loss_fn), with ``tx`` and ``loss_fn`` compared by value (code and closed-over
    values), not identity: a second run with an equal optimizer and loss does not compile again.
    The jitted function itself is ``make_step(...).func`` (``.lower(*make_step(...).args, ...)``
    compiles it ahead of time).
    """
    return functools.partial(_step, graphdef, params_def, ByValue(tx), ByValue(loss_fn), rest)


def adamw_cosine(
    learning_rate: float, warmup_steps: int, num_steps: int, weight_decay: float, *, end_fraction: float = 0.05
) -> optax.GradientTransformation:
    """The experiments' optimizer: global-norm clipping at 1, then AdamW on a linear warmup from 0
    to ``learning_rate`` over ``warmup_steps`` and a cosine decay to ``end_fraction * learning_rate``
    at ``num_steps``."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, num_steps, end_value=end_fraction * learning_rate
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


def num_params(model: nnx.Module) -> int:
    """The number of scalars in the model's ``nnx.Param`` leaves (what is trained)."""
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def scan_jsonl(path) -> tuple[list[dict], list[tuple[int, str, str]]]:
    """-> (the records of a JSONL file, its bad lines as ``(line number, text, why)``).

    Empty when the file does not exist. A bad line is one that is not a JSON object: torn by a
    crash, truncated, or garbage written by something else. The one JSONL scanner: ``read_jsonl``,
    ``experiments.common.read_jsonl`` and the sweep's results reader decide what to do with bad lines.
    """
    path = Path(path)
    if not path.exists():
        return [], []
    records, bad = [], []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append((lineno, line, f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad.append((lineno, line, f"a JSON {type(rec).__name__}, expected an object"))
    return records, bad


def read_jsonl(path, *, skip_bad: bool = False) -> list[dict]:
    """All records of a JSONL file (empty list if it does not exist).

    A torn last line (a write cut short by a crash) is left out with a warning, so an interrupted
    run can be read and resumed. A bad line anywhere else raises, unless ``skip_bad``: then every
    bad line is left out with a warning (what a grid resumed by key wants: ``append_jsonl`` ends a
    torn line and writes after it, so the torn record's cell simply runs again).

    Raises:
        ValueError: a line before the last is not a JSON object; names the file and the line.
    """
    path = Path(path)
    records, bad = scan_jsonl(path)
    last = max((i for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()),
               default=0) if bad else 0  # fmt: skip
    for lineno, line, why in bad:
        where = f"{path}:{lineno}: {why}: {line[:80]!r}"
        if not skip_bad and lineno != last:
            raise ValueError(f"read_jsonl: {where}")
        kind = "a torn last line" if lineno == last else "a bad line"
        warnings.warn(f"read_jsonl: dropping {kind}, {where}", RuntimeWarning, stacklevel=2)
    return records


def append_jsonl(path, record: dict) -> None:
    """Appends one record as a line of JSON (the format ``read_jsonl`` reads back).

    The line goes out in one ``write`` on a file opened for appending, so a crash leaves at most
    one torn last line; when the file ends in such a line, it is ended first, so the new record
    is a whole line of its own (``experiments.common.read_jsonl`` skips the torn one).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with path.open("rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpointer(directory, every):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=2, enable_async_checkpointing=False)
    return ocp, ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _restore_newest_readable(ocp, open_manager, abstract, workdir: Path):
    """-> (manager, restored state or None, its step or 0), from the newest checkpoint that restores.

    Checkpoints newer than that one failed to restore (truncated or zeroed files, missing metadata,
    an empty step directory): each is moved to ``workdir/corrupt_checkpoints/`` with a warning, so
    the run resumes from the readable one and later saves reuse those step numbers.

    Raises:
        RuntimeError: there are checkpoints and none of them restores (nothing is moved: that is
            more often a changed model or optimizer than corruption); names each step and its error.
    """
    mngr = open_manager()
    failed = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # noqa: BLE001  (any failure to read it: orbax/TensorStore raise many kinds)
            failed.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
            mngr.close()
            mngr = open_manager()  # a failed restore can leave the manager's handlers in a bad state
            continue
        if not failed:
            return mngr, restored, step
        mngr.close()
        for bad, why in failed:
            src = Path(mngr.directory) / str(bad)
            dst = workdir / "corrupt_checkpoints" / f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}"
            try:
                dst.parent.mkdir(exist_ok=True)
                shutil.move(src, dst)
                kept = f"moved to {dst}"
            except OSError as move_error:
                kept = f"left in place ({move_error})"
            warnings.warn(
                f"train: checkpoint step {bad} in {mngr.directory} cannot be restored ({why}); {kept}. "
                f"Resuming from step {step}, the newest readable checkpoint.",
                RuntimeWarning,
                stacklevel=3,
            )
        return open_manager(), restored, step
    if failed:
        mngr.close()
        raise RuntimeError(
            f"train: no checkpoint in {mngr.directory} can be restored:\n"
            + "\n".join(f"  step {step}: {why}" for step, why in failed)
            + "\nIf the model or optimizer changed since they were written, use a new workdir."
        )
    return mngr, None, 0


def train(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    batch_fn: Callable[[int], Any],
    *,
    num_steps: int,
    seed: int = 0,
    workdir=None,
    eval_fn: Callable[[nnx.Module], dict] | None = None,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    log_every: int = 1,
    verbose: bool = True,
    stop_after: int | None = None,
) -> tuple[nnx.Module, list[dict]]:
    """Train ``model`` for ``num_steps`` steps, resuming from the latest checkpoint in ``workdir``.

    Args:
        model: an NNX module; its ``nnx.Param`` leaves are trained, other state is left as is.
        tx: an optax optimizer.
        loss_fn: ``(model, batch, key) -> (loss, metrics)``, metrics a dict of scalars.
        batch_fn: ``step -> batch`` for steps 1 .. num_steps; must be deterministic in the step.
        num_steps: total number of steps of the run (a resumed run continues up to it).
        seed: dropout key of step s is ``fold_in(key(seed), s)``.
        workdir: folder for ``metrics.jsonl`` and ``checkpoints/``; None keeps nothing on disk.
        eval_fn: ``model -> dict`` of dev metrics, run every ``eval_every`` steps and at the end.
        checkpoint_every: save every k steps (0: only at the end); needs ``workdir``.
        log_every: write a train record every k steps.
        verbose: print progress (steps/s, ETA, loss) to stderr.
        stop_after: stop (as if interrupted) after this step; for tests of resuming.

    Returns:
        (the trained model, the list of metric records of the whole run, resumed part included).
    """
    if num_steps < 1:
        raise ValueError(f"train: num_steps must be >= 1, got {num_steps}")
    graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
    leaves, params_def = jax.tree.flatten(params_state)
    leaves = [jnp.array(x, copy=True) for x in leaves]  # the step donates them: keep the model's own
    opt_state = tx.init(leaves)
    step_fn = make_step(graphdef, params_def, rest, tx, loss_fn)
    start = 0
    records: list[dict] = []
    metrics_path = mngr = None
    if workdir is not None:
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        metrics_path = workdir / "metrics.jsonl"
        import orbax.checkpoint as ocp

        def open_manager():
            return _checkpointer(workdir / "checkpoints", checkpoint_every or num_steps)[1]

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": leaves, "opt_state": opt_state})
        mngr, restored, start = _restore_newest_readable(ocp, open_manager, abstract, workdir)
        if restored is not None:
            leaves, opt_state = restored["params"], restored["opt_state"]
        # Records written after the checkpoint belong to the lost part of the run: drop them.
        records = [r for r in read_jsonl(metrics_path) if r.get("step", start + 1) <= start]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def emit(record):
        records.append(record)
        if metrics_path is not None:
            append_jsonl(metrics_path, record)

    def current_model():
        return nnx.merge(graphdef, jax.tree.unflatten(params_def, leaves), rest)

    base_key = jax.random.key(seed)
    t0, last = time.perf_counter(), start
    end = num_steps if stop_after is None else min(num_steps, stop_after)
    if verbose and start:
        print(f"resumed from step {start}", file=sys.stderr)
    for s in range(start + 1, end + 1):
        batch = batch_fn(s)
        leaves, opt_state, loss, aux = step_fn(leaves, opt_state, batch, jax.random.fold_in(base_key, s))
        if s % log_every == 0 or s == end:
            loss = float(loss)
            if not np.isfinite(loss):
                raise FloatingPointError(f"train: loss is {loss} at step {s}")
            elapsed = time.perf_counter() - t0
            emit(
                {
                    "step": s,
                    "split": "train",
                    "loss": loss,
                    "time_s": round(elapsed, 3),
                    **{k: float(v) for k, v in aux.items()},
                }
            )
            if verbose:
                rate = (s - last) / max(elapsed, 1e-9)
                eta = (end - s) / max(rate, 1e-9)
                print(
                    f"\rstep {s}/{num_steps}  loss {loss:.4f}  {rate:.1f} steps/s  ETA {eta:.0f}s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        if eval_fn is not None and ((eval_every and s % eval_every == 0) or s == num_steps):
            dev = eval_fn(current_model())
            emit(
                {
                    "step": s,
                    "split": "dev",
                    "time_s": round(time.perf_counter() - t0, 3),
                    **{k: float(v) for k, v in dev.items()},
                }
            )
            if verbose:
                print(
                    f"\nstep {s} dev " + " ".join(f"{k} {v:.4f}" for k, v in dev.items()), file=sys.stderr, flush=True
                )
        if mngr is not None and (s == num_steps or (checkpoint_every and s % checkpoint_every == 0)):
            mngr.save(s, args=ocp.args.StandardSave({"params": leaves, "opt_state": opt_state}), force=s == num_steps)
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    if verbose:
        print(file=sys.stderr)
    return current_model(), records


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, lengths: jax.Array) -> tuple[jax.Array, dict]:
    """Mean cross-entropy and accuracy over real positions. logits ``[B, T, C]``, labels ``[B, T]``."""
    valid = (jnp.arange(labels.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)  # [B, T]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    n = jnp.maximum(valid.sum(), 1.0)
    acc = ((logits.argmax(-1) == labels) * valid).sum() / n
    return (ce * valid).sum() / n, {"accuracy": acc}
