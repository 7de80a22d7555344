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
# LIMIT (seconds a run, default 420) bounds each point; a point that runs out of it leaves
# only its log. SMOKE=1 runs 20 steps on 640 trees into a scratch data folder (the plumbing).
set -u
if [ $# -eq 0 ]; then
    echo "usage: bash benchmarks/gpu_paper_runs.sh \"<sweep file in configs/sweeps> --<axis>=<label> ...\" ..." >&2
    exit 2
fi
OUT=${OUT:-/tmp/paper_runs}
SMOKE=${SMOKE:-0}
LIMIT=${LIMIT:-420}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
PACK=paper_runs.tgz
source "$(dirname "$0")/_lent_machine.sh"

# The presets' accelerator and devices stay auto (one GPU there): an override would be part of
# the run's config, and the report would not pool its accuracy with the CPU runs'.
FIT=()
if [ "$SMOKE" = 1 ]; then
    FIT=(--trainer.max_steps 20 --trainer.val_check_interval 10 --data.data_dir "$(mktemp -d)"
        --data.train_size 640 --data.val_size 64 --data.test_size 64)
fi
step_machine
i=0
for point in "$@"; do
    i=$((i + 1))
    read -r -a words <<<"$point"
    sweep=configs/sweeps/${words[0]}
    name=$(sed -n 's/^name: *//p' "$sweep")
    step "run$i" "$LIMIT" $PY -m macformer_lit sweep "$sweep" "${words[@]:1}" --point \
        --runs_dir "$WORK/runs" --wandb_mode disabled ${FIT[@]+-- "${FIT[@]}"}
    for run in "$WORK/runs/$name"/*/version_*; do
        [ -f "$run/metrics.csv" ] && grep -q "test/acc" "$run/metrics.csv" || continue
        dest="$WORK/results/lra_listops/$name/${run#"$WORK/runs/$name/"}"
        mkdir -p "$dest" && cp "$run/config.yaml" "$run/metrics.csv" "$dest/"
    done
    find "$WORK/runs" -name '*.ckpt' -delete 2>/dev/null
    rm -rf "$WORK/runs"/*/*/version_*/wandb
    pack
done
echo "=== done $(date +%T); outputs in $OUT/$PACK"
