#!/usr/bin/env bash
# GPU check, run from the repository root on a machine with NVIDIA GPUs:
#   1. the CUDA-marked tests (devices, none / dp / ddp-nccl on real cards);
#   2. a short none vs dp comparison of one training setup: samples/s and peak memory per device.
# Results go to $OUT (default bench-results/): nvidia-smi.csv, cuda-tests.txt, dp_vs_single.{txt,json}.
# Environment: PYTHON (default .venv/bin/python, else python3), STEPS (default 20), BATCH (default 256).
# Exit status: 0 when the tests pass and the benchmark ran, 1 otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-bench-results}
STEPS=${STEPS:-20}
BATCH=${BATCH:-256}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# runner needs pydantic; a GPU image may lack it: install wheels carried in .whl/ if present.
if ! "$PY" -c "import pydantic" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    else
        echo "pydantic is missing for $PY and no wheels in .whl/: install it first" >&2
        exit 1
    fi
fi

echo "== machine"
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"

echo "== CUDA tests"
"$PY" -m pytest -m cuda tests/test_cuda.py -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/cuda-tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== none vs dp (resnet18, 64x64 synthetic images, global batch $BATCH, $STEPS timed steps)"
"$PY" benchmarks/dp_vs_single.py --model resnet18 --batch "$BATCH" --steps "$STEPS" --warmup 5 \
    --json "$OUT/dp_vs_single.json" 2>&1 | tee "$OUT/dp_vs_single.txt"
bench_rc=${PIPESTATUS[0]}

echo "== summary: cuda tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
