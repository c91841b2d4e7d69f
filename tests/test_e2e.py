"""End-to-end runs of both scripts, as a user runs them (subprocess), on a tiny GPT-2 with the real GPT-2 tokenizer,
fully offline. The reward model learned here is reused by the policy tests."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import REPO, read_jsonl, run_script, script_environment

REWARD = "train_reward_accelerate.py"
POLICY = "train_policy_accelerate.py"


def reward_flags(assets, output_dir, *extra, labels="labels"):
    return ["--base-model", str(assets["model"]), "--label-dataset", str(assets[labels]),
            "--task.query-dataset", str(assets["corpus"]), "--output-dir", str(output_dir),
            "--rollout-batch-size", "32", "--normalize-samples", "32", "--batch-size", "16", *extra]  # fmt: skip


def policy_flags(assets, reward_model, output_dir, *extra):
    """--task.passage-rows 1: each line of the tiny corpus is a passage already."""
    return [
        "--base-model",
        str(assets["model"]),
        "--rewards.trained-model",
        str(reward_model),
        "--task.query-dataset",
        str(assets["corpus"]),
        "--output-dir",
        str(output_dir),
        "--ppo.batch-size",
        "32",
        "--ppo.whitening-ranks",
        "2",
        "--ppo.lr",
        "1e-3",
        "--print-sample-output-freq",
        "5",
        "--task.passage-rows",
        "1",
        *extra,
    ]  # fmt: skip  (each line of the tiny corpus is a passage already)


@pytest.fixture(scope="session")
def reward_run(tiny_assets, tmp_path_factory):
    """(a) learnable synthetic labels: the sample with the most " good" tokens wins."""
    output_dir = tmp_path_factory.mktemp("reward") / "run"
    flags = reward_flags(tiny_assets, output_dir, "--labels.num-train", "2000", "--lr", "3e-3",
                         "--print-sample-output-freq", "50")  # fmt: skip
    result = run_script(REWARD, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_reward_model_learns_the_synthetic_preference(reward_run):
    rows = read_jsonl(reward_run / "metrics.jsonl")
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 126))  # 2000 labels / batch 16
    assert steps[0]["train/lr"] == pytest.approx(3e-3) and steps[-1]["train/lr"] == pytest.approx(3e-3 / 125)
    final = [row for row in rows if "test/accuracy" in row][-1]
    assert final["test/accuracy"] >= 0.6, final  # chance is 0.25
    assert final["test/loss"] < 1.0  # chance is ln 4 = 1.386
    before = next(row for row in rows if "normalization/before/mean" in row)
    after = next(row for row in rows if "normalization/after/mean" in row)
    for row, phase in ((before, "before"), (after, "after")):
        assert row[f"normalization/{phase}/std"] > 0
        assert abs(row[f"normalization/{phase}/normalized_mean"]) < 1.0  # a fresh sample of 32, so only roughly 0
    args = json.loads((reward_run / "args.json").read_text())
    assert args["local_batch_size"] == 16 and args["num_updates"] == 125


def load_saved_reward_model(directory):
    tokenizer = P.load_tokenizer(str(directory))
    P.check_reward_model(str(directory), tokenizer)
    return P.load_reward_model(str(directory)).eval()


def test_saved_reward_model_reloads_and_scores_identically(reward_run, tiny_assets):
    model = load_saved_reward_model(reward_run / "reward_model")
    head = load_file(reward_run / "reward_model" / "reward_head.safetensors")
    assert torch.equal(model.reward_gain.detach(), head["reward_gain"])
    assert head["reward_gain"].item() != 1.0  # normalization after training changed the gain
    # the saved weights are the trained ones: they get the run's last held-out accuracy on the same records (the 192
    # after the 2000 trained on: 12 whole batches of 16); normalization after training multiplies every score by one
    # positive gain, which keeps each record's best sample (an untrained backbone saved instead gets ~1 in 4)
    tokenizer = P.load_tokenizer(str(reward_run / "reward_model"))
    label_args = R.Args(labels=R.LabelHParams(num_train=2000), task=R.TaskHParams(query_length=64, response_length=24))
    labels = R.load_labels(str(tiny_assets["labels"]), tokenizer, label_args)
    held_out = slice(2000, 2192)
    with torch.no_grad():
        samples = labels["samples"][held_out]  # (192, 4, T): each query with each of its 4 samples, one row each
        scores = model(labels["queries"][held_out].repeat_interleave(4, 0), samples.flatten(0, 1)).view(-1, 4)
    final = [row for row in read_jsonl(reward_run / "metrics.jsonl") if "test/accuracy" in row][-1]
    assert (scores.argmax(1) == labels["best"][held_out]).sum().item() == round(final["test/accuracy"] * 192)
    vocabulary = model.backbone.config.vocab_size  # the tiny task's tokenizer (tests/tiny_task.py)
    queries, responses = torch.randint(0, vocabulary, (3, 64)), torch.randint(0, vocabulary, (3, 24))
    again = load_saved_reward_model(reward_run / "reward_model")
    with torch.no_grad():
        assert torch.equal(model(queries, responses), again(queries, responses))
    assert not list(reward_run.glob(".reward_model.*"))  # no temporary directories left behind


def small_reward_flags(assets, output_dir, *extra):
    return reward_flags(assets, output_dir, "--labels.num-train", "32", "--print-sample-output-freq", "2", *extra,
                        labels="small_labels")  # fmt: skip


def test_simulated_sentiment_labels_make_a_valid_label_file_and_train(tiny_assets, tmp_path):
    """(b) no human labels: the simulated labeler writes OAI-schema labels, then the script trains on them."""
    flags = small_reward_flags(tiny_assets, tmp_path / "run", "--labels.source", "sentiment",
                               "--labels.simulated-num-test", "16")  # fmt: skip
    result = run_script(REWARD, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "run" / "labels.json").read_text())
    vocabulary = json.loads((tiny_assets["model"] / "config.json").read_text())["vocab_size"]
    assert len(records) == 48
    for record in records:
        assert len(record["query"]) == 64 and record["best"] in range(4)
        assert all(len(record[f"sample{i}"]) == 24 for i in range(4))
        assert all(t < vocabulary or t == 50259 for i in range(4) for t in record[f"sample{i}"])  # OAI's pad id
    # the noisy labeler prefers positive samples: the chosen sample's VADER score beats the average one
    chosen = sum(r["scores"][r["best"]] for r in records) / len(records)
    average = sum(sum(r["scores"]) / 4 for r in records) / len(records)
    assert chosen > average
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert any("test/accuracy" in row for row in rows) and (tmp_path / "run" / "reward_model").is_dir()
    # stdout is a pipe here, as in a Slurm log: plain progress lines, not a bar drawn only at the end
    assert re.search(r"^simulating labels: 1/\d+ \(\d+%\), \d+ s, ~\d+ s left$", result.stdout, re.M)
    assert re.search(r"^training reward model: (\d+)/\1 \(100%\), \d+ s, ~0 s left$", result.stdout, re.M)
    # the file it wrote is reusable as --label-dataset
    written = {**tiny_assets, "written": tmp_path / "run" / "labels.json"}
    result = run_script(REWARD, *reward_flags(written, tmp_path / "again", "--labels.num-train", "32", "--dry-run",
                                              labels="written"))  # fmt: skip
    assert result.returncode == 0 and '"dry_run": "ok"' in result.stdout, result.stderr[-3000:]


def test_same_seed_twice_gives_identical_metrics(tiny_assets, tmp_path):
    """(d) reproducibility on one process."""
    for name in ("first", "second"):
        result = run_script(REWARD, *small_reward_flags(tiny_assets, tmp_path / name, "--seed", "3"))
        assert result.returncode == 0, result.stderr[-3000:]

    def metrics(name):
        return [{k: v for k, v in row.items() if not k.startswith(("elapsed", "time"))} for row in read_jsonl(tmp_path / name / "metrics.jsonl")]  # fmt: skip

    assert metrics("first") == metrics("second")
    first, second = (load_file(tmp_path / name / "reward_model" / "model.safetensors") for name in ("first", "second"))
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.fixture(scope="session")
def policy_run(tiny_assets, reward_run, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("policy") / "run"
    flags = policy_flags(tiny_assets, reward_run / "reward_model", output_dir, "--ppo.total-episodes", "320")
    result = run_script(POLICY, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_ppo_raises_the_reward_model_score(policy_run):
    rows = [row for row in read_jsonl(policy_run / "metrics.jsonl") if "objective/scores" in row]
    assert [row["update"] for row in rows] == list(range(1, 11))
    fifth = len(rows) // 5
    first = sum(row["objective/scores"] for row in rows[:fifth]) / fifth
    last = sum(row["objective/scores"] for row in rows[-fifth:]) / fifth
    assert last > first + 0.5, (first, last)  # measured, seeds 1-3: -3.7..-3.2 -> -1.5..-1.2 (1.6 at 20 updates)
    assert rows[0]["objective/kl"] == 0.0  # the policy starts as the reference policy
    assert all(row["ppo/policy/first_ratio_max_deviation"] == 0.0 for row in rows)  # rollout = first PPO forward
    assert rows[0]["ppo/lr"] == pytest.approx(1e-3) and rows[-1]["ppo/lr"] == pytest.approx(1e-3 / 10)
    assert rows[0]["objective/kl_coef"] == 0.15 and rows[1]["objective/kl_coef"] != 0.15  # adaptive
    for row in rows:  # the logged parts add up: a swap of kl and non_score_reward (one shape) would not
        kl_penalty = -row["objective/kl_coef"] * row["objective/kl"]
        assert row["objective/non_score_reward"] == pytest.approx(kl_penalty, rel=1e-5, abs=1e-7)
        total = row["objective/scores"] + row["objective/non_score_reward"]
        assert row["objective/score_total"] == pytest.approx(total, rel=1e-5, abs=1e-7)
        assert row["ppo/loss/total"] == pytest.approx(row["ppo/loss/policy"] + 0.1 * row["ppo/loss/value"], rel=1e-5)
        assert 0 <= row["ppo/policy/clipfrac"] <= 1 and 0 < row["objective/entropy"]
    later = [row["ppo/val/var_explained"] for row in rows[-fifth:]]
    assert min(later) > rows[0]["ppo/val/var_explained"]  # the value head learns (it starts at 0: no variance)
    samples = read_jsonl(policy_run / "samples.jsonl")
    assert {sample["update"] for sample in samples} == {1, 5, 10}
    assert set(samples[0]) == {"update", "query", "response", "score", "kl", "total_reward"}


def test_saved_policy_generates_a_padded_batch_with_the_stock_transformers_api(policy_run):
    """The README's snippet, as written there: a left-padded batch of 2 through generate(); the saved tokenizer pads
    with EOS on the left (the scripts' own [PAD] is one past the embedding and would crash a stock forward)."""
    directory = str(policy_run / "policy")
    # --- README: use the trained policy
    tokenizer = AutoTokenizer.from_pretrained(directory)
    policy = AutoModelForCausalLM.from_pretrained(directory)
    batch = tokenizer(["The cat sat on the mat.", "A dog"], return_tensors="pt", padding=True)
    output = policy.generate(**batch, max_new_tokens=8, do_sample=False)
    texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    # ---
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][0].all()  # the short prompt is padded
    alone = tokenizer(["The cat sat on the mat."], return_tensors="pt")
    single = policy.generate(**alone, max_new_tokens=8, do_sample=False)
    assert texts[0] == tokenizer.decode(single[0, alone["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(texts) == 2 and all(texts)


def short_policy_flags(assets, reward_run, output_dir, *extra):
    return policy_flags(assets, reward_run / "reward_model", output_dir, "--ppo.total-episodes", "64",
                        "--ppo.batch-size", "16", *extra)  # fmt: skip


def test_direct_rl_against_a_reward_function_loads_no_reward_model(tiny_assets, tmp_path):
    """--rewards.function module:callable in place of --rewards.trained-model: a whole run whose every score is the
    function's (0.25; no rejection sampling, so no penalty stands in for it)."""
    (tmp_path / "constant_reward.py").write_text("def score(queries, responses):\n    return [0.25] * len(responses)\n")
    flags = policy_flags(tiny_assets, "unused", tmp_path / "run", "--ppo.total-episodes", "32", "--ppo.batch-size",
                         "16", "--task.no-rejection-sampling", "--rewards.function", "constant_reward:score")  # fmt: skip
    index = flags.index("--rewards.trained-model")
    del flags[index : index + 2]
    result = run_script(POLICY, *flags, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "objective/scores" in row]
    assert len(rows) == 2 and all(row["objective/scores"] == 0.25 for row in rows)


@pytest.fixture(scope="module")
def short_run(tiny_assets, reward_run, tmp_path_factory) -> Path:
    """A plain short run: 4 updates of batch 16."""
    output_dir = tmp_path_factory.mktemp("short") / "run"
    result = run_script(POLICY, *short_policy_flags(tiny_assets, reward_run, output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def test_policy_same_seed_twice_is_identical(tiny_assets, reward_run, short_run, tmp_path):
    result = run_script(POLICY, *short_policy_flags(tiny_assets, reward_run, tmp_path / "again"))
    assert result.returncode == 0, result.stderr[-3000:]

    def metrics(directory):
        rows = read_jsonl(directory / "metrics.jsonl")
        return [{k: v for k, v in row.items() if not k.startswith(("elapsed", "time"))} for row in rows]

    assert metrics(tmp_path / "again") == metrics(short_run)


def first_update(assets, reward_run, output_dir: Path, *extra: str) -> dict:
    """The metrics of update 1 of a short run (batch 16, one update) with `extra` flags."""
    result = run_script(
        POLICY, *short_policy_flags(assets, reward_run, output_dir, "--ppo.total-episodes", "16", *extra)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_jsonl(output_dir / "metrics.jsonl")[0]


@pytest.fixture(scope="module")
def plain_first_update(short_run) -> dict:
    """The plain run's update 1, which the compiled runs and the memory knobs are compared with: the short run's,
    the same row as a run of that one update has (whose row, its last, adds sync/param_spread, compared nowhere)."""
    return read_jsonl(short_run / "metrics.jsonl")[0]


def test_compile_changes_the_first_update_only_by_float_rounding(tiny_assets, reward_run, plain_first_update,
                                                                 tmp_path):  # fmt: skip
    """--compile (compiled PPO forward) against a plain run of the same seed, at update 1 (later updates sample from
    weights that differ in the last bits, so they may diverge): the same rollout, PPO losses equal to 1e-4, first
    ratios 1 to 1e-4. And check.sh's `bf16+tf32+compile` (torch.compile through accelerate's bf16 autocast wrapper,
    the heads kept out of the compiled graph): its first update within bf16's tolerance of fp32's."""
    plain = plain_first_update
    compiled = first_update(tiny_assets, reward_run, tmp_path / "compile", "--compile")
    bf16 = first_update(tiny_assets, reward_run, tmp_path / "bf16", "--compile", "--mixed-precision", "bf16",
                        "--allow-tf32")  # fmt: skip
    assert plain["objective/kl"] == 0.0  # policy log-probs and reference log-probs from the same forward code
    assert {k: v for k, v in compiled.items() if k.startswith("objective/")} == {
        k: v for k, v in plain.items() if k.startswith("objective/")
    }  # the rollout is not compiled
    for key in ("ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl", "ppo/val/vpred"):
        assert compiled[key] == pytest.approx(plain[key], abs=1e-4), key
    assert plain["ppo/policy/first_ratio_max_deviation"] == 0.0
    assert compiled["ppo/policy/first_ratio_max_deviation"] < 1e-4  # compiled kernels round differently
    assert bf16["objective/kl"] == 0.0 and bf16["ppo/policy/first_ratio_max_deviation"] < 0.05
    for key in ("objective/scores", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl"):
        assert bf16[key] == pytest.approx(plain[key], abs=0.05), key


def test_the_first_ratio_metric_shows_a_rollout_that_differs_from_the_ppo_forward(tiny_assets, reward_run, tmp_path):
    """ppo/policy/first_ratio_max_deviation: max |ratio - 1| over the micro-batches of the first minibatch, which run
    before any optimizer step (0 in every plain run: test_ppo_raises_the_reward_model_score). The script run with the
    rollout's log-probs 1e-3 nats higher (rollout_logprobs wrapped): 1 - exp(-1e-3) there, not the larger deviations
    of the second minibatch, which runs after a step."""
    code = ("import run_utils, train_policy_accelerate as P\n"
            "rollout_logprobs = P.rollout_logprobs\n"
            "def shifted(*args):\n"
            "    logprobs, ref_logprobs, values = rollout_logprobs(*args)\n"
            "    return logprobs + 1e-3, ref_logprobs, values\n"
            "P.rollout_logprobs = shifted\n"
            "P.main(run_utils.task_cli(P.task_defaults))\n")  # fmt: skip
    flags = policy_flags(tiny_assets, reward_run / "reward_model", tmp_path / "run", "--ppo.total-episodes", "32",
                         "--ppo.nminibatches", "2", "--ppo.gradient-accumulation-steps", "2")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=600,
                            env=script_environment(), cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["ppo/policy/first_ratio_max_deviation"] == pytest.approx(1 - math.exp(-1e-3), rel=1e-2)
    assert row["ppo/policy/approxkl_max"] > 10 * 0.5 * 1e-3**2  # the second minibatch moved further


def test_memory_knobs_change_no_metric(tiny_assets, reward_run, plain_first_update, tmp_path):
    """Gradient accumulation: ppo/returns/* and ppo/val/* are OAI's per-rank-minibatch moments, computed on whole
    minibatch shares, so 1 or 4 micro-batches give the same values (an average of micro-batch variances read 3-24%
    low), and so do the losses. --gradient-checkpointing recomputes activations: the same numbers too. Both knobs in
    one run (either one's change to a metric shows there)."""
    plain = plain_first_update
    knobs = first_update(tiny_assets, reward_run, tmp_path / "knobs", "--ppo.gradient-accumulation-steps", "4",
                         "--gradient-checkpointing")  # fmt: skip
    assert plain["ppo/returns/var"] > 0.01
    assert plain["ppo/policy/first_ratio_max_deviation"] == knobs["ppo/policy/first_ratio_max_deviation"] == 0.0
    for key in ("ppo/returns/mean", "ppo/returns/var", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained",
                "ppo/loss/value", "ppo/loss/policy", "ppo/policy/approxkl"):  # fmt: skip
        assert knobs[key] == pytest.approx(plain[key], abs=1e-5, rel=1e-4), key


def test_gold_evaluation_logs_the_update_0_point_and_one_row_per_update(tiny_assets, reward_run, tmp_path):
    """--task.gold-labeler: metrics.jsonl starts with the pretrained policy's evaluation (update 0, the "before"
    point of the curve), then exactly one row per update; the last one also holds sync/param_spread."""
    flags = short_policy_flags(tiny_assets, reward_run, tmp_path / "run", "--task.gold-labeler", "sentiment",
                               "--eval-queries", "4", "--eval-every", "2")  # fmt: skip
    result = run_script(POLICY, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["update"] for row in rows] == [0, 1, 2, 3, 4]
    assert set(rows[0]) == {"update", "episode", "eval/gold_score", "eval/rm_score", "eval/kl"}
    assert rows[0]["eval/kl"] == 0.0 and "eval/gold_score" in rows[2] and "eval/gold_score" in rows[4]
    assert rows[-1]["sync/param_spread"] == 0.0 and all("sync/param_spread" not in row for row in rows[:-1])
    events = list((tmp_path / "run").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0  # TensorBoard, on by default


def test_a_label_file_without_spare_records_trains_without_a_held_out_evaluation(tiny_assets, tmp_path):
    """OAI reads exactly --labels.num-train records; the held-out evaluation is ours: skipped, with a notice."""
    result = run_script(REWARD, *reward_flags(tiny_assets, tmp_path / "run", "--labels.num-train", "128",
                                              "--print-sample-output-freq", "4", labels="small_labels"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no records beyond --labels.num-train 128: no held-out evaluation" in result.stdout
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows if "train/loss" in row] == list(range(1, 9))
    assert not any("test/accuracy" in row for row in rows) and (tmp_path / "run" / "reward_model").is_dir()


def test_each_process_draws_its_own_samples(tiny_assets, tmp_path):
    """(c) torchrun with 2 CPU processes (gloo). detail: different seeds for different processes — 2 processes simulate
    labels for the same query (a corpus of one sentence): with seed + rank * 100003 their samples differ; with one
    seed for both, each record of one process would have a twin from the other. Then they train on them, global batch
    8 = 4 per process: the script logs the spread of a parameter checksum over the processes at the end, which must be
    exactly 0 (DDP averaged the gradients)."""
    corpus = tmp_path / "one_sentence.txt"
    corpus.write_text("the cat sat on the mat and looked at the door .\n" * 64)
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(corpus), "--output-dir",
             str(tmp_path / "run"), "--labels.source", "sentiment", "--labels.num-train", "16",
             "--labels.simulated-num-test", "8", "--batch-size", "8", "--rollout-batch-size", "8",
             "--normalize-samples", "8", "--local-rollout-forward-batch-size", "8"]  # fmt: skip
    result = run_script(REWARD, *flags, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "run" / "labels.json").read_text())
    assert len(records) == 24 and len({tuple(r["query"]) for r in records}) == 1  # one query, both processes
    samples = {tuple(tuple(r[f"sample{i}"]) for i in range(4)) for r in records}
    assert len(samples) == len(records), "two records drew the same 4 samples: the processes share a seed"
    args = json.loads((tmp_path / "run" / "args.json").read_text())
    assert args["world_size"] == 2 and args["local_batch_size"] == 4
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["sync/param_spread"] for row in rows if "sync/param_spread" in row] == [0.0]
    assert rows[-1]["step"] == 2 and (tmp_path / "run" / "reward_model").is_dir()
    assert result.stdout.count("training reward model: 2/2 (100%)") == 1  # progress from the main process only
