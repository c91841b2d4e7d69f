"""Checkpoints and exact resume (both scripts), SIGTERM, and what happens when a process of a distributed run dies.

Fault injection: a run is killed at a random point after its first checkpoint (SIGKILL to the whole process group, as
a node failure or `scancel` would; or SIGTERM, as Slurm preemption does), then continued with `--resume`. The finished
run must equal an uninterrupted run with the same seed bit for bit: the same final parameters and the same
metrics.jsonl (one row per step; only the wall-clock `elapsed/*` and `time/*` columns may differ).
"""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, read_jsonl, run_script, script_command, script_environment

REWARD = "train_reward_accelerate.py"
POLICY = "train_policy_accelerate.py"
KILL_SEED = int(os.environ.get("RESUME_TEST_SEED", "0"))  # the random kill points are reproducible
KILL_POINTS = int(os.environ.get("RESUME_KILL_POINTS", "1"))  # more for a sweep: docs/checkpoints.md


def reward_flags(assets, output_dir, *extra):
    return ["--base-model", str(assets["model"]), "--label-dataset", str(assets["small_labels"]),
            "--task.query-dataset", str(assets["corpus"]), "--output-dir", str(output_dir),
            "--labels.num-train", "64", "--batch-size", "8", "--lr", "3e-3", "--rollout-batch-size", "16",
            "--normalize-samples", "16", "--print-sample-output-freq", "3", "--checkpoint-every", "2", *extra]  # fmt: skip


def policy_flags(assets, reward_model, output_dir, *extra):
    return ["--base-model", str(assets["model"]), "--rewards.trained-model", str(reward_model),
            "--task.query-dataset", str(assets["corpus"]), "--output-dir", str(output_dir),
            "--task.query-length", "16", "--task.response-length", "8", "--task.truncate-after", "2",
            "--ppo.batch-size", "16", "--ppo.whitening-ranks", "2", "--ppo.total-episodes", "128", "--ppo.lr", "1e-3",
            "--print-sample-output-freq", "3", "--checkpoint-every", "2", *extra]  # fmt: skip


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("elapsed", "time"))} for row in rows]


def checkpoints(output_dir: Path) -> list[str]:
    return sorted(path.name for path in (output_dir / "checkpoints").glob("step-*"))


def metrics_rows(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def choose_kill_point(name: str, rows: tuple[int, int]) -> tuple[int, float]:
    """A reproducible random kill point: after how many metrics rows, then how far into the next step (a fraction of
    a step's time, which run_and_interrupt measures as the run goes: on a fast machine or a slow one, the kill lands
    inside the step after the row, so after the last row but one it still comes before the run's end)."""
    rng = random.Random(f"{KILL_SEED}-{name}")
    return rng.randint(*rows), rng.uniform(0, 1)


def run_and_interrupt(command: list[str], output_dir: Path, sig: int, after_rows: int = 0, into_step: float = 0,
                      env=None):  # fmt: skip
    """Start a run, wait for its first checkpoint and for `after_rows` metrics rows, wait `into_step` of a step more
    (a step: the time between the last two rows it saw, per row), then send `sig` to its whole process group and
    every process under it (as Slurm or a node failure would); returns the exit status and output."""
    process = subprocess.Popen(command, env=env or script_environment(), cwd=REPO, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline, arrivals = time.time() + 300, [(0, time.time())]  # (rows seen, when first seen)
    while process.poll() is None and time.time() < deadline:
        if (rows := metrics_rows(output_dir)) > arrivals[-1][0]:
            arrivals.append((rows, time.time()))
        if checkpoints(output_dir) and rows >= after_rows:
            break
        time.sleep(0.02)
    step = 0.0  # unknown before two rows were seen (the first row's time includes the start-up)
    if len(arrivals) > 2:
        (rows_before, seen_before), (rows_last, seen_last) = arrivals[-2:]
        step = (seen_last - seen_before) / (rows_last - rows_before)
    delay = into_step * step
    time.sleep(delay)
    if process.poll() is None:
        logged = metrics_rows(output_dir)
        # the launcher's workers run in sessions of their own (torchrun, accelerate launch): signal each of them too
        workers = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, sig)
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)
        print(
            f"{output_dir}: {signal.Signals(sig).name} after {delay:.2f} s, {logged} metrics rows, {checkpoints(output_dir)}"
        )
    output, _ = process.communicate(timeout=120)
    return process.returncode, output


def assert_same_run(finished: Path, reference: Path, weights: str) -> None:
    assert without_timings(read_jsonl(finished / "metrics.jsonl")) == without_timings(
        read_jsonl(reference / "metrics.jsonl")
    )
    first, second = load_file(finished / weights), load_file(reference / weights)
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


# ---------------------------------------------------------------------------------------------------------------------
# reward model


@pytest.fixture(scope="module")
def reward_reference(tiny_assets, tmp_path_factory):
    """An uninterrupted run: 8 steps, a checkpoint every 2, evaluation every 3."""
    output_dir = tmp_path_factory.mktemp("reward-reference") / "run"
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_reward_checkpoints_keep_the_newest_two_and_each_is_complete(reward_reference):
    assert checkpoints(reward_reference) == ["step-00000006", "step-00000008"]
    newest = reward_reference / "checkpoints" / "step-00000008"
    # accelerate's save_state: model, optimizer, this process's RNG states; ours: the rest of the state, the log
    assert {path.name for path in newest.iterdir()} == {
        "pytorch_model.bin",
        "optimizer.bin",
        "random_states_0.pkl",
        "state.json",
        "metrics.jsonl",
        "samples.jsonl",
    }  # fmt: skip
    assert json.loads((newest / "state.json").read_text())["step"] == 8
    assert read_jsonl(newest / "metrics.jsonl")[-1]["step"] == 8
    assert not list((reward_reference / "checkpoints").glob(".*"))  # no temporaries left behind


@pytest.mark.parametrize("kill_point", range(KILL_POINTS))
def test_reward_resume_after_sigkill_is_bit_identical(tiny_assets, reward_reference, tmp_path, kill_point):
    output_dir = tmp_path / "run"
    rows, delay = choose_kill_point(f"reward-{kill_point}", (3, 7))  # of 10: normalization before, steps 1-8, after
    flags = reward_flags(tiny_assets, output_dir)
    returncode, output = run_and_interrupt(script_command(REWARD, flags), output_dir, signal.SIGKILL, rows, delay)
    assert returncode == -signal.SIGKILL, output[-3000:]  # really killed, not finished
    assert not (output_dir / "reward_model").exists()
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert_same_run(output_dir, reward_reference, "reward_model/model.safetensors")
    assert_same_run(output_dir, reward_reference, "reward_model/reward_head.safetensors")


def test_a_moved_run_resumes_by_path_from_its_newest_sound_checkpoint(tiny_assets, reward_reference, tmp_path):
    """The run directory moved and given with a trailing slash (a path, not a string: args.json holds the old one),
    and its newest checkpoint cut short after it was written: --resume says so, goes on from the one before it, and
    finishes as the uninterrupted run did."""
    output_dir = tmp_path / "moved"
    shutil.copytree(reward_reference, output_dir)
    shutil.rmtree(output_dir / "reward_model")  # as if killed after its last checkpoint
    state = output_dir / "checkpoints" / "step-00000008" / "state.json"
    state.write_text(state.read_text()[:100])
    result = run_script(REWARD, *reward_flags(tiny_assets, f"{output_dir}/", "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{output_dir}/checkpoints/step-00000008 is damaged (state.json: " in result.stdout.replace("\n", "")
    assert "resumed from" in result.stdout and "step-00000006 at step 7" in result.stdout.replace("\n", "")
    assert_same_run(output_dir, reward_reference, "reward_model/reward_head.safetensors")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
def test_reward_sigterm_or_ctrl_c_writes_a_checkpoint_and_stops_then_resumes_identically(
    tiny_assets, reward_reference, tmp_path, sig, code
):
    output_dir = tmp_path / "run"
    returncode, output = run_and_interrupt(
        script_command(REWARD, reward_flags(tiny_assets, output_dir)), output_dir, sig
    )
    assert returncode == code, output[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in output and "Traceback" not in output
    stopped_at = json.loads((output_dir / "checkpoints" / checkpoints(output_dir)[-1] / "state.json").read_text())[
        "step"
    ]
    assert read_jsonl(output_dir / "metrics.jsonl")[-1]["step"] == stopped_at < 8
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(output_dir, reward_reference, "reward_model/reward_head.safetensors")


SIMULATED = [
    "--labels.source",
    "sentiment",
    "--labels.simulated-num-test",
    "16",
    "--local-rollout-forward-batch-size",
    "8",
]


def test_ctrl_c_while_simulating_labels_stops_in_seconds_keeps_them_and_resumes_identically(tiny_assets, tmp_path):
    """80 labels made 2 queries at a time: Ctrl-C in the middle stops after the current 2 (not after all 80), the
    labels made so far are kept, and --resume continues them: the same labels and model as an uninterrupted run."""
    reference = tmp_path / "reference"
    assert run_script(REWARD, *reward_flags(tiny_assets, reference, *SIMULATED)).returncode == 0
    output_dir, log = tmp_path / "run", tmp_path / "first.log"
    flags = reward_flags(tiny_assets, output_dir, *SIMULATED)
    with log.open("w") as out:
        process = subprocess.Popen(script_command(REWARD, flags), env=script_environment(), cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.time() + 120
        while "simulating labels: 1/" not in log.read_text() and time.time() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        interrupted = time.time()
        process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 130 and time.time() - interrupted < 10, output[-3000:]
    assert "kept the labels made so far" in output and not (output_dir / "labels.json").exists()
    assert list((output_dir / "labels.partial").glob("process-*.pt"))
    result = run_script(REWARD, *flags, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed the labels from" in result.stdout and not (output_dir / "labels.partial").exists()
    assert (output_dir / "labels.json").read_text() == (reference / "labels.json").read_text()
    assert_same_run(output_dir, reference, "reward_model/reward_head.safetensors")


def test_resuming_a_finished_run_returns_at_once_and_changes_nothing(tiny_assets, reward_reference):
    before = (reward_reference / "metrics.jsonl").read_text()
    start = time.time()
    result = run_script(REWARD, *reward_flags(tiny_assets, reward_reference, "--resume"))
    assert result.returncode == 0 and "nothing to do" in result.stdout
    assert time.time() - start < 60 and (reward_reference / "metrics.jsonl").read_text() == before


def test_an_unfinished_run_is_neither_appended_to_nor_resumed_with_other_flags(tiny_assets, reward_reference, tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    first_attempt = json.loads((reward_reference / "args.json").read_text())
    first_attempt.update(output_dir=str(output_dir), lr=1.0, seed=7)
    (output_dir / "args.json").write_text(json.dumps(first_attempt))
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir))
    assert result.returncode != 0 and "--resume" in result.stderr and "unfinished run" in result.stderr
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir, "--resume"))
    assert result.returncode != 0
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"error: --resume: --lr, --seed differ from {output_dir / 'args.json'}"
    )
    assert (output_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


# ---------------------------------------------------------------------------------------------------------------------
# policy


@pytest.fixture(scope="module")
def policy_reference(tiny_assets, reward_reference, tmp_path_factory):
    """An uninterrupted run: 8 updates of 16 episodes, a checkpoint every 2."""
    output_dir = tmp_path_factory.mktemp("policy-reference") / "run"
    result = run_script(POLICY, *policy_flags(tiny_assets, reward_reference / "reward_model", output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


@pytest.mark.parametrize("kill_point", range(2 * KILL_POINTS))
def test_policy_resume_after_sigkill_is_bit_identical(
    tiny_assets, reward_reference, policy_reference, tmp_path, kill_point
):
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_reference / "reward_model", output_dir)
    rows, delay = choose_kill_point(f"policy-{kill_point}", (2, 7))  # of 8 rows: updates 1-8
    returncode, output = run_and_interrupt(script_command(POLICY, flags), output_dir, signal.SIGKILL, rows, delay)
    assert returncode == -signal.SIGKILL, output[-3000:]
    result = run_script(POLICY, *flags, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert_same_run(output_dir, policy_reference, "policy/model.safetensors")
    assert_same_run(output_dir, policy_reference, "policy/value_head.safetensors")
    updates = [row["update"] for row in read_jsonl(output_dir / "metrics.jsonl") if "objective/scores" in row]
    assert updates == list(range(1, 9))  # exactly one row per update
    samples = [row["update"] for row in read_jsonl(output_dir / "samples.jsonl")]
    assert samples == [row["update"] for row in read_jsonl(policy_reference / "samples.jsonl")]


def test_policy_sigterm_checkpoints_and_resumes_identically(tiny_assets, reward_reference, policy_reference, tmp_path):
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_reference / "reward_model", output_dir)
    returncode, output = run_and_interrupt(script_command(POLICY, flags), output_dir, signal.SIGTERM)
    assert returncode == 143 and "stopped by SIGTERM" in output, output[-3000:]
    result = run_script(POLICY, *flags, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(output_dir, policy_reference, "policy/model.safetensors")


@pytest.fixture(scope="module")
def policy_reference_two_processes(tiny_assets, reward_reference, tmp_path_factory):
    """An uninterrupted run on 2 processes (torchrun, gloo); its output in stdout.txt beside it."""
    output_dir = tmp_path_factory.mktemp("policy-reference-2") / "run"
    result = run_script(POLICY, *policy_flags(tiny_assets, reward_reference / "reward_model", output_dir), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    (output_dir.parent / "stdout.txt").write_text(result.stdout)
    return output_dir


def test_two_processes_keep_kl_coef_in_step(policy_reference_two_processes):
    """The 2-process run: the adaptive KL controller is fed the KL averaged over both processes, so kl_coef is
    identical on both at every update (the logged spread over processes is exactly 0), and so are the parameters at
    the end; the progress lines come from the main process only."""
    rows = read_jsonl(policy_reference_two_processes / "metrics.jsonl")
    updates = [row for row in rows if "objective/kl_coef" in row]
    assert len(updates) == 8 and all(row["sync/kl_coef_spread"] == 0.0 for row in updates)
    assert updates[-1]["objective/kl_coef"] != 0.15
    assert [row["sync/param_spread"] for row in rows if "sync/param_spread" in row] == [0.0]
    assert json.loads((policy_reference_two_processes / "args.json").read_text())["local_batch_size"] == 8
    stdout = (policy_reference_two_processes.parent / "stdout.txt").read_text()
    assert stdout.count("PPO: 8/8 (100%)") == 1


@pytest.mark.parametrize("kill_point", range(KILL_POINTS))
def test_policy_two_processes_resume_after_sigkill_is_bit_identical(
    tiny_assets, reward_reference, policy_reference_two_processes, tmp_path, kill_point
):
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_reference / "reward_model", output_dir)
    rows, delay = choose_kill_point(f"two-{kill_point}", (2, 7))
    returncode, output = run_and_interrupt(
        script_command(POLICY, flags, 2), output_dir, signal.SIGKILL, rows, delay, env=script_environment(2)
    )
    assert returncode == -signal.SIGKILL, output[-3000:]
    # each process's RNG states and query-stream position are in the checkpoint
    newest = output_dir / "checkpoints" / checkpoints(output_dir)[-1]
    assert (newest / "random_states_0.pkl").is_file() and (newest / "random_states_1.pkl").is_file()
    assert len(json.loads((newest / "state.json").read_text())["processes"]) == 2
    result = run_script(POLICY, *flags, "--resume", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout  # the workers were really killed: the run continued from a checkpoint
    assert_same_run(output_dir, policy_reference_two_processes, "policy/model.safetensors")
    # a checkpoint of 2 processes cannot continue on 1 (per-process RNG streams): a clear error
    (output_dir / "policy").rename(output_dir / "policy-finished")
    result = run_script(POLICY, *flags, "--resume")
    assert result.returncode != 0 and "written by 2 processes" in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# distributed failures


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_when_one_of_two_processes_dies_the_other_exits_with_an_error_in_bounded_time(
    tiny_assets, reward_reference, tmp_path
):
    """Launched without torchrun (as a cluster launcher might: one process per rank), so nothing but the scripts
    themselves stands between a dead peer and a hang: the survivor must fail, not wait for a 30-minute timeout."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = policy_flags(
        tiny_assets, reward_reference / "reward_model", tmp_path / "run", "--ppo.total-episodes", "1600"
    )
    processes = []
    for rank in range(2):
        env = {**script_environment(2), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
        processes.append(subprocess.Popen(script_command(POLICY, flags), env=env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        assert all(process.poll() is None for process in processes), processes[0].communicate()[0][-3000:]
        time.sleep(0.1)
    processes[1].kill()
    killed_at = time.time()
    output, _ = processes[0].communicate(timeout=180)
    waited = time.time() - killed_at
    assert processes[0].returncode != 0, output[-3000:]
    assert waited < 120, waited
