"""Adds what a GPU run measured to a tuning table.

    python -m benchmarks.tuning_table --from_gpu_check benchmarks/results/h200/run1_gpu_check.json
    python -m benchmarks.tuning_table --from_tuning results/tuning.json

writes into ``attnlab/tuning_table.json`` (the table committed with attnlab, read by
``attnlab.tuning.lookup`` after the user's own): from a ``gpu_check`` result, one entry per (mask,
head dim, direction) of its ``blocks`` section (``attnlab.tuning.entries_from_gpu_check``); from a
table ``attnlab.autotune`` wrote (``gpu_check``'s autotune section writes ``tuning.json`` beside its
result), every entry. ``--out`` names another table.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

from attnlab import tuning

FLAGS = flags.FLAGS
flags.DEFINE_list("from_gpu_check", [], "gpu_check result JSON files")
flags.DEFINE_list("from_tuning", [], "tables attnlab.autotune wrote (e.g. gpu_check's tuning.json)")
flags.DEFINE_string("out", str(Path(tuning.__file__).with_name("tuning_table.json")), "the table to write into")


def main(argv):
    del argv
    for path in FLAGS.from_gpu_check:
        rows = tuning.entries_from_gpu_check(json.loads(Path(path).read_text()))
        for key, config, ms in rows:
            tuning.store(key, config, FLAGS.out, ms=ms, source=str(path))
        print(f"{path}: {len(rows)} entries -> {FLAGS.out}")
    for path in FLAGS.from_tuning:
        rows = tuning.load_timed(path)
        for key, config, ms in rows:
            tuning.store(key, config, FLAGS.out, ms=ms, source=str(path))
        print(f"{path}: {len(rows)} entries -> {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
