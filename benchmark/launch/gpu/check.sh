#!/usr/bin/env bash
# One short GPU check of the real training loops (benchmark/speed/throughput.py), in this order:
#   1. gpt2 zero2: GPT-2 124M under DeepSpeed ZeRO-2 on every GPU of the node (its one-step reward model is trained
#      and evaluated under ZeRO-2 too): what the CPU tests cannot show, first so that no budget cuts it. On a node of
#      one GPU that is one rank (the plan says so): DeepSpeed's engine from the bundle on CUDA, nothing partitioned,
#      no NCCL traffic;
#   2. gpt2 reward: the reward stage at OpenAI's label batch (32) with its held-out evaluation (256 labels);
#   3-5. gpt2 at OpenAI's batch of 512 episodes (64 + 24 tokens, 4 PPO epochs): fp32, bf16 + TF32, bf16 + TF32 +
#      --compile;
#   6. gpt2-large (774M) in bf16 + TF32 (micro-batches of 128: --ppo.gradient-accumulation-steps 4).
# Every policy configuration first trains a one-step reward model in its own precision and evaluates it on 8 held-out
# labels, so every launch and precision passes through the reward script's training and evaluation on the device.
# The queries start and end at a period, as books queries do, so most are left-padded: the attention runs masked, as
# on books. Each configuration appends one JSON line to $RESULTS as it finishes (its seconds, its log, and
# throughput.py's line: the times, MFU against a peak measured in its own precision, torch.cuda.max_memory_allocated
# next to run_utils' estimate of it, and each update's ppo/policy/first_ratio_max_deviation: 0 when the PPO forward
# computes exactly what the rollout computed, as on CPU) and writes its output to $OUT_DIR/<model>_<config>.log; one
# that fails or passes its time limit appends {"name": ..., "failed": ...}.
#
#   PLAN=1 bash benchmark/launch/gpu/check.sh      # the plan: configurations, order, estimated times; no run
#   bash benchmark/launch/gpu/check.sh             # a node that can reach PyPI: requirements.txt installed
#   BUNDLE=DIR bash benchmark/launch/gpu/check.sh  # an air-gapped node, DIR made by benchmark/launch/gpu/prepare.sh
#   RUNS="tiny:reward tiny:fp32" BATCH=16 ACCELERATE_USE_CPU=true bash benchmark/launch/gpu/check.sh  # on a CPU
#
# RUNS lists MODEL:CONFIG in order (models: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl; configs: the keys of FLAGS
# below); e.g. the large ones left out of the default: RUNS="gpt2-large:fp32 gpt2-large:bf16+tf32+compile".
# What is missing is installed into $SITE (default $OUT_DIR/site-packages, put on PYTHONPATH), never into the
# node's own site-packages, and only what the node lacks: a package it has, at any version, is used as it is (and
# check.sh stops at start if torch, transformers, accelerate and tyro then do not import together). With
# BUNDLE the wheels come from the bundle with no index, and the models are built from its GPT-2 tokenizer with random
# weights (no Hub). PYTHON (default python3) runs everything.
#
# Time on one H100/H200: `PLAN=1` prints an estimate per configuration (benchmark/launch/gpu/plan.py: a FLOP count at
# assumed rates plus start-up costs; not measured yet) and the total, ~5.6 min for the default RUNS. LIMIT caps each
# configuration (throughput.py --timeout: its whole process tree is killed and its temporary files removed) and
# BUDGET the whole script; before the next configuration starts, no process of the previous one remains (and, with
# nvidia-smi, no GPU process that was not there before it), each wait bounded.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PYTHON=${PYTHON:-python3}
RUNS=${RUNS:-"gpt2:zero2 gpt2:reward gpt2:fp32 gpt2:bf16+tf32 gpt2:bf16+tf32+compile gpt2-large:bf16+tf32"}
BATCH=${BATCH:-512}
UPDATES=${UPDATES:-1}
LIMIT=${LIMIT:-150}
BUDGET=${BUDGET:-480}
OUT_DIR=${OUT_DIR:-runs/gpu_check}
RESULTS=${RESULTS:-$OUT_DIR/results.jsonl}
SITE=${SITE:-$OUT_DIR/site-packages}
if [[ ${PLAN:-0} == 1 || ${1:-} == --plan ]]; then
    gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
    exec "$PYTHON" -m benchmark.launch.gpu.plan --runs "$RUNS" --batch "$BATCH" --updates "$UPDATES" \
        --gpus "$(( gpus > 0 ? gpus : 1 ))" --limit "$LIMIT" --budget "$BUDGET"
fi
"$PYTHON" -m benchmark.launch.gpu.plan --runs "$RUNS" --batch "$BATCH" --updates "$UPDATES" >/dev/null || exit 2
mkdir -p "$OUT_DIR" "$SITE" "$(dirname "$RESULTS")"
SITE=$(cd "$SITE" && pwd)
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

missing() {  # the requirement lines of the files whose package is not installed, at any version
    "$PYTHON" - "$@" <<'PYTHON'
import importlib.metadata, sys
for path in sys.argv[1:]:
    for line in open(path):
        requirement = line.split("#")[0].strip()
        if requirement:
            try:
                importlib.metadata.version(requirement.split("==")[0])
            except importlib.metadata.PackageNotFoundError:
                print(requirement)
PYTHON
}
install_missing() {  # WHEEL_DIR (empty: the package index) REQUIREMENT_FILE...: what is missing, into $SITE
    local source=$1 wanted
    shift
    wanted=$(missing "$@") || return 1
    [[ -z $wanted ]] && return 0
    echo "check.sh: installing into $SITE (the node's own packages are kept):" $wanted >&2
    # --no-deps: each dependency is a line of the files, installed only if missing too; --no-build-isolation: a
    # source distribution (DeepSpeed's, from PyPI) builds against the node's torch
    # shellcheck disable=SC2086
    DS_BUILD_OPS=0 "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation --target "$SITE" \
        ${source:+--no-index --find-links "$source"} $wanted
}
tokenizer=()
if [[ -n ${BUNDLE:-} ]]; then
    install_missing "$BUNDLE/wheels" benchmark/launch/gpu/node-requirements.txt ||
        { echo "check.sh: cannot install the bundle's wheels from $BUNDLE/wheels" >&2; exit 1; }
    tokenizer=(--tokenizer "$BUNDLE/gpt2-tokenizer")
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
fi
if [[ " $RUNS " == *":zero2 "* ]]; then
    install_missing "${BUNDLE:+$BUNDLE/deepspeed}" requirements-deepspeed.txt \
        benchmark/launch/gpu/node-deepspeed-requirements.txt ||
        echo "check.sh: cannot install requirements-deepspeed.txt: the zero2 configuration will fail" >&2
fi
# the node's packages and the installed ones work together (a node's package older than a bundled one needs fails
# here, with its error)
"$PYTHON" -c "import torch, transformers, accelerate, tyro; print(f'torch {torch.__version__}, transformers \
{transformers.__version__}, accelerate {accelerate.__version__}, tyro {tyro.__version__}, cuda available: \
{torch.cuda.is_available()}')" >&2 || { echo "check.sh: torch, transformers, accelerate and tyro do not import together (above)" >&2; exit 1; }
gpus=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")

declare -A FLAGS=(  # the training scripts' flags of each configuration (throughput.py --extra)
    [fp32]=""
    [tf32]="--allow-tf32"
    [bf16+tf32]="--mixed-precision bf16 --allow-tf32"
    [bf16+tf32+compile]="--mixed-precision bf16 --allow-tf32 --compile"
    [zero2]=""
    [reward]=""
)
declare -A LAUNCHERS=(  # `accelerate launch`, through $PYTHON
    [zero2]="$PYTHON -m accelerate.commands.launch --config_file benchmark/launch/deepspeed_zero2.yaml --num_processes $gpus"
)

tagged() {  # the processes that inherited a configuration's tag, wherever they went (its whole tree)
    grep -lsxz "GPU_CHECK_TAG=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}
gpu_processes() {  # the processes that hold a GPU context (none without nvidia-smi)
    nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | sort
}
wait_until_gone() {  # TAG GPU_PROCESSES_BEFORE: no process of the configuration left, none new on the GPU (bounded)
    local deadline=$((SECONDS + 30)) left
    while left=$(tagged "$1"); [[ -n $left ]]; do
        if (( SECONDS >= deadline )); then
            echo "check.sh: killing what is left of the configuration:" $left >&2
            # shellcheck disable=SC2086
            kill -KILL $left 2>/dev/null
            deadline=$((SECONDS + 30))
        fi
        sleep 1
    done
    deadline=$((SECONDS + 60))
    while [[ -n $(comm -13 <(echo "$2") <(gpu_processes)) ]] && (( SECONDS < deadline )); do
        sleep 1
    done
}
child=""
trap '[[ -n $child ]] && kill -TERM "$child" 2>/dev/null && wait "$child"; exit 143' TERM INT  # throughput.py cleans up

index=0
for run in $RUNS; do
    model=${run%%:*} config=${run#*:} index=$((index + 1))
    name="$model $config" log="$OUT_DIR/${model}_${config}.log" tag="$$-$index"
    stage=(--stage policy --batch-size "$BATCH")
    [[ $config == reward ]] && stage=(--stage reward --batch-size 32 --eval-labels 256)
    # gradient accumulation does not change the math (micro-batches of the same minibatch); it bounds the memory
    accumulate=""
    [[ $config != reward && ($model == gpt2-large || $model == gpt2-xl) ]] && accumulate="--ppo.gradient-accumulation-steps 4"
    limit=$(( LIMIT < BUDGET - SECONDS ? LIMIT : BUDGET - SECONDS ))
    echo "== $index. $name (time limit $limit s, log $log)" >&2
    start=$SECONDS
    if (( limit <= 0 )); then
        echo "{\"name\": \"$name\", \"seconds\": 0, \"failed\": \"BUDGET ($BUDGET s) spent before it started\"}" | tee -a "$RESULTS"
        continue
    fi
    before=$(gpu_processes) output="$OUT_DIR/.${model}_${config}.out"
    : >"$log"
    GPU_CHECK_TAG=$tag "$PYTHON" -m benchmark.speed.throughput "${stage[@]}" --model "$model" --query-length 64 \
        --response-length 24 --updates "$UPDATES" "${tokenizer[@]}" --timeout "$limit" --log "$log" \
        --extra="$accumulate ${FLAGS[$config]}" --launcher="${LAUNCHERS[$config]:-}" >"$output" 2>>"$log" &
    child=$!
    wait "$child"
    status=$? child=""
    wait_until_gone "$tag" "$before"
    line=$(tail -n 1 "$output") && rm -f "$output"
    if (( status == 0 )) && [[ $line == "{"* ]]; then
        echo "{\"name\": \"$name\", \"seconds\": $((SECONDS - start)), \"log\": \"$log\", \"result\": $line}" | tee -a "$RESULTS"
    else
        why="exit status $status"
        (( status == 124 )) && why="time limit ($limit s)"
        echo "{\"name\": \"$name\", \"seconds\": $((SECONDS - start)), \"log\": \"$log\", \"failed\": \"$why\"}" |
            tee -a "$RESULTS"
        tail -n 5 "$log" >&2
    fi
done
