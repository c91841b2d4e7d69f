"""benchmark/openai/compare_reported.py offline: synthetic run directories, OpenAI's wandb metric mapping with fake
runs, and the fast fallback to the checked-in table when wandb cannot be reached."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmark.openai import compare_reported as compare

REPO_ROOT = Path(__file__).resolve().parents[1]

UPDATES = 50


def write_policy_run(directory: Path, seed: int, final_score: float, updates: int = UPDATES) -> None:
    """A metrics.jsonl shaped like the policy script's: score rises to final_score, KL to 6, entropy falls to 44."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w") as f:
        for update in range(1, updates + 1):
            t = update / updates
            record = {
                "update": update,
                "episode": update * 512,
                "objective/scores": -0.5 + (final_score + 0.5) * t + rng.normal(0, 0.05),
                "objective/kl": 6.0 * t,
                "objective/kl_coef": 0.15 + 0.1 * t,
                "objective/entropy": 60.0 - 16.0 * t,
                "ppo/policy/approxkl": 0.01 * (1 - t) + 0.001,
                "elapsed/fps": 1400.0,
            }
            f.write(json.dumps(record) + "\n")


@pytest.fixture
def policy_runs(tmp_path: Path) -> Path:
    for seed, score in ((1, 1.5), (2, 1.9), (3, 2.3)):
        write_policy_run(tmp_path / "runs" / f"policy_{seed}", seed, score)
    return tmp_path / "runs"


def run_compare(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    """The tool run as a module in `cwd` (the repository on PYTHONPATH)."""
    command = [sys.executable, "-m", "benchmark.openai.compare_reported", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_offline_compare_falls_back_fast_and_writes_everything(policy_runs, tmp_path):
    start = time.monotonic()
    result = run_compare(
        *("--task", "sentiment", "--runs", f"ours={policy_runs}/policy_*", "--output-dir", "out"), cwd=tmp_path
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 30, f"offline compare took {elapsed:.1f} s: the wandb fallback must be fast"
    assert "OpenAI from wandb unavailable" in result.stdout
    assert "[compare] ours: 3 local run directories" in result.stdout
    assert "[compare] OpenAI: reported end values from" in result.stdout
    out = tmp_path / "out"
    png, svg = out / "sentiment_curves.png", out / "sentiment_curves.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert svg.read_text().lstrip().startswith("<?xml") and "objective/scores" in svg.read_text()
    table = (out / "sentiment_final_values.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    # final score of a seed = mean of its last 5 of 50 updates (t = 0.92..1) = -0.5 + (final + 0.5) * 0.96 + noise
    # = 1.42, 1.80, 2.19 (noise std 0.05 / sqrt(5)): mean 1.80, inside OpenAI's 1.85 (seeds 0.75-2.65)
    score_row = rows["objective/scores"].split(" | ")
    assert score_row[2] == "3"
    assert float(score_row[3].split(" ± ")[0]) == pytest.approx(1.804, abs=0.05)
    assert score_row[5].startswith("1.85") and score_row[7].rstrip(" |") == "yes"
    # entropy: 60 - 16 * 0.96 = 44.64 for every seed, outside 44 ± 0.05
    entropy_row = rows["objective/entropy"].split(" | ")
    assert entropy_row[3] == "44.64 ± 0" and entropy_row[7].rstrip(" |") == "**no**"
    assert "| elapsed/fps | ours | 3 | 1400 ± 0 |" in table
    assert "wandb unavailable" in table  # the table says where OpenAI's numbers came from


def test_compare_wandb_only_fails_fast_offline(policy_runs, tmp_path, monkeypatch):
    # a closed local port stands in for an unreachable wandb, whatever this machine's network is
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.openai.compare_reported", "--runs", f"ours={policy_runs}/policy_*"]
        + ["--openai-source", "wandb", "--output-dir", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**dict(__import__("os").environ), "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}"},
    )
    assert result.returncode != 0
    assert "--openai-source wandb, but cannot reach 127.0.0.1" in result.stderr


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free once the socket closes: nothing listens there


def test_wandb_unreachable_reason(monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    start = time.monotonic()
    reason = compare.wandb_unreachable_reason(timeout=3)
    assert reason is not None and "127.0.0.1" in reason and time.monotonic() - start < 3.5
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert compare.wandb_unreachable_reason(timeout=3) is None


class FakeWandbRun:
    def __init__(self, run_id: str, config: dict, history: list[dict]):
        self.id, self.config, self._history = run_id, config, history

    def scan_history(self, page_size: int = 1000):
        return iter(self._history)


def openai_history(updates: int, with_episodes: bool) -> list[dict]:
    rows = []
    for step in range(updates):
        row = {
            "_step": step,
            "ppo/objective/score": 0.1 * step,
            "ppo/objective/kl": 1.0,
            "ppo/ppo/policy/approxkl": 0.5,
        }
        if with_episodes:
            row["ppo/elapsed/episodes"] = (step + 1) * 512
        rows.append(row)
    rows.append({"_step": updates, "train_reward/minibatch/loss": 1.2})  # a row with nothing we map is dropped
    return rows


def test_openai_metric_names_are_mapped_to_ours():
    for with_episodes in (True, False):
        run = compare.openai_run_to_run("openai/x", openai_history(4, with_episodes))
        assert run.x_name == "episode" and run.x.tolist() == [512, 1024, 1536, 2048]
        assert run.metrics["objective/scores"].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])
        assert run.metrics["objective/kl"].tolist() == [1.0] * 4
        assert run.metrics["ppo/policy/approxkl"].tolist() == [0.5] * 4
        assert "ppo/objective/score" not in run.metrics


def test_load_openai_wandb_filters_task_and_model(monkeypatch):
    calls = []

    class FakeApi:
        def runs(self, path, filters=None):
            calls.append((path, filters))
            return [
                FakeWandbRun(
                    "a",
                    {"task_id": "sentiment", "task": {"policy": {"initial_model": "124M"}}},
                    openai_history(3, True),
                ),
                FakeWandbRun(
                    "b", {"task_id": "sentiment", "task": {"value": {"policy": {"initial_model": "774M"}}}}, []
                ),
                FakeWandbRun("c", {"task_id": {"value": "sentiment"}}, openai_history(3, False)),
            ]

    monkeypatch.setattr(compare, "wandb_api", lambda timeout: FakeApi())
    group = compare.load_openai_wandb(compare.Args(task="sentiment", runs=["x=y"]))
    assert calls == [("openrlbenchmark/lm-human-preferences", {"config.task_id": "sentiment"})]
    assert [run.name for run in group.runs] == ["openai/a", "openai/c"]  # 774M dropped; unknown model kept
    assert group.name == "OpenAI (2 seeds)"
    references = compare.references_from_group(group, ["objective/scores"], fraction=0.1)
    assert references["objective/scores"].value == pytest.approx(0.2)


def test_online_path_plots_openai_curves(policy_runs, tmp_path, monkeypatch, capsys):
    # wandb "reachable" and answering with two OpenAI-like runs: their curves are drawn, their seeds the reference
    def history(final: float) -> list[dict]:
        rows = []
        for step in range(40):
            t = (step + 1) / 40
            rows.append(
                {
                    "_step": step,
                    "ppo/elapsed/episodes": (step + 1) * 640,
                    "ppo/objective/score": -0.5 + (final + 0.5) * t,
                    "ppo/objective/kl": 6.0 * t,
                    "ppo/objective/entropy": 60.0 - 15.0 * t,
                }
            )
        return rows

    class FakeApi:
        def runs(self, path, filters=None):
            config = {"task_id": "sentiment", "task": {"value": {"policy": {"initial_model": "124M"}}}}
            return [FakeWandbRun("s1", config, history(1.6)), FakeWandbRun("s2", config, history(2.1))]

    monkeypatch.setattr(compare, "wandb_unreachable_reason", lambda timeout: None)
    monkeypatch.setattr(compare, "wandb_api", lambda timeout: FakeApi())
    args = compare.Args(runs=[f"ours={policy_runs}/policy_*"], output_dir=str(tmp_path / "out"))
    assert compare.main(args) == 0
    printed = capsys.readouterr().out
    assert "[compare] OpenAI: wandb openrlbenchmark/lm-human-preferences: 2 runs, task_id=sentiment" in printed
    table = (tmp_path / "out" / "sentiment_final_values.md").read_text()
    # OpenAI's final score: last 4 of 40 records, t = 0.925..1: mean over both seeds 1.85 - 0.0375 * 2.35 = 1.762
    assert "| objective/scores | ours | 3 |" in table and "1.762 (2 OpenAI seeds" in table
    assert (tmp_path / "out" / "sentiment_curves.png").stat().st_size > 20_000


def test_config_value_unwraps_wandb_values():
    assert (
        compare.config_value(
            {"task": {"value": {"policy": {"initial_model": "124M"}}}}, "task.value.policy.initial_model"
        )
        == "124M"
    )
    assert (
        compare.config_value({"task": {"value": {"policy": {"initial_model": "124M"}}}}, "task.policy.initial_model")
        == "124M"
    )
    assert compare.config_value({"task_id": {"value": "sentiment"}}, "task_id") == "sentiment"
    assert compare.config_value({}, "task.policy") is None


def test_final_value_and_spread():
    run = compare.Run("r", "update", np.arange(20.0), {"m": np.arange(20.0), "gaps": np.array([np.nan] * 19 + [3.0])})
    assert compare.final_value(run, "m", 0.1) == pytest.approx(18.5)  # mean of the last 2 of 20
    assert compare.final_value(run, "m", 0.01) == pytest.approx(19.0)  # at least one record
    assert compare.final_value(run, "gaps", 0.1) == pytest.approx(3.0)
    assert math.isnan(compare.final_value(run, "absent", 0.1))
    assert compare.overlap(1.0, 2.0, 1.9, 3.0) and not compare.overlap(1.0, 2.0, 2.1, 3.0)


def test_reference_table_intervals():
    table = compare.load_reference_table(
        str(REPO_ROOT / "benchmark" / "openai" / "reported_end_values.csv"), "sentiment"
    )
    score = table["objective/scores"]
    assert (score.value, score.low, score.high) == (1.85, 0.75, 2.65)  # widened to OpenAI's seed range
    kl_coef = table["objective/kl_coef"]
    assert (kl_coef.low, kl_coef.high) == pytest.approx((0.2, 0.3))
    descriptiveness = compare.load_reference_table(
        str(REPO_ROOT / "benchmark" / "openai" / "reported_end_values.csv"), "descriptiveness"
    )
    assert descriptiveness["objective/scores"].value == 2.28 and descriptiveness["objective/kl_coef"].value == 0.32


def test_mean_std_curve_over_runs_of_different_length():
    short = compare.Run("a", "episode", np.array([0.0, 10.0]), {"m": np.array([0.0, 10.0])})
    long = compare.Run("b", "episode", np.array([0.0, 10.0, 20.0]), {"m": np.array([2.0, 12.0, 22.0])})
    x, mean, std = compare.mean_std_curve(compare.Group("g", [short, long], "test"), "m", smooth=1)
    assert x[0] == 0 and x[-1] == 20
    assert mean[0] == pytest.approx(1.0) and std[0] == pytest.approx(1.0)
    assert mean[-1] == pytest.approx(22.0) and std[-1] == pytest.approx(0.0)  # only the long run reaches x = 20


def test_compare_two_local_groups_without_openai(policy_runs, tmp_path):
    for seed in (1, 2):
        write_policy_run(tmp_path / "other" / f"policy_{seed}", seed + 10, 1.0)
    result = run_compare(
        *("--runs", f"tf-adam={policy_runs}/policy_*", "--runs", f"torch-adam={tmp_path}/other/policy_*"),
        *("--openai-source", "none", "--metrics", "objective/scores", "objective/kl", "--output-dir", "out"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "out" / "sentiment_final_values.md").read_text()
    assert "| objective/scores | tf-adam | 3 |" in table and "| objective/scores | torch-adam | 2 |" in table
    assert "OpenAI: not compared" in table


def test_compare_rejects_missing_runs(tmp_path):
    result = run_compare("--runs", f"x={tmp_path}/nothing_*", cwd=tmp_path)
    assert result.returncode != 0 and "no directory matching" in result.stderr
