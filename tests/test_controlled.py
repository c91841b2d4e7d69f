"""benchmark/studies/controlled.py, the controlled experiment: the commands it runs are the ones it means (parsed by the
quick start and by the training scripts), the dry run and estimate, and the report's numbers from runs laid out as
the quick start writes them."""

import dataclasses
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import quickstart
import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from benchmark.studies import controlled
from tests.conftest import REPO

SCRIPT = ["-m", "benchmark.studies.controlled"]  # run from the repository root
ARGS = controlled.Args(label_budgets=(96, 480, 1536))


def seed_1_flags(args, out: Path) -> list[tuple[object, list[str], list[str] | None]]:
    """Every quick start of seed 1's chain: its parsed options and the flags it gives each training script."""
    runs = []
    for line in controlled.commands(args, out):
        words = shlex.split(line.replace("{seed}", "1").split(" || ")[-1])
        assert words[:2] == ["python", "quickstart.py"], line
        parser = quickstart.build_parser()
        options = quickstart.parse_args(parser, words[2:])
        quickstart.check_flags(parser, options, Path(options.output_dir))  # the training scripts accept them
        run = Path(options.output_dir)
        reward_model = Path(options.reward_model or run / "reward" / "reward_model")
        policy = quickstart.policy_command(options, out / "base", out / "corpus.txt", reward_model, run / "policy")
        trains = options.reward_model is None and options.reward_function is None
        reward = quickstart.reward_command(options, out / "base", out / "q.jsonl", run / "reward") if trains else None
        runs.append((options, policy[2:], reward and reward[2:]))
    return runs


def test_each_run_trains_what_its_directory_says(tmp_path):
    out = tmp_path / "study"
    runs = seed_1_flags(ARGS, out)
    assert len(runs) == 4 * 3 + 3  # 3 budgets and direct RL at 3 KL coefficients; 3 initial-policy samplings
    trained, sampled = {}, {}
    for options, policy_flags, reward_flags in runs:
        policy = run_utils.task_cli(P.task_defaults, policy_flags)
        arm, setting = Path(options.output_dir).relative_to(out).parts[:2]
        assert options.mixed_precision == "bf16" and policy.mixed_precision == "bf16"
        if setting == "frontier":  # the initial policy sampled 32 times per held-out query, scored by one seed's RM
            assert options.updates == 1 and policy.eval_samples_per_query == 32
            seed_dir = f"seed_{options.seed}"
            assert Path(policy.rewards.trained_model) == out / arm / "kl_0.2" / seed_dir / "reward" / "reward_model"
            sampled[arm] = options.seed
            continue
        assert setting == f"kl_{policy.rewards.kl_coef:g}" and not policy.rewards.use_adaptive_kl
        assert policy.eval_every == 4 and policy.task.gold_labeler == "sentiment"
        if arm == "direct":
            assert policy.rewards.function == "sentiment" and policy.rewards.trained_model is None
            assert reward_flags is None
            continue
        budget = int(arm.removeprefix("labels_"))
        assert Path(policy.rewards.trained_model) == out / arm / "kl_0.2" / "seed_1" / "reward" / "reward_model"
        if reward_flags is not None:  # the budget's first KL coefficient trains the reward model
            reward = run_utils.task_cli(R.task_defaults, reward_flags)
            assert reward.labels.num_train == budget and reward.labels.source == "sentiment"
            trained[budget] = setting
    assert trained == {96: "kl_0.2", 480: "kl_0.2", 1536: "kl_0.2"}
    # one sampling per seed's chain, each run only in the chain of the seed whose reward model it uses
    assert sampled == {"labels_96": 1, "labels_480": 2, "labels_1536": 3}
    guards = [line.split(" || ")[0] for line in controlled.commands(ARGS, out) if "/frontier" in line]
    assert guards == ["test {seed} != 1", "test {seed} != 2", "test {seed} != 3"]
    assert all("--threads" not in line for line in controlled.commands(ARGS, out))  # the quick start's default


def test_seeds_side_by_side_get_their_threads_and_the_launcher_its_workers(tmp_path):
    out = tmp_path / "study"
    result = subprocess.run([sys.executable, *SCRIPT, "--dry-run", "--output-dir", str(out), "--threads", "1",
                             "--launcher-args=--workers 3"], capture_output=True, text=True, timeout=120,
                            cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr
    launcher = shlex.split(result.stdout.splitlines()[-1].removeprefix("launcher: "))
    assert launcher[launcher.index("--workers") + 1] == "3"
    chain = [launcher[i + 1] for i, word in enumerate(launcher) if word == "--command"]
    assert len(chain) == 15
    for line in chain:
        words = shlex.split(line.split(" || ")[-1])
        assert words[words.index("--threads") + 1] == "1", line
    for options, _, _ in seed_1_flags(dataclasses.replace(ARGS, threads=1), out):
        assert options.threads == 1
    bad = subprocess.run([sys.executable, *SCRIPT, "--dry-run", "--threads", "0"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --threads must be >= 1"


def test_the_paper_scale_commands_parse_and_use_simulated_labels(tmp_path):
    args = dataclasses.replace(ARGS, scale="paper", label_budgets=(1250, 5000, 20000))
    lines = controlled.commands(args, tmp_path)
    rewards = [shlex.split(line) for line in lines if "train_reward_accelerate.py" in line]
    policies = [shlex.split(line) for line in lines if "train_policy_accelerate.py" in line]
    assert len(rewards) == 3 and len(policies) == 15
    samplings = [words for words in policies if words[0] == "test"]  # one per budget, in that seed's chain only
    assert [words[:5] for words in samplings] == [["test", "{seed}", "!=", str(seed), "||"] for seed in (1, 2, 3)]
    for words, budget, seed in zip(samplings, (1250, 5000, 20000), (1, 2, 3), strict=True):
        parsed = run_utils.task_cli(P.task_defaults, words[words.index("train_policy_accelerate.py") + 1 :])
        assert parsed.eval_samples_per_query == 32 and parsed.seed == seed
        assert parsed.ppo.total_episodes == parsed.ppo.batch_size  # one update
        assert Path(parsed.rewards.trained_model) == tmp_path / f"labels_{budget}" / "kl_0.2" / f"seed_{seed}" / (
            "reward/reward_model"
        )
        assert Path(parsed.output_dir) == tmp_path / f"labels_{budget}" / "frontier" / "policy"
    for words in rewards:
        parsed = run_utils.task_cli(R.task_defaults, [w.replace("{seed}", "1") for w in words[2:]])
        assert parsed.labels.source == "sentiment" and parsed.labels.num_train in (1250, 5000, 20000)
    for words in (words for words in policies if words[0] != "test"):
        flags = [w.replace("{seed}", "1") for w in words[words.index("train_policy_accelerate.py") + 1 :]]
        parsed = run_utils.task_cli(P.task_defaults, flags)
        assert not parsed.rewards.use_adaptive_kl and parsed.task.gold_labeler == "sentiment"
        assert (parsed.rewards.function == "sentiment") == (parsed.rewards.trained_model is None)


def test_dry_run_prints_the_estimate_and_every_command_and_runs_nothing(tmp_path):
    out = tmp_path / "study"
    result = subprocess.run([sys.executable, *SCRIPT, "--dry-run", "--output-dir", str(out)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # 9 reward phases: 3 seeds x (25 s + budget x 0.2827 s); 36 policy runs of 150 s; 3 samplings of 30 + 2 x 64 x 32
    # x 0.11 s
    seconds = 3 * (3 * 25 + (96 + 480 + 1536) * (49 / 608 + 97 / 480)) + 36 * 150 + 3 * (30 + 2 * 64 * 32 * 0.11)
    assert lines[0].startswith(f"39 quick starts, 39 left: ~{seconds / 3600:.1f} h on 2 cores"), lines[0]
    assert sum("python quickstart.py" in line for line in lines[1:-1]) == 15 and lines[-1].startswith("launcher: ")
    assert lines[-1].count("--command") == 15 and not out.exists()
    bad = subprocess.run([sys.executable, *SCRIPT, "--dry-run", "--kl-coefs", "0"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "error: --label-budgets must be >= 8 labels each and --kl-coefs positive"
    ]


ALPHA, BETA = {"labels_96": 0.1, "labels_480": 0.3, "labels_1536": 0.4, "direct": 0.5}, 0.1


def fake_quick_start(directory: Path, arm: str, kl_coef: float, seed: int) -> None:
    """A finished quick start whose evaluations lie exactly on Gao's RL form: gold = 0.2 + d (alpha - beta log d)."""
    (directory / "policy").mkdir(parents=True)
    rows = []
    for update in range(0, 17, 4):
        kl = update / 16 * 4 / (kl_coef * 20) * (1 + 0.1 * seed)  # a smaller coefficient drifts further
        d = math.sqrt(kl)
        gold = 0.2 + (d * (ALPHA[arm] - BETA * math.log(d)) if d > 0 else 0.0)
        rows.append({"update": update, "episode": 16 * update, "eval/kl": kl, "eval/gold_score": gold,
                     "eval/rm_score": 0.0})  # fmt: skip
    (directory / "policy" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = {"reward_model": {"test_accuracy": 0.3 + 0.001 * seed, "labeler_ceiling": 0.7 + 0.1 * seed}}
    summary = summary if arm != "direct" else {}
    (directory / "summary.json").write_text(json.dumps(summary))


def fake_frontier(directory: Path) -> None:
    (directory / "policy").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = [dict(update=0, query_index=q, gold_score=float(g), rm_score=float(g + rng.normal()))
            for q in range(8) for g in rng.normal(size=16)]  # fmt: skip
    (directory / "policy" / "eval_samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "summary.json").write_text("{}")


def fake_study(out: Path) -> None:
    """Every arm, coefficient and seed finished; only labels_480's initial policy sampled."""
    for arm in controlled.arms(ARGS):
        for kl_coef in ARGS.kl_coefs:
            for seed in (1, 2, 3):
                fake_quick_start(controlled.run_dir(out, arm, kl_coef, seed), arm, kl_coef, seed)
    fake_frontier(controlled.frontier_dir(out, "labels_480"))


def test_report_fits_each_arm_and_tabulates_the_final_gains(tmp_path):
    fake_study(tmp_path)
    table = controlled.report(ARGS, tmp_path)
    rows = table.splitlines()
    for arm, alpha in ALPHA.items():  # every point on the form: alpha and beta back, the upper half predicted exactly
        (fit,) = [row for row in rows if row.startswith(f"| {arm} | 9 | RL: ")]  # 9 runs of 5 evaluations each
        assert "| 39 / 6 |" in fit, fit
        assert f"| {alpha:.3f} | {BETA:.3f} |" in fit and fit.endswith("| 0.000 | 0.000 | 0.000 |"), fit
    # direct RL at KL coefficient 0.05: final KL 4 / (0.05 x 20) x (1.1, 1.2, 1.3) = 4.4, 4.8, 5.2, mean 4.8
    (final,) = [row for row in rows if row.startswith("| direct | 0.05 | 3 | — | 4.80 |")]
    gains = [math.sqrt(k) * (0.5 - 0.1 * math.log(math.sqrt(k))) for k in (4.4, 4.8, 5.2)]
    mean, low, high = controlled.mean_ci(gains)
    assert final.endswith(f"| {mean:+.3f} [{low:+.3f}, {high:+.3f}] |"), final
    assert any(row.startswith("| labels_96 | 0.2 | 3 | 0.302 (ceiling 0.900) |") for row in rows)
    assert any(row.startswith("| labels_480 | 1 | best-of-n by gold: d (α − β d) |") for row in rows)
    assert (tmp_path / "controlled.md").read_text() == table and (tmp_path / "controlled.png").stat().st_size > 1000


def test_report_puts_ppo_next_to_the_sampled_optimum_at_matched_kls(tmp_path):
    fake_study(tmp_path)
    rows = [row.split(" | ") for row in controlled.report(ARGS, tmp_path).splitlines() if row.startswith("| direct | ")]
    rows = {float(row[1]): row for row in rows if len(row) == 8}
    # final KLs: 4 / (20 c) x (1.1, 1.2, 1.3) -> c = 0.2: 1.1-1.3, c = 0.05: 4.4-5.2, c = 0.0125: 17.6-20.8
    assert {kl: int(row[2]) for kl, row in rows.items()} == {0.25: 9, 0.5: 9, 1.0: 9, 2.0: 6, 4.0: 6, 8.0: 3}

    def gold(kl):  # the fake runs' gain, on Gao's RL form
        return math.sqrt(kl) * (0.5 - 0.1 * math.log(math.sqrt(kl)))

    gains = []  # KL 8 is reached between the c = 0.0125 runs' evaluations at a quarter and half of their final KL
    for seed in (1, 2, 3):
        final = 16 * (1 + 0.1 * seed)
        a, b = final / 4, final / 2
        gains.append(gold(a) + (gold(b) - gold(a)) * (8 - a) / (b - a))
    mean, low, high = controlled.mean_ci(gains)
    assert rows[8.0][3] == f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]", rows[8.0]
    # the optimum by gold from the 16 samples per query: found here by bisection on beta for KL(pi* || rho) = 1
    samples = controlled.read_samples(str(controlled.frontier_dir(tmp_path, "labels_480") / "policy" /
                                          "eval_samples.jsonl"), 0)  # fmt: skip
    scores = np.stack([s["gold_score"] for s in samples.values()])
    low_beta, high_beta = 1e-3, 1e3
    for _ in range(100):
        beta = math.sqrt(low_beta * high_beta)
        low_beta, high_beta = (beta, high_beta) if controlled.optimum(scores, beta)["kl"] > 1 else (low_beta, beta)
    at_1 = controlled.optimum(scores, beta)["score"] - scores.mean()
    optimum_text, ess = rows[1.0][6].split(" (")
    assert abs(float(optimum_text) - at_1) < 0.02 and 1 < float(ess.rstrip(")")) < 16, rows[1.0]
    assert rows[1.0][4] == optimum_text  # direct RL's own reward is gold
    ratio = float(rows[1.0][3].split()[0]) / float(optimum_text)
    assert float(rows[1.0][7].rstrip(" |")) == pytest.approx(ratio, abs=0.01)
    assert rows[8.0][6] == "—"  # beyond what 16 samples per query can reach (log 16 = 2.77 nats)
    budgets = [row.split(" | ") for row in (tmp_path / "controlled.md").read_text().splitlines()
               if row.startswith(("| labels_96 | 1 |", "| labels_480 | 1 |"))]  # fmt: skip
    assert [row[4] == "—" for row in budgets if len(row) == 8] == [True, False]  # only labels_480 was sampled
