"""Every training command of every benchmark suite parses and passes the scripts' flag validation with the number
of processes its launcher would start (what `--dry-run` runs before it reads the inputs, which the suite makes as it
goes, e.g. its reward models; run in-process: importing torch once instead of once per command)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memory_estimate
import run_utils
import train_policy_accelerate
import train_reward_accelerate
from benchmark.launch.launcher import suite_commands, training_script_args
from tests.conftest import REPO, unreachable_hub

SCRIPTS = {"train_reward_accelerate.py": train_reward_accelerate, "train_policy_accelerate.py": train_policy_accelerate}
SUITES = sorted((REPO / "benchmark" / "launch").glob("*.sh"))
COMMANDS = [(suite.name, i, argv) for suite in SUITES for i, argv in enumerate(suite_commands(suite))]


def test_every_suite_has_commands():
    assert {name for name, _, _ in COMMANDS} == {suite.name for suite in SUITES} and len(SUITES) >= 5


@pytest.mark.parametrize(("suite", "index", "argv"), COMMANDS, ids=[f"{s}-{i}" for s, i, _ in COMMANDS])
def test_suite_command_parses_and_validates(suite, index, argv, monkeypatch, capsys):
    world_size, (script, *flags) = training_script_args(argv)
    module = SCRIPTS[Path(script).name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = run_utils.task_cli(module.task_defaults, [*flags, "--dry-run"])  # as the script's last line parses
    run_utils.print_dry_run(module.validate_args(args), module.DRY_RUN_SIZES)  # every flag's check, the dry run's line
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dry_run"] == "ok" and report["world_size"] == world_size


DRY_RUNS = {
    "train_reward_accelerate.py": (["--dry-run"], ["--dry-run", "--batch-size", "30"]),
    "train_policy_accelerate.py": (["--dry-run", "--rewards.function", "sentiment"],
                                   ["--dry-run", "--rewards.function", "sentiment", "--ppo.batch-size", "30"]),
}  # fmt: skip


@pytest.mark.parametrize("script", sorted(DRY_RUNS))
def test_dry_run_from_the_command_line(script, tmp_path):
    """`--dry-run` needs no model, data or network (online, the Hub unreachable: the Hub's inputs listed as not
    checked); a batch that 4 processes can't split is a one-line error."""
    good, bad = DRY_RUNS[script]
    online = {**os.environ, **unreachable_hub()}
    result = subprocess.run([sys.executable, str(REPO / script), *good], capture_output=True, text=True, cwd=tmp_path,
                            env=online)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dry_run"] == "ok" and "--base-model gpt2 (on the Hub)" in report["not_checked"]
    env = {**online, "WORLD_SIZE": "4"}
    result = subprocess.run([sys.executable, str(REPO / script), *bad], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "batch-size" in result.stderr, result.stderr


QUEUE_GPU_GB = {"p4d.24xlarge": 40, "p5.48xlarge": 80}  # A100 40 GB, H100 80 GB
"""GPU memory per GPU of the instance types benchmark/launch/aws/pcluster.yaml's queues use"""


def usage_partition(suite: Path) -> str:
    """The Slurm queue a suite's usage line sends it to (`#   bash benchmark/launch/X.sh --slurm ...
    --slurm-partition Q`)."""
    usage = [
        line for line in suite.read_text().splitlines() if line.startswith(f"#   bash benchmark/launch/{suite.name}")
    ]
    (partition,) = {line.split("--slurm-partition ")[1].split()[0] for line in usage if "--slurm-partition" in line}
    return partition


@pytest.mark.parametrize("suite", SUITES, ids=[suite.name for suite in SUITES])
def test_every_suite_command_fits_the_gpus_of_the_queue_it_names(suite):
    """The estimated peak memory per process (memory_estimate.estimate_peak_memory, as --dry-run prints it) of each training
    command within 90% of a GPU of the queue its usage line names (benchmark/launch/aws/pcluster.yaml): a gpt2 policy at
    micro-batch 512 in fp32 (~38 GB) does not fit an A100 40 GB. Base models whose config is not here (no
    download) are left out."""
    import yaml

    pcluster = REPO / "benchmark" / "launch" / "aws" / "pcluster.yaml"
    queues = yaml.safe_load(pcluster.read_text())["Scheduling"]["SlurmQueues"]
    instance = {queue["Name"]: queue["ComputeResources"][0]["InstanceType"] for queue in queues}
    budget = run_utils.MEMORY_HEADROOM * QUEUE_GPU_GB[instance[usage_partition(suite)]]
    for argv in suite_commands(suite):
        processes, (script, *flags) = training_script_args(argv)
        config = next((argv[i + 1] for i, token in enumerate(argv) if token == "--config_file"), None)
        launch = yaml.safe_load((REPO / config).read_text()) if config else {}
        zero_stage = launch["deepspeed_config"]["zero_stage"] if launch.get("distributed_type") == "DEEPSPEED" else 0
        args = run_utils.task_cli(SCRIPTS[Path(script).name].task_defaults, flags)
        memory = memory_estimate.estimate_peak_memory(args, processes, zero_stage)
        assert memory is None or memory["total"] <= budget, (suite.name, usage_partition(suite), argv, memory)
