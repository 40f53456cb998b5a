#!/usr/bin/env bash
# The GPU check: what CPU tests cannot show, on one CUDA GPU, in under 8 minutes.
#
#   benchmarks/gpu_check.sh                  # on a machine with a CUDA GPU (uses GPU 0)
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh  # CPU dry run: the same steps, tiny models (CI runs this)
#
#   1. the suite's CUDA-capable tests (pytest -m cuda: ZeRO stages with fused AdamW on the device vs one
#      CPU process, fused vs foreach AdamW, a one-rank trainer on the device vs the CPU);
#   2. python -m benchmarks.gpu_mfu: a ~1.1B GPT in bf16, tokens/s, TFLOP/s, MFU against the GPU's
#      profile, torch.cuda.max_memory_allocated beside the planner's prediction;
#   3. python -m benchmarks.gpu_check: one checkpoint save and resume on the device.
# Exit status: 0 when every step passed; the first failing step's otherwise (2: no GPU and no dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
step() { echo; echo "== [$((SECONDS - start)) s] $*"; }

if [[ "${GPU_CHECK_DRY:-0}" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # every step takes its CPU path
    echo "GPU check: CPU dry run (GPU_CHECK_DRY=1): same steps, tiny models, no figures worth reading"
    # one of the marked tests proves the step runs; the whole suite (these tests included) runs on the CPU anyway
    test_args=(-k fused_adamw_on_the_device_matches_foreach)
    mfu_args=()
else
    if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "GPU check: no CUDA device visible to torch; GPU_CHECK_DRY=1 runs the CPU dry run" >&2
        exit 2
    fi
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
    test_args=()
    mfu_args=(--steps 10 --warmup 3)
fi

step "1/3 CUDA-capable tests: pytest -m cuda"
timeout 240 python -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_ready.py "${test_args[@]}"

step "2/3 MFU of a ~1B GPT in bf16: python -m benchmarks.gpu_mfu ${mfu_args[*]:-}"
timeout 240 python -m benchmarks.gpu_mfu "${mfu_args[@]}"

step "3/3 checkpoint save and resume: python -m benchmarks.gpu_check"
timeout 120 python -m benchmarks.gpu_check

echo
echo "GPU check passed in $((SECONDS - start)) s"
