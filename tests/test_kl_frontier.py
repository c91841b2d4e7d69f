"""benchmark/studies/kl_frontier.py: the sampled optimum of the KL-regularized objective and best-of-n, against cases
with a known answer, and the command on an eval_samples.jsonl as a policy run writes it."""

import itertools
import json
import math
import subprocess
import sys

import numpy as np

from benchmark.studies.kl_frontier import best_of_n, fit_gao, optimum
from tests.conftest import REPO

SCRIPT = ["-m", "benchmark.studies.kl_frontier"]  # run from the repository root


def test_best_of_n_equals_the_mean_over_every_subset():
    rng = np.random.default_rng(0)
    selector, evaluated = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    for n in (1, 2, 3, 7):
        brute = np.mean(
            [
                np.mean(
                    [
                        evaluated[q, max(subset, key=lambda i: selector[q, i])]
                        for subset in itertools.combinations(range(7), n)
                    ]
                )  # fmt: skip
                for q in range(3)
            ]
        )
        assert abs(best_of_n(selector, evaluated, n) - brute) < 1e-12, n
    assert abs(best_of_n(selector, evaluated, 1) - evaluated.mean()) < 1e-12  # one draw: the plain mean
    assert abs(best_of_n(selector, selector, 7) - selector.max(1).mean()) < 1e-12  # all N: the best one


def test_the_sampled_optimum_of_a_gaussian_reward_matches_its_closed_form():
    """r ~ N(0, 1) under rho: pi* ~ rho exp(r / beta) is N(1 / beta, 1), so E_pi*[r] = 1 / beta and
    KL(pi* || rho) = 1 / (2 beta^2)."""
    rewards = np.random.default_rng(1).normal(size=(4, 50_000))
    for beta in (2.0, 1.0):
        estimate = optimum(rewards, beta)
        assert abs(estimate["score"] - 1 / beta) < 0.03, estimate
        assert abs(estimate["kl"] - 1 / (2 * beta**2)) < 0.03, estimate
        assert abs(estimate["ess"] / 50_000 - math.exp(-1 / beta**2)) < 0.03, estimate  # ESS/N = 1/E_rho[w^2]
    wide = optimum(rewards, 1e6)  # beta -> infinity: pi* is rho
    assert abs(wide["score"] - rewards.mean()) < 1e-4 and wide["kl"] < 1e-6
    narrow = optimum(rewards, 1e-6)  # beta -> 0: the best sample, KL saturated at log N, ESS 1
    assert abs(narrow["score"] - rewards.max(1).mean()) < 1e-9
    assert abs(narrow["kl"] - math.log(50_000)) < 1e-6 and abs(narrow["ess"] - 1) < 1e-6


def test_gao_fits_recover_their_own_form_and_predict_the_upper_half():
    kls = np.linspace(0.0, 16.0, 17)
    d = np.sqrt(kls)
    curves = {"bon": d * (0.9 - 0.2 * d), "rl": d * (0.9 - 0.2 * np.log(np.maximum(d, 1e-300)))}
    for form, gains in curves.items():
        fit = fit_gao(kls, gains, form)
        assert abs(fit["alpha"] - 0.9) < 1e-9 and abs(fit["beta"] - 0.2) < 1e-9, (form, fit)
        assert fit["fitted_points"] == 9 and fit["predicted_points"] == 8  # KL <= 8 of 0..16 (0 included)
        assert fit["fit_rmse"] < 1e-9 and fit["prediction_max_error"] < 1e-9
        other = fit_gao(kls, gains, "rl" if form == "bon" else "bon")  # the other form fits the lower half loosely
        assert other["prediction_rmse"] > 0.05 and other["prediction_max_error"] >= other["prediction_rmse"], other
    noisy = fit_gao(kls, curves["bon"] + np.random.default_rng(3).normal(0, 0.01, 17), "bon")
    assert abs(noisy["alpha"] - 0.9) < 0.05 and 0 < noisy["prediction_rmse"] < 0.2
    assert fit_gao([0.0, 1.0, 4.0], [0.0, 0.5, 1.0], "bon") is None  # one point above KL 0 to fit with
    assert fit_gao([1.0, 1.0, 1.0], [0.1, 0.2, 0.3], "rl") is None  # nothing above half the largest KL to predict


def write_eval_samples(path, queries=5, per_query=8):
    rng = np.random.default_rng(2)
    rows = []
    for update in (0, 4):
        for query in range(queries):
            for _ in range(per_query):
                gold = float(rng.normal())
                rows.append(dict(update=update, query_index=query, query="q", response="r", gold_score=gold,
                                 rm_score=gold + float(rng.normal()), kl=0.0))  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def test_the_command_reads_update_0_and_writes_its_tables(tmp_path):
    rows = write_eval_samples(tmp_path / "eval_samples.jsonl", per_query=16)
    out = tmp_path / "frontier.json"
    result = subprocess.run([sys.executable, *SCRIPT, str(tmp_path / "eval_samples.jsonl"), "--betas", "1", "0.5",
                             "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "5 queries x 16 samples" in result.stdout and "best-of-n" in result.stdout
    frontier = json.loads(out.read_text())
    assert [row["n"] for row in frontier["best_of_n"]] == [1, 2, 4, 8, 16]
    gold = [row["gold_score"] for row in rows if row["update"] == 0]
    assert abs(frontier["best_of_n"][0]["gold_by_gold"] - np.mean(gold)) < 1e-9  # update 0's samples, not update 4's
    by_gold = [row["gold_by_gold"] for row in frontier["best_of_n"]]
    assert by_gold == sorted(by_gold) and all(
        row["gold_by_rm"] <= row["gold_by_gold"] + 1e-12 for row in frontier["best_of_n"]
    )
    assert [row["beta"] for row in frontier["optimum_gold"]] == [1.0, 0.5]
    assert frontier["optimum_gold"][1]["kl"] > frontier["optimum_gold"][0]["kl"] > 0
    fit = frontier["gao_fits"]["gold"]  # n = 1, 2, 4 (KL 0, 0.19, 0.64) fitted, n = 8, 16 (1.20, 1.84) predicted
    assert fit["fitted_points"] == 3 and fit["predicted_points"] == 2 and fit["fit_rmse"] < 1e-9
    assert f"by gold: alpha {fit['alpha']:.4f}" in result.stdout


def test_bad_input_gets_one_line(tmp_path):
    write_eval_samples(tmp_path / "eval_samples.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"update": 0}\n')
    for argv, message in [
        ([str(tmp_path / "missing.jsonl")], "no such file"),
        ([str(tmp_path / "broken.jsonl")], "line 1: not an eval_samples.jsonl row"),
        ([str(tmp_path / "eval_samples.jsonl"), "--update", "7"], "no samples of update 7"),
        ([str(tmp_path / "eval_samples.jsonl"), "--betas", "0"], "--betas must be positive"),
    ]:
        result = subprocess.run([sys.executable, *SCRIPT, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert result.returncode == 1 and message in result.stderr, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
