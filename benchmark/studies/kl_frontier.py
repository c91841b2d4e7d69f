"""What reward is reachable at what KL from the initial policy, estimated from its own samples: the optimum of the
KL-regularized objective and best-of-n, by the gold score (a simulated labeler) and by the reward model.

    python -m benchmark.studies.kl_frontier runs/quickstart/policy/eval_samples.jsonl            # update 0's samples
    python -m benchmark.studies.kl_frontier SAMPLES --betas 4 2 1 0.5 0.25 --out frontier.json  # another grid, saved

The input is a policy run's eval_samples.jsonl (written with --task.gold-labeler): at update 0 it holds, for each
held-out query x, responses y_1..y_N of the initial policy rho with their gold_score and rm_score (the reward model's
score with the truncation penalty, what PPO maximizes). More samples per query (--eval-samples-per-query) make both
estimates hold further out.

The optimum (Ziegler et al. 2019, Figure 3): for a reward r, pi*(y|x) is proportional to rho(y|x) exp(r(x, y) / beta).
Over each query's N samples, pi* is estimated by self-normalized weights w_i = softmax(r_i / beta), so
E_pi*[r] = sum_i w_i r_i and KL(pi* || rho) = sum_i w_i log(N w_i), averaged over queries. The estimate only holds
while the weights are spread: the effective sample size 1 / sum_i w_i^2 (out of N) says how far; at ESS near 1 the
KL estimate saturates at log N. For the reward model's optimum the gold score under its weights is reported too: what
optimizing the learned reward gives on the true one.

Best-of-n (KL = log n - (n - 1) / n): the expected gold score of the sample that the selector (gold or reward model)
ranks best among n drawn without replacement from the N, computed exactly over all n-subsets from the ranks: the
sample ranked i-th lowest of N is the best of a random n-subset with probability C(i - 1, n - 1) / C(N, n).

Gao, Schulman & Hilton (2022)'s functional forms, with d = sqrt(KL), for the gold score's gain over the initial
policy: best-of-n d (alpha - beta d), RL d (alpha - beta log d). Both are linear in (alpha, beta), so `fit_gao` fits
them by least squares on the points in the lower half of the KL range (KL <= half the largest) and reports how well
they predict the upper half, Gao's own test. Here the best-of-n curves are fitted; PPO runs' evaluation traces are
fitted the same way.
"""

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

import run_utils

SCORES = ("gold_score", "rm_score")


@dataclass
class Args:
    """The optimum and best-of-n by gold and reward-model score, from the initial policy's samples in a run's
    eval_samples.jsonl."""

    samples: tyro.conf.Positional[str]
    """a policy run's eval_samples.jsonl"""
    update: int = 0
    """the evaluation whose samples stand for the initial policy (0: before any PPO update)"""
    betas: tuple[float, ...] = field(default_factory=lambda: (8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625))
    """the KL coefficients beta at which the optimum is estimated"""
    out: Optional[str] = None
    """also write the tables as JSON here"""


def read_samples(path: str, update: int) -> dict[int, dict[str, np.ndarray]]:
    """Each held-out query's scores at `update`: {query_index: {score: (N,) array}}, the same N for every query."""
    if not Path(path).is_file():
        sys.exit(f"error: {path}: no such file (a policy run's eval_samples.jsonl, written with --task.gold-labeler)")
    by_query = defaultdict(lambda: defaultdict(list))
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row["update"] == update:
                for key in SCORES:
                    by_query[row["query_index"]][key].append(float(row[key]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            sys.exit(f"error: {path} line {number}: not an eval_samples.jsonl row ({error!r})")
    if not by_query:
        sys.exit(f"error: {path}: no samples of update {update} (see --update)")
    sizes = {len(scores["gold_score"]) for scores in by_query.values()}
    if len(sizes) != 1 or min(sizes) < 2:
        sys.exit(
            f"error: {path}: update {update} needs the same number (>= 2) of samples per query, got {sorted(sizes)}"
        )
    return {query: {key: np.array(values) for key, values in scores.items()} for query, scores in by_query.items()}


def optimum(rewards: np.ndarray, beta: float, evaluated: Optional[np.ndarray] = None) -> dict[str, float]:
    """The optimum pi* of E[r] - beta KL(pi || rho), estimated from samples of rho: `rewards` (Q, N) are r of N samples
    for each of Q queries; E_pi*[`evaluated`] (default r itself), KL(pi* || rho) and the effective sample size, all
    averaged over queries."""
    evaluated = rewards if evaluated is None else evaluated
    logits = rewards / beta
    weights = np.exp(logits - logits.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    n = rewards.shape[1]
    kl = np.sum(np.where(weights > 0, weights * np.log(np.maximum(weights * n, 1e-300)), 0.0), 1)
    return dict(beta=beta, score=float(np.mean(np.sum(weights * evaluated, 1))), kl=float(np.mean(kl)),
                ess=float(np.mean(1.0 / np.sum(weights**2, 1))))  # fmt: skip


def best_of_n(selector: np.ndarray, evaluated: np.ndarray, n: int) -> float:
    """The expected `evaluated` score of the sample that `selector` ranks highest among n of each query's N samples
    drawn without replacement, exactly over all n-subsets, averaged over queries; (Q, N) arrays."""
    size = selector.shape[1]
    order = np.argsort(selector, axis=1, kind="stable")
    ranked = np.take_along_axis(evaluated, order, 1)  # ascending by the selector
    chance = np.array([math.comb(i, n - 1) for i in range(size)], dtype=float) / math.comb(size, n)
    return float(np.mean(ranked @ chance))


def fit_gao(kls, gains, form: str) -> Optional[dict[str, float]]:
    """Gao et al.'s form ("bon": d (alpha - beta d), "rl": d (alpha - beta log d), d = sqrt(KL)) fitted by least
    squares to the (KL, gold gain) points with KL <= half the largest KL: alpha, beta, the fit's RMS error and, on the
    points above, the prediction's RMS and largest error. None with fewer than 2 points above KL 0 to fit or none to
    predict."""
    kls, gains = np.asarray(kls, dtype=float), np.asarray(gains, dtype=float)
    d = np.sqrt(kls)
    shape = d * d if form == "bon" else d * np.log(np.maximum(d, 1e-300))  # the term beta multiplies (d log d -> 0)
    design = np.stack([d, -shape], 1)  # gain = alpha d - beta shape
    lower = kls <= kls.max() / 2
    if (lower & (kls > 0)).sum() < 2 or lower.all():  # at KL 0 both forms are 0: that point tells nothing
        return None
    (alpha, beta), *_ = np.linalg.lstsq(design[lower], gains[lower], rcond=None)
    error = design @ np.array([alpha, beta]) - gains
    return dict(alpha=float(alpha), beta=float(beta), fitted_points=int(lower.sum()),
                fit_rmse=float(np.sqrt(np.mean(error[lower] ** 2))), predicted_points=int((~lower).sum()),
                prediction_rmse=float(np.sqrt(np.mean(error[~lower] ** 2))),
                prediction_max_error=float(np.max(np.abs(error[~lower]))))  # fmt: skip


def frontier(by_query: dict[int, dict[str, np.ndarray]], betas) -> dict[str, list[dict]]:
    gold = np.stack([scores["gold_score"] for scores in by_query.values()])
    rm = np.stack([scores["rm_score"] for scores in by_query.values()])
    size = gold.shape[1]
    ns = [2**k for k in range(int(math.log2(size)) + 1)]
    tables = dict(
        optimum_gold=[optimum(gold, beta) for beta in betas],
        optimum_rm=[{**optimum(rm, beta), "gold": optimum(rm, beta, gold)["score"]} for beta in betas],
        best_of_n=[
            dict(
                n=n,
                kl=math.log(n) - (n - 1) / n,
                gold_by_gold=best_of_n(gold, gold, n),
                gold_by_rm=best_of_n(rm, gold, n),
                rm_by_rm=best_of_n(rm, rm, n),
            )  # fmt: skip
            for n in ns
        ],
    )
    kls = [row["kl"] for row in tables["best_of_n"]]
    tables["gao_fits"] = {
        selector: fit_gao(kls, [row[f"gold_by_{selector}"] - gold.mean() for row in tables["best_of_n"]], "bon")
        for selector in ("gold", "rm")
    }
    return dict(queries=gold.shape[0], samples_per_query=size, **tables)


def print_tables(result: dict) -> None:
    print(f"{result['queries']} queries x {result['samples_per_query']} samples of the initial policy")
    print("\noptimum of E[r] - beta KL, estimated by self-normalized weights (ESS of N)")
    print(
        f"{'beta':>8} {'gold: E[gold]':>14} {'KL':>7} {'ESS':>6} {'rm: E[rm]':>10} {'E[gold]':>8} {'KL':>7} {'ESS':>6}"
    )
    for g, r in zip(result["optimum_gold"], result["optimum_rm"], strict=True):
        print(f"{g['beta']:>8.4g} {g['score']:>14.4f} {g['kl']:>7.3f} {g['ess']:>6.1f} "
              f"{r['score']:>10.4f} {r['gold']:>8.4f} {r['kl']:>7.3f} {r['ess']:>6.1f}")  # fmt: skip
    print("\nbest-of-n (KL = log n - (n-1)/n)")
    print(f"{'n':>5} {'KL':>7} {'gold, by gold':>14} {'gold, by rm':>12} {'rm, by rm':>10}")
    for row in result["best_of_n"]:
        print(f"{row['n']:>5} {row['kl']:>7.3f} {row['gold_by_gold']:>14.4f} {row['gold_by_rm']:>12.4f} "
              f"{row['rm_by_rm']:>10.4f}")  # fmt: skip
    print("\nbest-of-n's gold gain fitted by Gao et al.'s d (alpha - beta d), d = sqrt(KL), on KL <= half the largest")
    for selector, fit in result["gao_fits"].items():
        if fit is None:
            print(f"  by {selector}: too few values of n to fit and predict (more samples per query)")
            continue
        print(f"  by {selector}: alpha {fit['alpha']:.4f} beta {fit['beta']:.4f}; fit RMSE {fit['fit_rmse']:.4f} on "
              f"{fit['fitted_points']} points, predicting the other {fit['predicted_points']}: RMSE "
              f"{fit['prediction_rmse']:.4f}, largest error {fit['prediction_max_error']:.4f}")  # fmt: skip


def main(args: Args) -> None:
    if not args.betas or min(args.betas) <= 0:
        sys.exit("error: --betas must be positive numbers")
    result = frontier(read_samples(args.samples, args.update), args.betas)
    print_tables(result)
    if args.out:
        run_utils.write_text_atomic(Path(args.out), json.dumps(result, indent=1) + "\n")  # a finished file or none
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
