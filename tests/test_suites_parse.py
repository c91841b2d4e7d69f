"""Every training command of every benchmark suite parses and passes the scripts' flag validation with the number
of processes its launcher would start (the same code path as `--dry-run`, run in-process: importing torch once
instead of once per command)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

import run_utils
import train_policy_accelerate
import train_reward_accelerate
from benchmark.benchmark import benchmark_commands, training_script_args

SCRIPTS = {"train_reward_accelerate.py": train_reward_accelerate, "train_policy_accelerate.py": train_policy_accelerate}
SUITES = sorted((REPO / "benchmark").glob("*.sh"))
COMMANDS = [(suite.name, i, argv) for suite in SUITES for i, argv in enumerate(benchmark_commands(suite))]


def test_every_suite_has_commands():
    assert {name for name, _, _ in COMMANDS} == {suite.name for suite in SUITES} and len(SUITES) >= 5


@pytest.mark.parametrize(("suite", "index", "argv"), COMMANDS, ids=[f"{s}-{i}" for s, i, _ in COMMANDS])
def test_suite_command_parses_and_validates(suite, index, argv, monkeypatch, capsys):
    world_size, (script, *flags) = training_script_args(argv)
    module = SCRIPTS[Path(script).name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = run_utils.task_cli(module.task_defaults, [*flags, "--dry-run"])  # as the script's last line parses
    module.main(args)  # validates every flag and exits before loading anything
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dry_run"] == "ok" and report["world_size"] == world_size


DRY_RUNS = {
    "train_reward_accelerate.py": (["--dry-run"], ["--dry-run", "--batch-size", "30"]),
    "train_policy_accelerate.py": (["--dry-run", "--rewards.trained-model", "x"],
                                   ["--dry-run", "--rewards.trained-model", "x", "--ppo.batch-size", "30"]),
}  # fmt: skip


@pytest.mark.parametrize("script", sorted(DRY_RUNS))
def test_dry_run_from_the_command_line(script, tmp_path):
    """`--dry-run` needs no model, data or network; a batch that 4 processes can't split is a one-line error."""
    good, bad = DRY_RUNS[script]
    result = subprocess.run([sys.executable, str(REPO / script), *good], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["dry_run"] == "ok"
    env = {**os.environ, "WORLD_SIZE": "4"}
    result = subprocess.run([sys.executable, str(REPO / script), *bad], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "batch-size" in result.stderr, result.stderr
