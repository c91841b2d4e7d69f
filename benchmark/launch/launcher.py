"""Run benchmark commands over seeds: locally with N workers, or as one Slurm array job (one array task per seed).

Each `--command` is a shell command line (runs of whitespace in it count as one space); `{seed}` in it becomes the
seed and `--seed SEED` is appended unless the command passes `--seed` itself. Several `--command` flags form a chain
that runs in order for the same seed, and a failing command stops that seed's chain: this is how a policy run gets
the reward model of its own seed.

    # 3 seeds on this machine, one after another (reward model, then the policy trained against it)
    python -m benchmark.launch.launcher \
        --command "python train_reward_accelerate.py --label-dataset sentiment/offline_5k.json \
                   --output-dir runs/sentiment/reward_{seed}" \
        --command "python train_policy_accelerate.py --rewards.trained-model runs/sentiment/reward_{seed}/reward_model \
                   --output-dir runs/sentiment/policy_{seed}" \
        --num-seeds 3 --workers 1

    # the same as a Slurm array job, 8 GPUs per seed, at most 10 seeds at a time; print the script, submit nothing
    python -m benchmark.launch.launcher --command ... --command ... --num-seeds 10 --workers 10 \
        --slurm --slurm-gpus-per-task 8 --slurm-cpus-per-task 48 --slurm-partition gpu --dry-run

The Slurm script is `benchmark/launch/slurm/template.slurm` with its `{{placeholders}}` filled in; nothing
cluster-specific is in the template (partition, excluded nodes, time limit, account, setup lines are flags). Logs go to
`LOG_DIR/JOBNAME_ARRAYID_TASKID.out`; the log directory is created before `sbatch` (Slurm fails a job whose output
directory is missing without writing any log). `--slurm-wait` polls `squeue` until the array is done, then reads
each task's final state (`scontrol show job`, falling back to `sacct`) and exits non-zero if any seed failed.

The suites in `benchmark/launch/*.sh` call this launcher; `suite_commands(path)` extracts the training commands they
run, so that tests can check every one of them with the scripts' `--dry-run`.
"""

import dataclasses
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import tyro
import yaml

LAUNCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = LAUNCH_DIR.parents[1]  # the suites cd here: their relative paths start from it
DEFAULT_TEMPLATE = LAUNCH_DIR / "slurm" / "template.slurm"
LAUNCHER = "benchmark.launch.launcher"  # this file, as the suites run it: `python -m benchmark.launch.launcher`
TRAINING_SCRIPTS = ("train_reward_accelerate.py", "train_policy_accelerate.py")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# Slurm reports a finished array task as COMPLETED only if every command of its chain exited 0
SUCCESS_STATE = "COMPLETED"
# squeue/scontrol hiccups (controller busy) tolerated while waiting before giving up
MAX_QUERY_FAILURES = 10
LOG_TAIL_LINES = 20


@dataclasses.dataclass
class Args:
    command: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    """a shell command line to run for every seed; `{seed}` is replaced by the seed and `--seed SEED` is appended
    unless the command already passes `--seed`. Repeat the flag to chain commands: they run in order for the same
    seed and the first failure stops that seed"""
    num_seeds: int = 3
    """number of seeds: `start_seed, start_seed + 1, ...`"""
    start_seed: int = 1
    """first seed"""
    workers: int = 1
    """seeds run at the same time: local worker threads, or the Slurm array throttle (`--array=0-N%WORKERS`)"""
    job_name: str = "rlhf"
    """Slurm job name (`%x` in log names) and prefix of local log files"""
    log_dir: str = "logs"
    """directory for the logs and the rendered Slurm script; created before submission"""
    dry_run: bool = False
    """print what would run (local) or the rendered script and the sbatch call (Slurm), run nothing"""
    local_gpus_per_worker: int = 0
    """local runs only: give each worker its own `CUDA_VISIBLE_DEVICES` block of this many GPUs (0 = leave it)"""

    slurm: bool = False
    """submit a Slurm array job instead of running locally"""
    slurm_template: str = str(DEFAULT_TEMPLATE)
    """the sbatch script template with `{{placeholders}}`"""
    slurm_gpus_per_task: int = 0
    """GPUs per array task (per node when `--slurm-nodes` > 1), as `--gres=gpu:N`; 0 = no GPU request"""
    slurm_cpus_per_task: int = 1
    """CPU cores per array task (per node)"""
    slurm_nodes: int = 1
    """nodes per array task; the commands then run once per node (`srun --ntasks-per-node=1`) and must rendezvous
    themselves, e.g. `torchrun --nnodes $SLURM_NNODES --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT ...`"""
    slurm_partition: Optional[str] = None
    """partition (`--partition`); default: the cluster's default partition"""
    slurm_exclude: Optional[str] = None
    """nodes to avoid (`--exclude`), e.g. `node[01-03]`"""
    slurm_time: Optional[str] = None
    """time limit per array task (`--time`), e.g. `12:00:00`"""
    slurm_mem: Optional[str] = None
    """memory per node (`--mem`), e.g. `200G`"""
    slurm_account: Optional[str] = None
    """account to charge (`--account`)"""
    slurm_qos: Optional[str] = None
    """quality of service (`--qos`)"""
    slurm_extra: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    """any other sbatch option, one per flag, written with `=`: `--slurm-extra=--constraint=h100`"""
    slurm_setup: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    """shell lines the job runs before the commands, e.g. `--slurm-setup "source .venv/bin/activate"`"""
    slurm_requeue: bool = False
    """add `#SBATCH --requeue` (and append to the log instead of truncating it); after a requeue (preemption, node
    failure) each command gets `--resume`, so the training scripts must support `--resume`"""
    slurm_wait: bool = False
    """after submitting, poll `squeue` until the array is done; exit non-zero if any array task did not complete"""
    slurm_poll_seconds: float = 10.0
    """seconds between `squeue` polls with `--slurm-wait`"""


def seed_list(args: Args) -> list[int]:
    return list(range(args.start_seed, args.start_seed + args.num_seeds))


def seeded_commands(commands: list[str], seed: int) -> list[str]:
    """The chain of shell command lines for one seed: `{seed}` filled in, `--seed` appended where missing.

    Runs of whitespace become one space, so that suites can wrap long commands over several lines.
    """
    result = []
    for command in commands:
        command = re.sub(r"\s+", " ", command.strip()).replace("{seed}", str(seed))
        tokens = shlex.split(command)  # raises ValueError on unbalanced quotes
        if not any(t == "--seed" or t.startswith("--seed=") for t in tokens):
            command = f"{command} --seed {seed}"
        result.append(command)
    return result


def validate(args: Args) -> None:
    if not args.command:
        raise SystemExit("launcher.py: give at least one --command")
    for command in args.command:
        try:
            shlex.split(command)
        except ValueError as e:
            raise SystemExit(f"launcher.py: cannot parse --command {command!r}: {e}") from None
    for name in ("num_seeds", "workers", "slurm_cpus_per_task", "slurm_nodes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"launcher.py: --{name.replace('_', '-')} must be at least 1")
    for name in ("slurm_gpus_per_task", "local_gpus_per_worker"):
        if getattr(args, name) < 0:
            raise SystemExit(f"launcher.py: --{name.replace('_', '-')} must be 0 or more")
    if not re.fullmatch(r"[\w.-]+", args.job_name):
        raise SystemExit(f"launcher.py: --job-name {args.job_name!r}: use letters, digits, '_', '.', '-' only")
    for option in args.slurm_extra:
        if not option.startswith("-"):
            raise SystemExit(
                f"launcher.py: --slurm-extra {option!r} is not an sbatch option (write --slurm-extra=--x=y)"
            )


# ----------------------------------------------------------------------------------------------------------------
# local runs


def run_chain(commands: list[str], env: dict[str, str], log_path: Optional[Path]) -> int:
    """Run the commands of one seed in order through bash; stop at the first failure and return its exit code."""
    bash = shutil.which("bash") or "bash"
    for command in commands:
        if log_path is None:
            print(f"[launcher] {command}", flush=True)
            rc = subprocess.run([bash, "-c", command], env=env).returncode
        else:
            with open(log_path, "a") as log:
                log.write(f"[launcher] {command}\n")
                log.flush()
                rc = subprocess.run([bash, "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            return rc
    return 0


def run_local(args: Args) -> int:
    seeds = seed_list(args)
    chains = {seed: seeded_commands(args.command, seed) for seed in seeds}
    if args.dry_run:
        for seed, chain in chains.items():
            print(f"# seed {seed}")
            print("\n".join(chain))
        return 0
    # one worker: output straight to the terminal; several: one log file per seed, so outputs don't interleave
    log_dir = Path(args.log_dir)
    to_files = args.workers > 1
    if to_files:
        log_dir.mkdir(parents=True, exist_ok=True)
    gpu_blocks: queue.Queue = queue.Queue()
    for w in range(args.workers):
        block = range(w * args.local_gpus_per_worker, (w + 1) * args.local_gpus_per_worker)
        gpu_blocks.put(",".join(map(str, block)))
    print_lock = threading.Lock()

    def run_seed(seed: int) -> int:
        gpus = gpu_blocks.get()
        try:
            env = dict(os.environ)
            if args.local_gpus_per_worker > 0:
                env["CUDA_VISIBLE_DEVICES"] = gpus
            log_path = log_dir / f"{args.job_name}_local_{seed}.out" if to_files else None
            if log_path is not None:
                with print_lock:
                    print(f"[launcher] seed {seed} started, log: {log_path}", flush=True)
            rc = run_chain(chains[seed], env, log_path)
            with print_lock:
                print(f"[launcher] seed {seed} {'finished' if rc == 0 else f'FAILED (exit code {rc})'}", flush=True)
                if rc != 0 and log_path is not None:
                    print(tail(log_path, LOG_TAIL_LINES), flush=True)
            return rc
        finally:
            gpu_blocks.put(gpus)

    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        codes = dict(zip(seeds, pool.map(run_seed, seeds), strict=True))
    failed = {seed: rc for seed, rc in codes.items() if rc != 0}
    summary = f"{len(seeds) - len(failed)}/{len(seeds)} seeds succeeded"
    print(f"[launcher] {summary}" + (f"; failed seeds (exit codes): {failed}" if failed else ""))
    return 1 if failed else 0


def tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(f"    | {line}" for line in lines[-n:])


# ----------------------------------------------------------------------------------------------------------------
# Slurm


def sbatch_options(args: Args) -> list[str]:
    """The optional `#SBATCH` lines: only what was asked for, so the template holds nothing cluster-specific."""
    options = []
    if args.slurm_gpus_per_task > 0:
        options.append(f"--gres=gpu:{args.slurm_gpus_per_task}")
    for flag, value in (
        ("--partition", args.slurm_partition),
        ("--exclude", args.slurm_exclude),
        ("--time", args.slurm_time),
        ("--mem", args.slurm_mem),
        ("--account", args.slurm_account),
        ("--qos", args.slurm_qos),
    ):
        if value is not None:
            options.append(f"{flag}={value}")
    if args.slurm_requeue:
        options += ["--requeue", "--open-mode=append"]  # append: a requeued task keeps the log of its first attempt
    options.extend(args.slurm_extra)
    return [f"#SBATCH {option}" for option in options]


def array_tasks(args: Args) -> str:
    """The bash `case` arms: array task i runs the command chain of seed `start_seed + i`."""
    arms = []
    for index, seed in enumerate(seed_list(args)):
        lines = [f"  {index})", f"    SEED={seed}"]
        lines += [f"    run {shlex.quote(command)}" for command in seeded_commands(args.command, seed)]
        lines.append("    ;;")
        arms.append("\n".join(lines))
    return "\n".join(arms)


def render_slurm_script(args: Args, template: str) -> str:
    n = args.num_seeds
    values = {
        "job_name": args.job_name,
        "array": f"0-{n - 1}%{min(args.workers, n)}",
        "nodes": str(args.slurm_nodes),
        "cpus_per_task": str(args.slurm_cpus_per_task),
        "log_dir": str(Path(args.log_dir).resolve()),
        "workdir": str(Path.cwd()),
        "sbatch_options": "\n".join(sbatch_options(args)),
        "setup": "\n".join(args.slurm_setup) if args.slurm_setup else "# (no --slurm-setup lines)",
        "requeue": "1" if args.slurm_requeue else "0",
        "tasks": array_tasks(args),
    }
    missing = sorted(set(PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise SystemExit(f"launcher.py: the template has placeholders this launcher does not fill: {missing}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def run_query(command: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm client command (sbatch, squeue, scontrol, sacct) and capture its output."""
    if shutil.which(command[0]) is None:
        raise SystemExit(f"launcher.py: `{command[0]}` not found: --slurm needs the Slurm client commands on PATH")
    return subprocess.run(command, capture_output=True, text=True)


def submit(script_path: Path) -> str:
    """`sbatch --parsable SCRIPT` -> the array job id."""
    result = run_query(["sbatch", "--parsable", str(script_path)])
    if result.returncode != 0:
        raise SystemExit(f"launcher.py: sbatch failed (exit code {result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def wait_for_job(job_id: str, poll_seconds: float) -> None:
    """Poll `squeue` until no task of the job is pending or running (never `sbatch --wait`: it backs off to ~10 s)."""
    failures = 0
    while True:
        result = run_query(["squeue", "-h", "-j", job_id, "-o", "%i %T"])
        if result.returncode == 0:
            failures = 0
            if not result.stdout.strip():
                return
        elif "Invalid job id" in result.stderr:  # already purged from the controller: finished
            return
        else:
            failures += 1
            if failures > MAX_QUERY_FAILURES:
                raise SystemExit(f"launcher.py: squeue keeps failing: {result.stderr.strip()}")
        time.sleep(poll_seconds)


def parse_scontrol_jobs(text: str) -> list[dict[str, str]]:
    """`scontrol show job -o` output (one job per line, KEY=VALUE fields) -> one dict per job."""
    jobs = []
    for line in text.splitlines():
        fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
        if fields:
            jobs.append(fields)
    return jobs


def task_states(job_id: str) -> dict[int, tuple[str, str]]:
    """Final state and exit code of every array task: {task index: (JobState, ExitCode)}."""
    result = run_query(["scontrol", "show", "job", "-o", job_id])
    if result.returncode == 0:
        states = {}
        for job in parse_scontrol_jobs(result.stdout):
            if job.get("ArrayJobId") == job_id and job.get("ArrayTaskId", "").isdigit():
                states[int(job["ArrayTaskId"])] = (job["JobState"], job.get("ExitCode", "?"))
        if states:
            return states
    # purged from the controller (older than MinJobAge): ask the accounting database
    result = run_query(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"])
    if result.returncode != 0:
        raise SystemExit(f"launcher.py: cannot read the states of job {job_id}: {result.stderr.strip()}")
    states = {}
    for line in result.stdout.splitlines():
        job, state, exit_code = line.split("|")
        match = re.fullmatch(rf"{job_id}_(\d+)", job)
        if match:
            states[int(match.group(1))] = (state.split()[0], exit_code)  # "CANCELLED by 0" -> CANCELLED
    return states


def report_job(args: Args, job_id: str) -> int:
    states = task_states(job_id)
    seeds = seed_list(args)
    log_dir = Path(args.log_dir).resolve()
    failed = 0
    for index, seed in enumerate(seeds):
        state, exit_code = states.get(index, ("UNKNOWN", "?"))
        log_path = log_dir / f"{args.job_name}_{job_id}_{index}.out"
        print(f"[launcher] task {index} seed {seed}: {state} exit code {exit_code}  log: {log_path}")
        if state != SUCCESS_STATE:
            failed += 1
            print(tail(log_path, LOG_TAIL_LINES))
    print(f"[launcher] job {job_id}: {len(seeds) - failed}/{len(seeds)} seeds completed")
    return 1 if failed else 0


def run_slurm(args: Args) -> int:
    script = render_slurm_script(args, Path(args.slurm_template).read_text())
    log_dir = Path(args.log_dir).resolve()
    script_path = log_dir / f"{args.job_name}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.slurm"
    if args.dry_run:
        print(script)
        print(f"# would write {script_path} and run: sbatch --parsable {script_path}")
        return 0
    # a missing output directory makes Slurm fail the job without any log: create it before submitting
    log_dir.mkdir(parents=True, exist_ok=True)
    script_path.write_text(script)
    job_id = submit(script_path)
    print(f"[launcher] submitted array job {job_id} ({args.num_seeds} seeds) from {script_path}")
    print(f"[launcher] logs: {log_dir}/{args.job_name}_{job_id}_<task>.out; watch with: squeue -j {job_id}")
    if not args.slurm_wait:
        return 0
    wait_for_job(job_id, args.slurm_poll_seconds)
    return report_job(args, job_id)


# ----------------------------------------------------------------------------------------------------------------
# suites: the training commands a `benchmark/launch/*.sh` file runs


def logical_lines(text: str) -> list[str]:
    """Shell source -> logical lines: backslash-newline continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def suite_commands(path: str | Path) -> list[list[str]]:
    """Every training-script command in a suite file, as an argv list, in order of appearance.

    A command is either a `--command` of a `python -m benchmark.launch.launcher` call (with `{seed}` set to that call's
    `--start-seed` and `--seed` appended, as the launcher does) or a line that calls a training script directly.
    Suites keep these lines literal (no shell variables), so this static reading sees what would run.
    """
    commands = []
    for line in logical_lines(Path(path).read_text()):
        tokens = shlex.split(line, comments=True)
        launcher = next((i for i, t in enumerate(tokens) if t == LAUNCHER), None)
        if launcher is not None:
            flags = tokens[launcher + 1 :]
            chain, start_seed = [], 1
            for i, token in enumerate(flags):
                if token == "--command":
                    chain.append(flags[i + 1])
                elif token.startswith("--command="):
                    chain.append(token.split("=", 1)[1])
                elif token == "--start-seed":
                    start_seed = int(flags[i + 1])
                elif token.startswith("--start-seed="):
                    start_seed = int(token.split("=", 1)[1])
            commands += [shlex.split(c) for c in seeded_commands(chain, start_seed)]
        elif any(Path(t).name in TRAINING_SCRIPTS for t in tokens):
            commands.append(tokens)
    return commands


def launcher_flags(prefix: list[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` pairs of a launcher prefix such as `accelerate launch --num_processes 8`."""
    flags = {}
    for i, token in enumerate(prefix):
        if token.startswith("--") and "=" in token:
            key, value = token.split("=", 1)
            flags[key] = value
        elif token.startswith("--") and i + 1 < len(prefix) and not prefix[i + 1].startswith("--"):
            flags[token] = prefix[i + 1]
    return flags


def training_script_args(argv: list[str], root: Path = REPO_ROOT) -> tuple[int, list[str]]:
    """Split a suite command into (number of processes it launches, [script, *script_args]).

    Understands `python SCRIPT`, `accelerate launch [--num_processes N] [--config_file YAML] SCRIPT` (N counts the
    processes of all machines) and `torchrun --nnodes M --nproc_per_node N SCRIPT`, so that a test can run
    `python SCRIPT ARGS --dry-run` with `WORLD_SIZE` set to what the real launch would have. A relative
    `--config_file` is read from `root`, the directory the suites run in.
    """
    index = next(i for i, t in enumerate(argv) if Path(t).name in TRAINING_SCRIPTS)
    prefix, flags = argv[:index], launcher_flags(argv[:index])
    if "accelerate" in map(os.path.basename, prefix):
        if "--num_processes" in flags:
            return int(flags["--num_processes"]), argv[index:]
        if "--config_file" in flags:
            config = yaml.safe_load((root / flags["--config_file"]).read_text())
            return int(config.get("num_processes", 1)), argv[index:]
        return 1, argv[index:]
    if "torchrun" in map(os.path.basename, prefix):
        per_node = flags.get("--nproc_per_node", flags.get("--nproc-per-node", "1"))
        return int(per_node) * int(flags.get("--nnodes", "1")), argv[index:]
    return 1, argv[index:]


def main(args: Args) -> int:
    validate(args)
    return run_slurm(args) if args.slurm else run_local(args)


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
