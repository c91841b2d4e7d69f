#!/usr/bin/env bash
# Core reproduction of openai/lm-human-preferences: gpt2 (124M), sentiment and descriptiveness, 10 seeds each,
# OpenAI's hyperparameters (the scripts' defaults). Each seed trains its reward model, then the policy against it.
#
# Resources per seed: 1 node, 8 GPUs (OpenAI used 8 V100s), flags are global so the math is that of 1 GPU.
# Time per seed (ESTIMATE, to be replaced by measured numbers): reward model ~10 min, policy ~1-2 h on 8 A100/H100
# (OpenAI: 4.8 h on 8 V100). Whole suite: 20 seeds x 8 GPUs, ~250 GPU-hours.
#
#   bash benchmark/launch/core.sh --dry-run                                   # print the commands, run nothing
#   bash benchmark/launch/core.sh                                             # this machine, one seed after another
#   bash benchmark/launch/core.sh --slurm --workers 10 --slurm-partition gpu  # 2 Slurm array jobs of 10 seeds
# then (docs/reproduce.md): python -m benchmark.openai.compare_reported --task sentiment \
#           --runs "ours=runs/core/sentiment/policy_*"
set -euo pipefail
cd "$(dirname "$0")/../.."

# sentiment: 10 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name core-sentiment --num-seeds 10 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --label-dataset sentiment/offline_5k.json --output-dir runs/core/sentiment/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/core/sentiment/reward_{seed}/reward_model \
        --output-dir runs/core/sentiment/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# descriptiveness: 10 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name core-descriptiveness --num-seeds 10 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --label-dataset descriptiveness/offline_5k.json --output-dir runs/core/descriptiveness/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/core/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/core/descriptiveness/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"
