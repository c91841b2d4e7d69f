"""benchmark/speed/throughput.py runs the real training loops on a random-weight model and reports one JSON line
each."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from benchmark.speed import throughput
from tests.conftest import REPO


def test_throughput_harness_reports_both_stages(gpt2_tokenizer_dir):
    command = [sys.executable, "-m", "benchmark.speed.throughput", "--model", "tiny", "--batch-size", "8",
               "--query-length", "16", "--response-length", "12", "--updates", "1", "--eval-labels", "32",
               "--noptepochs", "2", "--extra=--local-rollout-forward-batch-size 4"]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    reward, policy = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])
    assert reward["stage"] == "reward" and reward["seconds_per_step"] > 0 and reward["mfu"] > 0
    assert reward["eval_seconds_per_label"] > 0
    assert policy["stage"] == "policy" and policy["tokens_per_second"] > 0
    assert set(policy["phases"]) == {"time/generation", "time/logprobs", "time/scoring", "time/ppo_epochs"}
    assert abs(sum(policy["phases"].values()) - policy["seconds_per_update"]) < 1e-6
    assert policy["mfu_ppo_epochs"] > 0 and policy["peak_memory_gb"] > 0
    # MFU = model FLOPs / time / the peak, two timings of other moments (the peak's matrix products first, the steps
    # later): beside the suite's other workers either can be slowed alone, and an MFU of 1.02 was seen, so no bound
    # of 1 here; what holds under any load is the FLOPs each MFU stands for, counted by hand for throughput.py's tiny
    # GPT-2 (2 layers, d 128, 1024 positions, GPT-2's vocabulary; tests/test_run_utils.py checks the formula): 2 per
    # trunk parameter and token (the reward model: 6, a forward and a backward, over a query and its 4 samples), and
    # the LM head on the responses; the PPO epochs: 2 epochs of 3 forwards' worth of 8 rows of 16 + 12 tokens
    d, vocabulary = 128, 50257
    trunk = 1024 * d + 2 * (12 * d * d + 13 * d) + 2 * d
    reward_flops = 6 * trunk * 8 * (16 + 4 * 12)
    assert reward["mfu"] * reward["peak_tflops"] * 1e12 * reward["seconds_per_step"] == pytest.approx(reward_flops)
    policy_flops = 2 * 3 * (2 * trunk * 8 * (16 + 12) + 2 * d * vocabulary * 8 * 12)
    epochs = policy["phases"]["time/ppo_epochs"]
    assert policy["mfu_ppo_epochs"] * policy["peak_tflops"] * 1e12 * epochs == pytest.approx(policy_flops)
    assert policy["first_ratio_max_deviation"] == [0.0, 0.0]  # each update's: the warm-up and the measured one


def accelerate_launcher(processes: int) -> str:
    """`accelerate launch` for `processes` CPU processes on this machine (with ACCELERATE_USE_CPU=true)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"{sys.executable} -m accelerate.commands.launch --multi_gpu --num_processes {processes} --main_process_port {port}"


TINY_POLICY = [sys.executable, "-m", "benchmark.speed.throughput", "--model", "tiny", "--stage", "policy",
               "--batch-size", "16", "--query-length", "16", "--response-length", "12", "--noptepochs", "1",
               "--extra=--local-rollout-forward-batch-size 4"]  # fmt: skip


def cpu_environment(**more) -> dict:
    return {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **more}


def test_throughput_runs_on_two_processes(gpt2_tokenizer_dir):
    """benchmark/launch/gpu/check.sh's zero2 configuration launches throughput.py on every GPU: its whitening ranks
    follow the processes (a fixed `--ppo.whitening-ranks 1` failed validation on more than one). Its reward model is
    evaluated on held-out labels, and the line holds the memory estimate of that launch. --stage policy needs no
    --eval-labels of its own (4 here, fewer than a batch, which --stage reward refuses)."""
    command = [*TINY_POLICY, "--updates", "1", "--eval-labels", "4", f"--launcher={accelerate_launcher(2)}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=cpu_environment(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["stage"] == "policy" and line["processes"] == 2 and line["seconds_per_update"] > 0
    assert line["peak_memory_gb"] > 0 and line["estimated_peak_memory_gb"]["total"] > 0


def tagged(tag: str) -> list[int]:
    """The processes whose environment holds THROUGHPUT_TEST_TAG=tag: what the run started, wherever it went."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"THROUGHPUT_TEST_TAG={tag}".encode() in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def test_a_stopped_or_timed_out_run_leaves_no_process_and_no_temporary_file(gpt2_tokenizer_dir, tmp_path):
    """SIGTERM once the launcher and its 2 workers run, then --timeout: each time the whole process tree is killed
    (the workers live in sessions of their own) and the temporary directory is gone."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    command = [*TINY_POLICY, "--updates", "1000", f"--launcher={accelerate_launcher(2)}"]
    env = cpu_environment(TMPDIR=str(temporary), THROUGHPUT_TEST_TAG=str(tmp_path))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline, start = time.monotonic() + 300, time.monotonic()
        running = lambda: len(tagged(str(tmp_path))) >= 4 and list(temporary.rglob("corpus.txt"))  # noqa: E731
        while not running() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # throughput.py, the launcher, 2 workers, and the run's files in its temporary directory
        seen = []
        for pid in tagged(str(tmp_path)):
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                seen.append(" ".join(psutil.Process(pid).cmdline()[:4]))
        assert list(temporary.rglob("corpus.txt")), (
            f"the run has its temporary directory: after {time.monotonic() - start:.0f} s, exit {process.poll()}, "
            f"running {seen}, in {temporary}: {sorted(str(path) for path in temporary.rglob('*'))[:20]}"
        )
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 143, stderr[-3000:]
        assert tagged(str(tmp_path)) == [] and not list(temporary.rglob("corpus.txt"))
        result = subprocess.run(
            [*command, "--timeout", "8"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
        )
        assert result.returncode == throughput.TIMED_OUT and "--timeout 8 s" in result.stderr, result.stderr[-3000:]
        assert tagged(str(tmp_path)) == [] and not list(temporary.rglob("corpus.txt"))
    finally:  # a failed check leaves nothing running for the rest of the suite (once it left 4 processes on the 2 cores)
        for pid in [process.pid, *tagged(str(tmp_path))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=60)


def test_mfu_peak_is_measured_in_the_runs_precision():
    """bf16 when --extra has --mixed-precision bf16, TF32 with --allow-tf32 (and no bf16), fp32 otherwise."""
    assert throughput.peak_precision("--mixed-precision bf16 --allow-tf32 --compile") == "bf16"
    assert throughput.peak_precision("--mixed-precision=bf16") == "bf16"
    assert throughput.peak_precision("--ppo.gradient-accumulation-steps 4 --allow-tf32") == "tf32"
    assert throughput.peak_precision("--mixed-precision no --allow-tf32") == "tf32"
    assert throughput.peak_precision("") == throughput.peak_precision("--mixed-precision no") == "fp32"
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    assert throughput.measure_peak_tflops(torch.device("cpu"), "bf16") > 0
    assert torch.backends.cuda.matmul.allow_tf32 == allow_tf32  # restored


def test_the_reward_stage_of_a_policy_measurement_takes_the_runs_precision():
    """With --stage policy, --extra's precision flags also reach the reward model trained first (check.sh's bf16
    configurations train and evaluate it under bf16: the best-of-4 forward's additive mask under bf16 SDPA), and only
    those: the policy's own flags would be refused by the reward script."""
    extra = "--ppo.gradient-accumulation-steps 4 --mixed-precision bf16 --allow-tf32 --compile"
    assert throughput.precision_flags(extra) == ["--mixed-precision", "bf16", "--allow-tf32"]
    assert throughput.precision_flags("--mixed-precision=bf16 --local-rollout-forward-batch-size 4") == [
        "--mixed-precision=bf16"
    ]
    assert throughput.precision_flags("--ppo.noptepochs 2") == throughput.precision_flags("") == []


def test_the_measured_task_has_left_padded_queries_and_padded_labels_as_books(gpt2_tokenizer_dir, tmp_path):
    """What throughput.py gives the scripts: queries that start and end at a period, so left-padded, each row by its
    own number of pads (the policy's forwards then attend under a (B, 1, L, L) mask, as on books, not unmasked), and
    label records padded as OpenAI's files are, which the reward script reads."""
    import rlhf_data
    import run_utils
    import train_policy_accelerate as P

    args = throughput.Args(model="tiny", tokenizer=str(gpt2_tokenizer_dir))
    model_dir, corpus, vocab = throughput.make_assets(args, tmp_path)
    flags = [*throughput.task_flags(args, model_dir, corpus), "--rewards.function", "sentiment"]
    policy_args = run_utils.task_cli(P.task_defaults, flags)
    tokenizer, pad = P.load_tokenizer(str(model_dir)), 50257
    texts = rlhf_data.QueryTexts.of_task(policy_args.task)
    queries = P.QueryStream(texts, tokenizer, policy_args.task, pad, policy_args.seed).next_batch(64)[0]
    pads = (queries == pad).sum(1)
    assert queries.shape == (64, 64) and (pads > 0).float().mean() > 0.5 and len(set(pads.tolist())) >= 4
    assert (queries[:, -1] == tokenizer.encode(".")[0]).all()  # left-padded: each ends at its last period
    labels = throughput.random_labels(tmp_path / "labels.json", 16, args, vocab - 1)
    lengths = {"query": 64, **{f"sample{i}": 24 for i in range(4)}}
    records = rlhf_data.read_label_records(str(labels), lengths, vocab, (throughput.OPENAI_PAD_ID, pad), 4)
    padded = [key for record in records for key in lengths if throughput.OPENAI_PAD_ID in record[key]]
    assert len(padded) > len(records) * len(lengths) / 2


def test_launch_of_counts_the_processes_and_the_zero_stage():
    assert throughput.launch_of("") == (1, 0)
    assert throughput.launch_of("accelerate launch --num_processes 4") == (4, 0)
    zero2 = str(REPO / "benchmark" / "launch" / "deepspeed_zero2.yaml")
    assert throughput.launch_of(f"accelerate launch --config_file {zero2}") == (8, 2)  # the file's num_processes
    launcher = f"python -m accelerate.commands.launch --config_file {zero2} --num_processes 2"
    assert throughput.launch_of(launcher) == (2, 2)
    assert throughput.launch_of("torchrun --nnodes 2 --nproc_per_node=4") == (8, 0)


def test_optimizations_benchmark_checks_each_pair_and_prints_the_table():
    """benchmark/speed/optimizations.py: every before/after pair computes the same result (checked before timing, so a
    wrong "after" stops the run) and each detail gets a row with positive timings."""
    command = [sys.executable, "-m", "benchmark.speed.optimizations", "--model", "tiny", "--batch-size", "2",
               "--query-length", "8", "--response-length", "6", "--repeats", "1", "--padding-rows", "16",
               "--metrics", "4"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 10 and all(row["before_s"] > 0 and row["after_s"] > 0 for row in rows)
    assert result.stdout.count("× |") == 10  # the markdown table


def test_sampling_speed_compares_the_loop_with_generate():
    """benchmark/speed/sampling_speed.py: one JSON line per setting with the timings of generate(), the loop and
    (several samples per context) the loop with the shared context forward."""
    command = [sys.executable, "-m", "benchmark.speed.sampling_speed", "--settings", "tiny", "--repeats", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["setting"] == "tiny" and row["batch"] == 4 and row["samples_per_context"] == 2
    assert all(row[key] > 0 for key in ("generate_s", "loop_s", "loop_over_generate", "shared_context_s"))
    assert 0 < row["matmul_floor_s"] < row["loop_s"]  # the loop's own products, timed alone: a part of its time
    assert 0 < row["streaming_floor_s"] < row["loop_s"]  # the same, in order, on the model's count of weights
    # the seconds keep 4 significant digits (a tiny floor takes a fraction of a millisecond): the ratio of the
    # rounded values within 0.2% of the ratio of the measured ones
    assert row["loop_over_streaming_floor"] == pytest.approx(row["loop_s"] / row["streaming_floor_s"], rel=2e-3)


def test_streaming_floor_replays_the_products_on_as_many_weights_as_the_model_has():
    """sampling_speed: the call's products recorded once, in order (product_shapes), timed by shape (matrix_products)
    and replayed in order (product_sequence), where an operand of a weight's size cycles through as many tensors as
    the model has weights of that size (3 layers of 64 x 64 here: 3 distinct ones, in turn) and other operands (the
    activations) take one tensor per shape."""
    from benchmark.speed import sampling_speed

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(3)), torch.nn.Linear(64, 8))
    x = torch.randn(5, 64)
    shapes = sampling_speed.product_shapes(lambda: model(model[:3](x)), ())
    assert [b for _, b in shapes] == [(64, 64)] * 6 + [(64, 8)] and {a for a, _ in shapes} == {(5, 64)}
    assert [(pair, count) for pair, count, _ in sampling_speed.matrix_products(shapes, 1)] == [
        (((5, 64), (64, 64)), 6),
        (((5, 64), (64, 8)), 1),
    ]  # each shape timed once, with its count
    sequence = sampling_speed.product_sequence(shapes, model)
    assert [tuple(b.shape) for _, b in sequence] == [(64, 64)] * 6 + [(64, 8)]  # 3 + 3 layers, then the head
    weights = [id(b) for _, b in sequence[:6]]
    assert len(set(weights[:3])) == 3 and weights[3:] == weights[:3]  # 3 distinct weights, in turn
    assert len({id(a) for a, _ in sequence}) == 1  # one (5, 64) activation for every product
    replay = sampling_speed.streaming_replay(shapes, model)
    assert sampling_speed.product_shapes(replay, ()) == shapes  # one replay: the call's products once, in its order


def test_sampling_speed_times_the_methods_in_turns():
    """sampling_speed.seconds_in_turns: a warm-up call of each method, then rounds in which each runs once, in turn
    (so that a slow stretch of the machine falls on all alike); the median of each method's rounds."""
    from benchmark.speed import sampling_speed

    calls = []
    sampling_speed.seconds_in_turns({name: (lambda name=name: calls.append(name)) for name in "xyz"}, 2)
    assert calls == list("xyz") * 3  # in turns: x y z (the warm-ups), then x y z twice
    medians = sampling_speed.seconds_in_turns({"fast": lambda: None, "slow": lambda: time.sleep(0.02)}, 3)
    assert list(medians) == ["fast", "slow"] and medians["fast"] < 0.02 <= medians["slow"] < 1


def test_ppo_profile_splits_the_step_by_kind_of_operation():
    """benchmark/speed/ppo_profile.py: the policy script's training step, timed and split: its matrix products timed
    alone (the trunk's and the LM head's, both found), the optimizer step and the rest, adding up to the step."""
    command = [sys.executable, "-m", "benchmark.speed.ppo_profile", "--model", "tiny", "--batch-size", "2",
               "--query-length", "8", "--response-length", "6", "--repeats", "2"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    parts = row["parts"]
    assert len(parts) == 4 and sum(parts.values()) == pytest.approx(row["seconds_per_step"], rel=1e-6)
    products = [parts["trunk matrix products (timed alone)"], parts["LM head matrix products (timed alone)"]]
    assert all(0 < seconds < row["seconds_per_step"] for seconds in products)
    assert 0 < parts["optimizer step (TF-style Adam, fused)"] < row["seconds_per_step"]
    others = set(row["top_other_ops_profiled_ms"])
    assert others and not others & {"aten::mm", "aten::addmm", "aten::bmm"}
    assert row["mfu"] == pytest.approx(row["seconds_at_peak"] / row["seconds_per_step"], rel=1e-6)
    assert 2 <= row["warmup_steps"] <= 12  # until a step faults in no new page, at most --max-warmup-steps
    assert "| part of the step |" in result.stdout and result.stdout.count("| ") >= 10  # the table


def test_ppo_profile_warms_up_until_a_step_faults_in_no_new_page():
    """ppo_profile.settle: warm-up steps go on until one takes no new page from the kernel (at least 2, at most the
    cap), so that the profile does not time the allocator's first steps."""
    from benchmark.speed import ppo_profile

    kept = []  # what the steps allocate stays allocated, so each new block is fresh memory

    def step_allocating(megabytes_per_step: list[int]):  # its first len(...) calls fill new memory, the rest nothing
        calls = iter(megabytes_per_step)

        def step():
            megabytes = next(calls, 0)
            if megabytes:
                kept.append(torch.ones(megabytes * 2**18))  # float32: written, so faulted in, page by page

        return step

    assert ppo_profile.settle(step_allocating([80, 80, 80]), 12) == 4
    assert ppo_profile.settle(step_allocating([]), 12) == 2  # no faults at all: still 2 steps
    assert ppo_profile.settle(step_allocating([80] * 20), 5) == 5  # never settles: the cap
