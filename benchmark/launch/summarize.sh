#!/usr/bin/env bash
# The summarization tasks of the paper: tldr (Reddit posts, Hub `webis/tldr-17`) and cnndm (news articles, Hub
# `cnn_dailymail` 3.0.0), gpt2 (124M), OpenAI's settings (`--task.name` sets them all, as launch.py): 500-token
# queries + "\n\nTL;DR:" (cnndm also "Article:\n\n" before), 75-token responses cut after the first newline at index
# >= 55; reward model on OpenAI's tldr/cnndm online_45k.json labels (46,000 to train on, batch 16, lr 2.5e-5); PPO
# with batch 32, lr 2e-6, a fixed KL coefficient (tldr 0.03, cnndm 0.01), no reward whitening, 1M episodes (31,250
# updates). Each seed trains its reward model, then the policy against it.
#
# Resources per seed: 1 GPU with 80 GB. PPO batches of 32 leave 8 GPUs mostly idle (4 episodes each, and sampling
# 75 tokens one after another takes as long as on one GPU), so one GPU per seed costs far fewer GPU-hours; the
# memory flags below (ESTIMATE for 575-token sequences, not measured yet) keep a seed under 80 GB and change no
# math. On 8 GPUs: `accelerate launch --num_processes 8` and drop them (README, task table).
# Time per seed (ESTIMATE, to be replaced by measured numbers): reward model ~1 h, policy ~15-30 h on one A100/H100.
# Whole suite: 2 tasks x 3 seeds x 1 GPU, ~100-200 GPU-hours.
#
#   bash benchmark/launch/summarize.sh --dry-run                                                # print the commands
#   bash benchmark/launch/summarize.sh --slurm --workers 3 --slurm-partition gpu-80gb --slurm-time 48:00:00
# then: python -m benchmark.openai.compare_reported --task tldr --runs "ours=runs/summarize/tldr/policy_*"
set -euo pipefail
cd "$(dirname "$0")/../.."

# tldr: 3 seeds x 1 GPU
python -m benchmark.launch.launcher --job-name summarize-tldr --num-seeds 3 \
    --command "python train_reward_accelerate.py --base-model gpt2 --task.name tldr \
        --gradient-accumulation-steps 2 --eval-batch-size 64 --output-dir runs/summarize/tldr/reward_{seed}" \
    --command "python train_policy_accelerate.py --base-model gpt2 --task.name tldr \
        --rewards.trained-model runs/summarize/tldr/reward_{seed}/reward_model \
        --ppo.gradient-accumulation-steps 2 --local-rollout-forward-batch-size 32 \
        --output-dir runs/summarize/tldr/policy_{seed}" \
    --slurm-gpus-per-task 1 --slurm-cpus-per-task 8 \
    "$@"

# cnndm: 3 seeds x 1 GPU
python -m benchmark.launch.launcher --job-name summarize-cnndm --num-seeds 3 \
    --command "python train_reward_accelerate.py --base-model gpt2 --task.name cnndm \
        --gradient-accumulation-steps 2 --eval-batch-size 64 --output-dir runs/summarize/cnndm/reward_{seed}" \
    --command "python train_policy_accelerate.py --base-model gpt2 --task.name cnndm \
        --rewards.trained-model runs/summarize/cnndm/reward_{seed}/reward_model \
        --ppo.gradient-accumulation-steps 2 --local-rollout-forward-batch-size 32 \
        --output-dir runs/summarize/cnndm/policy_{seed}" \
    --slurm-gpus-per-task 1 --slurm-cpus-per-task 8 \
    "$@"
