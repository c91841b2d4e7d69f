#!/usr/bin/env bash
# Ablation: PyTorch's Adam instead of the TF1-style Adam OpenAI used (--no-use-tensorflow-adam), both
# for the reward model and the policy; everything else as in core.sh, same seeds, so the curves pair up with it.
# Expected (blog): larger early approxkl and clipfrac, bigger KL spikes; the end score may be similar for gpt2.
#
# Resources per seed: 1 node, 8 GPUs. Time per seed (ESTIMATE): reward ~10 min, policy ~1-2 h. 20 seeds, ~250 GPU-h.
#
#   bash benchmark/launch/ablation_adam.sh --slurm --workers 10 --slurm-partition gpu
# then: python -m benchmark.openai.compare_reported --task sentiment --runs "tf-adam=runs/core/sentiment/policy_*" \
#           --runs "torch-adam=runs/ablation_adam/sentiment/policy_*"
set -euo pipefail
cd "$(dirname "$0")/../.."

# sentiment, PyTorch Adam: 10 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name adam-sentiment --num-seeds 10 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --label-dataset sentiment/offline_5k.json --no-use-tensorflow-adam \
        --output-dir runs/ablation_adam/sentiment/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/ablation_adam/sentiment/reward_{seed}/reward_model --no-use-tensorflow-adam \
        --output-dir runs/ablation_adam/sentiment/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"

# descriptiveness, PyTorch Adam: 10 seeds x 8 GPUs
python -m benchmark.launch.launcher --job-name adam-descriptiveness --num-seeds 10 \
    --command "accelerate launch --num_processes 8 train_reward_accelerate.py --base-model gpt2 \
        --label-dataset descriptiveness/offline_5k.json --no-use-tensorflow-adam \
        --output-dir runs/ablation_adam/descriptiveness/reward_{seed}" \
    --command "accelerate launch --num_processes 8 train_policy_accelerate.py --base-model gpt2 \
        --rewards.trained-model runs/ablation_adam/descriptiveness/reward_{seed}/reward_model --no-use-tensorflow-adam \
        --output-dir runs/ablation_adam/descriptiveness/policy_{seed}" \
    --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 \
    "$@"
