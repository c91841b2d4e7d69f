"""benchmark/launch/launcher.py --slurm --slurm-nodes 2 on a real two-node Slurm cluster that
benchmark/launch/slurm/ci_two_nodes.sh builds on this one machine (three network namespaces on a private bridge; one
slurmd per node namespace).

A tiny policy run spread over the two nodes (torchrun, c10d rendezvous at the template's MASTER_ADDR, one process per
node) must equal the same run as 2 processes on one machine (torchrun --standalone) bit for bit: the same
metrics.jsonl (timing columns dropped) and the same saved tensors. So must a two-node run that Slurm requeues mid-run
(`scontrol requeue`: SIGTERM, the script checkpoints and stops; the restart gets --resume from --slurm-requeue).

Needs root, `ip netns` and Debian's slurm-wlm + munge (the script installs them if missing). Nothing here skips: if
the cluster cannot be started the tests fail. Deselect them with `pytest -m "not slurm"`. About 75-100 s on 2 CPU
cores: the cluster starts in < 1 s; the time goes to three tiny training runs (the requeued one twice) and to the 10 s
for which Slurm holds a requeued job back.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import train_reward_accelerate
from tests.conftest import REPO, read_jsonl, run_script
from tests.loopback import sitecustomize as loopback

CLUSTER_SCRIPT = REPO / "benchmark" / "launch" / "slurm" / "ci_two_nodes.sh"
LAUNCHER = [sys.executable, "-m", "benchmark.launch.launcher"]  # run from the repository root
POLICY = "train_policy_accelerate.py"
SEED = 1  # the launcher's first seed
JOB_TIMEOUT = 180  # seconds for one job, far above the ~30 s the jobs here take
FINISHED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
# the job's environment: CPU, offline, one thread per process (both "nodes" share this machine's cores)
JOB_SETUP = "export ACCELERATE_USE_CPU=true HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 WANDB_MODE=offline"

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster():
    """The directory of a running two-node cluster; stopped and removed afterwards, also when starting it failed."""
    if os.geteuid() != 0:
        pytest.fail("the two-node Slurm tests create network namespaces, which needs root; deselect: -m 'not slurm'")
    directory = Path(tempfile.mkdtemp(prefix="slurm-two-nodes-"))
    try:
        start = time.monotonic()
        result = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            pytest.fail(
                f"could not start the two-node cluster (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        print(f"two-node slurm started in {time.monotonic() - start:.1f} s: {result.stdout.strip()}")
        # the jobs (which inherit this environment) may reach the nodes by name: the loopback guard's allowance
        os.environ[loopback.HOSTS_VARIABLE] = str(directory / "hosts")
        yield directory
    finally:
        os.environ.pop(loopback.HOSTS_VARIABLE, None)
        stop = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "stop", str(directory)], capture_output=True, text=True, timeout=180
        )
        shutil.rmtree(directory, ignore_errors=True)
        assert stop.returncode == 0, stop.stdout + stop.stderr


def in_cluster(cluster: Path, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command run where the cluster is reachable: the controller's network namespace, with its SLURM_CONF."""
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "run", str(cluster), *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def job_record(cluster: Path, job_id: str) -> dict[str, str]:
    """`scontrol show job -o` of array task 0 of the job."""
    result = in_cluster(cluster, "scontrol", "show", "job", "-o", job_id)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if fields.get("ArrayJobId") == job_id and fields.get("ArrayTaskId") == "0":
            return fields
    raise AssertionError(f"no array task 0 of job {job_id}: {result.stdout}")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def reward_model(tiny_assets, tmp_path_factory) -> Path:
    """An untrained reward model on the tiny GPT-2 (the policy runs need one; training it would add ~25 s)."""
    base = str(tiny_assets["model"])
    directory = tmp_path_factory.mktemp("reward") / "reward_model"
    tokenizer = train_reward_accelerate.load_tokenizer(base)
    torch.manual_seed(0)
    backbone = train_reward_accelerate.load_pretrained(AutoModel, base)
    model = train_reward_accelerate.RewardModel(backbone, tokenizer.pad_token_id)
    train_reward_accelerate.save_reward_model(model, directory, tokenizer, base, train_reward_accelerate.TaskHParams())
    return directory


def policy_flags(assets, reward_model: Path, output_dir: Path) -> list[str]:
    """tests/test_resume.py's tiny run, twice as long: 16 updates of 16 episodes, a checkpoint every 2 (with 8, the
    requeue sent once the first checkpoint was seen landed with 2 updates to spare, on an idle machine)."""
    return ["--base-model", str(assets["model"]), "--rewards.trained-model", str(reward_model),
            "--task.query-dataset", str(assets["corpus"]), "--output-dir", str(output_dir),
            "--task.query-length", "16", "--task.response-length", "8", "--task.truncate-after", "2",
            "--ppo.batch-size", "16", "--ppo.whitening-ranks", "2", "--ppo.total-episodes", "256", "--ppo.lr", "1e-3",
            "--print-sample-output-freq", "3", "--checkpoint-every", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_assets, reward_model, tmp_path_factory) -> Path:
    """The same run as 2 processes on one machine."""
    output_dir = tmp_path_factory.mktemp("two-processes") / "run"
    flags = policy_flags(tiny_assets, reward_model, output_dir)
    result = run_script(POLICY, *flags, "--seed", str(SEED), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def two_node_command(flags: list[str]) -> str:
    """One torchrun per node (srun starts it on both), meeting at the first node of the allocation."""
    return (
        f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d "
        f"--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT {POLICY} {shlex.join(flags)}"
    )


def submit_two_node_job(cluster: Path, flags: list[str], job_name: str, logs: Path, *extra: str) -> tuple[str, str]:
    """Run the launcher for one seed on 2 nodes; returns (array job id, launcher output)."""
    launcher = [*LAUNCHER, "--slurm", "--slurm-nodes", "2", "--slurm-poll-seconds", "0.5"]
    result = in_cluster(
        cluster,
        *launcher,
        *("--command", two_node_command(flags), "--num-seeds", "1", "--start-seed", str(SEED)),
        *("--job-name", job_name, "--log-dir", str(logs), "--slurm-setup", JOB_SETUP, *extra),
        timeout=JOB_TIMEOUT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + job_log(logs, job_name)[-6000:] + daemon_logs(cluster)
    match = re.search(r"submitted array job (\d+)", result.stdout)
    assert match, output
    return match.group(1), output


def daemon_logs(cluster: Path) -> str:
    """The tails of the cluster's daemon logs, for assertion messages (the directory goes when the module ends)."""
    tails = [
        f"\n---- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
        for path in sorted((cluster / "log").glob("*.log"))
    ]
    return "".join(tails)


def job_log(logs: Path, job_name: str) -> str:
    """The job's log (both attempts of a requeued job: the launcher makes Slurm append)."""
    return "".join(f"\n---- {path}\n{path.read_text()}" for path in sorted(logs.glob(f"{job_name}_*.out")))


def assert_same_run(finished: Path, reference: Path) -> float:
    """The same metrics.jsonl without the wall-clock columns, the same saved tensors; returns the largest absolute
    difference of the tensors (0.0)."""

    def without_timings(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(("elapsed", "time"))} for row in rows]

    assert without_timings(read_jsonl(finished / "metrics.jsonl")) == without_timings(
        read_jsonl(reference / "metrics.jsonl")
    )
    largest = 0.0
    for weights in ("policy/model.safetensors", "policy/value_head.safetensors"):
        first, second = load_file(finished / weights), load_file(reference / weights)
        assert first.keys() == second.keys()
        for key in first:
            largest = max(largest, (first[key] - second[key]).abs().max().item())
            assert torch.equal(first[key], second[key]), (weights, key)
    return largest


def test_policy_on_two_nodes_equals_two_processes_on_one_machine(
    cluster, tiny_assets, reward_model, reference, tmp_path
):
    output_dir, logs = tmp_path / "run", tmp_path / "logs"
    job_id, output = submit_two_node_job(
        cluster, policy_flags(tiny_assets, reward_model, output_dir), "twonodes", logs, "--slurm-wait"
    )
    log = job_log(logs, "twonodes")
    assert f"task 0 seed {SEED}: COMPLETED exit code 0:0" in output, output + log[-6000:] + daemon_logs(cluster)
    record = job_record(cluster, job_id)
    assert (record["NumNodes"], record["NodeList"]) == ("2", "node[1-2]"), record
    assert "on node1, nodes node[1-2]" in log  # the batch script runs on the first node, MASTER_ADDR = node1
    assert json.loads((output_dir / "args.json").read_text())["world_size"] == 2  # one process per node, both joined
    print(f"two nodes vs one machine: largest tensor difference {assert_same_run(output_dir, reference)}")


def test_policy_on_two_nodes_requeued_mid_run_resumes_bit_identically(
    cluster, tiny_assets, reward_model, reference, tmp_path
):
    """Preemption as Slurm does it: `scontrol requeue` sends SIGTERM to both nodes' tasks, the script writes a
    checkpoint and stops; the requeued job runs again with --resume and continues from that checkpoint to the end."""
    output_dir, logs = tmp_path / "run", tmp_path / "logs"
    job_id, _ = submit_two_node_job(
        cluster, policy_flags(tiny_assets, reward_model, output_dir), "requeue", logs, "--slurm-requeue"
    )
    checkpoints = output_dir / "checkpoints"
    wait_until(lambda: any(checkpoints.glob("step-*")), JOB_TIMEOUT, "the first checkpoint")
    updates_before = sum("objective/scores" in row for row in read_jsonl(output_dir / "metrics.jsonl"))
    requeue = in_cluster(cluster, "scontrol", "requeue", f"{job_id}_0")
    assert requeue.returncode == 0, requeue.stderr
    # Slurm holds the requeued job back until its step credentials expire: 10 s with ci_two_nodes.sh's cred_expire
    wait_until(lambda: job_record(cluster, job_id)["JobState"] in FINISHED_STATES, 2 * JOB_TIMEOUT, "the requeued job")
    record, log = job_record(cluster, job_id), job_log(logs, "requeue")
    context = log[-6000:] + daemon_logs(cluster)
    assert (record["JobState"], record["Restarts"], record["NodeList"]) == ("COMPLETED", "1", "node[1-2]"), context
    assert "restart 0:" in log and "restart 1:" in log and log.count(f"--seed {SEED} --resume") == 1, context
    # it really stopped and continued: the restart resumed from the checkpoint that the SIGTERM wrote
    stopped = re.search(r"stopped by SIGTERM after update (\d+): wrote (\S+);", log)
    resumed = re.search(r"resumed from (\S+) at update (\d+)", log)
    assert stopped and resumed, context
    assert resumed.group(1) == stopped.group(2) and int(resumed.group(2)) == int(stopped.group(1)) + 1, context
    updates = [row["update"] for row in read_jsonl(output_dir / "metrics.jsonl") if "objective/scores" in row]
    assert updates == list(range(1, 17))  # exactly one row per update
    largest = assert_same_run(output_dir, reference)
    print(
        f"requeued after {updates_before} of 16 updates, stopped after {stopped.group(1)}: largest difference {largest}"
    )
