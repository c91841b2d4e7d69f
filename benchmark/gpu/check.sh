#!/usr/bin/env bash
# One short GPU measurement of the real PPO loop (benchmark/throughput.py), sized to fit about 8 minutes on one
# H100/H200: GPT-2 124M and GPT-2 774M (gpt2-large) at OpenAI's batch of 512 episodes, fp32 vs bf16 + TF32 vs bf16 +
# TF32 + --compile + --logprobs-from-generation. Each configuration appends one JSON line to $RESULTS; a run that
# fails or passes its time limit appends {"name": ..., "failed": ...} and the script goes on.
#
#   bash benchmark/gpu/check.sh                     # results in runs/gpu_check/results.jsonl
#   MODELS="tiny" BATCH=16 ACCELERATE_USE_CPU=true bash benchmark/gpu/check.sh     # the same path on a CPU
#
# On a machine without PyPI or the Hub, prepare first where they are reachable: the GPT-2 tokenizer
# (`python -c "from pathlib import Path; import quickstart; quickstart.prepare_gpt2_tokenizer(Path('.cache'))"`,
# then take .cache/gpt2-tokenizer along) and wheels of any requirements.txt package the machine lacks.
#
# A full sentiment run is 1954 updates of 512 episodes (OpenAI: 4.8 h on 8 V100s), so its time on this GPU is about
# 1954 × seconds_per_update of the fastest configuration (plus the reward model and held-out evaluations).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODELS=${MODELS:-"gpt2 gpt2-large"}
BATCH=${BATCH:-512}
UPDATES=${UPDATES:-2}
LIMIT=${LIMIT:-240}
RESULTS=${RESULTS:-runs/gpu_check/results.jsonl}
mkdir -p "$(dirname "$RESULTS")"

measure() {  # name, then throughput.py flags
    local name=$1 line
    shift
    echo "== $name" >&2
    if line=$(timeout "$LIMIT" python benchmark/throughput.py --stage policy --batch-size "$BATCH" \
        --query-length 64 --response-length 24 --updates "$UPDATES" "$@" | tail -n 1) && [[ $line == "{"* ]]; then
        echo "{\"name\": \"$name\", \"result\": $line}" | tee -a "$RESULTS"
    else
        echo "{\"name\": \"$name\", \"failed\": \"exit status or time limit ($LIMIT s)\"}" | tee -a "$RESULTS"
    fi
}

for model in $MODELS; do
    # gradient accumulation does not change the math (micro-batches of the same minibatch); it bounds the memory
    accumulate="--ppo.gradient-accumulation-steps $([[ $model == gpt2-large || $model == gpt2-xl ]] && echo 4 || echo 1)"
    measure "$model fp32" --model "$model" --extra="$accumulate"
    measure "$model bf16+tf32" --model "$model" --extra="$accumulate --mixed-precision bf16 --allow-tf32"
    measure "$model bf16+tf32+compile+generation-logprobs" --model "$model" \
        --extra="$accumulate --mixed-precision bf16 --allow-tf32 --compile --logprobs-from-generation"
done
