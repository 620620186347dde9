#!/usr/bin/env bash
# The GPU checks in one run: tests/test_gpu.py (CUDA staging of async saves, CUDA RNG,
# NCCL, --gpus-per-worker, a real CUDA OOM), then how long an async save of 1 GiB of
# CUDA state blocks the loop (benchmarks/bench_cuda_staging.py).
#
# On a GPU node with this package installed:   bash benchmarks/gpu_check.sh
# Results land in $OUT (or ./gpu-check): gpu.txt, gpu_tests.log, cuda_staging.json.
#
# On an image that has torch but not our small dependencies, put their wheels in .whl/
# first (from a machine with pip access; .whl/ is git-ignored), e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     tenacity crc32c
# and the script installs them into /tmp/site without touching the image's packages.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version())" | tee -a "$out/gpu.txt"

status=0
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
timeout 150 python3 benchmarks/bench_cuda_staging.py --size-gb 1 --repeats 5 \
    --out "$out/cuda_staging.json" 2>&1 | tee "$out/cuda_staging.log" || status=1
exit $status
