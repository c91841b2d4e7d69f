#!/usr/bin/env bash
# Gradient accumulation must not change the math: per seed, train the reward model without and with
# accumulation (global batch 32 = 1 x 32 and 4 x 8), then the policy without and with accumulation (512 = 1 x 512
# and 8 x 64), both policies against the *same* reward model (the unaccumulated one), so the two policy curves
# differ only by accumulation (and float summation order). The policy runs stop at 100k episodes (~196 updates):
# enough to see the curves overlay or drift apart.
#
# Resources per seed: 1 GPU of 80 GB (one process keeps it to accumulation alone): the accumulation-1 policy (gpt2,
# fp32, micro-batch 512) needs ~41 GB by run_utils' estimate (`--dry-run`; docs/memory.md), more than 90% of an A100
# 40 GB, the `gpu` queue of benchmark/launch/aws/pcluster.yaml. Time per seed (ESTIMATE): 2 reward models ~15 min each,
# 2 policies ~15-20 min each, ~1.2 h in all. 3 seeds, ~4 GPU-hours.
#
#   bash benchmark/launch/grad_accum.sh --slurm --workers 3 --slurm-partition gpu-80gb
# then: python -m benchmark.openai.compare_reported --task sentiment \
#           --runs "accum-1=runs/grad_accum/sentiment/policy_accum1_*" \
#           --runs "accum-8=runs/grad_accum/sentiment/policy_accum8_*" --openai-source none
#       python -m benchmark.openai.compare_reported --task sentiment \
#           --runs "accum-1=runs/grad_accum/sentiment/reward_accum1_*" \
#           --runs "accum-4=runs/grad_accum/sentiment/reward_accum4_*" --metrics train/loss train/accuracy
set -euo pipefail
cd "$(dirname "$0")/../.."

# sentiment: 3 seeds x 1 GPU, four runs per seed
python -m benchmark.launch.launcher --job-name grad-accum --num-seeds 3 \
    --command "python train_reward_accelerate.py --base-model gpt2 --label-dataset sentiment/offline_5k.json \
        --gradient-accumulation-steps 1 --output-dir runs/grad_accum/sentiment/reward_accum1_{seed}" \
    --command "python train_reward_accelerate.py --base-model gpt2 --label-dataset sentiment/offline_5k.json \
        --gradient-accumulation-steps 4 --output-dir runs/grad_accum/sentiment/reward_accum4_{seed}" \
    --command "python train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/grad_accum/sentiment/reward_accum1_{seed}/reward_model \
        --ppo.total-episodes 100000 --ppo.gradient-accumulation-steps 1 \
        --output-dir runs/grad_accum/sentiment/policy_accum1_{seed}" \
    --command "python train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/grad_accum/sentiment/reward_accum1_{seed}/reward_model \
        --ppo.total-episodes 100000 --ppo.gradient-accumulation-steps 8 \
        --output-dir runs/grad_accum/sentiment/policy_accum8_{seed}" \
    --slurm-gpus-per-task 1 --slurm-cpus-per-task 8 \
    "$@"
