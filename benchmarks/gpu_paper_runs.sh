#!/bin/bash
# Paper-setting runs on a lent CUDA machine: sweep points run one after another, each under
# its own limit, and each finished run's config.yaml and metrics.csv packed into
# $OUT/paper_runs.tgz at once, laid out as results/lra_listops/<sweep>/<point>/version_0/ so
# that they are committed exactly as the run wrote them (the report then shows them as GPU
# rows: runs/<sweep>/<point>/sweep_run.log has the rest). ListOps data is generated there on
# first use (LRA's 96,000 / 2,000 / 2,000 trees; data/lra is not carried).
#
#   MACFORMER_LIT_COMMIT=<sha> bash benchmarks/gpu_paper_runs.sh \
#       "lra_listops_table2.yaml --method=softmax --seed=1" \
#       "lra_listops_table2.yaml --method=softmax --seed=2"
#   SMOKE=1 bash benchmarks/gpu_paper_runs.sh "lra_listops_table2.yaml --method=softmax --seed=1"
#
# LIMIT (seconds a run, default 420) bounds each point. A point that runs out of it saves
# last.ckpt (SIGTERM) and comes back as $OUT/resume_<n>.tgz (its folder under RUNS, default
# runs/lent, checkpoints included, W&B excluded). To go on in the next lease, unpack them into
# the checkout (mkdir -p runs/lent && for f in resume_*.tgz; do tar xzf $f -C runs/lent; done),
# carry runs/lent and give the same command: each unfinished point resumes where it stopped
# (the sweep's --ckpt_path last), finished ones are skipped.
# SMOKE=1 runs 20 steps on 640 trees into a scratch data folder (the plumbing; DATA_DIR keeps
# one folder across calls).
# PARALLEL=1 generates the data once, then runs all points at the same time on the one GPU
# (each is launch-bound, so they share it well; CUDA MPS is started where the machine allows,
# to let their kernels overlap): a short lease then fits several points, but their
# train/time_sec measures a shared GPU, not a backend's speed.
set -u
if [ $# -eq 0 ]; then
    echo "usage: bash benchmarks/gpu_paper_runs.sh \"<sweep file in configs/sweeps> --<axis>=<label> ...\" ..." >&2
    exit 2
fi
OUT=${OUT:-/tmp/paper_runs}
SMOKE=${SMOKE:-0}
LIMIT=${LIMIT:-420}
PARALLEL=${PARALLEL:-0}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
RUNS=${RUNS:-$PWD/runs/lent}
PACK=paper_runs.tgz
source "$(dirname "$0")/_lent_machine.sh"

# The presets' accelerator and devices stay auto (one GPU there): an override would be part of
# the run's config, and the report would not pool its accuracy with the CPU runs'.
FIT=()
DATA=(--data_dir data/lra)
if [ "$SMOKE" = 1 ]; then
    DATA=(--data_dir "${DATA_DIR:-$(mktemp -d)}" --train_size 640 --val_size 64 --test_size 64)
    FIT=(--trainer.max_steps 20 --trainer.val_check_interval 10 "${DATA[@]/#--/--data.}")
fi
collect() {  # each finished run's config.yaml and metrics.csv, at their results/ path, and its
    # point's log; its checkpoints go (a running point's stay: it tests its best one at the end)
    local run dest point
    for run in "$RUNS"/*/*/version_*; do
        [ -f "$run/metrics.csv" ] && grep -q "test/acc" "$run/metrics.csv" || continue
        dest="$WORK/results/lra_listops/${run#"$RUNS/"}"
        mkdir -p "$dest" && cp "$run/config.yaml" "$run/metrics.csv" "$dest/"
        point=$(dirname "$run")
        mkdir -p "$WORK/runs/${point#"$RUNS/"}"
        cp "$point"/sweep_* "$WORK/runs/${point#"$RUNS/"}/" 2>/dev/null
        find "$run" -name '*.ckpt' -delete
        rm -rf "$run/wandb"
    done
}
keep_unfinished() {  # every point under RUNS without a tested run comes back whole
    # (checkpoints too) as $OUT/resume_<n>.tgz, to go on in the next lease
    local point n=0
    rm -f "$OUT"/resume_*.tgz
    for point in "$RUNS"/*/*/; do
        point=${point%/}
        compgen -G "$point/version_*/checkpoints/*.ckpt" >/dev/null || continue
        grep -qs "test/acc" "$point"/version_*/metrics.csv && continue
        n=$((n + 1))
        tar czf "$OUT/resume_$n.tgz" -C "$RUNS" --exclude=wandb --exclude=.lock \
            "${point#"$RUNS/"}" &&
            echo "=== unfinished: ${point#"$RUNS/"} in $OUT/resume_$n.tgz ($(du -h "$OUT/resume_$n.tgz" | cut -f1))"
    done
}
run_point() {  # run_point I "SWEEP --axis=label ...": one sweep point under LIMIT
    local words
    read -r -a words <<<"$2"
    step "run$1" "$LIMIT" $PY -m macformer_lit sweep "configs/sweeps/${words[0]}" "${words[@]:1}" \
        --point --runs_dir "$RUNS" --wandb_mode disabled ${FIT[@]+-- "${FIT[@]}"}
}
step_machine
if [ "$PARALLEL" = 1 ]; then
    # The data once, before the points start (each would otherwise generate its own copy).
    step data 120 $PY -c "import sys; from macformer_lit.data.listops import ListOpsDataModule as D
a = sys.argv[1:]; kw = {a[i].lstrip('-'): a[i + 1] for i in range(0, len(a), 2)}
D(**{k: v if k == 'data_dir' else int(v) for k, v in kw.items()}).prepare_data()" "${DATA[@]}"
    if [ "$SMOKE" != 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
        MPS=1
        step mps 40 bash -c "nvidia-cuda-mps-control -d && timeout 25 $PY -c 'import torch
print(\"MPS client ok:\", torch.ones(1, device=\"cuda\").sum().item())'" || {
            echo quit | nvidia-cuda-mps-control
            MPS=0
            echo "MPS off: the points time-share the GPU"
        }
    fi
    i=0
    for point in "$@"; do
        i=$((i + 1))
        { run_point "$i" "$point"; collect; pack; } &
    done
    wait
    keep_unfinished
    # The MPS daemon would outlive this script (seen on a lent H100: still running in the next
    # call on the warm machine), and every later CUDA program there would go through it.
    [ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
else
    i=0
    for point in "$@"; do
        i=$((i + 1))
        run_point "$i" "$point"
        collect
        keep_unfinished
        pack
    done
fi
pack
echo "=== done $(date +%T); outputs in $OUT/$PACK"
