"""benchmark/launch/launcher.py against a real single-node Slurm (benchmark/launch/slurm/ci_start.sh): array jobs
through the project's template, a failing seed, a requeue, and the real training scripts on a tiny offline model.

Needs root and Debian's slurm-wlm + munge (ci_start.sh installs them: 10-20 s the first time). Nothing here skips: if
Slurm cannot be started the tests fail. Deselect them with `pytest -m "not slurm"`.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO_ROOT / "benchmark" / "launch" / "slurm"
LAUNCHER = [sys.executable, "-m", "benchmark.launch.launcher"]  # run from the repository root
FAKE_GPUS = 2  # the CI node gets 2 fake GPUs so that --slurm-gpus-per-task is exercised
JOB_TIMEOUT = 240  # seconds for one array job, far above what the jobs here take

pytestmark = pytest.mark.slurm


def slurmctld_running() -> bool:
    pidfile = Path("/run/slurmctld.pid")
    if not pidfile.is_file():
        return False
    pid = pidfile.read_text().strip()
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        return state != "Z" and Path(f"/proc/{pid}/comm").read_text().strip() == "slurmctld"
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running one-node cluster; stopped at the end if this fixture started it."""
    if os.geteuid() != 0:
        pytest.fail("the slurm tests install and start Slurm, which needs root; deselect them with -m 'not slurm'")
    started_here = not slurmctld_running()
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(SLURM_DIR / "ci_start.sh")],
        env={**os.environ, "SLURM_FAKE_GPUS": str(FAKE_GPUS)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"could not start Slurm (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    print(f"slurm started in {time.monotonic() - start:.1f} s: {result.stdout.strip()}")
    yield
    if started_here:
        subprocess.run(["bash", str(SLURM_DIR / "ci_stop.sh")], timeout=120, check=True)


def launch(*flags: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    """Run the launcher from the repository root, as the suites do."""
    command = [*LAUNCHER, "--slurm", "--slurm-poll-seconds", "0.5", *flags]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def submitted_job_id(stdout: str) -> str:
    match = re.search(r"submitted array job (\d+)", stdout)
    assert match, stdout
    return match.group(1)


def scontrol_tasks(job_id: str) -> dict[int, dict[str, str]]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    tasks = {}
    for line in out.splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if fields.get("ArrayJobId") == job_id and fields.get("ArrayTaskId", "").isdigit():
            tasks[int(fields["ArrayTaskId"])] = fields
    return tasks


def jobcomp_tasks(job_id: str) -> dict[int, dict[str, str]]:
    """The jobcomp/filetxt log: one line per finished job, independent of the controller's memory."""
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    path = Path(re.search(r"^JobCompLoc\s*=\s*(\S+)", config, re.M).group(1))
    tasks = {}
    for line in path.read_text().splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if fields.get("ArrayJobId") == job_id:
            tasks[int(fields["ArrayTaskId"])] = fields
    return tasks


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def slurm_view(job_id: str, log: Path) -> str:
    """What Slurm and the job's log say: for a failure message that explains itself."""
    parts = []
    for command in (["scontrol", "show", "job", job_id], ["sinfo", "-N", "-l"], ["squeue", "-a"]):
        result = subprocess.run(command, capture_output=True, text=True)
        parts.append(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}")
    for path in (log, Path("/var/log/slurm/slurmctld.log"), Path("/var/log/slurm/slurmd.log")):
        text = path.read_text(errors="replace") if path.is_file() else "(missing)"
        parts.append(f"---- tail {path}\n{text[-3000:]}")
    return "\n".join(parts)


def wait_for_task(job_id: str, predicate, timeout: float, what: str, log: Path) -> None:
    """wait_until for task 0 of an array job that should still be running: fails as soon as the task has ended without
    `predicate` holding, and on a timeout, with Slurm's view of the job and the node, and the job's log."""
    deadline = time.monotonic() + timeout
    while not predicate():
        try:
            state = scontrol_tasks(job_id).get(0, {}).get("JobState")
        except subprocess.CalledProcessError as error:  # CI once lost the controller here: say what was left of it
            raise AssertionError(
                f"scontrol failed waiting for {what}: {error.stderr.strip()}; slurmctld running: {slurmctld_running()}\n"
                + slurm_view(f"{job_id}_0", log)
            ) from error
        assert state not in FINISHED and time.monotonic() < deadline, (
            f"{'task ended ' + state if state in FINISHED else f'timed out after {timeout} s'} waiting for {what}\n"
            + slurm_view(f"{job_id}_0", log)
        )
        time.sleep(0.5)


def stand_in(script: str) -> str:
    """A command line running a small Python program (the appended `--seed N` lands in its sys.argv)."""
    return f"{sys.executable} -c {json.dumps(script)}"


# A stand-in for the reward then policy scripts: writes what they write (args.json, metrics.jsonl, model dirs) and
# records the job's GPU assignment. `{seed}` is filled in by the launcher.
REWARD_STAND_IN = (
    "import json, os, sys; d = sys.argv[1]; os.makedirs(d + '/reward_model');"
    "json.dump({'seed': int(sys.argv[-1])}, open(d + '/args.json', 'w'));"
    "open(d + '/metrics.jsonl', 'w').write(json.dumps({'step': 1, 'train/loss': 1.3}) + '\\n');"
    "open(d + '/gpus', 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', 'none'));"
    "open(d + '/cpus', 'w').write(os.environ.get('SLURM_CPUS_PER_TASK', 'none'))"
)
POLICY_STAND_IN = (
    "import json, os, sys; rm, d = sys.argv[1], sys.argv[2]; assert os.path.isdir(rm), rm;"
    "os.makedirs(d + '/policy'); json.dump({'seed': int(sys.argv[-1])}, open(d + '/args.json', 'w'));"
    "open(d + '/metrics.jsonl', 'w').write(json.dumps({'update': 1, 'objective/scores': 0.1}) + '\\n')"
)


def test_array_job_runs_each_seeds_chain(slurm_cluster, tmp_path):
    runs, logs = tmp_path / "runs", tmp_path / "not" / "yet" / "logs"  # the launcher must create the log dir
    result = launch(
        *("--command", stand_in(REWARD_STAND_IN) + f" {runs}/reward_{{seed}}"),
        *("--command", stand_in(POLICY_STAND_IN) + f" {runs}/reward_{{seed}}/reward_model {runs}/policy_{{seed}}"),
        *("--num-seeds", "2", "--start-seed", "3", "--workers", "2", "--job-name", "standin"),
        *("--log-dir", str(logs), "--slurm-gpus-per-task", "1", "--slurm-cpus-per-task", "2", "--slurm-wait"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = submitted_job_id(result.stdout)
    tasks = scontrol_tasks(job_id)
    assert {i: (t["JobState"], t["ExitCode"]) for i, t in tasks.items()} == {
        0: ("COMPLETED", "0:0"),
        1: ("COMPLETED", "0:0"),
    }
    assert {i: t["JobState"] for i, t in jobcomp_tasks(job_id).items()} == {0: "COMPLETED", 1: "COMPLETED"}
    for index, seed in enumerate((3, 4)):
        assert json.loads((runs / f"reward_{seed}" / "args.json").read_text()) == {"seed": seed}
        assert json.loads((runs / f"policy_{seed}" / "args.json").read_text()) == {"seed": seed}
        assert (runs / f"policy_{seed}" / "metrics.jsonl").read_text().strip()
        assert (runs / f"reward_{seed}" / "gpus").read_text() in [str(g) for g in range(FAKE_GPUS)]  # --gres=gpu:1
        assert (runs / f"reward_{seed}" / "cpus").read_text() == "2"  # the srun step has the task's CPUs
        log = (logs / f"standin_{job_id}_{index}.out").read_text()
        assert f"seed {seed}" in log and f"array task {index} (seed {seed}) done" in log


def test_failing_seed_fails_the_launcher(slurm_cluster, tmp_path):
    # seed 2's first command exits 3: its task must end FAILED with that code, its second command must not run
    fail_on_seed_2 = stand_in("import sys; sys.exit(3 if sys.argv[-1] == '2' else 0)")
    marker = stand_in("import sys; open(sys.argv[1], 'w')") + f" {tmp_path}/second_{{seed}}"
    result = launch(
        *("--command", fail_on_seed_2, "--command", marker, "--num-seeds", "2", "--workers", "2"),
        *("--job-name", "failing", "--log-dir", str(tmp_path / "logs"), "--slurm-wait"),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    job_id = submitted_job_id(result.stdout)
    assert "task 1 seed 2: FAILED exit code 3:0" in result.stdout
    assert "1/2 seeds completed" in result.stdout
    tasks = scontrol_tasks(job_id)
    assert (tasks[0]["JobState"], tasks[1]["JobState"], tasks[1]["ExitCode"]) == ("COMPLETED", "FAILED", "3:0")
    jobcomp = jobcomp_tasks(job_id)
    assert (jobcomp[0]["JobState"], jobcomp[1]["JobState"], jobcomp[1]["ExitCode"]) == ("COMPLETED", "FAILED", "3:0")
    assert (tmp_path / "second_1").exists() and not (tmp_path / "second_2").exists()
    assert "(seed 2) FAILED: exit code 3" in (tmp_path / "logs" / f"failing_{job_id}_1.out").read_text()


def test_missing_log_dir_fails_a_job_silently(slurm_cluster, tmp_path):
    # why the launcher creates the log directory: Slurm fails such a job and writes no log at all
    missing = tmp_path / "missing" / "%j.out"
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--output", str(missing), "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_until(
        lambda: not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout, 60, "job"
    )
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    assert "JobState=FAILED" in out and not (tmp_path / "missing").exists()


def test_requeued_task_resumes(slurm_cluster, tmp_path):
    # the first attempt waits to be requeued; after the requeue the command must get --resume
    program = (
        "import sys, time; out = sys.argv[1];"
        "open(out, 'a').write('resumed\\n' if '--resume' in sys.argv else 'started\\n');"
        "'--resume' in sys.argv or time.sleep(300)"
    )
    marker, logs = tmp_path / "attempts", tmp_path / "logs"
    result = launch(
        *("--command", stand_in(program) + f" {marker}", "--num-seeds", "1", "--job-name", "requeue"),
        *("--log-dir", str(logs), "--slurm-requeue"),
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = submitted_job_id(result.stdout)
    wait_until(lambda: marker.exists(), 60, "the first attempt to start")
    subprocess.run(["scontrol", "requeue", f"{job_id}_0"], check=True)
    # Slurm holds a requeued task back until its step credentials expire (Reason=BeginTime): 10 s with ci_start.sh's
    # cred_expire (120 s by default). Forcing an earlier start races with the revoked credentials and fails the task.
    wait_until(lambda: scontrol_tasks(job_id)[0]["JobState"] in FINISHED, 60, "the requeued task to finish")
    assert scontrol_tasks(job_id)[0]["JobState"] == "COMPLETED", scontrol_tasks(job_id)[0]
    assert marker.read_text() == "started\nresumed\n"
    assert scontrol_tasks(job_id)[0]["Restarts"] == "1"
    log = (logs / f"requeue_{job_id}_0.out").read_text()
    assert "restart 0:" in log and "restart 1:" in log and log.count("--seed 1 --resume") == 1  # both attempts kept


# ----------------------------------------------------------------------------------------------------------------
# the real training scripts, on a tiny random GPT-2 with the real tokenizer


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, gpt2_tokenizer_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    directory = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64)).save_pretrained(directory)
    AutoTokenizer.from_pretrained(gpt2_tokenizer_dir).save_pretrained(directory)
    return directory


def write_tiny_task_data(directory: Path, query_length: int = 64, response_length: int = 24) -> tuple[Path, Path]:
    """A best-of-4 label file in OpenAI's format (random GPT-2 token ids) and a text file of query sentences."""
    import random

    rng = random.Random(0)
    labels = [
        {
            "query": [rng.randrange(50000) for _ in range(query_length)],
            **{f"sample{i}": [rng.randrange(50000) for _ in range(response_length)] for i in range(4)},
            "best": rng.randrange(4),
        }
        for _ in range(96)
    ]
    label_file = directory / "labels.json"
    label_file.write_text(json.dumps(labels))
    words = "the old man walked slowly into a quiet room where she smiled and said nothing at all".split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randrange(8, 20))) + "." for _ in range(400)]
    query_file = directory / "queries.txt"
    query_file.write_text("\n".join(" ".join(sentences[i : i + 4]) for i in range(0, 400, 4)) + "\n")
    return label_file, query_file


def tiny_chain(tmp_path: Path, model_dir: Path, num_labels: int, policy_flags: str) -> tuple[Path, Path, str, str]:
    """(runs dir, log dir, reward command, policy command) of one seed's chain on the tiny model; `{seed}` is filled
    in by the launcher."""
    label_file, query_file = write_tiny_task_data(tmp_path)
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    python = sys.executable
    reward = (
        f"{python} train_reward_accelerate.py --base-model {model_dir} --label-dataset {label_file} "
        f"--task.query-dataset {query_file} --labels.num-train {num_labels} --batch-size 8 --rollout-batch-size 16 "
        f"--normalize-samples 16 --output-dir {runs}/reward_{{seed}}"
    )
    policy = (
        f"{python} train_policy_accelerate.py --base-model {model_dir} "
        f"--rewards.trained-model {runs}/reward_{{seed}}/reward_model --task.query-dataset {query_file} "
        f"{policy_flags} --output-dir {runs}/policy_{{seed}}"
    )
    return runs, logs, reward, policy


# the jobs' setup line: offline like the rest of the suite (no Hub, datasets or wandb lookups), one thread per task
OFFLINE = "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1"


def test_real_scripts_two_seed_array(slurm_cluster, tmp_path, tiny_model_dir):
    runs, logs, reward, policy = tiny_chain(
        tmp_path,
        tiny_model_dir,
        64,
        "--ppo.total-episodes 32 --ppo.batch-size 16 --ppo.whitening-ranks 1 --ppo.noptepochs 1",
    )
    start = time.monotonic()
    result = launch(
        *("--command", reward, "--command", policy, "--num-seeds", "2", "--workers", "2", "--job-name", "tiny"),
        *("--log-dir", str(logs), "--slurm-setup", OFFLINE, "--slurm-wait"),
    )
    print(f"2-seed array of the real scripts took {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = submitted_job_id(result.stdout)
    assert {i: t["JobState"] for i, t in scontrol_tasks(job_id).items()} == {0: "COMPLETED", 1: "COMPLETED"}
    assert {i: t["ExitCode"] for i, t in jobcomp_tasks(job_id).items()} == {0: "0:0", 1: "0:0"}
    for seed in (1, 2):
        reward_dir, policy_dir = runs / f"reward_{seed}", runs / f"policy_{seed}"
        assert json.loads((reward_dir / "args.json").read_text())["seed"] == seed
        assert json.loads((policy_dir / "args.json").read_text())["seed"] == seed
        reward_metrics = [json.loads(line) for line in (reward_dir / "metrics.jsonl").read_text().splitlines()]
        assert any("train/loss" in record for record in reward_metrics)
        policy_metrics = [json.loads(line) for line in (policy_dir / "metrics.jsonl").read_text().splitlines()]
        updates = [record for record in policy_metrics if "objective/scores" in record]
        assert [record["update"] for record in updates] == [1, 2]  # 32 episodes / 16 per update
        assert all("objective/kl" in record for record in updates)
        assert policy_metrics[-1]["sync/param_spread"] == 0.0  # the closing row of a finished run
        assert any((reward_dir / "reward_model").iterdir()) and any((policy_dir / "policy").iterdir())
    assert shutil.which("sbatch")  # it really went through Slurm


def test_real_policy_script_requeued_mid_run_resumes_from_its_checkpoint(slurm_cluster, tmp_path, tiny_model_dir):
    """Preemption as Slurm does it: `scontrol requeue` stops the running task (SIGTERM, then SIGKILL after KillWait);
    the requeued task gets --resume and the script continues from its newest checkpoint to the end, with exactly one
    metrics row per update."""
    runs, logs, reward, policy = tiny_chain(
        tmp_path,
        tiny_model_dir,
        16,
        "--ppo.total-episodes 256 --ppo.batch-size 16 --ppo.whitening-ranks 1 --ppo.noptepochs 1 --checkpoint-every 2",
    )
    result = launch(
        *("--command", reward, "--command", policy, "--num-seeds", "1", "--job-name", "preempt"),
        *("--log-dir", str(logs), "--slurm-setup", OFFLINE, "--slurm-requeue"),
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = submitted_job_id(result.stdout)
    policy_dir, log_file = runs / "policy_1", logs / f"preempt_{job_id}_0.out"
    checkpoint = "the first policy checkpoint"
    wait_for_task(job_id, lambda: list((policy_dir / "checkpoints").glob("step-*")), JOB_TIMEOUT, checkpoint, log_file)
    subprocess.run(["scontrol", "requeue", f"{job_id}_0"], check=True)
    wait_until(lambda: scontrol_tasks(job_id)[0]["JobState"] in FINISHED, 2 * JOB_TIMEOUT, "the requeued task")
    log = log_file.read_text()
    assert scontrol_tasks(job_id)[0]["JobState"] == "COMPLETED", log[-3000:]
    assert "restart 1:" in log and "resumed from" in log, log[-3000:]
    assert "nothing to do" in log  # the finished reward run returned at once on its --resume
    rows = [json.loads(line) for line in (policy_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows if "objective/scores" in row] == list(range(1, 17))  # 16 updates
    assert any((policy_dir / "policy").iterdir())
