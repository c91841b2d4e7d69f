"""The rollout with and without --task.stop-when-ended: the policy script itself, on a chat task with long responses,
once with sampling that stops when every response of the batch has ended and once with OpenAI's fixed length,
alternating, each pair on the same flags and seed (so on the same queries). Per run: each update's time/generation
(the sampling), time/logprobs (the rollout's forwards), time/ppo_epochs and the columns sampled
(objective/sampled_length), from its metrics.jsonl. One JSON line per run, then a table of medians.

    python -m benchmark.speed.stop_when_ended                       # SmolLM2-135M-Instruct, sums, 256-token responses
    python -m benchmark.speed.stop_when_ended --repeats 1 --updates 1 --base-model DIR --dataset FILE.jsonl

The default model and task are the arithmetic quick start's (prepared into .cache/ by `python quickstart.py --task
arithmetic`, or here on first use: quickstart_assets.py). Both arms train the same way until their responses differ:
the same queries, the same first draws; PPO then runs on the columns sampled (docs/chat.md says what that changes).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

REPO = Path(__file__).resolve().parents[2]
PHASES = ("time/generation", "time/logprobs", "time/ppo_epochs")


@dataclass
class Args:
    base_model: Optional[str] = None
    """a chat model directory (default: the quick start's SmolLM2-135M-Instruct, prepared into .cache/)"""
    dataset: Optional[str] = None
    """a JSON-lines query dataset with `text` and `answer` (default: the arithmetic quick start's sums)"""
    reward_function: str = "arithmetic_task:answer_reward"
    """the --rewards.function of both arms"""
    response_length: int = 256
    """tokens a response may take (the budget that fixed-length sampling always spends)"""
    query_length: int = 46
    """tokens of the templated prompt"""
    batch_size: int = 16
    """episodes per update"""
    updates: int = 2
    """updates per run"""
    repeats: int = 2
    """pairs of runs (stopping, then fixed length)"""
    threads: int = 2
    """torch threads of each run"""
    mixed_precision: str = "no"
    """the scripts' --mixed-precision"""


def run_once(args: Args, stop: bool, output: Path) -> dict:
    """One policy run; its per-update phase times and sampled columns."""
    flags = ["--base-model", args.base_model, "--task.chat-template", "--task.query-dataset", args.dataset,
             "--task.query-length", str(args.query_length), "--task.response-length", str(args.response_length),
             "--rewards.function", args.reward_function, "--ppo.batch-size", str(args.batch_size),
             "--ppo.total-episodes", str(args.batch_size * args.updates), "--ppo.whitening-ranks", "1",
             "--local-rollout-forward-batch-size", str(args.batch_size), "--mixed-precision", args.mixed_precision,
             "--print-sample-output-freq", "1000000", "--no-tensorboard", "--output-dir", str(output),
             "--task.stop-when-ended" if stop else "--task.no-stop-when-ended"]  # fmt: skip
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1",
                   "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "offline"}  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(REPO / "train_policy_accelerate.py"), *flags], cwd=REPO,
                            env=environment, capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"stop_when_ended: the policy run failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {
        "stop_when_ended": stop,
        "wall_s": time.perf_counter() - start,
        **{phase: [row[phase] for row in rows] for phase in PHASES},
        "sampled_length": [row.get("objective/sampled_length", args.response_length) for row in rows],
    }


def main(args: Args) -> list[dict]:
    if args.base_model is None or args.dataset is None:
        import quickstart_assets

        cache = REPO / ".cache"
        args.base_model = args.base_model or str(quickstart_assets.prepare_smollm2(cache))
        args.dataset = args.dataset or str(quickstart_assets.prepare_arithmetic(cache))
    results, scratch = [], Path(tempfile.mkdtemp(prefix="stop-when-ended-"))
    try:
        for repeat in range(args.repeats):
            for stop in (True, False):
                result = run_once(args, stop, scratch / f"run-{repeat}-{stop}")
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n| sampling | updates | {' | '.join(PHASES)} | columns sampled |\n|---|---|---|---|---|---|")
    for stop in (True, False):
        runs = [result for result in results if result["stop_when_ended"] == stop]
        medians = [statistics.median(value for run in runs for value in run[phase]) for phase in PHASES]
        lengths = [value for run in runs for value in run["sampled_length"]]
        name = "stops when every response ended" if stop else "fixed length (OpenAI)"
        print(f"| {name} | {sum(len(run[PHASES[0]]) for run in runs)} | "
              + " | ".join(f"{median:.2f} s" for median in medians)
              + f" | {min(lengths)}-{max(lengths)} of {args.response_length} |")  # fmt: skip
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
