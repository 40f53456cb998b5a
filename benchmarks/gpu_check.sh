#!/usr/bin/env bash
# The GPU check: what CPU tests cannot show, on one CUDA GPU, in about 5 minutes (4 min 15 s on an H200
# for steps 1-7; step 8's fp8 GEMMs and 100 fp8 steps are not yet timed on a GPU).
#
#   benchmarks/gpu_check.sh                  # on a machine with a CUDA GPU (uses GPU 0)
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh  # CPU dry run: the same steps, tiny models (CI runs this)
#   GPU_CHECK_OUT=<dir>                      # where the logs and JSON results go (default: a temporary folder)
#
#   1. the suite's CUDA-capable tests (pytest -m cuda): ZeRO stages with fused AdamW on the device vs one CPU
#      process, fused vs foreach AdamW, a one-rank trainer on the device vs the CPU (ZeRO-1, offload of the
#      optimizer and of the parameters, ZeRO-3 unsharded accumulation, MoE); ring attention's blocks on the
#      device (flash / memory-efficient / math kernels, chosen per dtype and head dim) vs fp64 full attention,
#      with one block's time beside the math kernel's ($out/ring_kernels.json, printed after the step); an
#      MoE block (mixtral, deepseek) compiled by inductor in bf16 against eager (torch's grouped op traced);
#   2. the Quickstart's training command on the device (NCCL, one rank; its log shows the loss);
#   3. mode=calibrate on the device for the ~1.1B GPT of step 4 (writes hardware.json);
#   4. python -m benchmarks.gpu_mfu: the ~1.1B GPT in bf16 at several micro-batches and with full activation
#      checkpointing: tokens/s, MFU, memory and step time beside the planner's (stock and calibrated profile);
#   5. python -m benchmarks.gpu_vs_torch: our single-process bf16 step against plain PyTorch's (autocast); then
#      both under torch.compile (ours: train.compile=true, each block and the loss; theirs: the whole model),
#      4 layers so that inductor's compile fits (the dry run traces with the eager backend only);
#   6. python -m benchmarks.checkpoint --world 1: a background save's stall against a synchronous one;
#   7. python -m benchmarks.gpu_check: a checkpoint saved and resumed on the device;
#   8. fp8 (train.precision=fp8): python -m benchmarks.fp8 gemm, a column layer's forward and backward through
#      torch._scaled_mm against the emulation (≤ 1e-3) and its time beside bf16's; the Quickstart at fp8, its final
#      loss within 2 % of step 2's (the CPU dry run skips this step: tests/benchmarks/test_fp8_bench.py runs it).
# Every step runs even if one before it failed (one device session shows everything); the exit status is
# 0 when every step passed, else the number of failed steps (2 as well: no GPU and no dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${GPU_CHECK_OUT:-$(mktemp -d -t gridtrain-gpu-check-XXXX)}"
mkdir -p "$out"
export GPU_CHECK_OUT="$out"  # the tests that leave results write them here (ring_kernels.json)
start=$SECONDS
failed=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record a failure and go on
    local name=$1 limit=$2
    shift 2
    echo
    echo "== [$((SECONDS - start)) s] $name: $*"
    timeout "$limit" "$@"
    local rc=$?
    if ((rc != 0)); then
        failed+=("$name (exit $rc$( ((rc == 124)) && echo ": over ${limit} s"))")
        echo "== $name FAILED (exit $rc)"
    fi
}

# the ~1.1B GPT of benchmarks.gpu_mfu, for calibrate
big=(model.n_layers=20 model.d_model=2048 model.n_heads=16 model.n_kv_heads=16 model.d_ff=8192
    model.seq_len=2048 model.vocab_size=50304 train.precision=bf16 train.micro_batch=4)
if [[ "${GPU_CHECK_DRY:-0}" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""  # every step takes its CPU path
    echo "GPU check: CPU dry run (GPU_CHECK_DRY=1): same steps, tiny models, no figures worth reading"
    # one of the marked tests proves the step runs; the whole suite (these tests included) runs on the CPU anyway
    test_args=(-k "fused_adamw_on_the_device_matches_foreach or cuda_device_equal_full_attention")
    # one rank, as on the one GPU the real check uses (calibrate spawns no collectives' ranks there either)
    big=(model.n_layers=2 model.d_model=64 model.n_heads=4 model.seq_len=32 train.micro_batch=2 train.threads=1
        plan.world_size=1)
    # the dry run proves the command trains, not how far or how fast (a set peak: the CPU is not measured)
    quick=(train.max_steps=2 train.threads=1 logger.peak_tflops=1)
    mfu_args=()
    vs_args=()
    compile_args=(--compile eager)
    ckpt_args=(--d 64 --layers 2 --seq 32 --rounds 1)
    fp8=0
else
    if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "GPU check: no CUDA device visible to torch; GPU_CHECK_DRY=1 runs the CPU dry run" >&2
        exit 2
    fi
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
    test_args=()
    quick=(train.max_steps=100)
    mfu_args=(--steps 6 --warmup 2)
    vs_args=()
    compile_args=(--compile inductor --layers 4)
    ckpt_args=(--d 1024 --layers 8 --seq 1024 --rounds 3)
    fp8=1
fi

step "1/8 CUDA-capable tests" 300 python -m pytest -q -n 0 -p no:cacheprovider -m cuda \
    tests/test_cuda_ready.py tests/parallel/layers/test_ring_kernels.py tests/models/test_compile_moe.py \
    "${test_args[@]}"
[[ -f "$out/ring_kernels.json" ]] && python -c "import json, sys; r = json.load(open(sys.argv[1])); \
print('ring attention blocks:', {c['dtype'] + ' d=' + str(c['head_dim']): c['kinds'] for c in r['cases']}, \
r['block_timing'])" "$out/ring_kernels.json"
step "2/8 Quickstart training on the device" 180 python -m recipes.gpt_tiny "${quick[@]}" logger.progress=false \
    "hydra.run.dir=$out/quickstart"
step "3/8 mode=calibrate" 180 python -m recipes.gpt_tiny mode=calibrate "${big[@]}" "hydra.run.dir=$out/calibrated"
hw=(--hardware "$out/calibrated/hardware.json")
[[ -f "$out/calibrated/hardware.json" ]] || hw=()
step "4/8 MFU and step time vs the planner" 300 python -m benchmarks.gpu_mfu "${mfu_args[@]}" "${hw[@]}" \
    --micro-batches 1,4,8 --json "$out/mfu.json"
step "4/8 (full activation checkpointing)" 120 python -m benchmarks.gpu_mfu "${mfu_args[@]}" "${hw[@]}" \
    --micro-batch 4 --checkpointing full --json "$out/mfu_full_ckpt.json"
step "5/8 ours vs plain PyTorch" 180 python -m benchmarks.gpu_vs_torch "${vs_args[@]}" --json "$out/vs_torch.json"
export TORCHINDUCTOR_CACHE_DIR="$out/inductor"  # the compiled step's kernels stay with the results
step "5/8 (torch.compile)" 240 python -m benchmarks.gpu_vs_torch "${compile_args[@]}" --json "$out/vs_torch_compiled.json"
step "6/8 background vs synchronous checkpoint" 180 python -m benchmarks.checkpoint --world 1 "${ckpt_args[@]}"
step "7/8 checkpoint save and resume" 120 python -m benchmarks.gpu_check
if ((fp8)); then
    step "8/8 fp8 GEMMs: torch._scaled_mm vs emulation, vs bf16" 120 python -m benchmarks.fp8 gemm --size 8192 \
        --json "$out/fp8_gemm.json"
    step "8/8 (the Quickstart at fp8)" 180 python -m recipes.gpt_tiny "${quick[@]}" train.precision=fp8 \
        logger.progress=false "hydra.run.dir=$out/quickstart_fp8"
    step "8/8 (fp8 vs the Quickstart's loss)" 30 python -m benchmarks.fp8 compare "$out/quickstart" "$out/quickstart_fp8"
else
    echo "== 8/8 fp8: skipped in the dry run (tests/benchmarks/test_fp8_bench.py runs benchmarks.fp8 on the CPU)"
fi

echo
if ((${#failed[@]})); then
    echo "GPU check: ${#failed[@]} step(s) failed in $((SECONDS - start)) s: ${failed[*]}"
    exit "${#failed[@]}"
fi
echo "GPU check passed in $((SECONDS - start)) s (results in $out)"
