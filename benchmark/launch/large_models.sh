#!/usr/bin/env bash
# Larger base models with OpenAI's hyperparameters: gpt2-large (774M) and gpt2-xl (1.5B) on both tasks, reward model
# and policy from the same base model (as OpenAI did), with DeepSpeed ZeRO-2 through
# benchmark/launch/deepspeed_zero2.yaml (8 processes, fp32, no gradient clipping). gpt2-xl is also run with PyTorch's
# Adam, where the blog saw large KL spikes. Needs `pip install -r requirements-deepspeed.txt` (the tested DeepSpeed) on
# the cluster. The policy runs write a checkpoint every 100 updates (~30 min): add `--slurm-requeue` and a preempted or
# failed node resumes there. tests/test_deepspeed.py runs these commands end to end at tiny scale under ZeRO-2 on 2
# CPU processes.
#
# Resources per seed: 1 node, 8 GPUs with 80 GB each (A100/H100). Time per seed (ESTIMATE, scaled from gpt2 by
# parameter count): gpt2-large ~5-8 h, gpt2-xl ~10-15 h. 15 seeds, roughly 1,000-1,500 GPU-hours.
#
#   bash benchmark/launch/large_models.sh --slurm --workers 3 --slurm-partition gpu-80gb --slurm-time 24:00:00
set -euo pipefail
cd "$(dirname "$0")/../.."

# gpt2-large, sentiment: 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name large-sentiment --num-seeds 3 \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_reward_accelerate.py \
        --base-model gpt2-large --label-dataset sentiment/offline_5k.json \
        --output-dir runs/large_models/gpt2-large/sentiment/reward_{seed}" \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_policy_accelerate.py \
        --base-model gpt2-large \
        --rewards.trained-model runs/large_models/gpt2-large/sentiment/reward_{seed}/reward_model \
        --output-dir runs/large_models/gpt2-large/sentiment/policy_{seed} --checkpoint-every 100" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# gpt2-large, descriptiveness: 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name large-descriptiveness --num-seeds 3 \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_reward_accelerate.py \
        --base-model gpt2-large --label-dataset descriptiveness/offline_5k.json \
        --output-dir runs/large_models/gpt2-large/descriptiveness/reward_{seed}" \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_policy_accelerate.py \
        --base-model gpt2-large \
        --rewards.trained-model runs/large_models/gpt2-large/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/large_models/gpt2-large/descriptiveness/policy_{seed} --checkpoint-every 100" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# gpt2-xl, sentiment: 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name xl-sentiment --num-seeds 3 \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_reward_accelerate.py \
        --base-model gpt2-xl --label-dataset sentiment/offline_5k.json \
        --output-dir runs/large_models/gpt2-xl/sentiment/reward_{seed}" \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_policy_accelerate.py \
        --base-model gpt2-xl --rewards.trained-model runs/large_models/gpt2-xl/sentiment/reward_{seed}/reward_model \
        --output-dir runs/large_models/gpt2-xl/sentiment/policy_{seed} --checkpoint-every 100" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# gpt2-xl, descriptiveness: 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name xl-descriptiveness --num-seeds 3 \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_reward_accelerate.py \
        --base-model gpt2-xl --label-dataset descriptiveness/offline_5k.json \
        --output-dir runs/large_models/gpt2-xl/descriptiveness/reward_{seed}" \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_policy_accelerate.py \
        --base-model gpt2-xl \
        --rewards.trained-model runs/large_models/gpt2-xl/descriptiveness/reward_{seed}/reward_model \
        --output-dir runs/large_models/gpt2-xl/descriptiveness/policy_{seed} --checkpoint-every 100" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# gpt2-xl, sentiment, PyTorch Adam (reward model and policy): 3 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name xl-adam-sentiment --num-seeds 3 \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_reward_accelerate.py \
        --base-model gpt2-xl --label-dataset sentiment/offline_5k.json --no-use-tensorflow-adam \
        --output-dir runs/large_models/gpt2-xl-torch-adam/sentiment/reward_{seed}" \
    --command "accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml train_policy_accelerate.py \
        --base-model gpt2-xl --no-use-tensorflow-adam \
        --rewards.trained-model runs/large_models/gpt2-xl-torch-adam/sentiment/reward_{seed}/reward_model \
        --output-dir runs/large_models/gpt2-xl-torch-adam/sentiment/policy_{seed} --checkpoint-every 100" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"
