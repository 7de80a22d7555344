# Sourced by gpu_check.sh and gpu_paper_runs.sh: what a lent machine needs before anything runs
# there, how each step runs under its own limit and is packed as it ends, and the machine step.
#   needs: OUT (results folder), PACK (archive name under $OUT), PY (python), WORK (scratch)
# Where the folder .whl holds wheels (packages the machine lacks: datasets, jsonargparse,
# omegaconf, ...), they are installed into /tmp/site first. A lent machine's .git is the
# session's start, not the tree sent: set MACFORMER_LIT_COMMIT to the tree's commit.
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
mkdir -p "$OUT" "$WORK"
echo "${MACFORMER_LIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" >"$WORK/commit.txt"

pack() {  # safe from steps running at the same time: each writes its own temporary archive;
    # tar's status 1 (a file changed while read: a run still writing) still packs the rest
    local tmp="$OUT/$PACK.$BASHPID.tmp"
    tar czf "$tmp" -C "$WORK" . 2>/dev/null
    if [ $? -le 1 ]; then mv "$tmp" "$OUT/$PACK"; else rm -f "$tmp"; fi
}
step() {  # step NAME SECONDS COMMAND...: run under a limit, log to $WORK/NAME.log, pack
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s) $(date +%T)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
    tail -n 12 "$WORK/$name.log"
    pack
    return $rc
}
step_machine() {  # the machine's GPU and versions, as the first step of a script
    step machine 60 bash -c "nvidia-smi 2>/dev/null; $PY -c 'import torch, lightning, pyarrow, fsspec, huggingface_hub as h
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())
print(\"lightning\", lightning.__version__, \"pyarrow\", pyarrow.__version__, \"fsspec\", fsspec.__version__, \"hub\", h.__version__)
if torch.cuda.is_available(): print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'"
}
