"""The paper's controlled experiment (Ziegler et al. 2019, section 3.1.1): a known reward, the VADER sentiment
labeler, stands in for the humans. Per seed: reward models from several label budgets, PPO against each of them and
directly against the known reward (direct RL), each at several fixed KL coefficients, every run evaluated on
held-out queries along training (gold score, reward-model score, KL); and per label budget one run that only samples
the initial policy many times per query, for the optimum of the KL-regularized objective and best-of-n
(benchmark/studies/kl_frontier.py). The report: learning curves (the paper's Figure 2), gold against KL for the optimum,
best-of-n and the PPO runs with Gao et al. (2022)'s fitted forms (Figure 3), their tables, and PPO next to the sampled
optimum at matched KLs.

    python -m benchmark.studies.controlled --dry-run        # every command and the time estimate, nothing runs
    python -m benchmark.studies.controlled                  # run here (resumable: finished runs are skipped)
    python -m benchmark.studies.controlled --threads 1 --launcher-args="--workers 3"   # 3 seeds side by side, 1 thread
    python -m benchmark.studies.controlled --report-only    # controlled.md and controlled.png of the finished runs
    python -m benchmark.studies.controlled --scale paper --dry-run   # gpt2 at OpenAI's sizes, for GPU nodes

`--scale cpu` runs `quickstart.py` (SmolLM2-135M, the simulated labeler, gold = VADER). The runs of one seed form
one chain of benchmark/launch/launcher.py (locally, or one Slurm array task per seed with --launcher-args "--slurm
..."): the first KL coefficient's run of a budget trains that budget's reward model, the others reuse it; budget k's
initial-policy sampling ends seed k's chain, so the chains are about as long when they run side by side.
"""

import dataclasses
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

from benchmark.studies.ablations import gain_at_kl, mean_ci, study_dir
from benchmark.studies.kl_frontier import best_of_n, fit_gao, optimum, read_samples

REPO = Path(__file__).resolve().parents[2]
DIRECT = "direct"
"""the direct-RL arm's name: PPO against the known reward itself"""
# seconds on 2 cores with bf16 units, from the quick start's measured phases (docs/quickstart.md#times): label
# sampling ~49 s per 608 label queries, training 97 s per 480 labels, ~25 s of start-up, normalization and test;
# a policy run ~150 s with its 5 evaluations; a sampling run ~110 s per 1,000 samples of each of its 2 evaluations.
# On a 2-vCPU AMD EPYC with avx512_bf16 a policy run took 207-217 s (1.4x), and 3 of them side by side at 1 thread
# each 544 s, 1.17x the throughput of one at a time at 2 threads (docs/controlled.md)
CPU_SECONDS = dict(reward_fixed=25.0, reward_per_label=49 / 608 + 97 / 480, policy=150.0, per_sample=0.11)
# as benchmark/studies/ablations.py: estimates, not measured (an initial-policy sampling: one update, 64 x 32 samples)
PAPER_GPU_HOURS = {"reward": 8 * 10 / 60, "policy": 8 * 1.5, "sampling": 8 * 5 / 60}
MATCHED_KLS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""the KLs (nats) at which the PPO runs are compared with the sampled optimum and best-of-n"""


@dataclass
class Args:
    scale: Literal["cpu", "paper"] = "cpu"
    """cpu: the quick start's setting on a CPU; paper: gpt2 at OpenAI's sizes, for GPU nodes"""
    label_budgets: tuple[int, ...] = ()
    """best-of-4 labels per reward model, from barely above chance to near the labeler's ceiling (default: cpu 96 480
    1536, the quick start's 480 in the middle; paper 1250 5000 20000, OpenAI's 5,000 sentiment labels in the middle)"""
    kl_coefs: tuple[float, ...] = (0.2, 0.05, 0.0125)
    """fixed KL coefficients (no adaptive controller), each run's curve then reaches its own KL"""
    num_seeds: int = 3
    """seeds 1..N: one reward model per budget and seed, every policy run at every seed"""
    eval_every: int = 4
    """held-out evaluation every this many updates: the points of each run's curve of gold against KL"""
    frontier_samples: int = 32
    """responses per held-out query in the runs that sample the initial policy (optimum and best-of-n)"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """fixed, not `auto`: a study resumed on another CPU keeps its numerics"""
    output_dir: Optional[str] = None
    """where the runs go (default runs/controlled/SCALE)"""
    threads: Optional[int] = None
    """CPU threads per quick start (default: the quick start's, every core). On 2 cores `--threads 1 --launcher-args=
    "--workers 3"` runs the 3 seeds' chains side by side (see docs/controlled.md for the measured gain)"""
    launcher_args: str = ""
    """extra flags of benchmark/launch/launcher.py, e.g. "--slurm --slurm-gpus-per-task 8 --slurm-partition gpu" """
    dry_run: bool = False
    """print every command, the launcher call and the estimate; run nothing"""
    report_only: bool = False
    """only write the report (controlled.md, controlled.png) of the runs in --output-dir"""


def arms(args: Args) -> list[str]:
    """One reward-model arm per label budget, then direct RL."""
    return [f"labels_{budget}" for budget in args.label_budgets] + [DIRECT]


def run_dir(out: Path, arm: str, kl_coef: float, seed="{seed}") -> Path:
    return out / arm / f"kl_{kl_coef:g}" / f"seed_{seed}"


def frontier_dir(out: Path, arm: str) -> Path:
    return out / arm / "frontier"


def commands(args: Args, out: Path) -> list[str]:
    """One seed's chain (`{seed}` is the seed, as the launcher substitutes it); a finished run is skipped."""
    if args.scale == "paper":
        return paper_commands(args, out)
    lines, threads = [], [] if args.threads is None else ["--threads", str(args.threads)]
    for arm in arms(args):
        for index, kl_coef in enumerate(args.kl_coefs):
            directory = run_dir(out, arm, kl_coef)
            command = ["python", "quickstart.py", "--seed", "{seed}", "--output-dir", str(directory),
                       "--mixed-precision", args.mixed_precision, "--kl-coef", f"{kl_coef:g}",
                       "--eval-every", str(args.eval_every), "--policy-args=--rewards.no-use-adaptive-kl",
                       *threads]  # fmt: skip
            if arm == DIRECT:
                command += ["--reward-function", "sentiment"]
            else:
                command += ["--labels", arm.removeprefix("labels_")]
                if index > 0:  # the budget's reward model, trained by its first run
                    first = run_dir(out, arm, args.kl_coefs[0])
                    command += ["--reward-model", str(first / "reward" / "reward_model")]
            lines.append(f"test -e {shlex.quote(str(directory / 'summary.json'))} || {shlex.join(command)}")
    for index, arm in enumerate(arms(args)[:-1]):  # budget k's samplings end seed k's chain (the chains stay even)
        directory, seed = frontier_dir(out, arm), index % args.num_seeds + 1  # scored by that seed's reward model
        command = ["python", "quickstart.py", "--seed", str(seed), "--output-dir", str(directory), "--mixed-precision",
                   args.mixed_precision, "--updates", "1", "--eval-every", "0", "--eval-samples-per-query",
                   str(args.frontier_samples), "--reward-model",
                   str(run_dir(out, arm, args.kl_coefs[0], seed) / "reward" / "reward_model"), *threads]  # fmt: skip
        lines.append(f"test {{seed}} != {seed} || test -e {shlex.quote(str(directory / 'summary.json'))} || "
                     f"{shlex.join(command)}")  # fmt: skip
    return lines


def paper_commands(args: Args, out: Path) -> list[str]:
    """gpt2 at OpenAI's sizes (their defaults), simulated sentiment labels, 8 processes per policy run."""
    lines = []
    for arm in arms(args):
        reward = run_dir(out, arm, args.kl_coefs[0]) / "reward"
        if arm != DIRECT:
            lines.append(shlex.join(["python", "train_reward_accelerate.py", "--seed", "{seed}", "--output-dir",
                                     str(reward), "--labels.source", "sentiment", "--labels.num-train",
                                     arm.removeprefix("labels_")]))  # fmt: skip
        for kl_coef in args.kl_coefs:
            rewards = ["--rewards.function", "sentiment"] if arm == DIRECT else [
                "--rewards.trained-model", str(reward / "reward_model")]  # fmt: skip
            lines.append(shlex.join(["accelerate", "launch", "--num_processes", "8", "train_policy_accelerate.py",
                                     "--seed", "{seed}", "--output-dir", str(run_dir(out, arm, kl_coef) / "policy"),
                                     *rewards, "--task.gold-labeler", "sentiment", "--rewards.kl-coef",
                                     f"{kl_coef:g}", "--rewards.no-use-adaptive-kl"]))  # fmt: skip
    for index, arm in enumerate(arms(args)[:-1]):  # as at cpu scale: one update, its update-0 evaluation the samples
        seed = index % args.num_seeds + 1
        reward = run_dir(out, arm, args.kl_coefs[0], seed) / "reward" / "reward_model"
        command = ["accelerate", "launch", "--num_processes", "8", "train_policy_accelerate.py", "--seed", str(seed),
                   "--output-dir", str(frontier_dir(out, arm) / "policy"), "--rewards.trained-model", str(reward),
                   "--task.gold-labeler", "sentiment", "--eval-samples-per-query", str(args.frontier_samples),
                   "--ppo.total-episodes", "512"]  # fmt: skip
        lines.append(f"test {{seed}} != {seed} || {shlex.join(command)}")
    return lines


def estimate(args: Args, out: Path) -> str:
    """What is left, in hours: finished runs (their summary.json) are not counted."""
    seeds = range(1, args.num_seeds + 1)
    if args.scale == "paper":
        rewards = len(args.label_budgets) * args.num_seeds
        policies = len(arms(args)) * len(args.kl_coefs) * args.num_seeds
        samplings = len(args.label_budgets)
        hours = (rewards * PAPER_GPU_HOURS["reward"] + policies * PAPER_GPU_HOURS["policy"]
                 + samplings * PAPER_GPU_HOURS["sampling"])  # fmt: skip
        return (f"{policies} policy runs, {rewards} reward models, {samplings} initial-policy samplings: ~{hours:.0f} "
                "GPU-hours (an estimate, not measured)")  # fmt: skip
    seconds, left = 0.0, 0
    for arm in arms(args):
        for index, kl_coef in enumerate(args.kl_coefs):
            for seed in seeds:
                if (run_dir(out, arm, kl_coef, seed) / "summary.json").exists():
                    continue
                left += 1
                seconds += CPU_SECONDS["policy"]
                if arm != DIRECT and index == 0:
                    seconds += CPU_SECONDS["reward_fixed"] + int(arm.removeprefix("labels_")) * CPU_SECONDS[
                        "reward_per_label"]  # fmt: skip
        if arm != DIRECT and not (frontier_dir(out, arm) / "summary.json").exists():
            left += 1
            seconds += 30 + 2 * 64 * args.frontier_samples * CPU_SECONDS["per_sample"]
    total = len(arms(args)) * len(args.kl_coefs) * args.num_seeds + len(args.label_budgets)
    return (f"{total} quick starts, {left} left: ~{seconds / 3600:.1f} h on 2 cores with bf16 units, one at a time, "
            "about twice that in fp32 (an estimate from the quick start's measured phases, docs/quickstart.md#times; "
            "measured on an AMD EPYC: 1.4x that, and 3 seeds side by side at 1 thread 1.17x faster)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# the report
def read_curve(directory: Path) -> Optional[dict]:
    """A finished quick start's held-out evaluations: episodes, KL, gold and reward-model score; its reward model's
    held-out accuracy and the labeler's own (the ceiling) when it trained one. None if it has not finished."""
    if not (directory / "summary.json").exists():
        return None
    summary = json.loads((directory / "summary.json").read_text())
    rows = [json.loads(line) for line in (directory / "policy" / "metrics.jsonl").read_text().splitlines() if line]
    evals = [row for row in rows if "eval/gold_score" in row]
    return dict(episode=[row["episode"] for row in evals], kl=[row["eval/kl"] for row in evals],
                gold=[row["eval/gold_score"] for row in evals], rm=[row["eval/rm_score"] for row in evals],
                accuracy=summary.get("reward_model", {}).get("test_accuracy"),
                ceiling=summary.get("reward_model", {}).get("labeler_ceiling"))  # fmt: skip


def frontier_of(directory: Path, betas) -> Optional[dict]:
    """The optimum (by gold, and by this budget's reward model with its gold) and best-of-n from the run's update-0
    samples, as gold gains over the initial policy's mean."""
    samples = directory / "policy" / "eval_samples.jsonl"
    if not (directory / "summary.json").exists():
        return None
    by_query = read_samples(str(samples), 0)
    gold = np.stack([scores["gold_score"] for scores in by_query.values()])
    rm = np.stack([scores["rm_score"] for scores in by_query.values()])
    base, ns = gold.mean(), [2**k for k in range(int(math.log2(gold.shape[1])) + 1)]
    return dict(
        optimum_gold=[(o["kl"], o["score"] - base, o["ess"]) for o in (optimum(gold, beta) for beta in betas)],
        optimum_rm=[(o["kl"], optimum(rm, o["beta"], gold)["score"] - base) for o in (optimum(rm, b) for b in betas)],
        best_of_n_gold=[(math.log(n) - (n - 1) / n, best_of_n(gold, gold, n) - base) for n in ns],
        best_of_n_rm=[(math.log(n) - (n - 1) / n, best_of_n(rm, gold, n) - base) for n in ns],
    )


def report(args: Args, out: Path) -> str:
    seeds = range(1, args.num_seeds + 1)
    curves = {arm: {kl_coef: {seed: read_curve(run_dir(out, arm, kl_coef, seed)) for seed in seeds}
                    for kl_coef in args.kl_coefs} for arm in arms(args)}  # fmt: skip
    betas = [2.0 ** (k / 2) for k in range(4, -13, -1)]  # 4 .. 1/64
    frontiers = {arm: frontier_of(frontier_dir(out, arm), betas) for arm in arms(args)[:-1]}
    lines = ["| arm | KL coefficient | seeds | reward model accuracy, held out (chance 0.25) | final KL | "
             "final gold gain [95% CI] |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    fitted: dict[str, Optional[dict]] = {}
    fits = ["| arm | runs | form | alpha | beta | points fitted / predicted | fit RMSE | prediction RMSE | "
            "largest prediction error |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, by_coef in curves.items():
        points = []
        for kl_coef, by_seed in by_coef.items():
            done = [curve for curve in by_seed.values() if curve is not None]
            gains = [curve["gold"][-1] - curve["gold"][0] for curve in done]
            mean, low, high = mean_ci(gains)
            accuracy = [curve["accuracy"] for curve in done if curve["accuracy"] is not None]
            ceiling = [curve["ceiling"] for curve in done if curve.get("ceiling") is not None]
            accuracy_text = f"{sum(accuracy) / len(accuracy):.3f}" if accuracy else "—"
            accuracy_text += f" (ceiling {sum(ceiling) / len(ceiling):.3f})" if ceiling else ""
            final_kl = sum(curve["kl"][-1] for curve in done) / len(done) if done else math.nan
            lines.append(f"| {arm} | {kl_coef:g} | {len(done)} | {accuracy_text} | {final_kl:.2f} | "
                         f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] |")  # fmt: skip
            points += [
                (kl, gold - curve["gold"][0])
                for curve in done
                for kl, gold in zip(curve["kl"], curve["gold"], strict=True)
            ]
        fitted[arm] = fit_gao([kl for kl, _ in points], [gain for _, gain in points], "rl") if points else None
        runs = sum(curve is not None for by_seed in by_coef.values() for curve in by_seed.values())
        fits.append(fit_row(arm, runs, "RL: d (α − β log d)", fitted[arm]))
    for arm, frontier in frontiers.items():
        if frontier is not None:
            for key, name in (("best_of_n_gold", "best-of-n by gold"), ("best_of_n_rm", "best-of-n by this RM")):
                kls, gains = zip(*frontier[key], strict=True)
                fits.append(fit_row(arm, 1, f"{name}: d (α − β d)", fit_gao(kls, gains, "bon")))
    table = ("Final held-out gold gain per arm and KL coefficient (mean over seeds, 95% Student-t interval):\n\n"
             + "\n".join(lines) + "\n\nGao et al.'s forms, d = √KL, fitted to each arm's evaluations with KL ≤ half "
             "the largest, predicting the rest:\n\n" + "\n".join(fits) + "\n")  # fmt: skip
    table += "\n" + against_optimum(curves, frontiers)
    (out / "controlled.md").write_text(table)
    plot(args, curves, frontiers, fitted, out / "controlled.png")
    return table


def along(points, kl: float) -> Optional[float]:
    """A sampled curve's value at `kl` (its (KL, value, ...) points, linear between them); None outside its range."""
    points = sorted(points)
    kls, values = [p[0] for p in points], [p[1] for p in points]
    return float(np.interp(kl, kls, values)) if kls and kls[0] <= kl <= kls[-1] else None


def against_optimum(curves: dict, frontiers: dict) -> str:
    """PPO at matched KLs next to what sampling the initial policy reaches there: each run's gold gain when its
    held-out KL first reached the KL (benchmark/studies/ablations.py's gain_at_kl), over every KL coefficient and seed
    of the arm; the optimum of the arm's own reward (gold for direct RL, else the budget's reward model, scored by
    gold), best-of-n by that reward, and the optimum by gold with its effective sample size (mean over the
    samplings)."""
    gold = [f for f in frontiers.values() if f is not None]
    lines = ["PPO against the sampled optimum at matched KL (gold gain over the initial policy; optimum and best-of-n "
             "from the initial policy's samples, `—` outside their sampled range):", "",
             "| arm | KL | runs | PPO [95% CI] | optimum of this arm's reward | best-of-n by it | optimum by gold "
             "(ESS) | PPO / gold optimum |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def text(value: Optional[float]) -> str:
        return "—" if value is None else f"{value:+.3f}"

    for arm, by_coef in curves.items():
        traces = [list(zip(curve["kl"], curve["gold"], strict=True)) for by_seed in by_coef.values()
                  for curve in by_seed.values() if curve is not None]  # fmt: skip
        own = [frontiers.get(arm)] if arm != DIRECT else gold
        for kl in MATCHED_KLS:
            gains = [gain for gain in (gain_at_kl(trace, kl) for trace in traces) if gain is not None]
            if not gains:
                continue
            mean, low, high = mean_ci(gains)
            key = "optimum_gold" if arm == DIRECT else "optimum_rm"
            own_opt = [v for v in (along(f[key], kl) for f in own if f is not None) if v is not None]
            own_bon = [v for v in (along(f["best_of_n_gold" if arm == DIRECT else "best_of_n_rm"], kl)
                                   for f in own if f is not None) if v is not None]  # fmt: skip
            opt = [v for v in (along(f["optimum_gold"], kl) for f in gold) if v is not None]
            ess = [v for v in (along([(k, e) for k, _, e in f["optimum_gold"]], kl) for f in gold) if v is not None]
            best = sum(opt) / len(opt) if opt else None
            lines.append(f"| {arm} | {kl:g} | {len(gains)} | {mean:+.3f} [{low:+.3f}, {high:+.3f}] | "
                         f"{text(sum(own_opt) / len(own_opt) if own_opt else None)} | "
                         f"{text(sum(own_bon) / len(own_bon) if own_bon else None)} | {text(best)}"
                         f"{f' ({sum(ess) / len(ess):.1f})' if ess else ''} | "
                         f"{f'{mean / best:.2f}' if best else '—'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def fit_row(arm: str, runs: int, form: str, fit: Optional[dict]) -> str:
    if fit is None:
        return f"| {arm} | {runs} | {form} | — | — | too few points | — | — | — |"
    return (f"| {arm} | {runs} | {form} | {fit['alpha']:.3f} | {fit['beta']:.3f} | {fit['fitted_points']} / "
            f"{fit['predicted_points']} | {fit['fit_rmse']:.3f} | {fit['prediction_rmse']:.3f} | "
            f"{fit['prediction_max_error']:.3f} |")  # fmt: skip


def plot(args: Args, curves: dict, frontiers: dict, fitted: dict, path: Path) -> None:
    """Left: gold against episodes at the middle KL coefficient, per arm, seed mean and min-max band (Figure 2).
    Right: gold gain against KL, the PPO runs' evaluations per arm with Gao's RL form fitted to them, the sampled
    optimum and best-of-n (Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    middle = args.kl_coefs[len(args.kl_coefs) // 2]
    first_fit = next((arm for arm, fit in fitted.items() if fit is not None), None)
    for color, (arm, by_coef) in enumerate(curves.items()):
        done = [curve for curve in by_coef[middle].values() if curve is not None]
        if done:
            length = min(len(curve["gold"]) for curve in done)
            ys = np.array([curve["gold"][:length] for curve in done])
            x = done[0]["episode"][:length]
            left.fill_between(x, ys.min(0), ys.max(0), color=f"C{color}", alpha=0.25, lw=0)
            left.plot(x, ys.mean(0), color=f"C{color}", label=arm)
        points = [(kl, gold - curve["gold"][0]) for by_seed in by_coef.values() for curve in by_seed.values()
                  if curve is not None for kl, gold in zip(curve["kl"], curve["gold"], strict=True)]  # fmt: skip
        if points:
            right.scatter(*zip(*points, strict=True), s=10, color=f"C{color}", label=f"PPO, {arm}")
        if fitted.get(arm) is not None:  # the fitted form over the whole range, the upper half its prediction
            d = np.sqrt(np.linspace(1e-3, max(kl for kl, _ in points), 100))
            fit = fitted[arm]
            right.plot(d * d, d * (fit["alpha"] - fit["beta"] * np.log(d)), ":", color=f"C{color}",
                       label="Gao's RL form, fitted to the lower half" if arm == first_fit else None)  # fmt: skip
    sampled = [arm for arm, frontier in frontiers.items() if frontier is not None]
    for arm, frontier in frontiers.items():
        if frontier is not None:
            right.plot(*zip(*[(kl, gain) for kl, gain, _ in frontier["optimum_gold"]], strict=True), "k-",
                       label="optimum by gold (sampled)" if arm == sampled[0] else None)  # fmt: skip
            right.plot(*zip(*frontier["best_of_n_rm"], strict=True), "--", color=f"C{list(curves).index(arm)}",
                       label=f"best-of-n by {arm}'s RM")  # fmt: skip
    left.set(title=f"held-out gold score (KL coefficient {middle:g})", xlabel="episodes", ylabel="gold score")
    right.set(title="gold gain against KL", xlabel="KL(policy || initial), nats", ylabel="gold gain")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper left" if axis is left else "lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(args: Args) -> None:
    if not args.label_budgets:
        args = dataclasses.replace(args, label_budgets=(96, 480, 1536) if args.scale == "cpu" else (1250, 5000, 20000))
    if not args.label_budgets or min(args.label_budgets) < 8 or not args.kl_coefs or min(args.kl_coefs) <= 0:
        raise SystemExit("error: --label-budgets must be >= 8 labels each and --kl-coefs positive")
    out = study_dir(args, "controlled")
    if args.report_only:
        print(report(args, out))
        return
    chain = commands(args, out)
    launcher = [sys.executable, "-m", "benchmark.launch.launcher", "--num-seeds", str(args.num_seeds),
                "--job-name", f"controlled-{args.scale}", "--log-dir", str(out / "logs")]  # fmt: skip
    for line in chain:
        launcher += ["--command", line]
    launcher += shlex.split(args.launcher_args)
    print(estimate(args, out))
    for line in chain:
        print(line)
    if args.dry_run:
        print("launcher: " + shlex.join(launcher))
        return
    result = subprocess.run(launcher, cwd=REPO)
    if args.scale == "cpu":
        print(report(args, out))
    raise SystemExit(result.returncode)


if __name__ == "__main__":
    main(tyro.cli(Args))
