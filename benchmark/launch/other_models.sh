#!/usr/bin/env bash
# Other base models of about gpt2's size: EleutherAI/pythia-160m (GPT-NeoX tokenizer) and HuggingFaceTB/SmolLM2-135M
# (Llama architecture, the model of the offline quick start), with gpt2 as the control, OpenAI's hyperparameters.
# OpenAI's label files hold GPT-2 token ids, which mean other tokens (pythia) or fall outside the vocabulary
# (SmolLM2) for these tokenizers, so every run here labels its own samples with the simulated labelers
# (--labels.source sentiment|descriptiveness: VADER / adjective share); the base model is the only
# difference between the runs of a task. OpenAI's numbers (human labels) are not the reference here.
#
# Resources per seed: 1 node, 8 GPUs. Time per seed (ESTIMATE): reward incl. labelling ~20 min, policy ~1-2 h.
# 18 seeds, ~250 GPU-hours.
#
#   bash benchmark/launch/other_models.sh --slurm --workers 6 --slurm-partition gpu
# then: python -m benchmark.openai.compare_reported --task sentiment --openai-source none \
#           --runs "gpt2=runs/other_models/gpt2/sentiment/policy_*" \
#           --runs "pythia-160m=runs/other_models/pythia-160m/sentiment/policy_*" \
#           --runs "smollm2-135m=runs/other_models/smollm2-135m/sentiment/policy_*"
set -euo pipefail
cd "$(dirname "$0")/../.."

# gpt2, sentiment (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name gpt2-sentiment --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --labels.source sentiment --output-dir runs/other_models/gpt2/sentiment/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/other_models/gpt2/sentiment/reward_{seed}/reward_model \
        --output-dir runs/other_models/gpt2/sentiment/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# gpt2, descriptiveness (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name gpt2-descriptiveness --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --labels.source descriptiveness --output-dir runs/other_models/gpt2/descriptiveness/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/other_models/gpt2/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/other_models/gpt2/descriptiveness/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# pythia-160m, sentiment (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name pythia-sentiment --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model EleutherAI/pythia-160m \
        --labels.source sentiment --output-dir runs/other_models/pythia-160m/sentiment/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model EleutherAI/pythia-160m \
        --rewards.trained-model runs/other_models/pythia-160m/sentiment/reward_{seed}/reward_model \
        --output-dir runs/other_models/pythia-160m/sentiment/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# pythia-160m, descriptiveness (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name pythia-descriptiveness --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model EleutherAI/pythia-160m \
        --labels.source descriptiveness --output-dir runs/other_models/pythia-160m/descriptiveness/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model EleutherAI/pythia-160m \
        --rewards.trained-model runs/other_models/pythia-160m/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/other_models/pythia-160m/descriptiveness/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# smollm2-135m, sentiment (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name smollm2-sentiment --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model HuggingFaceTB/SmolLM2-135M \
        --labels.source sentiment --output-dir runs/other_models/smollm2-135m/sentiment/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model HuggingFaceTB/SmolLM2-135M \
        --rewards.trained-model runs/other_models/smollm2-135m/sentiment/reward_{seed}/reward_model \
        --output-dir runs/other_models/smollm2-135m/sentiment/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# smollm2-135m, descriptiveness (simulated labeler): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name smollm2-descriptiveness --num-seeds 3 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model HuggingFaceTB/SmolLM2-135M \
        --labels.source descriptiveness --output-dir runs/other_models/smollm2-135m/descriptiveness/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model HuggingFaceTB/SmolLM2-135M \
        --rewards.trained-model runs/other_models/smollm2-135m/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/other_models/smollm2-135m/descriptiveness/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"
