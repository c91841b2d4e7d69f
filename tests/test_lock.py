"""A run owns its --output-dir: the same command started twice (a second terminal, a job submitted again) cannot both
run, on 1 or 2 processes; the second stops at once with one line naming the first (PID and host), and the first goes
on unharmed. A lock that a killed run left behind (kill -9, a lost node) is said to be stale and taken over.

To make the two runs overlap whatever the machine's speed, the first is paused (SIGSTOP) once it holds the lock, and
resumed (SIGCONT) after the second has been refused."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import run_utils
from tests.conftest import REPO, one_line_error, read_jsonl, run_script, script_command, script_environment

POLICY = "train_policy_accelerate.py"


def policy_flags(assets, output_dir: Path, *extra) -> list[str]:
    return ["--base-model", str(assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
            str(assets["corpus"]), "--task.query-length", "16", "--task.response-length", "8",
            "--task.truncate-after", "2", "--ppo.batch-size", "16", "--ppo.whitening-ranks", "2",
            "--ppo.total-episodes", "48", "--output-dir", str(output_dir), *extra]  # fmt: skip


def start_and_pause_when_locked(command: list[str], output_dir: Path) -> subprocess.Popen:
    """Start a run and pause it (every process of it) once its lock names it: it holds the directory, idle."""
    process = subprocess.Popen(command, env=script_environment(2), cwd=REPO, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lock, deadline = output_dir / run_utils.LOCK_FILE, time.time() + 120
    while not (lock.is_file() and lock.read_text().strip()) and time.time() < deadline:
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.02)
    signal_run(process, signal.SIGSTOP)
    return process


def signal_run(process: subprocess.Popen, sig: int) -> None:
    """`sig` to the run's process group and every process under it (torchrun's workers run in sessions of their own)."""
    workers = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, sig)
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, sig)


@pytest.mark.parametrize("first, second", [(1, 1), (2, 2), (1, 2)], ids=["1+1", "2+2", "1+2"])
def test_the_same_command_twice_on_one_directory_cannot_both_run(tiny_assets, tmp_path, first, second):
    output_dir = tmp_path / "run"
    process = start_and_pause_when_locked(script_command(POLICY, policy_flags(tiny_assets, output_dir), first),
                                          output_dir)  # fmt: skip
    try:
        holder = json.loads((output_dir / run_utils.LOCK_FILE).read_text())
        assert holder["host"] == socket.gethostname()
        start = time.time()
        again = run_script(POLICY, *policy_flags(tiny_assets, output_dir), nproc=second)
        assert again.returncode != 0 and time.time() - start < 60
        line = f"--output-dir '{output_dir}' is in use by another run (PID {holder['pid']} on host {holder['host']}"
        assert line in again.stderr, again.stderr[-3000:]
        assert "Loading weights" not in again.stderr  # refused before any model loaded
    finally:
        signal_run(process, signal.SIGCONT)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    rows = read_jsonl(output_dir / "metrics.jsonl")  # the first run's logs whole: nothing of the second's start
    assert [row["update"] for row in rows] == [1, 2, 3] and (output_dir / "policy").is_dir()
    assert (output_dir / run_utils.LOCK_FILE).read_text() == ""  # let go at the end
    assert run_utils.lock_holder(output_dir) is None


def test_a_lock_left_by_a_killed_run_is_stale_and_the_resume_takes_it_over(tiny_assets, tmp_path):
    """kill -9 after the lock was taken: the kernel lets the flock go, the file still names the dead run; --resume
    (and a dry run before it) sees no live holder, says the lock was stale, and runs."""
    output_dir = tmp_path / "run"
    process = start_and_pause_when_locked(script_command(POLICY, policy_flags(tiny_assets, output_dir)), output_dir)
    left = json.loads((output_dir / run_utils.LOCK_FILE).read_text())
    signal_run(process, signal.SIGKILL)
    process.communicate(timeout=60)
    assert run_utils.lock_holder(output_dir) is None  # the file names a PID, but no process holds it
    resumed = run_script(POLICY, *policy_flags(tiny_assets, output_dir, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"a stale run lock (PID {left['pid']} on host {left['host']}" in " ".join(said.split()), said[-3000:]
    assert (output_dir / "policy").is_dir()


def test_a_live_lock_is_never_taken_and_a_dry_run_says_who_holds_it(tiny_assets, tmp_path):
    """In this process: a held lock refuses a second RunLock and a --dry-run's output-directory check, naming its
    holder; released, the directory is free again."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    holder = subprocess.Popen(["python", "-c", "import fcntl, json, os, socket, sys, time\n"
                               f"f = open({str(output_dir / run_utils.LOCK_FILE)!r}, 'a+')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "f.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'since': 'now'}))\n"
                               "f.flush(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        expected = f"PID {holder.pid} on host {socket.gethostname()}, since now"
        assert run_utils.lock_holder(output_dir) == expected
        with pytest.raises(SystemExit) as failure:
            run_utils.RunLock(output_dir, "--output-dir 'x'")
        assert f"--output-dir 'x' is in use by another run ({expected})" in one_line_error(failure)
        dry = run_script(POLICY, *policy_flags(tiny_assets, output_dir, "--dry-run"))
        assert dry.returncode == 1 and f"is in use by another run ({expected})" in dry.stderr
    finally:
        holder.kill()
        holder.wait()
    lock = run_utils.RunLock(output_dir, "--output-dir 'x'")  # free now: taken (the dead holder's text: stale)
    assert json.loads((output_dir / run_utils.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (output_dir / run_utils.LOCK_FILE).read_text() == "" and run_utils.lock_holder(output_dir) is None
