"""This project side by side with OpenAI's own lm-human-preferences, on one CPU: the same tiny task run by both.

    python -m benchmark.openai.side_by_side --openai-src ../lm-human-preferences    # everything (~1.5 h on 2 cores)
    python -m benchmark.openai.side_by_side --openai-src DIR --stages reward update1  # some stages
    python -m benchmark.openai.side_by_side --report-only                             # tables and pictures again
    python -m benchmark.openai.side_by_side --openai-src DIR --write-reference        # + side_by_side_reference/

OpenAI's code (a checkout of https://github.com/openai/lm-human-preferences at commit cbfd210, never installed from
PyPI, where a package of that name is a dummy) runs unmodified on tensorflow-cpu 2.21 in a venv of its own that this
script builds from PyPI (benchmark/openai/tf/: the shim, the instrumented runner, the checkpoint writer). Both sides
start from the same weights (benchmark/openai/bridge.py) of the same tiny task (tests/tiny_task.py: a 2-layer
GPT-2 with GPT-2's vocabulary that has learned a 23-word corpus a little; best-of-4 labels of its own samples by the
VADER sentiment labeler; queries of 8 tokens, responses of 12 cut after a '.' at index >= 6).

Stages (each writes OUT/STAGE/, and the comparison as OUT/STAGE/comparison.json):
  assets    the tokenizer, corpus, base model, labels; OpenAI's initial model (base + this project's reward head init)
  reward    reward model training, 1 and 2 ranks: every step's loss and accuracy, the normalization's mean, std,
            gain and bias before and after (the normalizations score the same samples: OpenAI's, given to ours)
  update1   PPO update 1 on the same rollout: every stat OpenAI logs; 1 minibatch and 2 (with OpenAI's numpy
            permutations), 1 rank and 2 (mpiexec -n 2 against 2 torchrun processes)
  teacher   --teacher-updates updates, each update's rollout (OpenAI's samples) given to both sides
  scenarios the paths the base task leaves untaken (SCENARIOS, REWARD_SCENARIOS): a warm start, padded queries with a
            prefix and a suffix, gamma and lambda, 4 minibatches, a binding value clip, the controller in its range,
            no truncation, no reward whitening, a fixed KL coefficient; the reward model on padded queries
  curves    free-running learning curves, --seeds seeds a side, and seconds per update
  report    OUT/side_by_side.md (tables) and OUT/side_by_side.png (curves), from what the stages wrote
Without --openai-src the OpenAI stages are skipped with one line (the report reads what earlier runs wrote).
"""

import gzip
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

REPO = Path(__file__).resolve().parents[2]

OPENAI_COMMIT = "cbfd210bb8b08f6bc5c26878c10984b90f516c66"
OPENAI_PACKAGES = ["tensorflow-cpu==2.21.0", "typeguard==2.13.3", "regex==2026.11.19", "ftfy==6.3.1"]
"""OpenAI's dependencies that still run its code (typeguard 3 changed check_type); TF 2.21 runs TF1 code through
tf.compat.v1. Never `lm-human-preferences`: on PyPI that name is a dependency-confusion dummy."""
MPI_PACKAGES = ["mpi4py==4.1.2", "mpich==5.0.2"]
"""OpenAI's real multi-rank path (mpiexec -n 2) from PyPI wheels alone."""
STAGES = ("assets", "reward", "update1", "teacher", "scenarios", "curves", "report")

OPENAI_PAD_ID = 50259  # OpenAI's pad id for GPT-2's encoding (language/encodings.py: len(encoder) + 2)
PERIOD = 13  # GPT-2's '.': the truncate token, and the start and end text of the scenarios that cut queries

# the tiny task: one place for both sides' settings
TASK = dict(query_length=8, response_length=12, truncate_after=6, temperature=0.7)
CORPUS = dict(lines=600, seed=1)
BASE_MODEL = dict(steps=600, lr=1e-3, seed=0, saved_dropout=0.1)
"""tests/tiny_task.py's recipe: lr 1e-3 for 600 steps leaves the last hidden states varying across inputs (the
tests' lr 1e-2 for 150 steps grows an input-independent residual of norm ~170 in block 0, which squeezes a fresh
reward head's outputs into a std of 0.004 around -1.4: float32's E[r^2] - mean^2 then loses 1% of the variance). Its
config says dropout 0.1, as GPT-2's does: OpenAI trains without dropout, and so must this project's scripts."""
LABELS = dict(num_train=2048, num_test=256, seed=1)
REWARD = dict(batch_size=32, lr=3e-3, rollout_batch_size=64, normalize_samples=64)
POLICY = dict(batch_size=32, lr=1e-4, noptepochs=4, kl_coef=0.15, kl_target=1.0, kl_horizon=640)
"""PPO on the tiny task: its KL crosses the target within 40 updates, so the controller moves both ways (at most
0.2 * 32 / 640 = 1% an update)."""
QUERY_TEXTS = dict(query_prefix="", query_suffix="", start_text="", end_text="")
PPO_DEFAULTS = dict(gamma=1.0, lam=0.95, cliprange_value=0.2, whiten_rewards=True, adaptive_kl=True)
"""OpenAI's own values of the settings the base scenario leaves alone (train_policy.py PpoHParams)."""
MULTI_RANK_POLICY = dict(batch_size=64, nminibatches=2, noptepochs=2, gamma=0.9, lam=0.8, cliprange_value=0.05,
                         lr=3e-4, kl_horizon=64)  # fmt: skip
"""PPO in the multi-rank scenarios: `details`' settings, 64 episodes an update, and the KL controller inside its clip
at most of the compared updates, with a horizon of one batch, so that each move is its error itself (a KL fed to it 1%
off moves the coefficient ~1%, ten times the test's 1e-3). A batch's KL is noisy (from 1.9 to 4.2 nats in 5 updates
of the same run), so no one target keeps the error of a run inside ±0.2 by design: the rollouts come from a free run
with a fixed coefficient (`free_run`), whose draws the target does not change, and each scenario's target is then set
near the KL of those draws (KL_TARGETS)."""
KL_TARGETS = {"ranks_2": 2.348, "ranks_4": 3.6}
"""The KL targets of the multi-rank scenarios, from their free runs' KL: `ranks_2` 2.45, 3.56, 2.81, 4.15, 1.91, 4.82,
2.25 (1.62) nats, inside ±20% of 2.348 at 4 of its 7 moves (the largest window of the spread; 2.36 left the teacher-forced
run's update 5 at -0.201), `ranks_4` 5.91, 3.91,
3.23, 5.35, 3.60 (2.58), inside ±20% of 3.6 at 3 of its 5."""
MULTI_RANK = dict(
    task=dict(query_prefix="The sun", query_suffix=" the bird", start_text=".", end_text="."),
    warm_start=dict(scale=0.02, value_scale=0.2, eos_scale=0.9, seed=3),
    free_run=dict(adaptive_kl=False),
)
"""The multi-rank scenarios' task and warm start (`details`'), and their fixed-coefficient free run."""
SCENARIOS = {
    "details": dict(
        task=dict(query_prefix="The sun", query_suffix=" the bird", start_text=".", end_text="."),
        policy=dict(nminibatches=4, noptepochs=2, gamma=0.9, lam=0.8, cliprange_value=0.05, lr=3e-4, kl_target=2.5),
        warm_start=dict(scale=0.02, value_scale=0.2, eos_scale=0.9, seed=3),
        updates=6,
    ),
    "plain": dict(
        task=dict(truncate=False),
        policy=dict(whiten_rewards=False, adaptive_kl=False, kl_coef=0.05),
        updates=3,
    ),
    "ranks_2": dict(MULTI_RANK, policy=dict(MULTI_RANK_POLICY, kl_target=KL_TARGETS["ranks_2"]), updates=8, ranks=2),
    "ranks_4": dict(
        MULTI_RANK, policy=dict(MULTI_RANK_POLICY, kl_target=KL_TARGETS["ranks_4"]), updates=6, ranks=4, processes=2
    ),  # fmt: skip
}
"""Policy scenarios beyond the base one, each compared from update 1 on OpenAI's own rollouts (teacher-forced), so
that every path both scripts implement changes some compared number. `details`: the policy starts away from the
reference (a warm start: KL and values are not 0 at update 1), queries cut at a start and an end text, so padded, with
a prefix and a suffix around them, 4 minibatches and 2 epochs, gamma and lambda not 1 and 0.95, a value clip that
binds, the KL controller inside its clip range and at its top. `plain`: no truncation and no penalty, no reward
whitening, a fixed KL coefficient (OpenAI's summarization settings). `ranks_2`: OpenAI on 2 ranks (mpiexec -n 2)
against this project on 2 processes with --ppo.whitening-ranks 2, over 8 updates, each rank given its own draws of a
2-rank free run: what matters only with several processes or only after update 1 (the controller fed the KL of all
ranks, inside its clip at most updates, MULTI_RANK_POLICY; the lr schedule, Adam's state; 2 minibatches per rank),
from the `details` warm start and task; the weights after the last update are compared too. `ranks_4`: OpenAI on 4
ranks (mpiexec -n 4) against this project on 2 processes with --ppo.whitening-ranks 4: each process holds 2 of
OpenAI's ranks as whitening shares and shuffles each share with that rank's permutations, through the script's own
minibatches(). A scenario's `free_run` settings are those of the free run that draws its rollouts alone."""
SAMPLING_SCENARIO = "details"
"""The sampler is compared on this scenario's update 1: OpenAI's sampled tokens given to this project's sampler, whose
log-probs of them (its KV-cached forwards at the sampling temperature, from the warm policy, on padded contexts with
a prefix and a suffix) must be OpenAI's sampler's."""
REWARD_SCENARIOS = {
    "padded": dict(task=dict(start_text=".", end_text="."), labels=dict(num_train=512, num_test=64, seed=2)),
}
"""Reward-model scenarios beyond the base one: `padded`, queries cut at a start and an end text (so padded) in the
labels and in the normalizations' samples."""


@dataclass
class Args:
    openai_src: Optional[str] = None
    """a checkout of openai/lm-human-preferences at commit cbfd210 (git clone, then git checkout cbfd210)"""
    out: str = "runs/side_by_side"
    """where every stage writes"""
    openai_venv: str = ".cache/openai-tf-venv"
    """the venv OpenAI's code runs in, built here from PyPI the first time (~1.7 GB)"""
    stages: tuple[Literal["assets", "reward", "update1", "teacher", "scenarios", "curves", "report"], ...] = STAGES
    """stages to run, in this order (each reads what the earlier ones wrote)"""
    mpi: bool = True
    """also compare 2 ranks (installs mpi4py + mpich wheels into the venv); --no-mpi: one rank only"""
    teacher_updates: int = 12
    """updates of the teacher-forced comparison"""
    seeds: int = 10
    """free-running seeds a side"""
    updates: int = 40
    """free-running updates per seed (of POLICY's batch)"""
    curves_openai_only: bool = False
    """with the curves stage: OpenAI's runs alone, made again and checked against the committed curves_openai.csv
    (with --write-reference, their provenance)"""
    new_labels: bool = False
    """make the labels anew (this project's sampler, the VADER labeler) instead of taking the committed ones"""
    write_reference: bool = False
    """copy OpenAI's outputs of the stages run and the inputs they came from into
    benchmark/openai/side_by_side_reference/ (the CI test's data)"""
    report_only: bool = False
    """only the report stage"""


# ---------------------------------------------------------------------------------------------------------------------
# running both sides


class OpenAI:
    """OpenAI's code in its TensorFlow venv: runs benchmark/openai/tf/*.py with the shim's environment."""

    def __init__(self, args: Args, assets: Path):
        src = Path(args.openai_src).resolve()
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        if commit.returncode != 0 or commit.stdout.strip() != OPENAI_COMMIT:
            found = commit.stdout.strip() or "not a git checkout"
            raise SystemExit(f"error: --openai-src {src}: expected commit {OPENAI_COMMIT[:7]}, found {found[:12]}")
        self.src = src
        changes = self.tree_changes()
        if changes:
            raise SystemExit(f"error: --openai-src {src}: OpenAI's code must run unmodified, and these files differ "
                             f"from commit {OPENAI_COMMIT[:7]}: {' '.join(changes)}")  # fmt: skip
        self.python, self.mpi = build_openai_venv(Path(args.openai_venv), args.mpi), args.mpi
        self.versions_found = dict(openai_commit=OPENAI_COMMIT, **self.versions())
        self.environment = {**os.environ, "OAI_SRC": str(src), "OAI_TOKENIZER": str(assets / "tokenizer"),
                            "OAI_QUERIES": str(assets / "corpus.txt"), "TF_ENABLE_ONEDNN_OPTS": "0",
                            "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore"}  # fmt: skip

    def tree_changes(self) -> list[str]:
        """The files of OpenAI's checkout that differ from its commit, tracked or untracked (git status; what its
        .gitignore names, __pycache__, aside)."""
        status = subprocess.run(["git", "-C", str(self.src), "status", "--porcelain", "--untracked-files=all"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        return [line[3:] for line in status.splitlines() if line.strip()]

    @property
    def provenance(self) -> dict:
        """What a run of OpenAI's code runs on: the commit, whether its tree is clean now (computed before each run),
        the venv's versions and the CPU."""
        return dict(self.versions_found, openai_tree_clean=not self.tree_changes())

    def versions(self) -> dict:
        """What OpenAI's code ran on: the venv's Python, TensorFlow, NumPy and mpi4py, and the machine."""
        code = ("import json, platform, sys, numpy, tensorflow, mpi4py; print(json.dumps(dict(python=platform."
                "python_version(), tensorflow=tensorflow.__version__, numpy=numpy.__version__, mpi4py=mpi4py."
                "__version__)))")  # fmt: skip
        result = subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True)
        return {**json.loads(result.stdout.strip().splitlines()[-1]), "cpu": cpu_model()}

    def run(self, command: str, config: dict, ranks: int = 1, query_seed: int = 0) -> float:
        """run_openai.py COMMAND with `config` (written to config["out"]/config.json, with the command, the ranks and
        the query seed: what the reference's provenance records); returns the wall seconds."""
        out = Path(config["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=1))
        run = dict(command=command, ranks=ranks, query_seed=query_seed, config=config, provenance=self.provenance)
        (out / "run.json").write_text(json.dumps(run, indent=1))
        script = ["-m", "benchmark.openai.tf.run_openai", command, str(out / "config.json")]
        if ranks == 1:
            line = [self.python, *script]
        else:
            line = [str(Path(self.python).parent / "mpiexec"), "-n", str(ranks), self.python, *script]
        environment = {**self.environment, "OAI_QUERY_SEED": str(query_seed),
                       **({"OAI_MPI": "real", "OMP_NUM_THREADS": "1"} if ranks > 1 else {})}  # fmt: skip
        seconds = run_logged(line, out / "log.txt", environment)
        run["outputs"] = output_hashes(out)  # recorded as written: the reference's copies are checked against them
        (out / "run.json").write_text(json.dumps(run, indent=1))
        return seconds

    def write_checkpoint(self, arrays: dict, prefix: Path) -> None:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        np.savez(prefix.parent / "arrays.npz", **arrays)
        script = ["-m", "benchmark.openai.tf.checkpoint"]
        run_logged([self.python, *script, "write", str(prefix.parent / "arrays.npz"), str(prefix)],
                   prefix.parent / "checkpoint_log.txt", self.environment)  # fmt: skip

    def read_checkpoint(self, prefix: Path, arrays_path: Path) -> dict:
        script = ["-m", "benchmark.openai.tf.checkpoint"]
        run_logged([self.python, *script, "read", str(prefix), str(arrays_path)], arrays_path.with_suffix(".log"),
                   self.environment)  # fmt: skip
        return dict(np.load(arrays_path))


def output_hashes(out: Path) -> dict[str, str]:
    """The sha256 of every file a run of OpenAI's code wrote into `out` (its outputs, per rank, and its log), by name;
    not the harness's own config.json and run.json."""
    return {path.relative_to(out).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(out.rglob("*")) if path.is_file() and path.name not in ("config.json", "run.json")}  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name and core count (from /proc/cpuinfo where there is one)."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []  # fmt: skip
    return f"{names[0] if names else 'unknown'} ({os.cpu_count()} cores)"


def build_openai_venv(venv: Path, mpi: bool) -> str:
    """The venv's python, after installing OpenAI's dependencies (and the MPI wheels) the first time."""
    python = venv / "bin" / "python"
    packages = OPENAI_PACKAGES + (MPI_PACKAGES if mpi else [])
    marker = venv / "installed.json"
    if not marker.exists() or not set(packages) <= set(json.loads(marker.read_text())):
        print(f"side by side: installing {' '.join(packages)} into {venv} (once; ~1.7 GB, a minute or two)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
        marker.write_text(json.dumps(packages))
    return str(python)


def run_logged(command: list[str], log: Path, environment: dict) -> float:
    """Run a command with its output in `log`; on failure, stop with the log's tail. Returns the wall seconds."""
    start = time.time()
    with open(log, "w") as file:
        result = subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, env=environment, cwd=REPO)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(
            f"{tail}\nerror: `{shlex.join(command[:4])} ...` failed (exit {result.returncode}); log: {log}"
        )
    return time.time() - start


def run_ours(script: str, flags: list[str], out: Path, processes: int = 1, replay: Optional[Path] = None,
             policy_init: Optional[Path] = None) -> float:  # fmt: skip
    """One of this project's scripts (through benchmark/openai/replay.py when given samples, and a warm start's policy),
    replacing an earlier run in its --output-dir; returns the wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [*flags, "--overwrite"]
    warm = ["--policy-init", str(policy_init)] if policy_init else []
    target = ["-m", "benchmark.openai.replay", *warm, script, str(replay)] if replay else [str(REPO / script)]
    if processes == 1:
        command = [sys.executable, *target, *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   *target, *flags]  # fmt: skip
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
                   **({"OMP_NUM_THREADS": "1"} if processes > 1 else {})}  # fmt: skip
    return run_logged(command, out / "log.txt", environment)


def write_base_model(assets: Path, kernels: Optional[dict] = None) -> None:
    """assets/base: tests/tiny_task.py's GPT-2 trained on assets/corpus.txt, in a process of its own (one thread;
    `kernels`: environment variables such as MKL_CBWR, to check that other code paths give the same bytes)."""
    code = ("import sys; from pathlib import Path; from tests.tiny_task import write_tiny_gpt2; "
            "a = Path(sys.argv[1]); write_tiny_gpt2(a / 'base', a / 'tokenizer', "
            f"(a / 'corpus.txt').read_text().splitlines(), **{BASE_MODEL!r})")  # fmt: skip
    environment = {**os.environ, **(kernels or {}), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code, str(assets)], check=True, env=environment, cwd=REPO)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------------
# the task's settings on both sides


def task_settings(scenario: Optional[dict] = None) -> dict:
    """The task of the base scenario (TASK, no query texts around the query, truncation on) or of a scenario."""
    return {**TASK, **QUERY_TEXTS, "truncate": True, **(scenario or {}).get("task", {})}


def our_task_flags(assets: Path, scenario: Optional[dict] = None) -> list[str]:
    task = task_settings(scenario)
    return ["--base-model", str(assets / "base"), "--task.query-dataset", str(assets / "corpus.txt"),
            "--task.query-length", str(task["query_length"]), "--task.response-length", str(task["response_length"]),
            "--task.truncate-after", str(task["truncate_after"]), "--task.temperature", str(task["temperature"]),
            "--task.query-prefix", task["query_prefix"], "--task.query-suffix", task["query_suffix"],
            "--task.start-text", task["start_text"], "--task.end-text", task["end_text"], "--task.passage-rows", "1",
            *([] if task["truncate"] else ["--task.no-rejection-sampling"])]  # fmt: skip


def openai_task_hparams(assets: Path, scenario: Optional[dict] = None) -> dict:
    task = task_settings(scenario)
    return {"task.query_length": task["query_length"], "task.query_dataset": "side_by_side",
            "task.response_length": task["response_length"], "task.query_prefix": task["query_prefix"],
            "task.query_suffix": task["query_suffix"], "task.start_text": task["start_text"] or None,
            "task.end_text": task["end_text"] or None, "task.truncate_token": PERIOD if task["truncate"] else None,
            "task.truncate_after": task["truncate_after"], "task.penalty_reward_value": -1,
            "task.policy.temperature": task["temperature"],
            "task.policy.initial_model": str(assets / "openai_initial_model")}  # fmt: skip


def labels_of(scenario: Optional[dict] = None) -> dict:
    return {**LABELS, **(scenario or {}).get("labels", {})}


def our_reward_flags(assets: Path, seed: int = 1, scenario: Optional[dict] = None, labels: str = "labels.json"):
    return [*our_task_flags(assets, scenario), "--label-dataset", str(assets / labels),
            "--labels.num-train", str(labels_of(scenario)["num_train"]), "--batch-size", str(REWARD["batch_size"]),
            "--lr", str(REWARD["lr"]), "--rollout-batch-size", str(REWARD["rollout_batch_size"]),
            "--normalize-samples", str(REWARD["normalize_samples"]), "--print-sample-output-freq", "1000000",
            "--seed", str(seed)]  # fmt: skip


def openai_reward_hparams(assets: Path, seed: int = 1, scenario: Optional[dict] = None,
                          labels: str = "labels.json") -> dict:  # fmt: skip
    return {**openai_task_hparams(assets, scenario), "labels.type": "best_of_4",
            "labels.num_train": labels_of(scenario)["num_train"], "labels.source": str(assets / labels),
            "batch_size": REWARD["batch_size"], "lr": REWARD["lr"], "rollout_batch_size": REWARD["rollout_batch_size"],
            "normalize_before": True, "normalize_after": True, "normalize_samples": REWARD["normalize_samples"],
            "run.seed": seed, "run.log_interval": 10**9}  # fmt: skip


def policy_settings(scenario: Optional[dict] = None, nminibatches: int = 1) -> dict:
    """PPO's settings of the base scenario (POLICY, OpenAI's defaults for the rest) or of a scenario."""
    return {**POLICY, **PPO_DEFAULTS, "nminibatches": nminibatches, **(scenario or {}).get("policy", {})}


def our_policy_flags(assets: Path, updates: int, seed: int = 1, nminibatches: int = 1, ranks: int = 1,
                     scenario: Optional[dict] = None) -> list[str]:  # fmt: skip
    ppo = policy_settings(scenario, nminibatches)
    return [*our_task_flags(assets, scenario), "--rewards.trained-model", str(assets / "reward_model"),
            "--rewards.kl-coef", str(ppo["kl_coef"]), "--rewards.adaptive-kl.target", str(ppo["kl_target"]),
            "--rewards.adaptive-kl.horizon", str(ppo["kl_horizon"]), "--ppo.batch-size", str(ppo["batch_size"]),
            "--ppo.total-episodes", str(ppo["batch_size"] * updates), "--ppo.lr", str(ppo["lr"]),
            "--ppo.noptepochs", str(ppo["noptepochs"]), "--ppo.nminibatches", str(ppo["nminibatches"]),
            "--ppo.gamma", str(ppo["gamma"]), "--ppo.lam", str(ppo["lam"]),
            "--ppo.cliprange-value", str(ppo["cliprange_value"]),
            *([] if ppo["whiten_rewards"] else ["--ppo.no-whiten-rewards"]),
            *([] if ppo["adaptive_kl"] else ["--rewards.no-use-adaptive-kl"]),
            "--ppo.whitening-ranks", str(ranks), "--print-sample-output-freq", "1000000", "--seed", str(seed)]  # fmt: skip


def openai_policy_hparams(assets: Path, updates: int, seed: int = 1, nminibatches: int = 1,
                          scenario: Optional[dict] = None) -> dict:  # fmt: skip
    ppo = policy_settings(scenario, nminibatches)
    adaptive = {"rewards.adaptive_kl": "on", "rewards.adaptive_kl.target": ppo["kl_target"],
                "rewards.adaptive_kl.horizon": ppo["kl_horizon"]} if ppo["adaptive_kl"] else {}  # fmt: skip
    return {**openai_task_hparams(assets, scenario), "rewards.trained_model": str(assets / "openai_reward_model"),
            "rewards.kl_coef": ppo["kl_coef"], **adaptive, "ppo.batch_size": ppo["batch_size"],
            "ppo.total_episodes": ppo["batch_size"] * updates, "ppo.lr": ppo["lr"], "ppo.noptepochs": ppo["noptepochs"],
            "ppo.nminibatches": ppo["nminibatches"], "ppo.gamma": ppo["gamma"], "ppo.lam": ppo["lam"],
            "ppo.cliprange_value": ppo["cliprange_value"], "ppo.whiten_rewards": ppo["whiten_rewards"],
            "run.seed": seed, "run.log_interval": 10**9}  # fmt: skip


def reward_run_config(assets: Path, stage: Path, scenario: Optional[dict] = None, labels: str = "labels.json") -> dict:
    """The config of OpenAI's train_reward in `stage` (the reward stage's and the reward scenarios')."""
    hparams = {
        **openai_reward_hparams(assets, scenario=scenario, labels=labels),
        "run.save_dir": str(stage / "openai_run"),
    }
    return {"hparams": hparams, "out": str(stage / "openai")}


def free_run_config(assets: Path, source: Path, updates: int, seed: int = 1, name: str = "") -> dict:
    """The config of OpenAI's free train_policy run whose rollouts a stage gives both sides (`name`: a scenario's,
    with its `free_run` settings: those of the free run alone)."""
    scenario = SCENARIOS.get(name)
    if scenario and "free_run" in scenario:
        scenario = {**scenario, "policy": {**scenario["policy"], **scenario["free_run"]}}
    hparams = openai_policy_hparams(assets, updates, seed, scenario=scenario)
    return {"hparams": hparams, "out": str(source), **warm_config(assets, name)}


def forced_run_config(assets: Path, stage: Path, given: Path, updates: int, nminibatches: int, name: str = "") -> dict:
    """The config of OpenAI's train_policy on given rollouts (teacher-forced) in `stage`; a scenario's run saves its
    last checkpoint, whose weights are compared."""
    hparams = openai_policy_hparams(assets, updates, nminibatches=nminibatches, scenario=SCENARIOS.get(name))
    if name:
        hparams["run.save_dir"] = str(stage / "openai_run")
    return {"hparams": hparams, "out": str(stage / "openai"), "inject": str(given), **warm_config(assets, name)}


# ---------------------------------------------------------------------------------------------------------------------
# the stages


def stage_assets(out: Path, openai: OpenAI, new_labels: bool) -> None:
    """Tokenizer, corpus, base model and labels (this project's code, or the committed labels), and OpenAI's initial
    model from them."""
    import torch
    from transformers import AutoModel

    import train_reward_accelerate as R
    from benchmark.openai.bridge import head_to_openai, lm_arrays
    from quickstart_assets import prepare_gpt2_tokenizer
    from tests.tiny_task import synthetic_sentences

    assets = out / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copytree(prepare_gpt2_tokenizer(REPO / ".cache"), assets / "tokenizer", dirs_exist_ok=True)
    corpus = synthetic_sentences(CORPUS["lines"], CORPUS["seed"])
    (assets / "corpus.txt").write_text("\n".join(corpus) + "\n")
    write_base_model(assets)
    make_labels(assets, "labels", None, new_labels)
    # OpenAI's initial model: the base model and the reward head this project's reward script starts from (seed 1)
    tokenizer = R.load_tokenizer(str(assets / "base"))
    torch.manual_seed(1)  # as train_reward_accelerate.py's main, before it builds the reward model
    reward_model = R.RewardModel(R.load_pretrained(AutoModel, str(assets / "base")), tokenizer.pad_token_id)
    hparams, arrays = lm_arrays(assets / "base")  # and the reward head: OpenAI's init_op loads it when it is there
    head = reward_model.scalar_head
    arrays.update(head_to_openai(head.weight, head.bias, "model/heads/reward"))  # the value head is 0 on both sides
    (assets / "openai_initial_model").mkdir(exist_ok=True)
    (assets / "openai_initial_model" / "hparams.json").write_text(json.dumps(hparams))
    openai.write_checkpoint(arrays, assets / "openai_initial_model" / "model.ckpt")


def merge_ranks(directory: Path, name: str, ranks: int) -> dict:
    """An .npz OpenAI's ranks wrote one each, as one global batch: rank r's rows are rows r * N / R ... (r + 1) * N / R
    (for arrays of updates, (U, B, ...), along the batch axis)."""
    if ranks == 1:
        return dict(np.load(directory / name))
    parts = [np.load(directory / name.replace(".npz", f".rank{r}.npz")) for r in range(ranks)]
    return {key: np.concatenate([part[key] for part in parts], axis=1 if parts[0][key].ndim == 3 else 0)
            for key in parts[0].files}  # fmt: skip


def stage_reward(out: Path, openai: OpenAI, mpi: bool) -> None:
    """OpenAI's train_reward and this project's on the same labels, order and normalization samples; 1 rank's reward
    model becomes the policy stages' reward model on both sides."""
    from benchmark.openai.bridge import reward_model_arrays

    assets = out / "assets"
    for ranks in (1, 2) if mpi else (1,):
        stage = out / "reward" / f"ranks_{ranks}"
        openai.run("reward", reward_run_config(assets, stage), ranks)
        samples = merge_ranks(stage / "openai", "normalization_samples.npz", ranks)
        np.savez(stage / "samples.npz", **with_call_sites(samples, stage / "openai", ranks))
        flags = [*our_reward_flags(assets), "--output-dir", str(stage / "ours")]
        run_ours("train_reward_accelerate.py", flags, stage / "ours", ranks, replay=stage / "samples.npz")
        comparison = compare_reward(stage)
        (stage / "comparison.json").write_text(json.dumps(comparison, indent=1))
        print(f"reward, {ranks} rank(s): largest relative difference {comparison['largest']:.2e}")
    shutil.copytree(out / "reward" / "ranks_1" / "ours" / "reward_model", assets / "reward_model", dirs_exist_ok=True)
    hparams, arrays = reward_model_arrays(assets / "reward_model")
    (assets / "openai_reward_model").mkdir(exist_ok=True)
    (assets / "openai_reward_model" / "hparams.json").write_text(json.dumps(hparams))
    openai.write_checkpoint(arrays, assets / "openai_reward_model" / "checkpoints" / "model.ckpt")
    forward = forward_check(out, openai)
    print(f"bridges: largest relative difference of OpenAI's forward and ours {forward['largest']:.2e}")


def forward_check(out: Path, openai: OpenAI) -> dict:
    """The bridges' check: OpenAI's log-probs, entropies and values (Policy.analyze_responses, on the base model with
    a random value head) and rewards (TrainedRewardModel, the bridged reward model) of the same tokens as ours."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import train_policy_accelerate as P
    from benchmark.openai.bridge import head_to_openai, lm_arrays

    assets, stage = out / "assets", out / "reward" / "forward_check"
    samples = np.load(out / "reward" / "ranks_1" / "samples.npz")
    queries, responses = samples["before_queries"], samples["before_responses"]  # right-padded, OpenAI's pad id
    (stage / "policy").mkdir(parents=True, exist_ok=True)
    np.savez(stage / "tokens.npz", queries=queries, responses=responses)
    value_head = torch.nn.Linear(AutoConfig.from_pretrained(assets / "base").n_embd, 1)
    with torch.no_grad():
        value_head.weight.copy_(torch.from_numpy(np.random.RandomState(7).normal(0, 0.1, (1, value_head.in_features))))
        value_head.bias.fill_(0.5)
    hparams, arrays = lm_arrays(assets / "base")
    arrays.update(head_to_openai(value_head.weight, value_head.bias, "model/heads/value"))
    (stage / "policy" / "hparams.json").write_text(json.dumps(hparams))
    openai.write_checkpoint(arrays, stage / "policy" / "model.ckpt")
    config = {"hparams": {**openai_policy_hparams(assets, 1), "task.policy.initial_model": str(stage / "policy")},
              "out": str(stage / "openai"), "tokens": str(stage / "tokens.npz")}  # fmt: skip
    openai.run("forward", config)
    theirs = np.load(stage / "openai" / "forward.npz")
    pad = P.load_tokenizer(str(assets / "base")).pad_token_id
    policy = P.PolicyAndValueWrapper(P.load_pretrained(AutoModelForCausalLM, str(assets / "base")))
    policy.value_head.load_state_dict(value_head.state_dict())
    reward_model = P.load_reward_model(str(assets / "reward_model"))
    query_tokens, response_tokens = (torch.from_numpy(x).long() for x in (queries, responses))
    query_tokens, response_tokens = (torch.where(x == OPENAI_PAD_ID, pad, x) for x in (query_tokens, response_tokens))
    query_tokens = P.right_padding_to_left_padding(query_tokens, pad)
    tokens = torch.cat([query_tokens, response_tokens], 1)

    def our_forward(dtype) -> dict[str, np.ndarray]:
        with torch.no_grad():
            logits, values = policy.to(dtype)(tokens, queries.shape[1], pad, TASK["temperature"])
            if dtype == torch.float32:  # the scripts' own log-probs
                logprobs, entropies = P.logprobs_from_logits(logits, response_tokens, with_entropy=True)
            else:  # float64 throughout (the LM head's logits come out in fp32: recomputed from the hidden states)
                hidden = P.padded_forward(policy.lm.base_model, tokens, pad)[:, queries.shape[1] - 1 : -1]
                all_logprobs = torch.log_softmax(policy.lm.get_output_embeddings()(hidden) / TASK["temperature"], -1)
                logprobs = all_logprobs.gather(2, response_tokens[..., None]).squeeze(-1)
                entropies = -(all_logprobs.exp() * all_logprobs).sum(-1)
            scores = reward_model.to(dtype)(query_tokens, response_tokens)
        outputs = dict(logprobs=logprobs, entropies=entropies, values=values, scores=scores)
        return {key: value.double().numpy() for key, value in outputs.items()}

    ours, exact = our_forward(torch.float32), our_forward(torch.float64)  # float64: what both sides round
    rows = {}
    for key, mine in ours.items():
        difference = np.abs(mine - theirs[key])
        relative = difference / np.maximum(np.abs(theirs[key]), 1e-3)
        rows[key] = dict(scale=float(np.abs(theirs[key]).mean()), max_abs=float(difference.max()),
                         max_relative=float(relative.max()), openai_vs_float64=float(np.abs(theirs[key] - exact[key]).max()),
                         ours_vs_float64=float(np.abs(mine - exact[key]).max()))  # fmt: skip
    result = dict(rows=rows, largest=max(row["max_relative"] for row in rows.values()), tokens=int(responses.size))
    (stage / "comparison.json").write_text(json.dumps(result, indent=1))
    return result


def compare_reward(stage: Path) -> dict:
    """Every step's loss and accuracy, and each normalization's mean, std, gain and bias: OpenAI's and ours."""
    openai_steps = read_jsonl(stage / "openai" / ("reward_steps.jsonl" if (stage / "openai" / "reward_steps.jsonl")
                                                  .exists() else "reward_steps.rank0.jsonl"))  # fmt: skip
    ours = read_jsonl(stage / "ours" / "metrics.jsonl")
    ours_steps = {row["step"]: row for row in ours if "train/loss" in row}
    steps = [dict(step=row["step"], openai_loss=row["loss"], ours_loss=ours_steps[row["step"]]["train/loss"],
                  openai_accuracy=row["accuracy"], ours_accuracy=ours_steps[row["step"]]["train/accuracy"])
             for row in openai_steps]  # fmt: skip
    openai_json = (
        stage / "openai" / ("reward.json" if (stage / "openai" / "reward.json").exists() else "reward.rank0.json")
    )
    normalizations = json.loads(openai_json.read_text())["normalizations"]
    rows = []
    for phase in ("before", "after"):
        row = next(r for r in ours if f"normalization/{phase}/mean" in r)
        mean, std = row[f"normalization/{phase}/mean"], row[f"normalization/{phase}/std"]
        mine = dict(mean=mean, std=std, gain=1 / std, bias=-mean / std)
        rows += [dict(quantity=f"{phase}/{k}", openai=normalizations[phase][k], ours=mine[k]) for k in mine]
    relative = [relative_difference(s["openai_loss"], s["ours_loss"]) for s in steps]
    relative += [relative_difference(r["openai"], r["ours"]) for r in rows]
    accuracy = max(abs(s["openai_accuracy"] - s["ours_accuracy"]) for s in steps)
    return dict(steps=steps, normalization=rows, largest=max(relative), largest_accuracy_difference=accuracy)


def relative_difference(a: float, b: float, floor: float = 1e-8) -> float:
    return abs(a - b) / max(abs(a), abs(b), floor)


POLICY_STATS = ("objective/kl", "objective/kl_coef", "objective/entropy", "objective/score", "objective/score_total",
                "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "ppo/policy/entropy", "ppo/policy/approxkl",
                "ppo/policy/clipfrac", "ppo/returns/mean", "ppo/returns/var", "ppo/val/vpred", "ppo/val/error",
                "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained")  # fmt: skip
"""Every algorithmic stat OpenAI's train_policy logs (record_step_stats; elapsed/* aside)."""
OUR_NAMES = {"objective/score": "objective/scores"}  # where this project's name differs (the blog's)
UPDATE1_CONFIGS = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(ranks, minibatches) of the update-1 comparison: OpenAI's default (1 minibatch), 2 minibatches with OpenAI's numpy
permutations, and both on 2 ranks (mpiexec -n 2 against 2 processes with --ppo.whitening-ranks 2)."""


def given_rollouts(source: Path, destination: Path, ranks: int = 1) -> Path:
    """The queries and responses OpenAI sampled in a free run (on `ranks` ranks: rank r's rows are the global batch's
    r-th block), as the rollouts both sides are given."""
    names = ["rollouts.npz"] if ranks == 1 else [f"rollouts.rank{r}.npz" for r in range(ranks)]
    parts = [np.load(source / name) for name in names]
    np.savez(destination, **{key: np.concatenate([part[key] for part in parts], axis=1)
                             for key in ("queries", "responses")})  # fmt: skip
    return destination


def call_sites(openai_out: Path, ranks: int) -> dict:
    """The arguments OpenAI's trainer passed where benchmark/openai/replay.py hands this project's scripts draws
    instead (run_openai.py's calls.json, one per rank): the rows each rank drew, the response length, the temperature
    and samples per query it sampled with, which policy sampled, its number of ranks, the pad id its queries carry, the
    run's seed and the texts its query stream holds out and, for PPO, its minibatches and epochs. The same at every
    call and on every rank, or the harness stops."""
    calls = [json.loads((openai_out / name).read_text()) for name in calls_files(ranks)]
    sampling = {json.dumps(call, sort_keys=True) for rank in calls for call in rank["sampling"]}
    settings = {json.dumps({k: v for k, v in rank.items() if k not in ("rank", "sampling")}, sort_keys=True)
                for rank in calls}  # fmt: skip
    if len(sampling) != 1 or len(settings) != 1 or {rank["ranks"] for rank in calls} != {ranks}:
        raise SystemExit(f"error: {openai_out}: OpenAI's calls differ between calls or ranks: {sampling}, {settings}")
    return {**json.loads(sampling.pop()), **json.loads(settings.pop())}


def calls_files(ranks: int) -> list[str]:
    return ["calls.json"] if ranks == 1 else [f"calls.rank{r}.json" for r in range(ranks)]


def with_call_sites(arrays: dict, openai_out: Path, ranks: int) -> dict:
    """`arrays` (what a replay file holds) plus `call_sites`, OpenAI's arguments at the replayed calls (JSON)."""
    return {**arrays, "call_sites": np.array(json.dumps(call_sites(openai_out, ranks), sort_keys=True))}


def replay_with_orders(given: Path, openai_out: Path, ranks: int, destination: Path) -> Path:
    """The given rollouts plus the minibatch orders OpenAI drew for them, (U, ranks, epochs, B / ranks), and OpenAI's
    arguments at the calls they replace (call_sites)."""
    names = ["rollouts.npz"] if ranks == 1 else [f"rollouts.rank{r}.npz" for r in range(ranks)]
    orders = np.stack([np.load(openai_out / name)["orders"] for name in names], axis=1)
    np.savez(destination, **with_call_sites({**np.load(given), "orders": orders}, openai_out, ranks))
    return destination


SKETCH_SIZE = 8
"""Rows and columns of the weights' sketches (weight_sketch): 64 numbers a matrix, 8 a vector."""


def policy_arrays(policy_dir: Path, value_head: bool = True) -> dict[str, np.ndarray]:
    """A policy directory of this project's (its model and value head; without one, a zero value head, as both sides
    start) as OpenAI's arrays, named as under OpenAI's `policy/` scope (`model/h0/attn/c_attn/w`, `model/heads/value/w`)."""
    import torch
    from safetensors.torch import load_file

    from benchmark.openai.bridge import head_to_openai, lm_arrays

    _, arrays = lm_arrays(policy_dir)
    if value_head:
        head = load_file(Path(policy_dir) / "value_head.safetensors")
    else:
        head = {"weight": torch.zeros(1, arrays["model/wte"].shape[1]), "bias": torch.zeros(1)}
    arrays.update(head_to_openai(head["weight"], head["bias"], "model/heads/value"))
    return arrays


def weight_sketch(initial: dict[str, np.ndarray], final: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each weight's change from `initial` to `final`, Δ, in float64, sketched by fixed Gaussian matrices of variance
    1/SKETCH_SIZE (seeded by the weight's name): A Δ B for a matrix (A: (k, rows), B: (cols, k)), G Δ for a vector, Δ
    for a scalar. A sketch's norm is about ‖Δ‖, and two changes' sketches differ by about the norm of the changes'
    difference (Johnson–Lindenstrauss): the weights after training compared in 64 numbers a matrix, small enough to
    commit (GPT-2's embedding alone is 3.2M numbers), and no deviation of any entry can hide."""
    import zlib

    sketches = {}
    for name in sorted(initial):
        delta = np.asarray(final[name], np.float64) - np.asarray(initial[name], np.float64)
        delta = delta.reshape(delta.shape[-2:]) if delta.ndim == 3 else delta  # a Conv1D weight (1, nx, nf)
        rng = np.random.RandomState(zlib.crc32(name.encode()))
        if delta.ndim == 2:
            a = rng.standard_normal((SKETCH_SIZE, delta.shape[0])) / np.sqrt(SKETCH_SIZE)
            b = rng.standard_normal((delta.shape[1], SKETCH_SIZE)) / np.sqrt(SKETCH_SIZE)
            sketches[name] = a @ delta @ b
        elif delta.ndim == 1:
            sketches[name] = rng.standard_normal((SKETCH_SIZE, delta.shape[0])) / np.sqrt(SKETCH_SIZE) @ delta
        else:
            sketches[name] = delta.reshape(1)
    return sketches


def sketch_differences(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per weight: the norm of OpenAI's change's sketch and how far ours is from it, relative to that norm."""
    if sorted(ours) != sorted(theirs):
        raise ValueError(f"different weights: {sorted(set(ours) ^ set(theirs))}")
    rows = {}
    for name in theirs:
        norm, off = float(np.linalg.norm(theirs[name])), float(np.linalg.norm(ours[name] - theirs[name]))
        rows[name] = dict(norm=norm, difference=off, relative=off / max(norm, 1e-12))
    return rows


def openai_final_policy(openai: "OpenAI", openai_run: Path) -> dict[str, np.ndarray]:
    """The trained policy's weights in OpenAI's last checkpoint (train_policy.py saves one when it ends), named as
    policy_arrays names them."""
    checkpoints = sorted((openai_run / "policy" / "checkpoints").glob("model.ckpt-*.index"))
    if not checkpoints:
        raise SystemExit(f"error: {openai_run}: OpenAI's run saved no checkpoint")
    prefix = checkpoints[-1].with_suffix("")
    arrays = openai.read_checkpoint(prefix, openai_run / "final_policy.npz")
    return {name.removeprefix("policy/"): value for name, value in arrays.items()
            if name.startswith("policy/") and "/ppo_opt" not in name and "Adam" not in name}  # fmt: skip


def run_policy_pair(openai: OpenAI, stage: Path, given: Path, updates: int, ranks: int, nminibatches: int,
                    scenario: Optional[dict] = None, name: str = "") -> dict:  # fmt: skip
    """OpenAI's train_policy and this project's on the given rollouts (of the base scenario, or of scenario `name`);
    returns the comparison."""
    assets = stage.parents[1 if scenario is None else 2] / "assets"
    seconds = openai.run("policy", forced_run_config(assets, stage, given, updates, nminibatches, name), ranks)
    replay = replay_with_orders(given, stage / "openai", ranks, stage / "replay.npz")
    flags = [
        *our_policy_flags(assets, updates, nminibatches=nminibatches, ranks=ranks, scenario=scenario),
        "--output-dir",
        str(stage / "ours"),
    ]
    warm = assets / f"warm_policy_{name}" if (scenario or {}).get("warm_start") else None
    processes = (scenario or {}).get("processes", ranks)  # this project's processes: `ranks` whitening shares in all
    our_seconds = run_ours("train_policy_accelerate.py", flags, stage / "ours", processes, replay=replay,
                           policy_init=warm)  # fmt: skip
    comparison = {**compare_policy(stage), "seconds": dict(openai=seconds, ours=our_seconds)}
    if name:
        initial = policy_arrays(warm or assets / "base", value_head=warm is not None)
        theirs = weight_sketch(initial, openai_final_policy(openai, stage / "openai_run"))
        np.savez(stage / "openai_weights.npz", **theirs)
        ours = weight_sketch(initial, policy_arrays(stage / "ours" / "policy"))
        comparison["weights"] = sketch_differences(ours, theirs)
    (stage / "comparison.json").write_text(json.dumps(comparison, indent=1))
    return comparison


def compare_policy(stage: Path) -> dict:
    """Each update's stats, OpenAI's and ours, and their relative differences."""
    openai_dir = stage / "openai"
    openai_rows = read_jsonl(openai_dir / ("policy_stats.jsonl" if (openai_dir / "policy_stats.jsonl").exists()
                                           else "policy_stats.rank0.jsonl"))  # fmt: skip
    ours = {row["update"]: row for row in read_jsonl(stage / "ours" / "metrics.jsonl") if "objective/kl" in row}
    updates = []
    for row in openai_rows:
        mine = ours[row["update"]]
        stats = {key: dict(openai=row[key], ours=mine[OUR_NAMES.get(key, key)]) for key in POLICY_STATS}
        for value in stats.values():
            value["relative"] = relative_difference(value["openai"], value["ours"])
        updates.append(dict(update=row["update"], stats=stats))
    largest = [max(s["relative"] for s in u["stats"].values()) for u in updates]
    return dict(updates=updates, largest_per_update=largest)


def stage_update1(out: Path, openai: OpenAI, mpi: bool) -> None:
    """PPO update 1 on one rollout of OpenAI's, in each of UPDATE1_CONFIGS."""
    assets = out / "assets"
    source = out / "update1" / "openai_sampled"
    openai.run("policy", free_run_config(assets, source, 1))
    given = given_rollouts(source, out / "update1" / "given.npz")
    for ranks, nminibatches in UPDATE1_CONFIGS:
        if ranks > 1 and not mpi:
            continue
        stage = out / "update1" / f"ranks_{ranks}_minibatches_{nminibatches}"
        comparison = run_policy_pair(openai, stage, given, 1, ranks, nminibatches)
        print(f"update 1, {ranks} rank(s), {nminibatches} minibatch(es): largest relative difference "
              f"{comparison['largest_per_update'][0]:.2e}")  # fmt: skip
    # the control: this project against itself, the same math in another float summation order (2 micro-batches)
    stage = out / "update1" / "ranks_1_minibatches_1"
    flags = [*our_policy_flags(assets, 1), "--ppo.gradient-accumulation-steps", "2", "--output-dir",
             str(stage / "ours_accumulated")]  # fmt: skip
    run_ours("train_policy_accelerate.py", flags, stage / "ours_accumulated", replay=stage / "replay.npz")
    plain, accumulated = (next(r for r in read_jsonl(stage / d / "metrics.jsonl") if "objective/kl" in r)
                          for d in ("ours", "ours_accumulated"))  # fmt: skip
    control = {key: dict(plain=plain[OUR_NAMES.get(key, key)], accumulated=accumulated[OUR_NAMES.get(key, key)],
                         relative=relative_difference(plain[OUR_NAMES.get(key, key)],
                                                      accumulated[OUR_NAMES.get(key, key)]))
               for key in POLICY_STATS}  # fmt: skip
    (stage / "control.json").write_text(json.dumps(control, indent=1))
    print(
        f"update 1, ours against ours with 2 micro-batches: largest {max(c['relative'] for c in control.values()):.2e}"
    )


def stage_teacher(out: Path, openai: OpenAI, updates: int) -> None:
    """`updates` updates of OpenAI's free run, each update's rollout given to both sides again."""
    assets = out / "assets"
    source = out / "teacher" / "openai_sampled"
    openai.run("policy", free_run_config(assets, source, updates))
    given = given_rollouts(source, out / "teacher" / "given.npz")
    comparison = run_policy_pair(openai, out / "teacher" / "forced", given, updates, 1, 1)
    largest = ", ".join(f"{x:.1e}" for x in comparison["largest_per_update"])
    print(f"teacher-forced, largest relative difference per update: {largest}")


def warm_config(assets: Path, name: str) -> dict:
    """run_openai.py's setting for scenario `name`'s warm start: the checkpoint its trained policy starts from."""
    scenario = SCENARIOS.get(name, {})
    return {"policy_init": str(assets / f"openai_warm_policy_{name}")} if scenario.get("warm_start") else {}


def write_warm_policy(assets: Path, name: str, openai: Optional["OpenAI"] = None) -> Path:
    """Scenario `name`'s warm start (tests/tiny_task.py write_warm_policy) in this project's layout and, given
    OpenAI's side, as OpenAI's checkpoint (trunk and value head)."""
    from safetensors.torch import load_file

    from benchmark.openai.bridge import head_to_openai, lm_arrays
    from tests.tiny_task import write_warm_policy as write

    ours = write(assets / "base", assets / f"warm_policy_{name}", **SCENARIOS[name]["warm_start"])
    if openai is not None:
        hparams, arrays = lm_arrays(ours)
        head = load_file(ours / "value_head.safetensors")
        arrays.update(head_to_openai(head["weight"], head["bias"], "model/heads/value"))
        (assets / f"openai_warm_policy_{name}").mkdir(exist_ok=True)
        (assets / f"openai_warm_policy_{name}" / "hparams.json").write_text(json.dumps(hparams))
        openai.write_checkpoint(arrays, assets / f"openai_warm_policy_{name}" / "model.ckpt")
    return ours


def make_labels(assets: Path, name: str, scenario: Optional[dict], new_labels: bool) -> None:
    """assets/NAME.json: best-of-4 labels of the base model's own samples, picked by the VADER labeler (this project's
    reward script makes them, on the scenario's task) or, unless `new_labels`, the same labels as committed with the
    reference (label sampling on another CPU can draw other tokens: 4 of 2,304 records differed between an Intel Xeon
    and an AMD EPYC, and the reference's free-running curves were made with the committed labels)."""
    committed = REFERENCE / (
        "labels.json.gz" if scenario is None else f"reward_{name.removeprefix('labels_')}/labels.json.gz"
    )
    if not new_labels and committed.exists():
        (assets / f"{name}.json").write_bytes(gzip.decompress(committed.read_bytes()))
        return
    labels, run = labels_of(scenario), assets / f"{name}_run"
    flags = [*our_task_flags(assets, scenario), "--labels.source", "sentiment", "--labels.num-train",
             str(labels["num_train"]), "--labels.simulated-num-test", str(labels["num_test"]), "--seed",
             str(labels["seed"]), "--no-normalize-before", "--no-normalize-after", "--output-dir", str(run)]  # fmt: skip
    run_ours("train_reward_accelerate.py", flags, run)
    shutil.copy(run / "labels.json", assets / f"{name}.json")


def stage_scenarios(out: Path, openai: OpenAI, new_labels: bool) -> None:
    """The reward scenarios (OpenAI's train_reward and ours on the scenario's labels and normalization samples) and
    the policy scenarios (each `updates` updates of OpenAI's free run, every rollout given to both sides again)."""
    assets = out / "assets"
    for name, scenario in REWARD_SCENARIOS.items():
        stage, labels = out / "scenarios" / f"reward_{name}", f"labels_{name}.json"
        make_labels(assets, f"labels_{name}", scenario, new_labels)
        openai.run("reward", reward_run_config(assets, stage, scenario, labels))
        samples = merge_ranks(stage / "openai", "normalization_samples.npz", 1)
        np.savez(stage / "samples.npz", **with_call_sites(samples, stage / "openai", 1))
        flags = [*our_reward_flags(assets, scenario=scenario, labels=labels), "--output-dir", str(stage / "ours")]
        run_ours("train_reward_accelerate.py", flags, stage / "ours", replay=stage / "samples.npz")
        comparison = compare_reward(stage)
        (stage / "comparison.json").write_text(json.dumps(comparison, indent=1))
        print(f"reward scenario {name}: largest relative difference {comparison['largest']:.2e}")
    for name, scenario in SCENARIOS.items():
        stage = out / "scenarios" / name
        if scenario.get("ranks", 1) > 1 and not openai.mpi:
            print(f"scenario {name}: skipped (--no-mpi)")
            continue
        if scenario.get("warm_start"):
            write_warm_policy(assets, name, openai)
        source, ranks = stage / "openai_sampled", scenario.get("ranks", 1)
        openai.run("policy", free_run_config(assets, source, scenario["updates"], name=name), ranks)
        given = given_rollouts(source, stage / "given.npz", ranks)  # each rank's own draws, rank r's the r-th block
        nminibatches = policy_settings(scenario)["nminibatches"]
        comparison = run_policy_pair(openai, stage / "forced", given, scenario["updates"], ranks, nminibatches,
                                     scenario, name)  # fmt: skip
        largest = ", ".join(f"{x:.1e}" for x in comparison["largest_per_update"])
        print(f"scenario {name}, largest relative difference per update: {largest}")
    compare_sampling(out)


def compare_sampling(out: Path) -> None:
    """OpenAI's sampler and this project's sample_responses: the log-probs of OpenAI's sampled tokens (SAMPLING_SCENARIO,
    update 1), each side's own sampling path."""
    name = SAMPLING_SCENARIO
    rollouts, stage = (
        np.load(out / "scenarios" / name / "openai_sampled" / "rollouts.npz"),
        out / "scenarios" / "sampling",
    )
    stage.mkdir(parents=True, exist_ok=True)
    given = {key: rollouts[key][0] for key in ("queries", "responses", "logprobs")}
    np.savez(stage / "given.npz", **given)
    ours = sampler_logprobs(
        out / "assets" / f"warm_policy_{name}", given["queries"], given["responses"], SCENARIOS[name]
    )
    difference = float(np.abs(ours - given["logprobs"]).max())
    (stage / "comparison.json").write_text(json.dumps(dict(largest_difference=difference), indent=1))
    print(f"sampling: the sampler's log-probs of OpenAI's samples within {difference:.1e} nats of OpenAI's sampler's")


def sampler_logprobs(policy_dir: Path, queries: np.ndarray, responses: np.ndarray, scenario: dict) -> np.ndarray:
    """This project's sample_responses from a policy, on OpenAI's (right-padded) queries in the scenario's contexts
    (QueryStream.format), made to draw OpenAI's `responses` (draw_tokens replaced): the log-probs its own sampling
    forwards give those tokens, (B, T)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    import train_policy_accelerate as P

    lm, tokenizer = P.load_pretrained(AutoModelForCausalLM, str(policy_dir)), P.load_tokenizer(str(policy_dir))
    task, pad_id = SimpleNamespace(**task_settings(scenario), chat_template=False), tokenizer.pad_token_id
    stream = SimpleNamespace(tokenizer=tokenizer, task=task, pad_id=pad_id)  # what QueryStream.format reads
    given = torch.from_numpy(queries).long()
    contexts = P.QueryStream.format(stream, torch.where(given == OPENAI_PAD_ID, pad_id, given))
    tokens, logprobs, draw = torch.from_numpy(responses).long(), [], P.draw_tokens

    def draw_given(probabilities: torch.Tensor) -> torch.Tensor:
        step = tokens[:, len(logprobs) : len(logprobs) + 1]  # (B, 1)
        logprobs.append(probabilities.gather(1, step).log())
        return step

    P.draw_tokens = draw_given
    try:
        P.sample_responses(lm, contexts, pad_id, task.response_length, task.temperature)
    finally:
        P.draw_tokens = draw
    return torch.cat(logprobs, 1).numpy()


def openai_query_order(assets: Path, seed: int, batches: int, scenario: Optional[dict] = None) -> np.ndarray:
    """The queries OpenAI's sampler gives a run whose dataset seed is `seed` (OAI_QUERY_SEED), (batches, B, C) with
    OpenAI's pad id: the corpus shuffled by random.seed(seed) (benchmark/openai/tf/shim.py), each text cut as OpenAI's
    dataset cuts it (the scripts' query_from_text, which tests/test_openai_reference.py checks against OpenAI's own
    cut queries), texts that give no query skipped, the same order in every epoch (tf.data's repeat)."""
    import itertools
    import random
    from types import SimpleNamespace

    import rlhf_data
    import train_policy_accelerate as P

    texts = [line.strip() for line in (assets / "corpus.txt").read_text().splitlines() if line.strip()]
    random.seed(seed)
    random.shuffle(texts)
    tokenizer, task = (
        P.load_tokenizer(str(assets / "base")),
        SimpleNamespace(**task_settings(scenario), chat_template=False),
    )
    queries = []
    for text in texts:
        tokens = tokenizer.encode(rlhf_data.clean_query_text(text, "sentiment"), add_special_tokens=False)
        queries += [query] if (query := P.query_from_text(tokenizer, tokens, task, OPENAI_PAD_ID)) else []
    size = policy_settings(scenario)["batch_size"]
    return np.array(list(itertools.islice(itertools.cycle(queries), batches * size))).reshape(batches, size, -1)


def stage_curves(out: Path, openai: OpenAI, seeds: int, updates: int, openai_only: bool = False) -> None:
    """Free-running runs, `seeds` a side: OpenAI's samples with TensorFlow's RNG, ours with torch's; seed k of both
    sides reads the same queries in the same order (OpenAI's for that seed, given to ours by
    benchmark/openai/replay.py), so that a seed's two runs differ only by what each side draws itself: samples and
    minibatch shuffles. `openai_only`: OpenAI's side alone, checked against the committed curves_openai.csv (OpenAI's
    runs made again, with their provenance, for the reference)."""
    assets = out / "assets"
    for seed in range(1, seeds + 1) if openai_only else ():
        stage = out / "curves" / f"seed_{seed}"
        openai.run("policy", free_run_config(assets, stage / "openai", updates, seed), query_seed=seed)
        print(f"curves: OpenAI's seed {seed} of {seeds}", flush=True)
    if openai_only:
        committed = (REFERENCE / "curves_openai.csv").read_text().splitlines()
        made = [f"{seed},{row['update']}," + ",".join(f"{row[key]:.7g}" for key in CURVE_STATS)
                for seed in range(1, seeds + 1) for row in read_jsonl(out / "curves" / f"seed_{seed}" / "openai" /
                "policy_stats.jsonl")]  # fmt: skip
        same = sum(a == b for a, b in zip(made, committed[1:], strict=False))
        print(f"curves: OpenAI's {len(made)} rows made again, {same} equal to the committed curves_openai.csv's "
              f"{len(committed) - 1} to 7 digits")  # fmt: skip
        if same != len(made) or len(made) != len(committed) - 1:
            raise SystemExit("error: OpenAI's free-running runs did not reproduce curves_openai.csv")
        return
    for seed in range(1, seeds + 1):
        stage = out / "curves" / f"seed_{seed}"
        if (
            not (stage / "openai" / "policy_stats.jsonl").exists()
            or len(read_jsonl(stage / "openai" / "policy_stats.jsonl")) < updates
        ):
            openai.run("policy", free_run_config(assets, stage / "openai", updates, seed), query_seed=seed)  # its order
        if not (stage / "ours" / "policy").exists():
            queries = openai_query_order(assets, seed, updates)
            if not np.array_equal(np.load(stage / "openai" / "rollouts.npz")["queries"], queries):
                raise SystemExit(f"curves: seed {seed}: OpenAI's queries are not openai_query_order's")
            np.savez(stage / "queries.npz", **with_call_sites(dict(queries=queries), stage / "openai", 1))
            flags = [*our_policy_flags(assets, updates, seed), "--output-dir", str(stage / "ours")]
            run_ours("train_policy_accelerate.py", flags, stage / "ours", replay=stage / "queries.npz")
        print(f"curves: seed {seed} of {seeds}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# the report

CURVE_STATS = {"objective/score": "score", "objective/kl": "KL (nats)", "objective/kl_coef": "kl_coef",
               "ppo/policy/approxkl": "approxkl", "ppo/policy/clipfrac": "clip fraction",
               "ppo/loss/value": "value loss", "objective/entropy": "entropy (nats)"}  # fmt: skip
LAST_UPDATES = 10  # the curve test compares each seed's mean over its last 10 updates


def curves(out: Path) -> dict[str, dict[str, np.ndarray]]:
    """Per side, per stat: (seeds, updates) of the free-running runs, the stats under OpenAI's names."""
    sides = {"openai": [], "ours": []}
    for seed_dir in sorted((out / "curves").glob("seed_*"), key=lambda d: int(d.name.split("_")[1])):
        openai_rows = read_jsonl(seed_dir / "openai" / "policy_stats.jsonl")
        our_rows = [r for r in read_jsonl(seed_dir / "ours" / "metrics.jsonl") if "objective/kl" in r]
        sides["openai"].append({key: [r[key] for r in openai_rows] for key in POLICY_STATS})
        sides["ours"].append({key: [r[OUR_NAMES.get(key, key)] for r in our_rows] for key in POLICY_STATS})
    return {side: {key: np.array([run[key] for run in runs]) for key in POLICY_STATS} for side, runs in sides.items()}


def permutation_test(a: np.ndarray, b: np.ndarray, draws: int = 20000) -> float:
    """Two-sided p-value of the difference of means of a and b, by random relabelling (no distribution assumed)."""
    pooled, observed = np.concatenate([a, b]), abs(a.mean() - b.mean())
    rng = np.random.RandomState(0)
    hits = sum(abs(p[: len(a)].mean() - p[len(a) :].mean()) >= observed - 1e-15
               for p in (rng.permutation(pooled) for _ in range(draws)))  # fmt: skip
    return (hits + 1) / (draws + 1)


def paired_test(differences: np.ndarray, draws: int = 20000) -> float:
    """Two-sided p-value of the mean of paired differences, by random sign flips (no distribution assumed)."""
    observed, rng = abs(differences.mean()), np.random.RandomState(0)
    signs = rng.choice([-1.0, 1.0], size=(draws, len(differences)))
    return float(((np.abs((signs * differences).mean(1)) >= observed - 1e-15).sum() + 1) / (draws + 1))


def bootstrap_interval(differences: np.ndarray, draws: int = 20000) -> list[float]:
    """95% percentile bootstrap interval of the mean of `differences`."""
    rng = np.random.RandomState(1)
    means = differences[rng.randint(len(differences), size=(draws, len(differences)))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def holm(p_values: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values (each seed's quantities are tested together)."""
    adjusted, running = {}, 0.0
    for rank, (key, p) in enumerate(sorted(p_values.items(), key=lambda item: item[1])):
        running = max(running, min(1.0, (len(p_values) - rank) * p))
        adjusted[key] = running
    return adjusted


DETECTABLE = 2.80
"""z(0.975) + z(0.80): a mean paired difference this many standard errors from 0 is found 80% of the time at
p < 0.05 (normal approximation; for 29 degrees of freedom Student's t gives 2.90)."""


def curve_tests(data: dict) -> dict:
    """Per stat: each seed's mean over the last LAST_UPDATES updates, OpenAI's seeds against ours: unpaired (a
    permutation test of the two means) and paired (seed k of both sides read the same queries: a sign-flip test of
    the mean difference, its bootstrap interval, the smallest difference found 80% of the time, Holm over the
    stats)."""
    rows = {}
    for key in CURVE_STATS:
        a, b = (data[side][key][:, -LAST_UPDATES:].mean(1) for side in ("openai", "ours"))
        rows[key] = dict(openai_mean=float(a.mean()), openai_std=float(a.std(ddof=1)), ours_mean=float(b.mean()),
                         ours_std=float(b.std(ddof=1)), p=permutation_test(a, b), openai_range=[float(a.min()),
                         float(a.max())], ours_seeds=b.tolist(), openai_seeds=a.tolist())  # fmt: skip
        if len(a) == len(b):
            d = b - a
            rows[key].update(difference=float(d.mean()), difference_ci95=bootstrap_interval(d),
                             difference_std=float(d.std(ddof=1)), paired_p=paired_test(d),
                             detectable=float(DETECTABLE * d.std(ddof=1) / np.sqrt(len(d))),
                             correlation=float(np.corrcoef(a, b)[0, 1]))  # fmt: skip
    if all("paired_p" in row for row in rows.values()):
        for key, adjusted in holm({key: row["paired_p"] for key, row in rows.items()}).items():
            rows[key]["paired_p_holm"] = adjusted
    return rows


def plot_curves(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (key, title) in zip(axes.flat, CURVE_STATS.items(), strict=False):
        for side, color, label in (
            ("openai", "tab:blue", "OpenAI's code (TF)"),
            ("ours", "tab:orange", "this project"),
        ):
            values = data[side][key]
            x = np.arange(1, values.shape[1] + 1) * POLICY["batch_size"]
            ax.plot(x, values.mean(0), color=color, label=f"{label}, mean of {len(values)} seeds")
            ax.fill_between(x, values.min(0), values.max(0), color=color, alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("episodes")
        ax.grid(alpha=0.3)
    axes.flat[-1].axis("off")
    axes.flat[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Side by side on the tiny task: mean and min-max band over seeds (benchmark/openai/side_by_side.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def seconds_per_update(out: Path) -> dict:
    """Median seconds per update of the free-running runs, the first update of each run excluded (graph warm-up)."""
    openai, ours = [], []
    for seed_dir in (out / "curves").glob("seed_*"):
        openai += [r["harness/seconds"] for r in read_jsonl(seed_dir / "openai" / "policy_stats.jsonl")[1:]]
        times = [r["elapsed/time"] for r in read_jsonl(seed_dir / "ours" / "metrics.jsonl") if "objective/kl" in r]
        ours += list(np.diff(times))
    return dict(
        openai=float(np.median(openai)), ours=float(np.median(ours)), ratio=float(np.median(openai) / np.median(ours))
    )


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def write_report(out: Path) -> None:
    """OUT/side_by_side.md and OUT/side_by_side.png from what the stages wrote (a stage not run is left out)."""
    parts = ["# Side by side with OpenAI's lm-human-preferences (benchmark/openai/side_by_side.py)\n"]
    for ranks in (1, 2):
        path = out / "reward" / f"ranks_{ranks}" / "comparison.json"
        if path.exists():
            c = json.loads(path.read_text())
            steps = c["steps"]
            relative = [relative_difference(s["openai_loss"], s["ours_loss"]) for s in steps]
            same = sum(s["openai_accuracy"] == s["ours_accuracy"] for s in steps)
            parts.append(f"## Reward model, {ranks} rank(s)\n\n{len(steps)} steps: loss relative difference "
                         f"{relative[0]:.1e} at step 1, largest {max(relative):.1e} (step "
                         f"{int(np.argmax(relative)) + 1}); accuracy equal at {same} of {len(steps)} steps.\n")  # fmt: skip
            rows = [[r["quantity"], f"{r['openai']:.7g}", f"{r['ours']:.7g}",
                     f"{relative_difference(r['openai'], r['ours']):.1e}"] for r in c["normalization"]]  # fmt: skip
            parts.append(markdown_table(["normalization", "OpenAI", "ours", "relative difference"], rows) + "\n")
    path = out / "reward" / "forward_check" / "comparison.json"
    if path.exists():
        c = json.loads(path.read_text())
        rows = [[key, f"{r['scale']:.3g}", f"{r['max_abs']:.1e}", f"{r['max_relative']:.1e}",
                 f"{r['openai_vs_float64']:.1e}", f"{r['ours_vs_float64']:.1e}"] for key, r in c["rows"].items()]  # fmt: skip
        header = ["quantity", "mean abs", "largest abs difference", "largest relative", "OpenAI vs float64",
                  "ours vs float64"]  # fmt: skip
        parts.append(f"## Bridges: the same forward on {c['tokens']} response tokens\n\n" + markdown_table(header, rows)
                     + "\n")  # fmt: skip
    configs = [
        (r, m)
        for r, m in UPDATE1_CONFIGS
        if (out / "update1" / f"ranks_{r}_minibatches_{m}" / "comparison.json").exists()
    ]
    if configs:
        compared = {cfg: json.loads((out / "update1" / f"ranks_{cfg[0]}_minibatches_{cfg[1]}" / "comparison.json")
                                    .read_text())["updates"][0]["stats"] for cfg in configs}  # fmt: skip
        control_path = out / "update1" / "ranks_1_minibatches_1" / "control.json"
        control = json.loads(control_path.read_text()) if control_path.exists() else {}
        header = ["stat", "OpenAI (1 rank, 1 minibatch)", "ours", *[f"rel. diff, {r} rank(s) {m} mb" for r, m in configs],
                  "ours vs ours, 2 micro-batches"]  # fmt: skip
        rows = [[key, f"{compared[configs[0]][key]['openai']:.7g}", f"{compared[configs[0]][key]['ours']:.7g}",
                 *[f"{compared[cfg][key]['relative']:.1e}" for cfg in configs],
                 f"{control[key]['relative']:.1e}" if key in control else ""] for key in POLICY_STATS]  # fmt: skip
        parts.append("## PPO update 1, the same rollout\n\n" + markdown_table(header, rows) + "\n")
    path = out / "teacher" / "forced" / "comparison.json"
    if path.exists():
        c = json.loads(path.read_text())
        keys = ("objective/score", "objective/kl", "objective/kl_coef", "ppo/loss/value", "ppo/policy/approxkl")
        rows = [[u["update"], f"{c['largest_per_update'][i]:.1e}", *[f"{u['stats'][k]['relative']:.1e}" for k in keys]]
                for i, u in enumerate(c["updates"])]  # fmt: skip
        parts.append("## Teacher-forced: every update's rollout given to both sides\n\n"
                     + markdown_table(["update", "largest of the 19 stats", *keys], rows) + "\n")  # fmt: skip
    if (out / "curves").exists():
        data = curves(out)
        plot_curves(data, out / "side_by_side.png")
        tests = curve_tests(data)
        rows = [[CURVE_STATS[key], f"{t['openai_mean']:.4g} ± {t['openai_std']:.2g}", f"{t['ours_mean']:.4g} ± "
                 f"{t['ours_std']:.2g}", f"{t['p']:.2f}"] for key, t in tests.items()]  # fmt: skip
        speed = seconds_per_update(out)
        parts.append(f"## Free-running: {len(data['openai'][POLICY_STATS[0]])} seeds a side, last {LAST_UPDATES} "
                     "updates of each seed\n\n" + markdown_table(["quantity", "OpenAI (mean ± sd over seeds)",
                     "ours", "permutation test p"], rows) + f"\n\nSeconds per update (median, first excluded): "
                     f"OpenAI {speed['openai']:.2f}, ours {speed['ours']:.2f}: {speed['ratio']:.1f}x.\n")  # fmt: skip
        if all("paired_p" in t for t in tests.values()):
            rows = [[CURVE_STATS[key], f"{t['difference']:+.3g} [{t['difference_ci95'][0]:+.3g}, "
                     f"{t['difference_ci95'][1]:+.3g}]", f"{t['paired_p']:.2f}", f"{t['paired_p_holm']:.2f}",
                     f"{t['detectable']:.3g}", f"{t['correlation']:.2f}"] for key, t in tests.items()]  # fmt: skip
            parts.append("Paired by seed (both sides of a seed read the same queries):\n\n" + markdown_table(
                ["quantity", "ours − OpenAI [95% bootstrap]", "sign-flip p", "Holm over the 7", "detectable at 80% "
                 "power", "correlation of the sides"], rows) + "\n")  # fmt: skip
        (out / "curve_tests.json").write_text(json.dumps(dict(tests=tests, seconds=speed), indent=1))
    (out / "side_by_side.md").write_text("\n".join(parts))
    print(
        f"side by side: wrote {out / 'side_by_side.md'}"
        + (" and side_by_side.png" if (out / "curves").exists() else "")
    )


# ---------------------------------------------------------------------------------------------------------------------
# the reference data of tests/test_openai_reference.py

REFERENCE = REPO / "benchmark" / "openai" / "side_by_side_reference"


def write_reference(out: Path, stages) -> None:
    """OpenAI's outputs of `stages` and the inputs both sides were given, small files: what CI compares this project
    with (the settings and the base labels always; the outputs of the stages that ran, so that a stage can be made
    again alone)."""
    REFERENCE.mkdir(exist_ok=True)
    (REFERENCE / "labels.json.gz").write_bytes(gzip.compress((out / "assets" / "labels.json").read_bytes(), mtime=0))
    model = (out / "assets" / "base" / "model.safetensors").read_bytes()
    warm = {}
    for name, scenario in SCENARIOS.items():
        if scenario.get("warm_start"):
            digest = hashlib.sha256()
            for file in ("model.safetensors", "value_head.safetensors"):
                digest.update((out / "assets" / f"warm_policy_{name}" / file).read_bytes())
            warm[name] = digest.hexdigest()
    settings = dict(task=TASK, corpus=CORPUS, base_model=BASE_MODEL, labels=LABELS, reward=REWARD, policy=POLICY,
                    scenarios=SCENARIOS, reward_scenarios=REWARD_SCENARIOS,
                    base_model_sha256=hashlib.sha256(model).hexdigest(), warm_policy_sha256=warm)  # fmt: skip
    (REFERENCE / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    rewards = [(f"reward_ranks_{ranks}", out / "reward" / f"ranks_{ranks}", None) for ranks in (1, 2)]
    rewards = rewards if "reward" in stages else []
    rewards += [(f"reward_{name}", out / "scenarios" / f"reward_{name}", f"labels_{name}.json")
                for name in REWARD_SCENARIOS if "scenarios" in stages]  # fmt: skip
    for name, stage, labels in rewards:
        if (stage / "comparison.json").exists():
            target = REFERENCE / name
            target.mkdir(exist_ok=True)
            if labels:
                (target / "labels.json.gz").write_bytes(gzip.compress((out / "assets" / labels).read_bytes(), mtime=0))
            shutil.copy(stage / "samples.npz", target / "samples.npz")
            write_provenance(out, target / "provenance.json", [stage / "openai"])
            c = json.loads((stage / "comparison.json").read_text())
            steps = [dict(step=s["step"], loss=s["openai_loss"], accuracy=s["openai_accuracy"]) for s in c["steps"]]
            normalization = {r["quantity"]: r["openai"] for r in c["normalization"]}
            (target / "openai.json").write_text(json.dumps(dict(steps=steps, normalization=normalization), indent=1)
                                                + "\n")  # fmt: skip
    policies = [(f"update1_ranks_{r}_minibatches_{m}", out / "update1" / f"ranks_{r}_minibatches_{m}",
                 out / "update1" / "openai_sampled") for r, m in UPDATE1_CONFIGS if "update1" in stages]  # fmt: skip
    policies += (
        [("teacher", out / "teacher" / "forced", out / "teacher" / "openai_sampled")] if "teacher" in stages else []
    )
    policies += [(f"scenario_{name}", out / "scenarios" / name / "forced", out / "scenarios" / name / "openai_sampled")
                 for name in SCENARIOS if "scenarios" in stages]  # fmt: skip
    if "scenarios" in stages and (out / "scenarios" / "sampling" / "comparison.json").exists():
        (REFERENCE / "sampling").mkdir(exist_ok=True)
        given = np.load(out / "scenarios" / "sampling" / "given.npz")
        np.savez_compressed(REFERENCE / "sampling" / "given.npz", queries=given["queries"].astype(np.int32),
                            responses=given["responses"].astype(np.int32), logprobs=given["logprobs"])  # fmt: skip
        write_provenance(
            out, REFERENCE / "sampling" / "provenance.json", [out / "scenarios" / SAMPLING_SCENARIO / "openai_sampled"]
        )
    for name, stage, sampled in policies:
        if (stage / "comparison.json").exists():
            target = REFERENCE / name
            target.mkdir(exist_ok=True)
            replay = np.load(stage / "replay.npz")
            np.savez_compressed(target / "replay.npz", queries=replay["queries"].astype(np.int32),
                                responses=replay["responses"].astype(np.int32), orders=replay["orders"].astype(np.int16),
                                call_sites=replay["call_sites"])  # fmt: skip
            c = json.loads((stage / "comparison.json").read_text())
            rows = [dict(update=u["update"], **{k: v["openai"] for k, v in u["stats"].items()}) for u in c["updates"]]
            (target / "openai.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            if (stage / "openai_weights.npz").exists():
                np.savez_compressed(target / "openai_weights.npz", **np.load(stage / "openai_weights.npz"))
            write_provenance(out, target / "provenance.json", [sampled, stage / "openai"])
    seeds = sorted((out / "curves").glob("seed_*"), key=lambda d: int(d.name.split("_")[1]))
    if "curves" in stages and seeds and all((seed / "openai" / "run.json").exists() for seed in seeds):
        write_provenance(out, REFERENCE / "curves_provenance.json", [seed / "openai" for seed in seeds], keep=())
    if "curves" in stages and (out / "curve_tests.json").exists():
        data = curves(out)
        for side in ("openai", "ours"):
            lines = ["seed,update," + ",".join(CURVE_STATS)]
            for seed in range(len(data[side]["objective/kl"])):
                for update in range(data[side]["objective/kl"].shape[1]):
                    values = ",".join(f"{data[side][k][seed, update]:.7g}" for k in CURVE_STATS)
                    lines.append(f"{seed + 1},{update + 1},{values}")
            (REFERENCE / f"curves_{side}.csv").write_text("\n".join(lines) + "\n")
    print(f"side by side: wrote {REFERENCE}")


OUTPUTS_KEPT = "openai_outputs"
"""Where a stage of the reference keeps OpenAI's own output files verbatim, a folder per run (run_0, run_1, ... in
the order of its provenance.json's runs): what the stage's data is derived from, hashed as written (run.json's
`outputs`). The log is hashed but not kept (it holds this machine's paths)."""


def write_provenance(out: Path, target: Path, runs: list[Path], keep: tuple[str, ...] = ("*",)) -> None:
    """`target` (a stage's provenance.json): what OpenAI's code ran on (commit, a clean tree computed before each run,
    TensorFlow, NumPy, mpi4py, Python, the CPU) and, for each of its runs that made the stage's data, the command,
    ranks, query seed, the config it was given (paths under the side by side's output directory written as OUT/...)
    and the sha256 of each file it wrote, taken as it wrote them. Those of its files that match `keep` (the log
    aside) are copied next to it, under OUTPUTS_KEPT/run_K/, for tests/test_openai_reference.py to hash again."""
    records = [json.loads((run / "run.json").read_text()) for run in runs]
    kept = target.parent / OUTPUTS_KEPT
    shutil.rmtree(kept, ignore_errors=True)
    for index, (run, record) in enumerate(zip(runs, records, strict=True)):
        for name in record["outputs"]:
            if name != "log.txt" and any(Path(name).match(pattern) for pattern in keep):
                (kept / f"run_{index}" / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(run / name, kept / f"run_{index}" / name)
    provenance = {json.dumps(record.pop("provenance"), sort_keys=True) for record in records}
    if len(provenance) != 1:
        raise SystemExit(f"error: {target}: its OpenAI runs ran on different setups: {sorted(provenance)}")

    def relative(value):
        if isinstance(value, dict):
            return {key: relative(item) for key, item in value.items()}
        if isinstance(value, str) and (value == str(out) or value.startswith(f"{out}/")):
            return "OUT" + value[len(str(out)) :]
        return value

    document = dict(openai=json.loads(provenance.pop()), runs=[relative(record) for record in records])
    target.write_text(json.dumps(document, indent=1) + "\n")


def main(args: Args) -> None:
    out = Path(args.out).resolve()  # absolute: OpenAI reads a relative model path as a gs:// name
    stages = ("report",) if args.report_only else args.stages
    needs_openai = [stage for stage in stages if stage != "report"]
    if needs_openai and args.openai_src is None:
        print(f"side by side: skipped {', '.join(needs_openai)}: no --openai-src (a checkout of "
              f"openai/lm-human-preferences at {OPENAI_COMMIT[:7]})")  # fmt: skip
        stages = [stage for stage in stages if stage == "report"]
    openai = OpenAI(args, out / "assets") if needs_openai and args.openai_src else None
    for stage in STAGES:
        if stage not in stages:
            continue
        start = time.time()
        print(f"side by side: {stage} ...", flush=True)
        if stage == "assets":
            stage_assets(out, openai, args.new_labels)
        elif stage == "reward":
            stage_reward(out, openai, args.mpi)
        elif stage == "update1":
            stage_update1(out, openai, args.mpi)
        elif stage == "teacher":
            stage_teacher(out, openai, args.teacher_updates)
        elif stage == "scenarios":
            stage_scenarios(out, openai, args.new_labels)
        elif stage == "curves":
            stage_curves(out, openai, args.seeds, args.updates, args.curves_openai_only)
        else:
            write_report(out)
        print(f"side by side: {stage} done in {time.time() - start:.0f} s", flush=True)
    if args.write_reference:
        write_reference(out, stages)


if __name__ == "__main__":
    main(tyro.cli(Args))
