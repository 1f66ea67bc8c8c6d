#!/usr/bin/env bash
# The GPU check on a lent device machine, from the repository root (docs/backends.md, "The GPU check"):
#
#   make gpu-wheels                       # here, once: tokamax and what it needs that the image lacks -> .whl/
#   device run: bash benchmarks/gpu_run.sh   (carry [".whl"], timeout_s 420)
#
# Installs the carried wheels (if any) into /tmp/site, runs benchmarks.gpu_check with the default sections
# (~6 min, each section within its budget) and writes $OUT/gpu_check.json (rewritten after every row),
# $OUT/gpu_check.torch.jsonl (torch's rows as they finish) and $OUT/gpu_check.log. Arguments go to gpu_check.
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site \
    || echo "gpu_run: the carried wheels did not install; the tokamax rows will say why"
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/gpu_check.log"
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-390}" python3 -m benchmarks.gpu_check --out "$OUT/gpu_check.json" "$@" 2>&1 \
  | tee -a "$OUT/gpu_check.log"
