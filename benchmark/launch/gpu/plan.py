"""The plan of benchmark/launch/gpu/check.sh: its configurations in order, each with its estimated seconds on one H100 /
H200 and the total against the budget. An estimate from a FLOP count at assumed rates plus start-up costs: nothing is
run, measured or imported beyond the standard library (a login node without torch can print it).

    PLAN=1 bash benchmark/launch/gpu/check.sh            # the plan of what check.sh would run (it calls this)
    python3 -m benchmark.launch.gpu.plan --runs "gpt2:fp32 gpt2-large:fp32" --batch 512 --updates 1 --gpus 1
"""

import argparse
import math

SIZES = {
    "tiny": (2, 128),
    "gpt2": (12, 768),
    "gpt2-medium": (24, 1024),
    "gpt2-large": (36, 1280),
    "gpt2-xl": (48, 1600),
}
"""(layers, d_model) of the models check.sh builds (random weights, GPT-2's vocabulary)"""
VOCAB = 50257
QUERY, RESPONSE, EPOCHS = 64, 24, 4  # check.sh's policy task: OpenAI's query and response lengths, 4 PPO epochs
REWARD_BATCH, REWARD_EVAL = 32, 256  # check.sh's reward configuration: OpenAI's label batch, 256 held-out labels
ROLLOUT_CHUNK = 64  # rows per sampling loop (--local-rollout-forward-batch-size)
CONFIGS = {  # name: (stage, precision of the matrix products, DeepSpeed, --compile)
    "zero2": ("policy", "fp32", True, False),
    "reward": ("reward", "fp32", False, False),
    "fp32": ("policy", "fp32", False, False),
    "tf32": ("policy", "tf32", False, False),
    "bf16+tf32": ("policy", "bf16", False, False),
    "bf16+tf32+compile": ("policy", "bf16", False, True),
}
# Assumed, not measured (no GPU has run this project yet), for an H100 or H200:
TFLOPS = {"fp32": 40, "tf32": 150, "bf16": 200}  # achieved on these shapes: ~60% of the dense fp32 peak (67), ~20-30%
# of the TF32 (~495) and bf16 (~990) peaks (small products, eager kernels, fp32 log-softmax over 50k logits)
START_S = 30  # per configuration: Python and the libraries imported three times, the tokenizer, the one-step reward
# model (its normalization and 8 held-out labels), the first CUDA kernels
START_S_PER_GB = 8  # the random model's fp32 weights: initialized on CPU, saved once, loaded five times
LAYER_STEP_S = 2e-4  # one layer of one sampling step of a chunk: launch-bound (eager, ~15 kernels)
COMPILE_S, COMPILE_S_PER_LAYER = 30, 2.5  # Inductor's first compilation of the training forward, cold cache
DEEPSPEED_S = 20  # importing DeepSpeed and building its engine, for the reward and for the policy stage
ONE_RANK = "1 GPU: one DeepSpeed rank, nothing partitioned, no NCCL traffic: DeepSpeed's engine runs, ZeRO-2's sharding does not"


def trunk_parameters(layers: int, d: int) -> int:
    """The matrices a token multiplies with: attention 4 d^2 and MLP 8 d^2 per GPT-2 block."""
    return 12 * layers * d * d


def estimated_seconds(model: str, config: str, batch: int, updates: int, gpus: int) -> float:
    """One configuration of check.sh: start-up, then a warm-up and `updates` measured updates (steps)."""
    stage, precision, deepspeed, compiled = CONFIGS[config]
    layers, d = SIZES[model]
    trunk, rate = trunk_parameters(layers, d), TFLOPS[precision] * 1e12
    weights_gb = 4 * (trunk + (VOCAB + 1024) * d) / 1e9
    seconds = START_S + START_S_PER_GB * weights_gb + (DEEPSPEED_S if deepspeed else 0)
    if compiled:
        seconds += COMPILE_S + COMPILE_S_PER_LAYER * layers
    sampling_loops = RESPONSE * layers * LAYER_STEP_S  # one chunk's sampling steps
    if stage == "reward":  # one row per label: the query and its 4 samples; normalization samples a batch first
        tokens = QUERY + 4 * RESPONSE
        flops = (updates + 1) * 6 * trunk * REWARD_BATCH * tokens + 2 * trunk * REWARD_EVAL * tokens
        return seconds + flops / rate + 3 * math.ceil(REWARD_BATCH / ROLLOUT_CHUNK) * sampling_loops
    tokens, head = batch * (QUERY + RESPONSE), 2 * d * VOCAB * batch * RESPONSE
    forward = 2 * trunk * tokens + head  # the policy's (or the reference's) over every row, its head on the response
    update = forward * (3 + 3 * EPOCHS) + 2 * trunk * tokens  # sampling, 2 log-prob forwards, PPO, the reward model
    per_update = update / gpus / rate + math.ceil(batch / gpus / ROLLOUT_CHUNK) * sampling_loops
    return seconds + (updates + 1) * per_update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="check.sh's RUNS: MODEL:CONFIG ... in order")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--limit", type=int, default=150)
    parser.add_argument("--budget", type=int, default=480)
    args = parser.parse_args()
    runs = [run.partition(":")[::2] for run in args.runs.split()]  # (model, config)
    unknown = [f"{m}:{c}" for m, c in runs if m not in SIZES or c not in CONFIGS]
    if unknown:
        raise SystemExit(
            f"plan.py: unknown in RUNS: {' '.join(unknown)} (models: {list(SIZES)}; configs: {list(CONFIGS)})"
        )
    print(f"check.sh plan: {len(runs)} configurations on {args.gpus} GPU(s), batch {args.batch}, 1 warm-up + "
          f"{args.updates} measured update(s) each; ESTIMATED, not measured: achieved TFLOP/s assumed "
          + ", ".join(f"{p} {r}" for p, r in TFLOPS.items())
          + f", start-up {START_S} s + {START_S_PER_GB} s per GB of weights, compile {COMPILE_S} s + "
          f"{COMPILE_S_PER_LAYER} s per layer, DeepSpeed {DEEPSPEED_S} s")  # fmt: skip
    total = 0.0
    for i, (model, config) in enumerate(runs, 1):
        seconds = estimated_seconds(model, config, args.batch, args.updates, args.gpus)
        total += seconds
        over = f"  (over LIMIT {args.limit} s)" if seconds > args.limit else ""
        checks = f"  ({ONE_RANK})" if CONFIGS[config][2] and args.gpus == 1 else ""
        print(f"{i:3}. {model + ' ' + config:<28} ~{seconds:4.0f} s   (total ~{total:4.0f} s){over}{checks}")
    verdict = "within" if total <= args.budget else "OVER"
    print(f"total ~{total:.0f} s: {verdict} BUDGET {args.budget} s")


if __name__ == "__main__":
    main()
