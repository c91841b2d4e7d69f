"""DeepSpeed ZeRO-2 and multi-machine launches on 2 CPU processes (gloo), against the plain 2-process DDP run.

The ZeRO-2 runs are `benchmark/launch/large_models.sh`'s own commands (`accelerate launch --config_file
benchmark/launch/deepspeed_zero2.yaml ...`) with the models and data swapped for tiny offline ones, 2 processes instead
of 8, and tests/deepspeed_cpu.py in front of the script (on a machine without GPUs accelerate starts DeepSpeed without a
communication backend; that CPU-only fix stays here). Each run asserts that the DeepSpeed engine really trained:
its checkpoints hold ZeRO's per-process optimizer partitions, which plain DDP never writes.

Without gradient accumulation a ZeRO-2 run is bit-identical to the DDP run (the PyTorch-Adam pair below). With it,
ZeRO-2 reduces each micro-batch's gradients over the processes as they come and DDP sums the micro-batches on each
process and reduces once: the same sums in another order, equal to float32 rounding; tests/test_processes.py checks
both scripts under ZeRO-2 with accumulation against 1 process, metric by metric and weight by weight.
"""

import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import memory_estimate
import run_utils
from benchmark.launch.launcher import suite_commands
from tests.conftest import REPO, read_jsonl, run_script, script_environment
from tests.test_resume import (
    POLICY,
    REWARD,
    assert_same_run,
    policy_flags,
    reward_flags,
    run_and_interrupt,
)

ZERO2_CONFIG = "benchmark/launch/deepspeed_zero2.yaml"
CPU_LAUNCH = str(REPO / "tests" / "deepspeed_cpu.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def large_model_commands() -> list[list[str]]:
    """The training commands of benchmark/launch/large_models.sh, as the launcher would run them for seed 1."""
    return suite_commands(REPO / "benchmark" / "launch" / "large_models.sh")


def tiny(argv: list[str], values: dict[str, str], extra: list[str], nproc: int = 2) -> list[str]:
    """A suite command at tiny scale: its launcher prefix with --num_processes `nproc` and the CPU launch fix in
    front of the script; the values of the flags in `values` replaced; `extra` appended."""
    index = next(i for i, token in enumerate(argv) if token.endswith((REWARD, POLICY)))
    prefix, script, flags = argv[:index], argv[index], argv[index + 1 :]
    assert prefix[:4] == ["accelerate", "launch", "--config_file", ZERO2_CONFIG], prefix
    for flag, value in values.items():
        assert flag in flags, (flag, flags)
        flags[flags.index(flag) + 1] = value
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / ZERO2_CONFIG),
              "--num_processes", str(nproc), "--main_process_port", str(free_port())]  # fmt: skip
    return [*launch, CPU_LAUNCH, str(REPO / script), *flags, *extra]


def zero2_environment() -> dict:
    environment = script_environment(2)
    del environment["ACCELERATE_USE_CPU"]  # with it accelerate would silently run plain DDP, not DeepSpeed
    return environment


def run_zero2(command: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**zero2_environment(), **env}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, cwd=REPO)
    assert result.returncode == 0, (shlex.join(command), result.stdout[-3000:], result.stderr[-3000:])
    return result


def assert_trained_by_zero2(output_dir: Path) -> None:
    """ZeRO's optimizer partitions, one per process, in every checkpoint: the DeepSpeed engine did the training."""
    checkpoints = sorted((output_dir / "checkpoints").glob("step-*"))
    assert checkpoints, f"no checkpoints in {output_dir}"
    for checkpoint in checkpoints:
        partitions = sorted(path.name for path in checkpoint.rglob("*optim_states.pt"))
        assert partitions == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)], checkpoint


def assert_identical_policy_runs(run: Path, reference: Path) -> None:
    """The same metrics rows (but their timings) and the same saved policy and value head, bit for bit, saved in
    fp32 like the DDP run's."""
    for name in ("policy/model.safetensors", "policy/value_head.safetensors"):
        assert_same_run(run, reference, name)
        assert {tensor.dtype for tensor in load_file(run / name).values()} == {torch.float32}, name


# ---------------------------------------------------------------------------------------------------------------------
# large_models.sh's PyTorch-Adam pair (the other pairs differ only in model and label names, which are swapped for the
# tiny ones here), both commands under ZeRO-2 without accumulation, and its first policy command (the TF-style Adam,
# the default) with gradient accumulation. That ZeRO-2 with accumulation computes what 1 process computes, for both
# scripts, is tests/test_processes.py.

PPO_ACCUMULATE = ["--ppo.gradient-accumulation-steps", "2"]


def tiny_reward(argv: list[str], assets, output_dir: Path, *extra: str) -> list[str]:
    values = {"--base-model": str(assets["model"]), "--label-dataset": str(assets["small_labels"]),
              "--output-dir": str(output_dir)}  # fmt: skip
    return tiny(argv, values, reward_flags(assets, output_dir, *extra))


def tiny_policy(
    argv: list[str], assets, reward_model: Path, output_dir: Path, *extra: str, nproc: int = 2
) -> list[str]:
    values = {"--base-model": str(assets["model"]), "--rewards.trained-model": str(reward_model),
              "--output-dir": str(output_dir)}  # fmt: skip
    return tiny(argv, values, policy_flags(assets, reward_model, output_dir, *extra), nproc)


@pytest.fixture(scope="module")
def zero2_reward(tiny_assets, tmp_path_factory) -> Path:
    """large_models.sh's PyTorch-Adam reward command under ZeRO-2; its reward model is the one every policy run here
    reads."""
    output_dir = tmp_path_factory.mktemp("zero2-reward") / "run"
    reward_argv = large_model_commands()[8]
    assert "--no-use-tensorflow-adam" in reward_argv
    extensions = output_dir.parent / "torch_extensions"
    run_zero2(tiny_reward(reward_argv, tiny_assets, output_dir), TORCH_EXTENSIONS_DIR=str(extensions))
    assert_trained_by_zero2(output_dir)
    # DeepSpeed's engine started on 2 CPU processes without JIT-building its shared-memory op there
    # (tests/loopback/sitecustomize.py: no_shared_memory_op)
    assert not list(extensions.glob("*shm*"))
    return output_dir


def test_a_stale_build_lock_stops_the_launch_in_one_line_instead_of_a_wait(tiny_assets, tmp_path):
    """An interrupted first build of a DeepSpeed extension leaves `lock` in torch's extension folder, and the next
    launch would wait on it forever: the scripts name it in one line before DeepSpeed starts, and leave it there."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "py_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    command = tiny_reward(large_model_commands()[8], tiny_assets, tmp_path / "run")
    environment = {**zero2_environment(), "TORCH_EXTENSIONS_DIR": str(extensions)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment, cwd=REPO)
    assert result.returncode != 0
    assert f"error: a DeepSpeed build lock that no process holds: {lock} (an interrupted build" in result.stderr, (
        result.stderr[-3000:]
    )
    assert lock.exists()


@pytest.fixture(scope="module")
def reward_model(zero2_reward) -> Path:
    return zero2_reward / "reward_model"


@pytest.fixture(scope="module")
def ddp_policy(tiny_assets, reward_model, tmp_path_factory) -> Path:
    """The PyTorch-Adam policy run under plain 2-process DDP (torchrun)."""
    output_dir = tmp_path_factory.mktemp("ddp-policy") / "run"
    flags = policy_flags(tiny_assets, reward_model, output_dir, "--no-use-tensorflow-adam")
    result = run_script(POLICY, *flags, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_zero2_with_torch_adam_runs_large_models_sh_end_to_end(tiny_assets, zero2_reward, reward_model, ddp_policy,
                                                               tmp_path):  # fmt: skip
    """large_models.sh's PyTorch-Adam pair under ZeRO-2 without accumulation: its policy run bit-identical to plain
    DDP (the reward model both read is the ZeRO-2 reward command's, whose gain, set before training, survived ZeRO's
    fp32 copy of the weights)."""
    before = read_jsonl(zero2_reward / "metrics.jsonl")[0]
    assert before["step"] == 0 and abs(before["normalization/before/std"] - 1) > 0.5  # a gain far from its initial 1
    head = load_file(reward_model / "reward_head.safetensors")
    after = next(row for row in read_jsonl(zero2_reward / "metrics.jsonl") if "normalization/after/std" in row)
    assert head["reward_gain"].item() == pytest.approx(1 / after["normalization/after/std"], rel=1e-6)
    policy_argv = large_model_commands()[9]
    assert "--no-use-tensorflow-adam" in policy_argv
    run_zero2(tiny_policy(policy_argv, tiny_assets, reward_model, tmp_path / "policy"))
    assert_trained_by_zero2(tmp_path / "policy")
    assert_identical_policy_runs(tmp_path / "policy", ddp_policy)


@pytest.fixture(scope="module")
def zero2_policy(tiny_assets, reward_model, tmp_path_factory) -> Path:
    """large_models.sh's first policy command (the TF-style Adam) with gradient accumulation, under ZeRO-2."""
    output_dir = tmp_path_factory.mktemp("zero2-policy") / "run"
    run_zero2(tiny_policy(large_model_commands()[1], tiny_assets, reward_model, output_dir, *PPO_ACCUMULATE))
    assert_trained_by_zero2(output_dir)
    return output_dir


def test_zero2_policy_resume_after_sigkill_is_bit_identical(tiny_assets, reward_model, zero2_policy, tmp_path):
    first = read_jsonl(zero2_policy / "metrics.jsonl")[0]
    assert first["update"] == 1 and abs(first["objective/kl"]) < 1e-6  # fp32: the policy starts as the reference
    output_dir = tmp_path / "run"
    command = tiny_policy(large_model_commands()[1], tiny_assets, reward_model, output_dir, *PPO_ACCUMULATE)
    returncode, output = run_and_interrupt(command, output_dir, signal.SIGKILL, 3, 0.1, env=zero2_environment())
    assert returncode == -signal.SIGKILL, output[-3000:]
    assert not (output_dir / "policy").exists()
    result = run_zero2([*command, "--resume"])
    assert "resumed from" in result.stdout
    assert_trained_by_zero2(output_dir)
    assert_same_run(output_dir, zero2_policy, "policy/model.safetensors")
    assert_same_run(output_dir, zero2_policy, "policy/value_head.safetensors")


# ---------------------------------------------------------------------------------------------------------------------
# what the scripts refuse under DeepSpeed, before anything is written


def test_bf16_under_deepspeed_is_refused_with_one_line(tiny_assets, reward_model, tmp_path):
    """large_models.sh's policy command with --mixed-precision bf16, launched under ZeRO-2 (one process: the refusal
    comes before any collective)."""
    output_dir = tmp_path / "run"
    command = tiny_policy(large_model_commands()[1], tiny_assets, reward_model, output_dir, nproc=1)
    result = subprocess.run([*command, "--mixed-precision", "bf16"], capture_output=True, text=True, timeout=300,
                            env=zero2_environment(), cwd=REPO)  # fmt: skip
    assert result.returncode != 0
    errors = sorted({line for line in result.stderr.splitlines() if line.startswith("error:")})
    assert len(errors) == 1 and "--mixed-precision bf16 under DeepSpeed" in errors[0], result.stderr[-3000:]
    assert f'{POLICY}", line' not in result.stderr  # no traceback through the script (the launcher prints its own)
    assert not output_dir.exists()


def deepspeed_accelerator(**config) -> SimpleNamespace:
    """What check_launch reads of an Accelerator under DeepSpeed: the plugin's config as accelerate builds it from
    benchmark/launch/deepspeed_zero2.yaml, with `config` on top."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.0)
    plugin.deepspeed_config.update(config)
    state = SimpleNamespace(deepspeed_plugin=plugin)
    return SimpleNamespace(num_processes=1, mixed_precision="no", state=state)  # WORLD_SIZE unset: 1


def test_check_launch_turns_off_deepspeeds_default_clipping_and_sets_the_micro_batch():
    accelerator, args = deepspeed_accelerator(), SimpleNamespace(micro_batch_size=4)
    assert accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto"  # = 1.0
    run_utils.check_launch(accelerator, args)
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    assert config["gradient_clipping"] == 0.0 and config["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.parametrize(
    ("config", "message"),
    [({"gradient_clipping": 1.0}, "clips gradients at 1.0"), ({"bf16": {"enabled": True}}, "bf16 under DeepSpeed")],
    ids=["clipping", "bf16-in-config"],
)
def test_check_launch_refuses_a_deepspeed_config_that_changes_openais_math(config, message):
    with pytest.raises(SystemExit, match=message):
        run_utils.check_launch(deepspeed_accelerator(**config), SimpleNamespace(micro_batch_size=4))


def test_check_launch_refuses_a_deepspeed_that_cannot_run_the_reward_model(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.19.8")
    with pytest.raises(SystemExit, match="deepspeed 0.19.8 cannot start a model with 0-dim parameters"):
        run_utils.check_launch(deepspeed_accelerator(), SimpleNamespace(micro_batch_size=4))


def test_check_launch_sizes_zero2s_buckets_unless_the_config_does():
    """DeepSpeed's default buckets are 5e8 values (a 1.86 GB fp32 gradient bucket at every backward, whatever the
    model) and accelerate resolves "auto" only for a model with a .config: the scripts set 5e7, which the memory
    estimate counts, and keep a number a config sets."""
    accelerator = deepspeed_accelerator()
    run_utils.check_launch(accelerator, SimpleNamespace(micro_batch_size=4))
    zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 50_000_000
    assert memory_estimate.ZERO_REDUCE_BUCKET == 4 * zero["reduce_bucket_size"]  # bytes in the estimate: fp32
    own = {"stage": 2, "reduce_bucket_size": 10**8, "allgather_bucket_size": "auto"}
    accelerator = deepspeed_accelerator(zero_optimization=own)
    run_utils.check_launch(accelerator, SimpleNamespace(micro_batch_size=4))
    assert own == {"stage": 2, "reduce_bucket_size": 10**8, "allgather_bucket_size": 50_000_000}


def test_zero3_is_refused_with_one_line_before_any_work(tiny_assets, tmp_path):
    """ZeRO-3 partitions every weight, and the scripts read weights whole (the LM head's in each sampling step): the
    launch check refuses it, and so does a --dry-run under a ZeRO-3 launch (accelerate launch's environment)."""
    from accelerate.utils import DeepSpeedPlugin

    zero3 = SimpleNamespace(num_processes=1, mixed_precision="no",
                            state=SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3)))  # fmt: skip
    with pytest.raises(SystemExit, match="DeepSpeed ZeRO-3 partitions every weight"):
        run_utils.check_launch(zero3, SimpleNamespace(micro_batch_size=4))
    flags = ["--base-model", str(tiny_assets["model"]), "--label-dataset", str(tiny_assets["small_labels"]),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "run"), "--labels.num-train", "64",
             "--task.passage-rows", "1", "--dry-run"]  # fmt: skip
    result = run_script(
        REWARD, *flags, env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and "ZeRO-3" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_the_pinned_deepspeed_is_the_tested_one():
    import deepspeed

    pinned = [line for line in (REPO / "requirements-deepspeed.txt").read_text().splitlines() if "==" in line]
    assert pinned == [f"deepspeed=={deepspeed.__version__}"] and deepspeed.__version__ not in run_utils.DEEPSPEED_BROKEN
    for user in (
        "benchmark/launch/large_models.sh",
        "benchmark/launch/aws/pcluster.yaml",
        "benchmark/launch/gpu/check.sh",
    ):
        assert "requirements-deepspeed.txt" in (REPO / user).read_text(), user


# ---------------------------------------------------------------------------------------------------------------------
# several machines on loopback, and launches whose processes do not know each other


def two_machines(launcher: str, flags: list[str]) -> list[list[str]]:
    """Two "machines" of one process each on this host, rendezvousing on 127.0.0.1."""
    port, script = str(free_port()), str(REPO / POLICY)
    if launcher == "torchrun":
        return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", script, *flags]] * 2  # fmt: skip
    return [[sys.executable, "-m", "accelerate.commands.launch", *(["--multi_gpu"] if launcher == "accelerate" else []),
             "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip",
             "127.0.0.1", "--main_process_port", port, script, *flags] for rank in (0, 1)]  # fmt: skip


def run_machines(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    processes = [subprocess.Popen(command, env=script_environment(2), cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for command in commands]  # fmt: skip
    outputs = [process.communicate(timeout=600) for process in processes]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(processes, outputs, strict=True)]


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_two_machines_on_loopback_equal_one_machine(tiny_assets, reward_model, ddp_policy, tmp_path, launcher):
    """`accelerate launch --multi_gpu --num_machines 2` and `torchrun --nnodes 2` (c10d): the same run as 2 processes
    on one machine, bit for bit."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_model, output_dir, "--no-use-tensorflow-adam")
    for result in run_machines(two_machines(launcher, flags)):
        assert result.returncode == 0, result.stderr[-3000:]
    assert_identical_policy_runs(output_dir, ddp_policy)


def test_processes_that_do_not_form_the_launched_run_stop_with_the_fix(tiny_assets, reward_model, tmp_path):
    """`accelerate launch --num_machines 2` without --multi_gpu (accelerate adds it only with several GPUs per
    machine, so a cluster of 1-GPU nodes meets this): each process would train alone as rank 0 of 1."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_model, output_dir)
    for result in run_machines(two_machines("accelerate-without-multi-gpu", flags)):
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "add --multi_gpu" in errors[0], result.stderr[-3000:]
    assert not output_dir.exists()  # nothing written


def test_the_guard_names_the_launch_fix_on_one_machine_too(tiny_assets, reward_model, tmp_path):
    """torchrun on a machine without GPUs and without ACCELERATE_USE_CPU: accelerate starts no process group."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, reward_model, output_dir)
    result = run_script(POLICY, *flags, nproc=2, env={"ACCELERATE_USE_CPU": "false"})
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
    assert result.returncode != 0 and len(errors) == 1 and "ACCELERATE_USE_CPU=true" in errors.pop()
    assert not output_dir.exists()
