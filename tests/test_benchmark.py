"""The benchmark launcher and the suites, without Slurm: command expansion, local runs, the rendered sbatch script,
the training commands the suites run, the DeepSpeed and AWS ParallelCluster configs (offline)."""

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import run_utils
from benchmark.launch import launcher
from tests.conftest import tracked_files

REPO_ROOT = Path(__file__).resolve().parents[1]

BENCHMARK = REPO_ROOT / "benchmark"
LAUNCH = BENCHMARK / "launch"
# suite file -> number of training commands in it (one per --command, not per seed)
SUITE_COMMAND_COUNTS = {
    "core.sh": 4,  # sentiment, descriptiveness x (reward, policy)
    "ablation_adam.sh": 4,  # the same with --no-use-tensorflow-adam
    "grad_accum.sh": 4,  # reward x2, policy x2
    "large_models.sh": 10,  # (gpt2-large, gpt2-xl) x 2 tasks + gpt2-xl torch Adam, each (reward, policy)
    "other_models.sh": 12,  # (gpt2, pythia-160m, SmolLM2-135M) x 2 tasks x (reward, policy), simulated labels
    "summarize.sh": 4,  # tldr, cnndm x (reward, policy)
}


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_seeded_commands_fill_seed_and_append_it():
    commands = ["python a.py --out runs/r_{seed}", "python b.py --seed 7  \n   --x {seed}"]
    assert launcher.seeded_commands(commands, 3) == [
        "python a.py --out runs/r_3 --seed 3",
        "python b.py --seed 7 --x 3",  # passes --seed itself: nothing appended; whitespace runs collapsed
    ]
    assert launcher.seeded_commands(["t.py --seed={seed}"], 4) == ["t.py --seed=4"]


def test_every_suite_is_counted():
    assert sorted(p.name for p in LAUNCH.glob("*.sh")) == sorted(SUITE_COMMAND_COUNTS)


@pytest.mark.parametrize("suite", sorted(SUITE_COMMAND_COUNTS))
def test_suite_commands_extracts_every_training_command(suite):
    commands = launcher.suite_commands(LAUNCH / suite)
    assert len(commands) == SUITE_COMMAND_COUNTS[suite]
    for argv in commands:
        world_size, script_argv = launcher.training_script_args(argv)
        assert script_argv[0] in launcher.TRAINING_SCRIPTS
        assert world_size in (1, 8)
        assert flag_value(argv, "--seed") == "1"
        assert "--output-dir" in argv and "--base-model" in argv
        joined = shlex.join(argv)
        assert "{seed}" not in joined and "$" not in joined, "suite commands must be literal (no shell variables)"


def test_suite_chains_give_each_policy_its_own_seeds_reward_model():
    for suite in SUITE_COMMAND_COUNTS:
        reward_dirs = []
        for argv in launcher.suite_commands(LAUNCH / suite):
            script = launcher.training_script_args(argv)[1][0]
            if script == "train_reward_accelerate.py":
                reward_dirs.append(flag_value(argv, "--output-dir"))
            else:
                trained = flag_value(argv, "--rewards.trained-model")
                assert trained.endswith("/reward_model"), trained
                assert trained.removesuffix("/reward_model") in reward_dirs, f"{suite}: {trained} not trained before"


def test_suite_output_dirs_are_all_different():
    output_dirs = [
        flag_value(argv, "--output-dir")
        for suite in SUITE_COMMAND_COUNTS
        for argv in launcher.suite_commands(LAUNCH / suite)
    ]
    assert len(output_dirs) == len(set(output_dirs))


def test_suites_state_gpus_and_time_for_every_launch():
    for suite in SUITE_COMMAND_COUNTS:
        text = (LAUNCH / suite).read_text()
        assert re.search(r"Resources per seed: .*GPU", text), suite
        assert re.search(r"Time per seed", text), suite
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("python -m benchmark.launch.launcher"):
                assert lines[i - 1].startswith("#") and "GPU" in lines[i - 1], f"{suite}:{i + 1}: say the GPU count"
                end = next(j for j in range(i, len(lines)) if not lines[j].endswith("\\"))
                launch = " ".join(lines[i : end + 1])
                assert "--slurm-gpus-per-task" in launch and launch.endswith('"$@"'), f"{suite}:{i + 1}"


def test_training_script_args_counts_processes():
    split = launcher.training_script_args
    assert split(["python", "train_policy_accelerate.py", "--x", "1"]) == (
        1,
        ["train_policy_accelerate.py", "--x", "1"],
    )
    assert split(["accelerate", "launch", "--num_processes", "8", "train_reward_accelerate.py"])[0] == 8
    assert split(["accelerate", "launch", "--num_processes=4", "train_reward_accelerate.py"])[0] == 4
    deepspeed = [
        "accelerate",
        "launch",
        "--config_file",
        "benchmark/launch/deepspeed_zero2.yaml",
        "train_policy_accelerate.py",
    ]
    assert split(deepspeed) == (8, ["train_policy_accelerate.py"])
    torchrun = ["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "train_policy_accelerate.py", "--y"]
    assert split(torchrun) == (8, ["train_policy_accelerate.py", "--y"])


def run_launcher(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    """The launcher run as a module in `cwd`, where its commands run (the repository on PYTHONPATH)."""
    command = [sys.executable, "-m", "benchmark.launch.launcher", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_local_runs_chain_commands_per_seed_and_report_failures(tmp_path):
    # seed 2's first command fails: its second command must not run, the others finish, the exit code says so
    first = f'{sys.executable} -c \'import sys; open("first_{{seed}}", "w"); sys.exit(3 if {{seed}} == 2 else 0)\''
    second = f'{sys.executable} -c \'open("second_{{seed}}", "w")\''  # the appended --seed goes to sys.argv
    result = run_launcher(
        *("--command", first, "--command", second, "--num-seeds", "3", "--workers", "2", "--log-dir", "logs"),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.glob("first_*")) == ["first_1", "first_2", "first_3"]
    assert sorted(p.name for p in tmp_path.glob("second_*")) == ["second_1", "second_3"]
    assert "seed 2 FAILED (exit code 3)" in result.stdout
    assert "2/3 seeds succeeded" in result.stdout
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"rlhf_local_{s}.out" for s in (1, 2, 3)]


def test_local_gpu_blocks_per_worker(tmp_path):
    command = "echo $CUDA_VISIBLE_DEVICES > gpus_{seed}; true"  # the appended --seed goes to `true`
    result = run_launcher(
        *("--command", command, "--num-seeds", "2", "--workers", "2", "--local-gpus-per-worker", "2"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert sorted((tmp_path / f"gpus_{s}").read_text().strip() for s in (1, 2)) == ["0,1", "2,3"]


def test_local_dry_run_runs_nothing(tmp_path):
    result = run_launcher("--command", "touch x_{seed}", "--num-seeds", "2", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.split("\n")[:4] == ["# seed 1", "touch x_1 --seed 1", "# seed 2", "touch x_2 --seed 2"]
    assert list(tmp_path.iterdir()) == []


def test_slurm_dry_run_renders_the_template(tmp_path):
    result = run_launcher(
        *("--command", "python train_reward_accelerate.py --output-dir r_{seed}"),
        *("--command", "python train_policy_accelerate.py --rewards.trained-model r_{seed}/reward_model"),
        *("--num-seeds", "3", "--start-seed", "5", "--workers", "2", "--job-name", "demo", "--log-dir", "deep/logs"),
        *("--slurm", "--slurm-gpus-per-task", "8", "--slurm-cpus-per-task", "48", "--slurm-partition", "gpu"),
        *("--slurm-exclude", "node[01-02]", "--slurm-time", "12:00:00", "--slurm-requeue"),
        *("--slurm-extra=--constraint=h100", "--slurm-setup", "source .venv/bin/activate", "--dry-run"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout.split("\n# would write")[0]
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=demo",
        "#SBATCH --array=0-2%2",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=48",
        f"#SBATCH --output={tmp_path}/deep/logs/%x_%A_%a.out",
        f"#SBATCH --chdir={tmp_path}",
        "#SBATCH --signal=TERM@300",  # the template's own: time to checkpoint before the time limit
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --exclude=node[01-02]",
        "#SBATCH --time=12:00:00",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --constraint=h100",
    ]
    assert "{{" not in script and "source .venv/bin/activate" in script
    assert "    SEED=7\n    run 'python train_reward_accelerate.py --output-dir r_7 --seed 7'\n" in script
    assert "run 'python train_policy_accelerate.py --rewards.trained-model r_7/reward_model --seed 7'" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid bash
    assert not (tmp_path / "deep").exists()  # a dry run creates nothing


def test_template_has_nothing_cluster_specific():
    template = launcher.DEFAULT_TEMPLATE.read_text()
    directives = [line for line in template.splitlines() if line.startswith("#SBATCH")]
    for option in ("--partition", "--gres", "--gpus", "--exclude", "--time", "--account", "--qos", "--mem"):
        assert not any(option in line for line in directives), option
    assert set(re.findall(r"\{\{(\w+)\}\}", template)) == {
        "job_name",
        "array",
        "nodes",
        "cpus_per_task",
        "log_dir",
        "workdir",
        "sbatch_options",
        "setup",
        "requeue",
        "tasks",
    }


def test_launcher_rejects_bad_flags(tmp_path):
    """Each refused for its own reason, in one line (a traceback from deeper down is a non-zero exit too)."""
    cases = [
        (["--num-seeds", "2"], "give at least one --command"),
        (["--command", "echo 'unbalanced"], "cannot parse --command"),
        (["--command", "true", "--workers", "0"], "--workers must be at least 1"),
        (["--command", "true", "--job-name", "a b"], "--job-name 'a b': use letters"),
        (["--command", "true", "--slurm", "--slurm-extra=constraint=x", "--dry-run"], "not an sbatch option"),
    ]
    for flags, words in cases:
        result = run_launcher(*flags, cwd=tmp_path)
        assert result.returncode != 0 and "Traceback" not in result.stderr, (flags, result.stderr[-2000:])
        assert words in result.stderr.strip().splitlines()[-1], (flags, result.stderr[-2000:])


def test_parse_scontrol_jobs():
    text = (
        "JobId=4 ArrayJobId=3 ArrayTaskId=1 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0\n"
        "JobId=3 ArrayJobId=3 ArrayTaskId=0 JobName=x JobState=COMPLETED Reason=None ExitCode=0:0\n"
    )
    jobs = launcher.parse_scontrol_jobs(text)
    assert [(j["ArrayTaskId"], j["JobState"], j["ExitCode"]) for j in jobs] == [
        ("1", "FAILED", "3:0"),
        ("0", "COMPLETED", "0:0"),
    ]


def test_deepspeed_zero2_config_keeps_openai_math():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    path = LAUNCH / "deepspeed_zero2.yaml"
    config = load_config_from_file(str(path))  # accelerate's own loader: rejects unknown keys
    assert config.distributed_type == "DEEPSPEED" and config.num_processes == 8 and config.mixed_precision == "no"
    ds = config.deepspeed_config
    assert ds["zero_stage"] == 2 and "gradient_accumulation_steps" not in ds
    # what accelerate launch turns these into: no clipping (OpenAI has none), accumulation from the scripts
    plugin = DeepSpeedPlugin(
        zero_stage=ds["zero_stage"],
        gradient_clipping=ds["gradient_clipping"],
        offload_optimizer_device=ds["offload_optimizer_device"],
        offload_param_device=ds["offload_param_device"],
        zero3_init_flag=ds["zero3_init_flag"],
    )
    # accelerate drops the 0 (DeepSpeed then clips at its default 1.0): the scripts' launch check sets it
    assert "gradient_clipping" not in plugin.deepspeed_config
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 2
    accelerator = SimpleNamespace(num_processes=1, mixed_precision="no", state=SimpleNamespace(deepspeed_plugin=plugin))
    run_utils.check_launch(accelerator, SimpleNamespace(micro_batch_size=4))
    assert plugin.deepspeed_config["gradient_clipping"] == 0.0
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 4


def test_aws_parallelcluster_config():
    config = yaml.safe_load((LAUNCH / "aws" / "pcluster.yaml").read_text())
    for key in ("Region", "Image", "HeadNode", "Scheduling", "SharedStorage"):
        assert key in config, key
    assert config["Image"]["Os"] in (
        "alinux2",
        "alinux2023",
        "ubuntu2004",
        "ubuntu2204",
        "ubuntu2404",
        "rhel8",
        "rhel9",
    )
    head = config["HeadNode"]
    assert head["InstanceType"] and head["Networking"]["SubnetId"] and head["Ssh"]["KeyName"]
    assert config["Scheduling"]["Scheduler"] == "slurm"
    queues = config["Scheduling"]["SlurmQueues"]
    names = [q["Name"] for q in queues]
    assert len(names) == len(set(names))
    for queue in queues:
        assert re.fullmatch(r"[a-z][a-z0-9-]{0,24}", queue["Name"]), queue["Name"]  # ParallelCluster's naming rule
        assert queue["Networking"]["SubnetIds"]
        for resource in queue["ComputeResources"]:
            assert resource["InstanceType"].split(".")[0] in ("p4d", "p4de", "p5", "p5e", "p5en"), "8-GPU instances"
            assert resource["MinCount"] == 0 < resource["MaxCount"]
    assert any(s["MountDir"] and s["StorageType"] in ("Efs", "FsxLustre", "Ebs") for s in config["SharedStorage"])
    # docs/clusters.md walks through this file and uses its queue names as partitions
    readme = (REPO_ROOT / "docs" / "clusters.md").read_text()
    assert "benchmark/launch/aws/pcluster.yaml" in readme
    for name in names:
        assert f"--slurm-partition {name}" in readme, name
    placeholders = re.findall(r"REPLACE_ME\w*", (LAUNCH / "aws" / "pcluster.yaml").read_text())
    assert placeholders and all(p in readme for p in set(placeholders))


def test_every_benchmark_path_and_module_the_repository_names_exists():
    """The paths under benchmark/ and tests/ and the `python -m benchmark...` modules that the docs, the tools and the
    tests name exist (placeholders and the results directory aside): a file that moves takes its mentions along."""
    import importlib.util

    missing = []
    for path in tracked_files():
        if path.suffix not in (".py", ".md", ".sh", ".slurm", ".yaml", ".toml", ".txt"):
            continue
        text = path.read_text()
        for name in re.findall(r"(?<![\w./-])((?:benchmark|tests)/[\w./-]*[\w/])", text):
            if not (REPO_ROOT / name).exists() and not re.search(r"/X\.|^benchmark/results", name):
                missing.append(f"{path.relative_to(REPO_ROOT)}: {name}")
        for module in re.findall(r"-m (benchmark(?:\.\w+)+)", text):
            if "ROOM" not in module and importlib.util.find_spec(module) is None:
                missing.append(f"{path.relative_to(REPO_ROOT)}: {module}")
    assert not missing, missing


def test_no_machine_specific_paths_in_benchmark_files():
    for path in tracked_files():
        if BENCHMARK in path.parents and path.suffix in (".py", ".sh", ".slurm", ".yaml", ".md", ".csv"):
            text = path.read_text()
            assert str(REPO_ROOT.parent) + "/" not in text and tempfile.gettempdir() + "/" not in text, path
            assert os.environ.get("HOME", "/root") + "/" not in text, path
