"""benchmark/studies/ablations.py: each arm's flags are accepted by the scripts and change exactly the detail it names;
the dry run prints every arm's commands; the report's numbers from runs laid out as the suite writes them."""

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import quickstart
import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from benchmark.studies import ablations
from tests.conftest import REPO


def flat(config, prefix: str = "") -> dict:
    fields = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            fields.update(flat(value, f"{prefix}{field.name}."))
        else:
            fields[f"{prefix}{field.name}"] = value
    return fields


def script_flags(args: ablations.Args, name: str, tmp_path) -> dict[str, list[str]]:
    """The flags each training script gets when the suite runs arm `name` for seed 1: the policy's and, if the arm
    trains its own reward model, the reward script's. At cpu scale through quickstart.py, as it builds them."""
    lines = [line.replace("{seed}", "1") for line in ablations.arm_commands(args, name, ablations.ALL_ARMS[name],
                                                                            tmp_path)]  # fmt: skip
    if args.scale == "cpu":
        words = shlex.split(lines[0].split(" || ", 1)[1])
        parser = quickstart.build_parser()
        options = quickstart.parse_args(parser, words[2:])  # after `python quickstart.py`
        base, corpus, out = tmp_path / "base", tmp_path / "corpus.txt", Path(options.output_dir)
        reward_model = Path(options.reward_model or out / "reward" / "reward_model")
        flags = {"policy": quickstart.policy_command(options, base, corpus, reward_model, out / "policy")[2:]}
        if options.reward_model is None:
            flags["reward"] = quickstart.reward_command(options, base, corpus, out / "reward")[2:]
        return flags
    scripts = {"train_reward_accelerate.py": "reward", "train_policy_accelerate.py": "policy"}
    flags = {}
    for line in lines:
        words = shlex.split(line)
        script = next(i for i, word in enumerate(words) if word in scripts)
        flags[scripts[words[script]]] = words[script + 1 :]
    return flags


PATHS = {"output_dir", "rewards.trained_model"}
"""Fields that differ between arms by where they write and which reward model they read, not by the detail."""


@pytest.mark.parametrize(
    ("scale", "name"), [("cpu", name) for name in ablations.ARMS] + [("paper", name) for name in ablations.ALL_ARMS]
)
def test_each_arm_changes_exactly_its_detail_in_the_commands_the_suite_runs(scale, name, tmp_path):
    """Each arm's training-script flags, as the suite really runs them (at cpu scale: quickstart.py's commands with
    the flags it adds, --reward-model included), against the full recipe's: exactly the arm's changes differ."""
    args = ablations.Args(scale=scale)
    full, arm = (script_flags(args, which, tmp_path) for which in ("full", name))
    scripts = {"policy": P, "reward": R}
    changed = {}
    for role, flags in arm.items():
        parsed, reference = (flat(run_utils.task_cli(scripts[role].task_defaults, f)) for f in (flags, full[role]))
        changed.update({key: value for key, value in parsed.items() if reference[key] != value and key not in PATHS})
    assert changed == dict(ablations.ALL_ARMS[name].changes)
    assert bool(changed) == (name != "full")
    assert ("reward" in arm) == (name == "full" or bool(ablations.ALL_ARMS[name].reward_flags))


@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_dry_run_prints_every_arms_commands_and_runs_nothing(scale, tmp_path):
    out = tmp_path / "abl"
    command = [sys.executable, "-m", "benchmark.studies.ablations", "--scale", scale, "--dry-run",
               "--output-dir", str(out), "--num-seeds", "3"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    arms = {**ablations.ARMS, **(ablations.PAPER_ONLY if scale == "paper" else {})}
    for name, arm in arms.items():
        mine = [line for line in lines if line.startswith(f"{name}: ")]
        assert mine, name
        words = shlex.split(mine[-1].split(": ", 1)[1])
        if scale == "cpu":
            assert words[:4] == ["test", "-e", str(out / name / "seed_{seed}" / "summary.json"), "||"]
            words = words[4:]
            assert words[:2] == ["python", "quickstart.py"] and "--seed" in words
            reuses = "--reward-model" in words
            assert reuses == (name != "full" and not arm.reward_flags)
            given = {
                word.split("=", 1)[0]: word.split("=", 1)[1] for word in words if word.startswith("--") and "=" in word
            }
            assert shlex.split(given.get("--policy-args", "")) == list(arm.policy_flags)
            assert shlex.split(given.get("--reward-args", "")) == list(arm.reward_flags)
        else:
            assert "train_policy_accelerate.py" in words and "--task.gold-labeler" in words
            assert not arm.policy_flags or words[-len(arm.policy_flags) :] == list(arm.policy_flags)
    assert "GPU-hours" in result.stdout if scale == "paper" else "quick starts" in result.stdout
    launcher = next(line for line in lines if line.startswith("launcher: "))
    assert launcher.count("--command") == sum(len(ablations.arm_commands(ablations.Args(scale=scale), n, a, out))
                                              for n, a in arms.items())  # fmt: skip
    assert not out.exists()


def test_report_of_a_missing_study_is_one_line(tmp_path):
    command = [sys.executable, "-m", "benchmark.studies.ablations", "--report-only", "--output-dir",
               str(tmp_path / "none")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --output-dir {tmp_path / 'none'}: no study there to report "
                                                  "(run it without --report-only)"]  # fmt: skip


def test_unknown_arm_is_one_line():
    result = subprocess.run([sys.executable, "-m", "benchmark.studies.ablations", "--arms", "nope", "--dry-run"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --arms nope")


def fake_run(run_dir, gold_gain: float, kl: float, approxkl: float, minutes: float = 4.0) -> None:
    (run_dir / "policy").mkdir(parents=True)
    rows = [{"update": 0, "episode": 0, "eval/gold_score": 0.2, "eval/rm_score": -0.5, "eval/kl": 0.0}]
    rows += [{"update": u, "episode": 16 * u, "objective/kl": kl * u / 2, "ppo/policy/approxkl": approxkl * u,
              "ppo/policy/clipfrac": 0.1} for u in (1, 2)]  # fmt: skip
    rows[-1].update({"eval/gold_score": 0.2 + gold_gain, "eval/rm_score": 1.0, "eval/kl": kl})
    (run_dir / "policy" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    mean = {"mean": 0.0}
    policy = {"gold_score": {"difference": {"mean": gold_gain}}, "rm_score": {"difference": {"mean": 1.5}},
              "final_kl": {"mean": kl}, "kl": mean}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps({"policy": policy, "timings_s": {"total": 60 * minutes}}))


def test_report_pairs_each_arm_with_the_full_recipe_by_seed(tmp_path):
    """Gains 0.5, 0.6, 0.7 (full) and 0.1, 0.3, 0.2 (arm): the full recipe's mean 0.6 ± t(2) 4.303 · 0.1/√3 =
    ±0.2484; the paired differences -0.4, -0.3, -0.5: mean -0.4, the same half-width."""
    for seed, (full, arm) in enumerate(((0.5, 0.1), (0.6, 0.3), (0.7, 0.2)), 1):
        fake_run(tmp_path / "full" / f"seed_{seed}", full, kl=10.0, approxkl=0.01)
        fake_run(tmp_path / "fixed-kl" / f"seed_{seed}", arm, kl=20.0, approxkl=0.02, minutes=1.0 + seed)
    args = ablations.Args(arms=("fixed-kl", "torch-adam"), num_seeds=3, output_dir=str(tmp_path))
    table = ablations.report(args, ablations.arms_of("cpu", args.arms), tmp_path)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.split("\n\n")[0].splitlines()[2:]}
    assert "| 3 | +0.600 [+0.352, +0.848] | — |" in rows["full"]
    assert "| 3 | +0.200 [-0.048, +0.448] | -0.400 [-0.648, -0.152] |" in rows["fixed-kl"]
    assert "| 20.0 | +10.0 [+10.0, +10.0] | 0.0300 (0.020) | 0.100 | 0 of 3 | 3.0 |" in rows["fixed-kl"]
    assert "| 10.0 | — | 0.0150 (0.010) |" in rows["full"]
    assert rows["full"].endswith("| 0 of 3 | 4.0 |")
    assert (tmp_path / "ablations.md").read_text() == table and (tmp_path / "ablations.png").stat().st_size > 1000
    # at KL 10, the most every run reached, the arm (KL 20 at its end, linear from 0) had half its gain: 0.05, 0.15,
    # 0.10, mean 0.1 ± 4.303 · 0.05/√3; paired with the full recipe's 0.5, 0.6, 0.7: -0.45, -0.45, -0.6, mean -0.5 ±
    # 4.303 · 0.05
    matched = table.split("\n\n", 1)[1].splitlines()
    assert matched[0].startswith("Gold gain at matched KLs, up to 10.00 nats")
    assert matched[2] == "| arm | seeds | 1.00 nats | 2.00 nats | 4.00 nats | 8.00 nats | 10.00 nats |"
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in matched[4:]}
    assert list(rows) == ["full", "fixed-kl"]  # an arm with no finished run has no row
    assert rows["full"][0] == "3" and rows["full"][-1] == "+0.600 [+0.352, +0.848] |"
    assert rows["fixed-kl"][-1] == "-0.500 [-0.715, -0.285] |"
    # and at 1, 2, 4, 8 nats on the way: at 4 the full recipe (KL 10 at its end) had 0.4 of its gains, 0.2, 0.24,
    # 0.28; the arm 0.2 of its own: 0.02, 0.06, 0.04, paired -0.18, -0.18, -0.24
    assert rows["full"][3] == "+0.240 [+0.141, +0.339]"
    assert rows["fixed-kl"][3] == "-0.200 [-0.286, -0.114]"


def test_gain_at_kl_interpolates_where_the_run_first_reached_it():
    trace = [(0.0, 0.2), (4.0, 0.6), (2.0, 0.5), (8.0, 1.0)]  # its KL fell back once
    assert abs(ablations.gain_at_kl(trace, 2.0) - 0.2) < 1e-12  # on the way up, not where it came back to 2
    assert abs(ablations.gain_at_kl(trace, 6.0) - (0.5 + 0.5 * 4 / 6 - 0.2)) < 1e-12  # from 2 back up to 8
    assert ablations.gain_at_kl(trace, 0.0) == 0.0
    assert ablations.gain_at_kl(trace, 9.0) is None and ablations.gain_at_kl([(0.0, 0.3)], 0.0) == 0.0


def test_shrinking_flags_reach_every_cpu_run(tmp_path):
    args = ablations.Args(updates=20, eval_every=10)
    for name, arm in ablations.ARMS.items():
        (line,) = ablations.arm_commands(args, name, arm, tmp_path)
        words = shlex.split(line)
        assert words[words.index("--updates") + 1] == "20" and words[words.index("--eval-every") + 1] == "10", name
    (plain,) = ablations.arm_commands(ablations.Args(), "full", ablations.ARMS["full"], tmp_path)
    assert "--updates" not in plain and "--eval-every" not in plain and "--threads" not in plain


def test_seeds_side_by_side_get_their_threads_and_the_launcher_its_workers(tmp_path):
    args = ablations.Args(threads=1, launcher_args="--workers 3", output_dir=str(tmp_path))
    command = ablations.launcher_command(args, ablations.arms_of("cpu", ()), tmp_path)
    assert command[command.index("--workers") + 1] == "3"
    chain = [command[i + 1] for i, word in enumerate(command) if word == "--command"]
    assert len(chain) == len(ablations.ARMS)
    for line in chain:
        words = shlex.split(line.split(" || ")[-1])
        options = quickstart.parse_args(quickstart.build_parser(), [w.replace("{seed}", "1") for w in words[2:]])
        assert options.threads == 1, line
    bad = subprocess.run([sys.executable, "-m", "benchmark.studies.ablations", "--dry-run", "--threads", "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --threads must be >= 1"


def test_a_rerun_skips_the_finished_quick_starts_and_runs_the_others(tmp_path):
    (tmp_path / "full" / "seed_1").mkdir(parents=True)
    (tmp_path / "full" / "seed_1" / "summary.json").write_text("{}")
    (line,) = ablations.arm_commands(ablations.Args(), "full", ablations.ARMS["full"], tmp_path)
    assert "python quickstart.py" in line
    probe = line.replace("python quickstart.py", "false")  # stands in for the run: fails if it is reached
    ran = {seed: subprocess.run(["bash", "-c", probe.replace("{seed}", str(seed))]).returncode for seed in (1, 2)}
    assert ran == {1: 0, 2: 1}


def test_the_estimate_counts_only_the_runs_left(tmp_path, capsys):
    (tmp_path / "full" / "seed_1").mkdir(parents=True)
    (tmp_path / "full" / "seed_1" / "summary.json").write_text("{}")
    args = ablations.Args(arms=("torch-adam", "no-reward-normalization"), num_seeds=2, output_dir=str(tmp_path))
    ablations.main(dataclasses.replace(args, dry_run=True))
    first = capsys.readouterr().out.splitlines()[0]  # left: full seed 2 (5 min), 2 x torch-adam (2.5), 2 x norm (5)
    assert first.startswith("6 quick starts (4 train their reward model), 1 already finished: ~20 min left"), first


def test_an_unfinished_run_is_not_counted_as_diverged_and_a_nan_is(tmp_path):
    for seed in (1, 2, 3):
        fake_run(tmp_path / "full" / f"seed_{seed}", 0.5, kl=10.0, approxkl=0.01)
        fake_run(tmp_path / "fixed-kl" / f"seed_{seed}", 0.4, kl=10.0, approxkl=0.01)
    (tmp_path / "fixed-kl" / "seed_3" / "summary.json").unlink()  # still running
    metrics = tmp_path / "fixed-kl" / "seed_2" / "policy" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"ppo/policy/clipfrac": 0.1', '"ppo/policy/clipfrac": NaN', 1))
    args = ablations.Args(arms=("fixed-kl",), num_seeds=3, output_dir=str(tmp_path))
    table = ablations.report(args, ablations.arms_of("cpu", args.arms), tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| fixed-kl |"))
    assert row.startswith("| fixed-kl | 2 |") and "| 1 of 3 |" in row, row


def test_a_paper_scale_run_counts_once_its_policy_is_saved(tmp_path):
    for name, gain in (("full", 0.5), ("torch-adam", 0.2)):
        run_dir = tmp_path / name / "seed_1"
        fake_run(run_dir, gain, kl=6.0, approxkl=0.01)
        (run_dir / "summary.json").unlink()  # the paper scale runs the scripts, not the quick start
        metrics = run_dir / "policy" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        rows[-1]["elapsed/time"] = 5400.0
        metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "full" / "seed_1" / "policy" / "policy").mkdir()
    (tmp_path / "full" / "seed_1" / "policy" / "policy" / "value_head.safetensors").write_bytes(b"x")
    args = ablations.Args(scale="paper", arms=("torch-adam",), num_seeds=1, output_dir=str(tmp_path))
    rows = {line.split(" | ")[0].strip("| "): line for line in ablations.report(args, ablations.arms_of("paper", args.arms), tmp_path).split("\n\n")[0].splitlines()[2:]}  # fmt: skip
    assert rows["full"].startswith("| full | 1 | +0.500 [") and rows["full"].endswith("| 0 of 1 | 90.0 |")
    assert rows["torch-adam"].startswith("| torch-adam | 0 |")  # still running: no gain yet
