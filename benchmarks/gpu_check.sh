#!/bin/bash
# Everything this project checks on a CUDA machine, in one command that fits a short lease:
# the machine, the CUDA-marked tests (and the Maclaurin fast options' tests), the
# training-step benchmark (eager fp32, bf16 autocast, fp16 with a GradScaler) at every LRA
# preset, the attention benchmark, one real CLI training run in fp16 (RMFA exp + ppSBN,
# synthetic translation, test BLEU), and the compiled training
# step at the ListOps shape. At most about 10 minutes on one H100/H200. Measured on an H200
# at 598b889: machine 23 s, tests 25 s, training-step benchmark 115 s, attention benchmark
# 22 s; the fp16 fit and the compiled step ran out of their limits then (100 and 150 s): the
# fit reached step 680 of 1,200 at ~10 steps/s (before bb6a01a), and Macformer's cold
# inductor compile took over 2 minutes.
#
#   bash benchmarks/gpu_check.sh                 # results under $OUT (default /tmp/gpu_check)
#   DEVICE=cpu SMOKE=1 bash benchmarks/gpu_check.sh   # the plumbing on a CPU, tiny shapes
#
# Each step runs under its own time limit and its log and outputs are packed into
# $OUT/gpu_check.tgz after it, so a step that runs out of time costs only itself
# (benchmarks/_lent_machine.sh: wheels from .whl, MACFORMER_LIT_COMMIT). Copy the results
# into benchmarks/results/ by hand (train_step_cuda.*, attention_speed_cuda.*) and name the
# machine and commit in benchmarks/README.md.
set -u
OUT=${OUT:-/tmp/gpu_check}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
PACK=gpu_check.tgz
export WANDB_MODE=disabled
source "$(dirname "$0")/_lent_machine.sh"
mkdir -p "$WORK/bench"

if [ "$SMOKE" = 1 ]; then
    TS=(--max-len 64 --batch 2 --rounds 1 --warmup 0 --gemm-n 256 --gemm-calls 2)
    AS=(--ns 128 --repeats 1 --warmup 0)
    FIT=(--trainer.max_steps 20 --trainer.limit_val_batches 2 --trainer.limit_test_batches 2)
else
    TS=(--rounds 5)
    AS=()
    FIT=()
fi

step_machine
step tests 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_device_branches.py tests/attention/test_maclaurin_fast.py \
    tests/attention/test_triton_fused.py tests/attention/test_triton_sbn.py
step train_step 200 $PY -m benchmarks.train_step --device "$DEVICE" \
    --backends softmax,macformer,macformer_recompute,rmfa_nosbn,softmax_ppsbn,macformer_learns,macformer_fast,macformer_fused,macformer_fused_bf16,macformer_fused_bf16_triton_sbn,favor,linear,torch \
    --paths eager,bf16,fp16 "${TS[@]}" --out "$WORK/bench" --name "train_step_$DEVICE"
step attention_speed 75 $PY -m benchmarks.attention_speed --device "$DEVICE" "${AS[@]}" \
    --out "$WORK/bench" --name "attention_speed_$DEVICE"
step fit_fp16 150 $PY -m macformer_lit fit --config translation_synthetic.yaml \
    --config attention/rmfa_exp.yaml --config trainer/fp16.yaml --wandb_mode disabled \
    --experiment gpu_check_fp16 --runs_dir "$WORK/runs" "${FIT[@]}"
find "$WORK/runs" -name '*.ckpt' -delete 2>/dev/null
pack
step train_step_compile 200 $PY -m benchmarks.train_step --device "$DEVICE" --presets listops \
    --backends softmax,macformer,macformer_learns,macformer_fast,macformer_fused --paths eager,bf16,compile+bf16 "${TS[@]}" \
    --out "$WORK/bench" --name "train_step_compile_$DEVICE"
echo "=== done $(date +%T); outputs in $OUT/gpu_check.tgz"
