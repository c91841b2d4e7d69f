"""DeepSpeed ZeRO-2 and multi-machine launches on 2 CPU processes (gloo), each against the plain 2-process DDP run.

The ZeRO-2 runs are `benchmark/launch/large_models.sh`'s own commands (`accelerate launch --config_file
benchmark/launch/deepspeed_zero2.yaml ...`) with the models and data swapped for tiny offline ones, 2 processes instead
of 8, and tests/deepspeed_cpu.py in front of the script (on a machine without GPUs accelerate starts DeepSpeed without a
communication backend; that CPU-only fix stays here). Each run asserts that the DeepSpeed engine really trained:
its checkpoints hold ZeRO's per-process optimizer partitions, which plain DDP never writes.

Tolerance: with gradient accumulation, ZeRO-2 reduces each micro-batch's gradients over the processes as they come,
DDP sums the micro-batches on each process and reduces once: the same sums in another order, so float32 rounding
differs (measured: ~1e-7 relative). Without accumulation the runs are bit-identical (test_zero2_policy_without_...).
"""

import json
import math
import os
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
    without_timings,
)
from train_policy_accelerate import load_reward_model
from train_reward_accelerate import OPENAI_PAD_ID

ZERO2_CONFIG = "benchmark/launch/deepspeed_zero2.yaml"
CPU_LAUNCH = str(REPO / "tests" / "deepspeed_cpu.py")
# relative: the same sums in another order under gradient accumulation (the module docstring); ZERO2_RTOL=1 to measure
RTOL = float(os.environ.get("ZERO2_RTOL", "1e-3"))


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


def run_zero2(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=zero2_environment(), cwd=REPO)
    assert result.returncode == 0, (shlex.join(command), result.stdout[-3000:], result.stderr[-3000:])
    return result


def assert_trained_by_zero2(output_dir: Path) -> None:
    """ZeRO's optimizer partitions, one per process, in every checkpoint: the DeepSpeed engine did the training."""
    checkpoints = sorted((output_dir / "checkpoints").glob("step-*"))
    assert checkpoints, f"no checkpoints in {output_dir}"
    for checkpoint in checkpoints:
        partitions = sorted(path.name for path in checkpoint.rglob("*optim_states.pt"))
        assert partitions == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)], checkpoint


def assert_close_runs(
    run: Path, reference: Path, weights: list[str], rtol: float = RTOL, noise: frozenset[str] = frozenset()
) -> None:
    """The same metrics rows and saved tensors up to `rtol`: each metric relative to its largest value over the run,
    each tensor to its largest entry (a value that passes near 0, as the policy loss of a late update, -6e-5 where the
    first ones are ~2e-2, or a weight near 0, is measured against its quantity's scale). Metrics in `noise` are only
    checked to be there and finite: what rounding noise moves by whole Adam steps."""
    rows, reference_rows = (without_timings(read_jsonl(path / "metrics.jsonl")) for path in (run, reference))
    assert [sorted(row) for row in rows] == [sorted(row) for row in reference_rows]
    scales = {}
    for reference_row in reference_rows:
        for key, value in reference_row.items():
            if isinstance(value, float):
                scales[key] = max(scales.get(key, 1e-6), abs(value))
    differences = [(0.0, "nothing")]
    for row, reference_row in zip(rows, reference_rows, strict=True):
        for key, value in row.items():
            if isinstance(value, float) and key in noise:
                assert math.isfinite(value) and math.isfinite(reference_row[key]), key
            elif isinstance(value, float):
                scale = scales[key]
                differences.append(
                    (abs(value - reference_row[key]) / scale, f"{key} at {row.get('step', row.get('update'))}")
                )
            else:
                assert value == reference_row[key], key
    for name in weights:
        tensors, reference_tensors = load_file(run / name), load_file(reference / name)
        assert tensors.keys() == reference_tensors.keys()
        for key, tensor in tensors.items():
            assert tensor.dtype == torch.float32, (name, key, tensor.dtype)  # saved in fp32, like the DDP run
            if key == "scalar_head.bias":
                continue  # its gradient is 0 (best-of-4 is shift-invariant): Adam's steps there are rounding noise
            scale = reference_tensors[key].abs().max().clamp(min=1e-6)
            differences.append((((tensor - reference_tensors[key]).abs().max() / scale).item(), f"{name}:{key}"))
    largest = max(differences)
    print(f"{run.parent.name} vs {reference.parent.name}: largest relative difference {largest[0]:.2e} ({largest[1]})")
    assert largest[0] <= rtol, largest


# ---------------------------------------------------------------------------------------------------------------------
# reward model: large_models.sh's first reward command, with gradient accumulation and the TF-style Adam (default)

ACCUMULATE = ["--gradient-accumulation-steps", "2"]


def tiny_reward(argv: list[str], assets, output_dir: Path, *extra: str) -> list[str]:
    values = {"--base-model": str(assets["model"]), "--label-dataset": str(assets["small_labels"]),
              "--output-dir": str(output_dir)}  # fmt: skip
    return tiny(argv, values, reward_flags(assets, output_dir, *extra))


@pytest.fixture(scope="module")
def ddp_reward(tiny_assets, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ddp-reward") / "run"
    result = run_script(REWARD, *reward_flags(tiny_assets, output_dir, *ACCUMULATE), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


@pytest.fixture(scope="module")
def zero2_reward(tiny_assets, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("zero2-reward") / "run"
    run_zero2(tiny_reward(large_model_commands()[0], tiny_assets, output_dir, *ACCUMULATE))
    return output_dir


def reward_scores(run: Path, labels: Path) -> torch.Tensor:
    """What a saved reward model says: its scores of the first label records' query + sample pairs."""
    records = json.loads(labels.read_text())[:32]
    queries = torch.tensor([record["query"] for record in records])
    samples = torch.tensor([[record[f"sample{i}"] for i in range(4)] for record in records])
    model = load_reward_model(str(run / "reward_model"))
    queries, samples = (x.masked_fill(x == OPENAI_PAD_ID, model.pad_id) for x in (queries, samples))  # ours here
    with torch.no_grad():  # each query with each of its 4 samples, one row each
        return model(queries.repeat_interleave(4, 0), samples.flatten(0, 1)).view(-1, 4)


def test_zero2_reward_model_equals_ddp_and_keeps_its_normalization(zero2_reward, ddp_reward, tiny_assets):
    """The reward model is compared by what it says, not by its weights: the final layer norm's bias and the head's
    bias shift all 4 samples' rewards alike, so best-of-4 gives them a gradient of exactly 0, and the rounding noise
    that stands in for it moves them by whole Adam steps (differently in each run, DDP's too)."""
    assert_trained_by_zero2(zero2_reward)
    # the mean reward after training moves with those biases (a shift of all rewards): its difference is that noise
    # (measured 1.4e-3 of the mean after 8 steps); normalization after takes the shift out (its bias is set from this
    # mean), and the scores of the normalized model are compared below
    assert_close_runs(zero2_reward, ddp_reward, [], noise=frozenset({"normalization/after/mean"}))
    scores, reference = (reward_scores(run, tiny_assets["small_labels"]) for run in (zero2_reward, ddp_reward))
    difference = ((scores - reference).abs().max() / reference.abs().max()).item()
    print(f"reward model scores: largest relative difference {difference:.2e}")
    # what the trained models say differs by more than their metrics: 1.35e-3 of the largest score (measured after
    # the sampler's change of the normalization samples; below 1e-3 before), as Adam turns rounding differences in
    # small gradients into lr-sized steps: the bound here is twice RTOL
    assert difference <= 2 * RTOL and reference.std() > 0.1
    head = load_file(zero2_reward / "reward_model" / "reward_head.safetensors")
    before = read_jsonl(zero2_reward / "metrics.jsonl")[0]
    # the gain set before training survived ZeRO's fp32 copy of the weights: far from its initial 1
    assert before["step"] == 0 and abs(before["normalization/before/std"] - 1) > 0.5
    assert abs(head["reward_gain"].item() - 1) > 0.5


# ---------------------------------------------------------------------------------------------------------------------
# policy: large_models.sh's first policy command, with gradient accumulation and the TF-style Adam (default)

PPO_ACCUMULATE = ["--ppo.gradient-accumulation-steps", "2"]


def tiny_policy(
    argv: list[str], assets, reward_model: Path, output_dir: Path, *extra: str, nproc: int = 2
) -> list[str]:
    values = {"--base-model": str(assets["model"]), "--rewards.trained-model": str(reward_model),
              "--output-dir": str(output_dir)}  # fmt: skip
    return tiny(argv, values, policy_flags(assets, reward_model, output_dir, *extra), nproc)


@pytest.fixture(scope="module")
def ddp_policy(tiny_assets, ddp_reward, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ddp-policy") / "run"
    flags = policy_flags(tiny_assets, ddp_reward / "reward_model", output_dir, *PPO_ACCUMULATE)
    result = run_script(POLICY, *flags, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


@pytest.fixture(scope="module")
def zero2_policy(tiny_assets, ddp_reward, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("zero2-policy") / "run"
    argv = large_model_commands()[1]
    run_zero2(tiny_policy(argv, tiny_assets, ddp_reward / "reward_model", output_dir, *PPO_ACCUMULATE))
    return output_dir


POLICY_WEIGHTS = ["policy/model.safetensors", "policy/value_head.safetensors"]


def test_zero2_policy_equals_ddp(zero2_policy, ddp_policy):
    assert_trained_by_zero2(zero2_policy)
    assert_close_runs(zero2_policy, ddp_policy, POLICY_WEIGHTS)
    first = read_jsonl(zero2_policy / "metrics.jsonl")[0]
    assert first["update"] == 1 and abs(first["objective/kl"]) < 1e-6  # fp32: the policy starts as the reference


def test_zero2_policy_resume_after_sigkill_is_bit_identical(tiny_assets, ddp_reward, zero2_policy, tmp_path):
    output_dir = tmp_path / "run"
    command = tiny_policy(
        large_model_commands()[1], tiny_assets, ddp_reward / "reward_model", output_dir, *PPO_ACCUMULATE
    )
    returncode, output = run_and_interrupt(command, output_dir, signal.SIGKILL, 3, 0.1, env=zero2_environment())
    assert returncode == -signal.SIGKILL, output[-3000:]
    assert not (output_dir / "policy").exists()
    result = run_zero2([*command, "--resume"])
    assert "resumed from" in result.stdout
    assert_trained_by_zero2(output_dir)
    assert_same_run(output_dir, zero2_policy, "policy/model.safetensors")
    assert_same_run(output_dir, zero2_policy, "policy/value_head.safetensors")


def test_zero2_with_torch_adam_runs_large_models_sh_end_to_end(tiny_assets, ddp_reward, tmp_path):
    """large_models.sh's PyTorch-Adam pair (the other pairs differ only in model and label names, which are swapped
    for the tiny ones here), both commands, under ZeRO-2 without accumulation: bit-identical to plain DDP."""
    reward_argv, policy_argv = large_model_commands()[8:10]
    assert "--no-use-tensorflow-adam" in reward_argv and "--no-use-tensorflow-adam" in policy_argv
    run_zero2(tiny_reward(reward_argv, tiny_assets, tmp_path / "reward"))
    assert_trained_by_zero2(tmp_path / "reward")
    reward_model = tmp_path / "reward" / "reward_model"
    run_zero2(tiny_policy(policy_argv, tiny_assets, reward_model, tmp_path / "policy"))
    assert_trained_by_zero2(tmp_path / "policy")
    ddp = tmp_path / "ddp"
    flags = policy_flags(tiny_assets, reward_model, ddp, "--no-use-tensorflow-adam")
    assert run_script(POLICY, *flags, nproc=2).returncode == 0
    assert_close_runs(tmp_path / "policy", ddp, POLICY_WEIGHTS, rtol=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# what the scripts refuse under DeepSpeed, before anything is written


def test_bf16_under_deepspeed_is_refused_with_one_line(tiny_assets, ddp_reward, tmp_path):
    """large_models.sh's policy command with --mixed-precision bf16, launched under ZeRO-2 (one process: the refusal
    comes before any collective)."""
    output_dir = tmp_path / "run"
    command = tiny_policy(large_model_commands()[1], tiny_assets, ddp_reward / "reward_model", output_dir, nproc=1)
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
def test_two_machines_on_loopback_equal_one_machine(tiny_assets, ddp_reward, ddp_policy, tmp_path, launcher):
    """`accelerate launch --multi_gpu --num_machines 2` and `torchrun --nnodes 2` (c10d): the same run as 2 processes
    on one machine, bit for bit."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, ddp_reward / "reward_model", output_dir, *PPO_ACCUMULATE)
    for result in run_machines(two_machines(launcher, flags)):
        assert result.returncode == 0, result.stderr[-3000:]
    assert_close_runs(output_dir, ddp_policy, POLICY_WEIGHTS, rtol=0.0)
    assert_same_run(output_dir, ddp_policy, "policy/model.safetensors")


def test_processes_that_do_not_form_the_launched_run_stop_with_the_fix(tiny_assets, ddp_reward, tmp_path):
    """`accelerate launch --num_machines 2` without --multi_gpu (accelerate adds it only with several GPUs per
    machine, so a cluster of 1-GPU nodes meets this): each process would train alone as rank 0 of 1."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, ddp_reward / "reward_model", output_dir)
    for result in run_machines(two_machines("accelerate-without-multi-gpu", flags)):
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "add --multi_gpu" in errors[0], result.stderr[-3000:]
    assert not output_dir.exists()  # nothing written


def test_the_guard_names_the_launch_fix_on_one_machine_too(tiny_assets, ddp_reward, tmp_path):
    """torchrun on a machine without GPUs and without ACCELERATE_USE_CPU: accelerate starts no process group."""
    output_dir = tmp_path / "run"
    flags = policy_flags(tiny_assets, ddp_reward / "reward_model", output_dir)
    result = run_script(POLICY, *flags, nproc=2, env={"ACCELERATE_USE_CPU": "false"})
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
    assert result.returncode != 0 and len(errors) == 1 and "ACCELERATE_USE_CPU=true" in errors.pop()
    assert not output_dir.exists()
