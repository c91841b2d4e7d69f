"""Compare our runs with OpenAI's lm-human-preferences: learning curves (PNG + SVG) and a table of final values.

Our runs come from local run directories (each with the `metrics.jsonl` the training scripts write) and/or from
wandb (`ENTITY/PROJECT`, optionally filtered by tags). OpenAI's baseline comes from the public wandb project
`openrlbenchmark/lm-human-preferences` (runs of `task_id` = the task, 124M model), with its metric names mapped to
ours; when wandb cannot be reached it falls back, within seconds, to the end values OpenAI reported
(`benchmark/openai/reported_end_values.csv`: read off the paper's plots, so only final values, no curves).

    python -m benchmark.openai.compare_reported --task sentiment --runs "ours=runs/core/sentiment/policy_*"
    python -m benchmark.openai.compare_reported --task sentiment --runs "tf-adam=runs/core/sentiment/policy_*" \
        --runs "torch-adam=runs/ablation_adam/sentiment/policy_*" --wandb-runs "wandb=ENTITY/PROJECT:tag1,tag2"
    python -m benchmark.openai.compare_reported --task sentiment --runs "rm=runs/core/sentiment/reward_*" \
        --metrics train/loss

Writes `OUTPUT_DIR/TASK_curves.png` and `.svg` (mean +- std over seeds per metric and group, OpenAI in black) and
`OUTPUT_DIR/TASK_final_values.md` (per metric and group: the mean of the last 10% of each seed's records, averaged
over seeds, its spread, the difference from OpenAI and whether the two overlap); it prints where the data came from.
"""

import csv
import dataclasses
import glob
import json
import math
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlparse

import matplotlib
import numpy as np
import tyro

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

OPENAI_DIR = Path(__file__).resolve().parent
OPENAI_PROJECT = "openrlbenchmark/lm-human-preferences"
# OpenAI's wandb history (openrlbenchmark's import of their TF summaries: every key got a `ppo/` prefix) -> our name.
# Same definitions on both sides: elapsed/fps is the current update's response tokens per second, ppo/returns/* and
# ppo/val/{mean,var} are averages of per-rank-minibatch moments (train_policy_accelerate.py share_moments).
OPENAI_METRICS = {
    "ppo/objective/score": "objective/scores",
    "ppo/objective/score_total": "objective/score_total",
    "ppo/objective/kl": "objective/kl",
    "ppo/objective/kl_coef": "objective/kl_coef",
    "ppo/objective/entropy": "objective/entropy",
    "ppo/ppo/policy/approxkl": "ppo/policy/approxkl",
    "ppo/ppo/policy/clipfrac": "ppo/policy/clipfrac",
    "ppo/ppo/policy/entropy": "ppo/policy/entropy",
    "ppo/ppo/loss/policy": "ppo/loss/policy",
    "ppo/ppo/loss/value": "ppo/loss/value",
    "ppo/ppo/loss/total": "ppo/loss/total",
    "ppo/ppo/returns/mean": "ppo/returns/mean",
    "ppo/ppo/returns/var": "ppo/returns/var",
    "ppo/ppo/val/vpred": "ppo/val/vpred",
    "ppo/ppo/val/error": "ppo/val/error",
    "ppo/ppo/val/clipfrac": "ppo/val/clipfrac",
    "ppo/ppo/val/mean": "ppo/val/mean",
    "ppo/ppo/val/var": "ppo/val/var",
    "ppo/ppo/val/var_explained": "ppo/val/var_explained",
    "ppo/elapsed/fps": "elapsed/fps",
    "ppo/elapsed/time": "elapsed/time",
}
OPENAI_EPISODES = "ppo/elapsed/episodes"  # OpenAI's x axis: episodes so far, (update + 1) * batch size
OPENAI_BATCH_SIZE = 512  # episodes per PPO update for the books tasks, if a history lacks OPENAI_EPISODES
OPENAI_TASK_KEY = "task_id"  # run config key holding the task (sentiment, descriptiveness, tldr, cnndm)
OPENAI_MODEL_KEY = "task.value.policy.initial_model"  # run config path holding the model size, e.g. 124M
X_KEYS = ("episode", "update", "step")  # our x axis, by preference: policy runs have episodes, reward runs steps
DEFAULT_METRICS = [
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "objective/entropy",
    "objective/score_total",
    "objective/non_score_reward",
    "ppo/policy/approxkl",
    "ppo/policy/clipfrac",
    "ppo/policy/entropy",
    "ppo/loss/value",
    "ppo/val/vpred",
    "elapsed/fps",
]
TABLE_COLUMNS = (
    "metric",
    "group",
    "seeds",
    "ours (mean ± std)",
    "our seed range",
    "OpenAI",
    "Δ (ours − OpenAI)",
    "inside spread",
)
GRID_POINTS = 200  # x resolution of the averaged curves
PLOT_COLUMNS = 3


@dataclasses.dataclass
class Args:
    task: Literal["sentiment", "descriptiveness", "tldr", "cnndm"] = "sentiment"
    """the task the runs trained on: selects OpenAI's runs (`task_id`) and reference values"""
    runs: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    """a group of local runs, `NAME=GLOB`: every directory matching GLOB with a metrics.jsonl is one seed"""
    wandb_runs: tyro.conf.UseAppendAction[list[str]] = dataclasses.field(default_factory=list)
    """a group of wandb runs, `NAME=ENTITY/PROJECT` or `NAME=ENTITY/PROJECT:TAG1,TAG2` (runs having all tags)"""
    openai_source: Literal["auto", "wandb", "table", "none"] = "auto"
    """OpenAI's baseline: `auto` = wandb, else the checked-in table; `wandb` = fail without wandb; `table`; `none`"""
    openai_project: str = OPENAI_PROJECT
    """the wandb project with OpenAI's runs"""
    openai_model: str = "124M"
    """OpenAI model size to compare against (their config `task.policy.initial_model`)"""
    reference_table: str = str(OPENAI_DIR / "reported_end_values.csv")
    """OpenAI's reported end values, used when wandb is unreachable"""
    metrics: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_METRICS))
    """metrics to plot and tabulate (our names); missing ones are skipped"""
    final_fraction: float = 0.1
    """the final value of a run is the mean over this last fraction of its records"""
    smooth: int = 1
    """plot a moving average over this many records of each run (the table always uses raw values)"""
    output_dir: str = "benchmark/results"
    """where the PNG, SVG and markdown table go"""
    wandb_timeout: float = 5.0
    """seconds to wait for wandb before falling back (connection check and each API call)"""


@dataclasses.dataclass
class Run:
    """One seed's curves: x (episodes or steps) and each metric on the same x, NaN where it was not logged."""

    name: str
    x_name: str
    x: np.ndarray
    metrics: dict[str, np.ndarray]


@dataclasses.dataclass
class Group:
    name: str
    runs: list[Run]
    source: str  # where the runs came from, in words


@dataclasses.dataclass
class Reference:
    """OpenAI's final value of one metric and the interval it is compared on."""

    value: float
    low: float
    high: float
    note: str


# ----------------------------------------------------------------------------------------------------------------
# loading


def records_to_run(name: str, records: list[dict], x_key: Optional[str] = None) -> Run:
    """Logged rows (dicts) -> Run; the x axis is the first of X_KEYS found in the rows unless `x_key` is given."""
    if x_key is None:
        x_key = next((k for k in X_KEYS if any(k in r for r in records)), None)
    rows = [r for r in records if x_key is not None and r.get(x_key) is not None]
    x = np.array([float(r[x_key]) for r in rows]) if rows else np.arange(len(records), dtype=float)
    rows = rows or records
    keys = {k for r in rows for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)}
    metrics = {k: np.array([float(r.get(k, math.nan)) for r in rows]) for k in sorted(keys)}
    return Run(name=name, x_name=x_key or "record", x=x, metrics=metrics)


def load_local_group(spec: str) -> Group:
    name, pattern = split_spec(spec, "--runs")
    directories = sorted(d for d in glob.glob(pattern) if (Path(d) / "metrics.jsonl").is_file())
    if not directories:
        raise SystemExit(f"compare_reported.py: --runs {spec!r}: no directory matching {pattern!r} has a metrics.jsonl")
    runs = []
    for directory in directories:
        lines = (Path(directory) / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        runs.append(records_to_run(directory, records))
    return Group(name=name, runs=runs, source=f"{len(runs)} local run directories matching {pattern!r}")


def split_spec(spec: str, flag: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name or not value:
        raise SystemExit(f"compare_reported.py: {flag} takes NAME=VALUE, got {spec!r}")
    return name, value


def wandb_base_url() -> str:
    """The API server the wandb client talks to: WANDB_BASE_URL, else the client's default (it changed between
    releases: api.wandb.ai, then api.forge.coreweave.com in wandb 0.31)."""
    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    import wandb  # only needed for wandb sources; importing it takes about a second

    return wandb.Settings().base_url


def wandb_unreachable_reason(timeout: float) -> Optional[str]:
    """None if a TCP connection to the wandb API server opens within `timeout` s, else why not. The probe runs in a
    thread so that a hanging DNS lookup cannot stall us either; the wandb client itself, when its server does not
    answer, waits for its own timeouts and retries (here: 20 s for one failed query, more with retries)."""
    url = urlparse(wandb_base_url())
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    outcome: dict[str, str] = {}

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome["ok"] = "yes"
        except OSError as e:
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if "ok" in outcome:
        return None
    return f"cannot reach {host}:{port} ({outcome.get('error', f'no answer within {timeout:g} s')})"


def wandb_api(timeout: float):
    import wandb

    return wandb.Api(timeout=int(math.ceil(timeout)))  # needs `wandb login` (any account: the projects are public)


def config_value(config: dict, dotted: str):
    """`config["a"]["b"]` for "a.b", also through wandb's `{"value": ...}` wrappers; None if absent."""
    node = config
    for key in dotted.split("."):
        if isinstance(node, dict) and key not in node and "value" in node:
            node = node["value"]
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node["value"] if isinstance(node, dict) and set(node) == {"value"} else node


def openai_run_to_run(name: str, history: list[dict]) -> Run:
    """One OpenAI wandb history -> Run with our metric names, x = episodes."""
    records = []
    for row in history:
        record = {ours: row[theirs] for theirs, ours in OPENAI_METRICS.items() if row.get(theirs) is not None}
        if not record:
            continue
        if row.get(OPENAI_EPISODES) is not None:
            record["episode"] = row[OPENAI_EPISODES]
        else:  # `_step` counts updates from 0
            record["episode"] = (row["_step"] + 1) * OPENAI_BATCH_SIZE
        records.append(record)
    return records_to_run(name, records, x_key="episode")


def load_openai_wandb(args: Args) -> Group:
    api = wandb_api(args.wandb_timeout)
    runs = []
    for run in api.runs(args.openai_project, filters={f"config.{OPENAI_TASK_KEY}": args.task}):
        model = config_value(run.config, OPENAI_MODEL_KEY)
        if model is not None and str(model) != args.openai_model:
            continue
        runs.append(openai_run_to_run(f"openai/{run.id}", list(run.scan_history(page_size=1000))))
    if not runs:
        raise RuntimeError(f"no runs with {OPENAI_TASK_KEY}={args.task} and model {args.openai_model}")
    source = f"wandb {args.openai_project}: {len(runs)} runs, {OPENAI_TASK_KEY}={args.task}, model {args.openai_model}"
    return Group(name=f"OpenAI ({len(runs)} seeds)", runs=runs, source=source)


def load_wandb_group(spec: str, timeout: float) -> Group:
    name, path = split_spec(spec, "--wandb-runs")
    path, _, tag_list = path.partition(":")
    tags = [t for t in tag_list.split(",") if t]
    filters = {"$and": [{"tags": {"$in": [tag]}} for tag in tags]} if tags else None
    api = wandb_api(timeout)
    runs = [
        records_to_run(f"{path}/{run.id}", list(run.scan_history(page_size=1000))) for run in api.runs(path, filters)
    ]
    if not runs:
        raise SystemExit(f"compare_reported.py: --wandb-runs {spec!r}: no runs found")
    return Group(
        name=name, runs=runs, source=f"wandb {path}" + (f" with tags {tags}" if tags else "") + f": {len(runs)} runs"
    )


def load_reference_table(path: str, task: str) -> dict[str, Reference]:
    """The checked-in table: the interval is value +- read-off uncertainty, widened to OpenAI's seed range if known."""
    references = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["task"] != task:
                continue
            value, uncertainty = float(row["value"]), float(row["uncertainty"])
            low, high = value - uncertainty, value + uncertainty
            note = f"±{uncertainty:g} read off plots"
            if row["seed_min"] and row["seed_max"]:
                low, high = min(low, float(row["seed_min"])), max(high, float(row["seed_max"]))
                note += f"; OpenAI seeds {row['seed_min']}–{row['seed_max']}"
            references[row["metric"]] = Reference(value=value, low=low, high=high, note=note)
    return references


# ----------------------------------------------------------------------------------------------------------------
# statistics


def final_value(run: Run, metric: str, fraction: float) -> float:
    """Mean of the metric over the last `fraction` of the run's logged values (at least one)."""
    values = run.metrics.get(metric)
    if values is None:
        return math.nan
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return math.nan
    return float(values[-max(1, math.ceil(fraction * len(values))) :].mean())


def final_values(group: Group, metric: str, fraction: float) -> np.ndarray:
    values = np.array([final_value(run, metric, fraction) for run in group.runs])
    return values[np.isfinite(values)]


def references_from_group(group: Group, metrics: list[str], fraction: float) -> dict[str, Reference]:
    """OpenAI's runs from wandb: the value is the mean over their seeds, the interval their seed range."""
    references = {}
    for metric in metrics:
        values = final_values(group, metric, fraction)
        if len(values):
            note = f"{len(values)} OpenAI seeds, range {values.min():.3g}–{values.max():.3g}"
            references[metric] = Reference(float(values.mean()), float(values.min()), float(values.max()), note)
    return references


def mean_std_curve(group: Group, metric: str, smooth: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The group's runs interpolated onto one x grid -> (x, mean, std) over the runs present at each x."""
    curves = []
    for run in group.runs:
        values = run.metrics.get(metric)
        if values is None:
            continue
        keep = np.isfinite(values)
        if keep.sum() < 2:
            continue
        x, y = run.x[keep], values[keep]
        if smooth > 1:
            y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
            x = x[smooth - 1 :]
        curves.append((x, y))
    if not curves:
        return None
    grid = np.linspace(min(x[0] for x, _ in curves), max(x[-1] for x, _ in curves), GRID_POINTS)
    stacked = np.full((len(curves), GRID_POINTS), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (grid >= x[0]) & (grid <= x[-1])
        stacked[i, inside] = np.interp(grid[inside], x, y)
    present = np.isfinite(stacked)
    count = present.sum(axis=0)
    mean = np.where(present, stacked, 0.0).sum(axis=0) / np.maximum(count, 1)
    variance = np.where(present, (stacked - mean) ** 2, 0.0).sum(axis=0) / np.maximum(count, 1)
    mean[count == 0] = np.nan
    return grid, mean, np.sqrt(variance)


# ----------------------------------------------------------------------------------------------------------------
# outputs


def plot(
    groups: list[Group],
    openai_curves: Optional[Group],
    references: dict[str, Reference],
    metrics: list[str],
    args: Args,
    path_stem: Path,
) -> list[Path]:
    rows = math.ceil(len(metrics) / PLOT_COLUMNS)
    fig, axes = plt.subplots(rows, PLOT_COLUMNS, figsize=(5 * PLOT_COLUMNS, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x_label = {"episode": "episodes", "update": "updates", "step": "steps"}.get(groups[0].runs[0].x_name, "records")
    handles: dict[str, object] = {}
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for i, group in enumerate(groups + ([openai_curves] if openai_curves else [])):
            is_openai = group is openai_curves
            curve = mean_std_curve(group, metric, args.smooth)
            if curve is None:
                continue
            x, mean, std = curve
            color = "black" if is_openai else colors[i % len(colors)]
            label = group.name if is_openai else f"{group.name} ({len(group.runs)} seeds)"
            (line,) = ax.plot(x, mean, color=color, linewidth=1.4, linestyle="--" if is_openai else "-")
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
            handles.setdefault(label, line)
        reference = references.get(metric)
        if reference is not None and openai_curves is None:
            # OpenAI's reported value applies to the end of training: draw it over the last final_fraction of x
            x_low, x_high = (
                min(r.x.min() for g in groups for r in g.runs),
                max(r.x.max() for g in groups for r in g.runs),
            )
            start = x_high - args.final_fraction * (x_high - x_low)
            ax.fill_between([start, x_high], reference.low, reference.high, color="black", alpha=0.12, linewidth=0)
            (line,) = ax.plot([start, x_high], [reference.value] * 2, color="black", linestyle="--", linewidth=1.6)
            handles.setdefault("OpenAI reported final value (band: uncertainty / seed range)", line)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel(x_label, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    fig.suptitle(f"{args.task}: mean ± std over seeds", fontsize=12)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=120)
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def overlap(low_a: float, high_a: float, low_b: float, high_b: float) -> bool:
    return low_a <= high_b and low_b <= high_a


def markdown_table(
    groups: list[Group], references: dict[str, Reference], metrics: list[str], args: Args, sources: list[str]
) -> str:
    lines = [
        f"# {args.task}: final values",
        "",
        f"Final value of a run = mean over its last {args.final_fraction:.0%} of logged updates; then mean ± std",
        "(sample std) and range over seeds. *Inside spread* = OpenAI's interval (its value ± read-off uncertainty",
        "or its seed range) overlaps our seed range.",
        "",
        "Sources:",
        *[f"- {s}" for s in sources],
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|---" * len(TABLE_COLUMNS) + "|",
    ]
    for metric in metrics:
        reference = references.get(metric)
        for group in groups:
            values = final_values(group, metric, args.final_fraction)
            if len(values) == 0:
                continue
            mean = values.mean()
            std = values.std(ddof=1) if len(values) > 1 else 0.0
            std = 0.0 if std < 1e-9 * max(1.0, abs(mean)) else std  # identical seeds: no float noise like 3e-17
            cells = [metric, group.name, str(len(values)), f"{mean:.4g} ± {std:.2g}"]
            cells.append(f"{values.min():.4g} – {values.max():.4g}")
            if reference is None:
                cells += ["–", "–", "–"]
            else:
                inside = overlap(values.min(), values.max(), reference.low, reference.high)
                cells += [f"{reference.value:.4g} ({reference.note})", f"{mean - reference.value:+.3g}"]
                cells.append("yes" if inside else "**no**")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def shown_path(path: str) -> str:
    """A path as a reader wants it in a report: relative to the current directory when it is below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def openai_baseline(args: Args, metrics: list[str]) -> tuple[Optional[Group], dict[str, Reference], str]:
    """OpenAI's curves (or None) and final values, and a sentence saying where they came from."""
    if args.openai_source == "none":
        return None, {}, "OpenAI: not compared (--openai-source none)"
    if args.openai_source in ("auto", "wandb"):
        reason = wandb_unreachable_reason(args.wandb_timeout)
        if reason is None:
            try:
                group = load_openai_wandb(args)
                return group, references_from_group(group, metrics, args.final_fraction), f"OpenAI: {group.source}"
            except Exception as e:  # wandb's errors have no common base class; reported below, never hidden
                if args.openai_source == "wandb":
                    raise
                reason = f"wandb query failed: {type(e).__name__}: {e}"
        elif args.openai_source == "wandb":
            raise SystemExit(f"compare_reported.py: --openai-source wandb, but {reason}")
        print(f"[compare] OpenAI from wandb unavailable ({reason}); using the reported end values instead")
        fallback = f"OpenAI: reported end values from {shown_path(args.reference_table)} (wandb unavailable: {reason})"
    else:
        fallback = f"OpenAI: reported end values from {shown_path(args.reference_table)} (--openai-source table)"
    return None, load_reference_table(args.reference_table, args.task), fallback


def main(args: Args) -> int:
    if not args.runs and not args.wandb_runs:
        raise SystemExit("compare_reported.py: give at least one --runs NAME=GLOB or --wandb-runs NAME=ENTITY/PROJECT")
    if not 0 < args.final_fraction <= 1:
        raise SystemExit("compare_reported.py: --final-fraction must be in (0, 1]")
    groups = [load_local_group(spec) for spec in args.runs]
    if args.wandb_runs:
        reason = wandb_unreachable_reason(args.wandb_timeout)
        if reason is not None:
            raise SystemExit(f"compare_reported.py: --wandb-runs given, but {reason}")
        groups += [load_wandb_group(spec, args.wandb_timeout) for spec in args.wandb_runs]
    metrics = [m for m in args.metrics if any(m in r.metrics for g in groups for r in g.runs)]
    if not metrics:
        raise SystemExit(f"compare_reported.py: none of the metrics {args.metrics} is in the runs")
    openai_curves, references, openai_source = openai_baseline(args, metrics)
    sources = [f"{group.name}: {group.source}" for group in groups] + [openai_source]
    for source in sources:
        print(f"[compare] {source}")

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    figures = plot(groups, openai_curves, references, metrics, args, output_dir / f"{args.task}_curves")
    table = markdown_table(groups, references, metrics, args, sources)
    table_path = output_dir / f"{args.task}_final_values.md"
    table_path.write_text(table)
    print(table)
    print(f"[compare] wrote {', '.join(map(str, figures))} and {table_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
