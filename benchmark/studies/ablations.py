"""Which implementation details matter: the full recipe and each detail switched off (one flag per arm, see
docs/details.md), over several seeds, then one report: a table (gold and reward-model score gains with 95% CIs over
seeds, paired with the full recipe by seed, final KL, approxkl, clip fraction, divergence), the gold gains at
matched KLs, and one picture.

    python -m benchmark.studies.ablations --scale cpu --dry-run                # every arm's commands, nothing runs
    python -m benchmark.studies.ablations --scale cpu --num-seeds 3            # run them here, one seed after another
    python -m benchmark.studies.ablations --threads 1 --launcher-args="--workers 3"   # 3 seeds at once, 1 thread each
    python -m benchmark.studies.ablations --scale cpu --report-only            # the table and picture of finished runs
    python -m benchmark.studies.ablations --scale paper --num-seeds 3 --launcher-args "--slurm --slurm-gpus-per-task 8"

`--scale cpu` is the quick start (SmolLM2-135M, simulated labels, gold = VADER): `quickstart.py` per arm and seed,
the reward model trained once per seed by the full recipe and reused by every arm that leaves the reward pipeline
alone. `--scale paper` is OpenAI's setting (gpt2, its labels, books), with VADER as the gold judge, for GPU nodes.
Runs go through benchmark/launch/launcher.py (locally, or as a Slurm array with --launcher-args "--slurm ...").
At cpu scale the same command continues a study, or adds arms to it: a quick start that finished (its summary.json
is there) is skipped, an unfinished one continues where it stopped (quickstart.py's own rule).
"""

import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import tyro

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Arm:
    policy_flags: tuple[str, ...] = ()
    """flags of train_policy_accelerate.py that switch the detail off"""
    reward_flags: tuple[str, ...] = ()
    """flags of train_reward_accelerate.py (an arm with any trains its own reward model)"""
    changes: tuple[tuple[str, object], ...] = ()
    """(field, value) of the scripts' Args that the flags change, and nothing else (checked by a test)"""


ARMS = {
    "full": Arm(),
    "torch-adam": Arm(("--no-use-tensorflow-adam",), changes=(("use_tensorflow_adam", False),)),
    "fixed-kl": Arm(("--rewards.no-use-adaptive-kl",), changes=(("rewards.use_adaptive_kl", False),)),
    "last-token-kl": Arm(("--rewards.no-per-token-kl",), changes=(("rewards.per_token_kl", False),)),
    "no-reward-whitening": Arm(("--ppo.no-whiten-rewards",), changes=(("ppo.whiten_rewards", False),)),
    "no-advantage-whitening": Arm(("--ppo.no-whiten-advantages",), changes=(("ppo.whiten_advantages", False),)),
    "no-value-clipping": Arm(("--ppo.no-clip-value",), changes=(("ppo.clip_value", False),)),
    "raw-logit-logprobs": Arm(("--task.no-scale-logprobs",), changes=(("task.scale_logprobs", False),)),
    "random-value-head": Arm(("--no-zero-value-head",), changes=(("zero_value_head", False),)),
    "no-rejection-sampling": Arm(("--task.no-rejection-sampling",), changes=(("task.rejection_sampling", False),)),
    "no-reward-normalization": Arm(
        reward_flags=("--no-normalize-before", "--no-normalize-after"),
        changes=(("normalize_before", False), ("normalize_after", False)),
    ),
}
PAPER_ONLY = {"whole-batch-whitening": Arm(("--ppo.whitening-ranks", "1"), changes=(("ppo.whitening_ranks", 1),))}
"""The quick start already whitens over its whole 16-episode batch; at OpenAI's 512 this is a real arm."""
ALL_ARMS = {**ARMS, **PAPER_ONLY}
T_95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]  # Student t, 97.5%, df 1..10
PAPER_GPU_HOURS = {"reward": 8 * 10 / 60, "policy": 8 * 1.5}  # estimates (README: ~10 min, ~1-2 h on 8 GPUs)
MATCHED_KLS = (1.0, 2.0, 4.0, 8.0)
"""nats at which the gold gains are compared (those below the largest KL every run reached, then that one)"""


@dataclass
class Args:
    scale: Literal["cpu", "paper"] = "cpu"
    """cpu: the quick start's setting on a CPU; paper: OpenAI's, for GPU nodes"""
    arms: tuple[str, ...] = ()
    """arms to run or report (default: all of the scale); the full recipe always runs first"""
    num_seeds: int = 3
    """seeds 1..N, shared by every arm (each arm is paired with the full recipe by seed)"""
    output_dir: Optional[str] = None
    """where the runs go (default runs/ablations/SCALE)"""
    updates: Optional[int] = None
    """cpu scale: PPO updates per run instead of the quick start's 16 (to shrink the study)"""
    eval_every: Optional[int] = None
    """cpu scale: quickstart.py --eval-every instead of its 8 (the evaluations before and after always run)"""
    smoke: bool = False
    """cpu scale: every run at quickstart.py --smoke sizes (the machinery in a few minutes, no result)"""
    threads: Optional[int] = None
    """cpu scale: CPU threads per quick start (default: the quick start's, every core). On 2 cores `--threads 1
    --launcher-args="--workers 3"` runs the 3 seeds' chains side by side (docs/controlled.md: 1.17x the throughput)"""
    launcher_args: str = ""
    """extra flags of benchmark/launch/launcher.py, e.g. "--slurm --slurm-gpus-per-task 8 --slurm-partition gpu" """
    processes: int = 8
    """paper scale: processes (GPUs) per policy run (accelerate launch --num_processes)"""
    dry_run: bool = False
    """print every arm's exact commands and the launcher call, run nothing"""
    report_only: bool = False
    """only write the report (ablations.md, ablations.png) of the runs in --output-dir"""


def arms_of(scale: str, names: tuple[str, ...]) -> dict[str, Arm]:
    known = {**ARMS, **(PAPER_ONLY if scale == "paper" else {})}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"error: --arms {' '.join(unknown)}: not an arm of --scale {scale} ({', '.join(known)})")
    return {"full": known["full"], **{name: known[name] for name in names or known if name != "full"}}


def arm_commands(args: Args, name: str, arm: Arm, out: Path) -> list[str]:
    """The shell commands of one arm for one seed (`{seed}` is the seed, as the launcher substitutes it)."""
    run_dir = out / name / "seed_{seed}"
    own_reward = name == "full" or arm.reward_flags
    if args.scale == "cpu":
        command = ["python", "quickstart.py", "--seed", "{seed}", "--output-dir", str(run_dir)]
        if args.smoke:
            command.append("--smoke")
        if args.updates is not None:
            command += ["--updates", str(args.updates)]
        if args.eval_every is not None:
            command += ["--eval-every", str(args.eval_every)]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        if not own_reward:
            command += ["--reward-model", str(out / "full" / "seed_{seed}" / "reward" / "reward_model")]
        if arm.reward_flags:  # `--flag=value`: the value starts with "--"
            command.append(f"--reward-args={shlex.join(arm.reward_flags)}")
        if arm.policy_flags:
            command.append(f"--policy-args={shlex.join(arm.policy_flags)}")
        return [f"test -e {shlex.quote(str(run_dir / 'summary.json'))} || {shlex.join(command)}"]  # finished: skip
    commands, reward_dir = [], (run_dir if own_reward else out / "full" / "seed_{seed}") / "reward"
    if own_reward:
        reward = ["python", "train_reward_accelerate.py", "--seed", "{seed}", "--output-dir", str(reward_dir)]
        commands.append(shlex.join(reward + list(arm.reward_flags)))
    policy = ["accelerate", "launch", "--num_processes", str(args.processes), "train_policy_accelerate.py",
              "--seed", "{seed}", "--rewards.trained-model", str(reward_dir / "reward_model"),
              "--output-dir", str(run_dir / "policy"), "--task.gold-labeler", "sentiment"]  # fmt: skip
    return commands + [shlex.join(policy + list(arm.policy_flags))]


def launcher_command(args: Args, arms: dict[str, Arm], out: Path) -> list[str]:
    """The launcher with one chain per seed: the full recipe first (its reward model), then every arm."""
    command = [sys.executable, "-m", "benchmark.launch.launcher", "--num-seeds", str(args.num_seeds),
               "--job-name", f"ablations-{args.scale}", "--log-dir", str(out / "logs")]  # fmt: skip
    for name, arm in arms.items():
        for line in arm_commands(args, name, arm, out):
            command += ["--command", line]
    return command + shlex.split(args.launcher_args)


# ---------------------------------------------------------------------------------------------------------------------
# the report
def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval over seeds (nan for fewer than 2)."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    if n < 2:
        return mean, math.nan, math.nan
    half = T_95[min(n - 1, len(T_95)) - 1] * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - half, mean + half


def read_run(run_dir: Path) -> Optional[dict]:
    """One run's numbers: PPO statistics and curves, and once it finished (the quick start's summary.json, or at paper
    scale the saved policy) its gains and final KL; None if it has not started."""
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "policy" / "metrics.jsonl"
    if not metrics_path.exists():
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    updates = [row for row in rows if row.get("update", 0) > 0]
    values = [value for row in updates for value in row.values() if isinstance(value, float)]
    run = {
        "approxkl": sum(row["ppo/policy/approxkl"] for row in updates) / max(len(updates), 1),
        "approxkl_first": updates[0]["ppo/policy/approxkl"] if updates else math.nan,
        "clipfrac": sum(row["ppo/policy/clipfrac"] for row in updates) / max(len(updates), 1),
        "diverged": not all(math.isfinite(value) for value in values),  # unfinished is not diverged
        "kl_curve": [(row["episode"], row["objective/kl"]) for row in updates],
        "gold_curve": [(row["episode"], row["eval/gold_score"]) for row in rows if "eval/gold_score" in row],
        "gold_kl_trace": [(row["eval/kl"], row["eval/gold_score"]) for row in rows if "eval/gold_score" in row],
    }
    if summary_path.exists():
        policy = json.loads(summary_path.read_text())["policy"]
        run.update(gold_gain=policy["gold_score"]["difference"]["mean"], rm_gain=policy["rm_score"]["difference"]["mean"],
                   final_kl=policy["final_kl"]["mean"])  # fmt: skip
        run["minutes"] = json.loads(summary_path.read_text()).get("timings_s", {}).get("total", math.nan) / 60
    elif (run_dir / "policy" / "policy" / "value_head.safetensors").exists():  # paper scale, the policy saved: its
        evals = [row for row in rows if "eval/gold_score" in row]  # own first and last gold evaluation
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            run.update(gold_gain=last["eval/gold_score"] - first["eval/gold_score"],
                       rm_gain=last["eval/rm_score"] - first["eval/rm_score"], final_kl=last["eval/kl"],
                       minutes=updates[-1].get("elapsed/time", math.nan) / 60 if updates else math.nan)  # fmt: skip
    return run


def gain_at_kl(trace: list[tuple[float, float]], kl: float) -> Optional[float]:
    """The gold gain over the first evaluation at the moment the run's held-out KL first reached `kl`, linear between
    the two evaluations around it; None if it never did. `trace`: (eval/kl, eval/gold_score) in training order."""
    for (kl_a, gold_a), (kl_b, gold_b) in list(zip(trace, trace[1:], strict=False)) or [(trace[0], trace[0])]:
        if kl_a <= kl <= kl_b:
            return gold_a + (gold_b - gold_a) * ((kl - kl_a) / (kl_b - kl_a) if kl_b > kl_a else 0.0) - trace[0][1]
    return None


def matched_kl_table(runs: dict[str, dict[int, Optional[dict]]]) -> str:
    """Gold gains compared at common KLs (docs/ablations.md: an arm that drifts further buys more gold with more KL):
    at 1, 2, 4, 8 nats below the largest held-out KL every finished run reached, and at that KL. One row per arm with a
    finished run, one column per KL: the full recipe's own gain, and each arm's difference from it, paired by seed."""
    done = {name: {seed: run for seed, run in by_seed.items() if run is not None and "gold_gain" in run}
            for name, by_seed in runs.items()}  # fmt: skip
    done = {name: by_seed for name, by_seed in done.items() if by_seed}
    reached = [max(kl for kl, _ in run["gold_kl_trace"]) for by_seed in done.values() for run in by_seed.values()]
    if not reached or min(reached) <= 0 or "full" not in done:
        return ""
    common = min(reached)
    kls = [kl for kl in MATCHED_KLS if kl < common] + [common]
    lines = [f"Gold gain at matched KLs, up to {common:.2f} nats, the largest held-out KL that every finished run "
             "reached (each run read where its KL first reached it, linear between its evaluations). The full "
             "recipe's row is its own gain [95% CI]; every other row is the arm minus the full recipe, paired by seed "
             "[95% CI].", "",
             "| arm | seeds | " + " | ".join(f"{kl:.2f} nats" for kl in kls) + " |",
             "|---|---|" + "---|" * len(kls)]  # fmt: skip
    full = {kl: {seed: gain_at_kl(run["gold_kl_trace"], kl) for seed, run in done["full"].items()} for kl in kls}
    for name, by_seed in done.items():
        cells = []
        for kl in kls:
            gains = {seed: gain_at_kl(run["gold_kl_trace"], kl) for seed, run in by_seed.items()}
            values = list(gains.values()) if name == "full" else [
                gain - full[kl][seed] for seed, gain in gains.items() if seed in full[kl]]  # fmt: skip
            mean, low, high = mean_ci(values)
            cells.append(f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]")
        lines.append(f"| {name} | {len(by_seed)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(args: Args, arms: dict[str, Arm], out: Path) -> str:
    """ablations.md (the table) and ablations.png (gold score and KL against episodes, arm by arm) in `out`."""
    seeds = range(1, args.num_seeds + 1)
    runs = {name: {seed: read_run(out / name / f"seed_{seed}") for seed in seeds} for name in arms}
    full = runs["full"]
    lines = [
        "| arm | seeds | gold gain [95% CI] | minus full, paired [95% CI] | RM gain | final KL | KL minus full, paired "
        "[95% CI] | approxkl (first update) | clip fraction | diverged | minutes per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_seed in runs.items():
        done = {seed: run for seed, run in by_seed.items() if run is not None and "gold_gain" in run}
        gains = [run["gold_gain"] for run in done.values()]
        pairs = [
            (run, full[seed]) for seed, run in done.items() if full.get(seed) is not None and "gold_gain" in full[seed]
        ]
        mean, low, high = mean_ci(gains)
        pmean, plow, phigh = mean_ci([run["gold_gain"] - base["gold_gain"] for run, base in pairs])
        kmean, klow, khigh = mean_ci([run["final_kl"] - base["final_kl"] for run, base in pairs])
        average = {key: sum(run[key] for run in done.values()) / len(done) if done else math.nan for key in
                   ("rm_gain", "final_kl", "approxkl", "approxkl_first", "clipfrac", "minutes")}  # fmt: skip
        diverged = sum(run is not None and run["diverged"] for run in by_seed.values())
        lines.append(
            f"| {name} | {len(done)} | {mean:+.3f} [{low:+.3f}, {high:+.3f}] | "
            + ("—" if name == "full" else f"{pmean:+.3f} [{plow:+.3f}, {phigh:+.3f}]")
            + f" | {average['rm_gain']:+.2f} | {average['final_kl']:.1f} | "
            + ("—" if name == "full" else f"{kmean:+.1f} [{klow:+.1f}, {khigh:+.1f}]")
            + f" | {average['approxkl']:.4f} "
            f"({average['approxkl_first']:.3f}) | {average['clipfrac']:.3f} | {diverged} of {len(by_seed)} | {average['minutes']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    matched = matched_kl_table(runs)
    table += "\n" + matched if matched else ""
    (out / "ablations.md").write_text(table)
    plot(runs, out / "ablations.png")
    return table


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [name for name in runs if name != "full"] or ["full"]
    columns = min(len(arms), 5)
    blocks = math.ceil(len(arms) / columns)  # each block: a row of gold panels over a row of KL panels
    figure, axes = plt.subplots(2 * blocks, columns, figsize=(3.0 * columns, 2.5 * 2 * blocks), squeeze=False)
    for index, name in enumerate(arms):
        block, column = divmod(index, columns)
        for row, (key, label) in enumerate((("gold_curve", "held-out gold score"), ("kl_curve", "KL (nats)"))):
            axis = axes[2 * block + row][column]
            for arm, color in [("full", "0.6")] + ([(name, "C1")] if name != "full" else []):
                curves = [run[key] for run in runs[arm].values() if run is not None and run[key]]
                if not curves:
                    continue
                length = min(len(curve) for curve in curves)
                x = [curves[0][i][0] for i in range(length)]
                ys = [[curve[i][1] for curve in curves] for i in range(length)]
                axis.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.3, lw=0)
                axis.plot(
                    x,
                    [sum(y) / len(y) for y in ys],
                    color=color,
                    label=f"{'full recipe' if arm == 'full' else 'this arm'} (seed mean, min-max band)",
                )
            axis.set_title(name if row == 0 else "", fontsize=9)
            axis.set_xlabel("episodes" if row == 1 else "")
            axis.set_ylabel(label if column == 0 else "")
            axis.grid(alpha=0.3)
    for row in range(2):  # one y scale for every gold panel, one for every KL panel; empty panels hidden
        panels = [axes[2 * block + row][column] for block in range(blocks) for column in range(columns)]
        shown = [axis for axis in panels if axis.has_data()]
        for axis in shown:
            axis.set_ylim(min(a.get_ylim()[0] for a in shown), max(a.get_ylim()[1] for a in shown))
        for axis in panels:
            axis.set_visible(axis in shown)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def study_dir(args, study: str) -> Path:
    """A study's output directory (--output-dir, or runs/STUDY/SCALE), after its common flags' checks: --threads,
    and with --report-only a directory that holds a study."""
    if args.threads is not None and args.threads < 1:
        raise SystemExit("error: --threads must be >= 1")
    out = Path(args.output_dir or f"runs/{study}/{args.scale}")
    if args.report_only and not out.is_dir():
        raise SystemExit(f"error: --output-dir {out}: no study there to report (run it without --report-only)")
    return out


def main(args: Args) -> None:
    arms = arms_of(args.scale, args.arms)
    out = study_dir(args, "ablations")
    if args.report_only:
        print(report(args, arms, out))
        return
    command = launcher_command(args, arms, out)
    policy_runs = args.num_seeds * len(arms)
    reward_runs = args.num_seeds * sum(1 for name, arm in arms.items() if name == "full" or arm.reward_flags)
    if args.scale == "paper":
        hours = reward_runs * PAPER_GPU_HOURS["reward"] + policy_runs * PAPER_GPU_HOURS["policy"]
        print(
            f"{policy_runs} policy runs, {reward_runs} reward models: ~{hours:.0f} GPU-hours (an estimate, not measured)"
        )
    else:
        todo = [name for name in arms for seed in range(1, args.num_seeds + 1)
                if not (out / name / f"seed_{seed}" / "summary.json").exists()]  # fmt: skip
        with_reward = sum(1 for name in todo if name == "full" or arms[name].reward_flags)
        minutes = with_reward * 5 + (len(todo) - with_reward) * 2.5  # ~5 min with a reward phase, ~2.5 without
        print(f"{policy_runs} quick starts ({reward_runs} train their reward model), {policy_runs - len(todo)} already "
              f"finished: ~{minutes:.0f} min left on 2 cores with bf16 units, about twice that in fp32 (per run: "
              "docs/quickstart.md#times)")  # fmt: skip
    for name, arm in arms.items():
        for line in arm_commands(args, name, arm, out):
            print(f"{name}: {line}")
    if args.dry_run:
        print("launcher: " + shlex.join(command))
        return
    result = subprocess.run(command, cwd=REPO)
    print(report(args, arms, out))
    raise SystemExit(result.returncode)


if __name__ == "__main__":
    main(tyro.cli(Args))
