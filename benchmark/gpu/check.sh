#!/usr/bin/env bash
# One short GPU measurement of the real PPO loop (benchmark/throughput.py): GPT-2 124M and 774M (gpt2-large) at
# OpenAI's batch of 512 episodes (64 + 24 tokens, 4 PPO epochs), in fp32, bf16 + TF32, and bf16 + TF32 + --compile;
# and GPT-2 124M under DeepSpeed ZeRO-2 (benchmark/deepspeed_zero2.yaml on every GPU of
# the node, NCCL: what the CPU tests cannot show; its reward model is trained under ZeRO-2 too). Each configuration
# appends one JSON line to $RESULTS (its wall time included); one that fails or passes its time limit appends
# {"name": ..., "failed": ...} and the script goes on.
#
#   bash benchmark/gpu/check.sh                            # a node that can reach PyPI: requirements.txt installed
#   BUNDLE=DIR bash benchmark/gpu/check.sh                 # an air-gapped node, DIR made by benchmark/gpu/prepare.sh
#   MODELS=tiny BATCH=16 ACCELERATE_USE_CPU=true bash benchmark/gpu/check.sh     # the same path on a CPU
#
# With BUNDLE the node's own torch / transformers / accelerate are used (nothing of them is replaced): the bundle's
# wheels are installed with no index, and models are built from its GPT-2 tokenizer with random weights (no Hub).
#
# Time on one H100/H200 (an estimate, not measured yet): an update of GPT-2 124M at batch 512 is ~1.3e14 FLOPs (4
# epochs x 3 forwards' worth + 4 rollout forwards of ~8.6e12: 85M trunk parameters x 45k tokens x 2, plus the LM
# head on the response tokens): ~4-5 s in fp32 at half the H200's 67 TFLOP/s, a few s in bf16; gpt2-large is ~8x
# that. With start-up (imports, a random model, a 1-step reward model: ~25-40 s) and 1 warm-up + UPDATES updates,
# about 35 s + 30 s + 80 s (compile) for gpt2 and 105 s + 50 s + 120 s for gpt2-large, ~60 s for zero2: ~8 min.
# LIMIT caps each configuration and BUDGET the whole script (8 min): a configuration past either is recorded as
# failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODELS=${MODELS:-"gpt2 gpt2-large"}
CONFIGS=${CONFIGS:-"fp32 bf16+tf32 bf16+tf32+compile zero2"}
BATCH=${BATCH:-512}
UPDATES=${UPDATES:-1}
LIMIT=${LIMIT:-150}
BUDGET=${BUDGET:-480}
RESULTS=${RESULTS:-runs/gpu_check/results.jsonl}
mkdir -p "$(dirname "$RESULTS")"
tokenizer=()
if [[ -n ${BUNDLE:-} ]]; then
    python -m pip install --quiet --no-index --find-links "$BUNDLE/wheels" -r benchmark/gpu/node-requirements.txt ||
        { echo "check.sh: cannot install the bundle's wheels from $BUNDLE/wheels" >&2; exit 1; }
    tokenizer=(--tokenizer "$BUNDLE/gpt2-tokenizer")
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
fi
if [[ " $CONFIGS " == *" zero2 "* ]]; then
    if [[ -n ${BUNDLE:-} ]]; then
        install=(--no-index --find-links "$BUNDLE/deepspeed")
    else
        install=()
    fi
    python -m pip install --quiet "${install[@]}" -r requirements-deepspeed.txt ||
        echo "check.sh: cannot install requirements-deepspeed.txt: the zero2 configuration will fail" >&2
fi
gpus=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
python -c "import torch, transformers, accelerate, tyro; print(f'torch {torch.__version__}, transformers \
{transformers.__version__}, accelerate {accelerate.__version__}, tyro {tyro.__version__}, cuda available: \
{torch.cuda.is_available()}')" >&2

declare -A FLAGS=(
    [fp32]=""
    [bf16+tf32]="--mixed-precision bf16 --allow-tf32"
    [bf16+tf32+compile]="--mixed-precision bf16 --allow-tf32 --compile"
    [zero2]=""
)
declare -A LAUNCHERS=([zero2]="accelerate launch --config_file benchmark/deepspeed_zero2.yaml --num_processes $gpus")
for config in $CONFIGS; do  # configurations in order, each on every model: the last ones are cut first by BUDGET
    for model in $MODELS; do
        [[ $config == zero2 && $model != gpt2 && $model != tiny ]] && continue  # ZeRO-2 on GPT-2 124M only: ~1 min
        # gradient accumulation does not change the math (micro-batches of the same minibatch); it bounds the memory
        accumulate="--ppo.gradient-accumulation-steps $([[ $model == gpt2-large || $model == gpt2-xl ]] && echo 4 || echo 1)"
        name="$model $config"
        limit=$(( LIMIT < BUDGET - SECONDS ? LIMIT : BUDGET - SECONDS ))
        echo "== $name (time limit $limit s)" >&2
        start=$SECONDS
        if (( limit > 0 )) && line=$(timeout "$limit" python benchmark/throughput.py --stage policy --model "$model" --batch-size "$BATCH" \
            --query-length 64 --response-length 24 --updates "$UPDATES" "${tokenizer[@]}" \
            --extra="$accumulate ${FLAGS[$config]}" --launcher="${LAUNCHERS[$config]:-}" | tail -n 1) && [[ $line == "{"* ]]; then
            echo "{\"name\": \"$name\", \"seconds\": $((SECONDS - start)), \"result\": $line}" | tee -a "$RESULTS"
        else
            echo "{\"name\": \"$name\", \"seconds\": $((SECONDS - start)), \"failed\": \"exit status or time limit ($limit s)\"}" |
                tee -a "$RESULTS"
        fi
    done
done
