"""N processes compute what 1 process computes: the README's promise that the same flags give the same optimization on
1 or 8 GPUs, end to end for both scripts, on plain DDP and under DeepSpeed ZeRO-2.

With the same draws (benchmark/openai/replay.py hands each run the draws OpenAI's 2 ranks made in the side by side,
benchmark/openai/side_by_side_reference/), a run on 2 processes equals a run on 1 process with the same global batch
(and, for PPO, `--ppo.whitening-ranks 2`, so that its one process whitens the same two shares): every metric of every
step and update, and the weights after training, to float rounding. What only matters with several processes from
update 2 on — a per-process count where a global one belongs, a learning-rate schedule that counts local steps, a
metric or a KL-controller input reduced over one process, gradients not averaged — breaks that equality. The 2-process
comparisons with OpenAI's 2 ranks (tests/test_openai_reference.py) check the same code against OpenAI's; these check
that the processes together compute what one does, whatever OpenAI's code does.

Tolerance: the same sums in another order (a mean over 32 rows on 1 process, a mean of two means over 16 on 2, DDP's
or ZeRO's all-reduce), float32 rounding that Adam's normalized steps carry on: measured (docs/side-by-side.md) at most
METRICS_RTOL / 10 of a metric's largest value over the run, WEIGHTS_RTOL / 10 of a weight's change."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmark.openai import side_by_side as S
from tests.conftest import REPO, assert_processes_ran, failure, read_jsonl, run_script, script_environment
from tests.test_deepspeed import ZERO2_CONFIG, free_port
from tests.test_openai_reference import side_by_side_assets
from tests.test_resume import without_timings

REFERENCE = REPO / "benchmark" / "openai" / "side_by_side_reference"
METRICS_RTOL = 5e-4  # each metric, relative to its largest value over the run
WEIGHTS_RTOL = 6e-4  # each weight's change from its initial value, relative to the change's largest entry
REWARD_STEPS = 8  # of the reward model (labels of the reference, 32 a step)
KL_TARGET, KL_HORIZON = 3.0, 64
"""The KL controller of the PPO runs: a target near these updates' KL (2.45, 3.56, 2.81, 4.15 nats), so that its
proportional error lies inside its ±0.2 clip at 3 of its 4 moves (the scenario's own target, set for all 8 of its
updates, at 2), and a horizon of one batch (64 episodes), so that each move is the error itself: a KL fed to it 1% off
moves the next coefficient by ~1% (kl / target ~ 1), 20 times the 5e-4 the metrics are compared to."""
POLICY_UPDATES = 5  # of PPO, with the adaptive KL controller moving (the `ranks_2` scenario's first updates)
UNIT_SCALE = {"normalized_mean": 1.0}
"""Metrics measured against 1, not their own size: the rewards' mean after a normalization, 0 up to rounding, of rewards
whose std is 1."""
LAUNCHES = ("1 process", "2 processes", "2 processes, ZeRO-2")
ACCUMULATE = {"2 processes, ZeRO-2": 2}
"""Micro-batches per step under ZeRO-2, which then reduces each one's gradients as they come (DDP once per step)."""


@pytest.fixture(scope="module")
def assets(gpt2_tokenizer_dir, tmp_path_factory) -> Path:
    """The side by side's tiny task: tokenizer, corpus, base model, the reference's labels."""
    return side_by_side_assets(tmp_path_factory.mktemp("processes") / "assets", gpt2_tokenizer_dir)


def launch(how: str, arguments: list[str], log: Path) -> None:
    """benchmark/openai/replay.py with `arguments` on 1 process, on 2 (torchrun: DDP) or on 2 under the ZeRO-2 config
    of benchmark/launch/large_models.sh (accelerate launch, tests/deepspeed_cpu.py's CPU fix in front)."""
    if how == "2 processes, ZeRO-2":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / ZERO2_CONFIG),
                   "--num_processes", "2", "--main_process_port", str(free_port()), str(REPO / "tests" /
                   "deepspeed_cpu.py"), "-m", "benchmark.openai.replay", *arguments]  # fmt: skip
        environment = script_environment(2)
        del environment["ACCELERATE_USE_CPU"]  # with it accelerate would silently run plain DDP, not DeepSpeed
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, cwd=REPO)
    else:
        result = run_script("benchmark.openai.replay", *arguments, nproc=1 if how == "1 process" else 2)
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"{how}: {failure(result)}"
    assert_processes_ran(arguments, 1 if how == "1 process" else 2)


def trained_by_zero2(output_dir: Path) -> bool:
    """ZeRO's optimizer partitions, one per process, in the run's last checkpoint: the DeepSpeed engine trained."""
    partitions = sorted(path.name for path in output_dir.rglob("*optim_states.pt"))
    return partitions == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)]


@pytest.fixture(scope="module")
def reward_runs(assets) -> dict[str, Path]:
    """The reward model trained for REWARD_STEPS steps on 1 process, on 2 and on 2 under ZeRO-2, each given the
    normalizations' samples of OpenAI's 2 ranks."""
    runs = {}
    for how in LAUNCHES:
        out = assets.parent / f"reward {how}"
        flags = [*S.our_reward_flags(assets), "--labels.num-train", str(REWARD_STEPS * S.REWARD["batch_size"]),
                 "--checkpoint-every", str(REWARD_STEPS), "--output-dir", str(out),
                 "--gradient-accumulation-steps", str(ACCUMULATE.get(how, 1))]  # fmt: skip
        launch(how, ["train_reward_accelerate.py", str(REFERENCE / "reward_ranks_2" / "samples.npz"), *flags],
               out.with_suffix(".log"))  # fmt: skip
        runs[how] = out
    return runs


@pytest.fixture(scope="module")
def policy_runs(assets, reward_runs) -> dict[str, Path]:
    """PPO for POLICY_UPDATES updates of the `ranks_2` scenario (warm start, 2 minibatches, the controller moving) on 1
    process with --ppo.whitening-ranks 2, on 2 and on 2 under ZeRO-2, each given OpenAI's 2 ranks' draws."""
    shutil.copytree(reward_runs["1 process"] / "reward_model", assets / "reward_model")
    scenario = S.SCENARIOS["ranks_2"]
    given = np.load(REFERENCE / "scenario_ranks_2" / "replay.npz")
    replay = assets.parent / "replay.npz"  # its first updates
    np.savez(replay, **{key: given[key][:POLICY_UPDATES] if key != "call_sites" else given[key] for key in given.files})
    warm = S.write_warm_policy(assets, "ranks_2")
    runs = {}
    for how in LAUNCHES:
        out = assets.parent / f"policy {how}"
        flags = [*S.our_policy_flags(assets, POLICY_UPDATES, ranks=2, scenario=scenario), "--checkpoint-every",
                 str(POLICY_UPDATES), "--output-dir", str(out), "--rewards.adaptive-kl.target", str(KL_TARGET),
                 "--rewards.adaptive-kl.horizon", str(KL_HORIZON),
                 "--ppo.gradient-accumulation-steps", str(ACCUMULATE.get(how, 1))]  # fmt: skip
        launch(how, ["--policy-init", str(warm), "train_policy_accelerate.py", str(replay), *flags],
               out.with_suffix(".log"))  # fmt: skip
        runs[how] = out
    return runs


def metric_differences(run: Path, reference: Path) -> list[tuple[float, str]]:
    """Every metric of every row of `run` against `reference`'s, relative to the metric's largest value over the
    reference run: (difference, where), largest first. The rows and their metrics must be the same."""
    rows, reference_rows = (without_timings(read_jsonl(path / "metrics.jsonl")) for path in (run, reference))
    assert [sorted(row) for row in rows] == [sorted(row) for row in reference_rows]
    scale = {}
    for row in reference_rows:
        for key, value in row.items():
            floor = UNIT_SCALE.get(key.rsplit("/", 1)[-1], 1e-12)
            scale[key] = max(scale.get(key, floor), abs(value)) if isinstance(value, float) else None
    differences = []
    for row, reference_row in zip(rows, reference_rows, strict=True):
        where = f"at {'update' if 'update' in row else 'step'} {row.get('update', row.get('step'))}"
        for key, value in row.items():
            if scale[key] is None:
                assert value == reference_row[key], (key, where)
            else:
                differences.append((abs(value - reference_row[key]) / scale[key], f"{key} {where}"))
    return sorted(differences, reverse=True)


def weight_differences(run: Path, reference: Path, initial: dict[str, torch.Tensor], skip=()) -> list[tuple]:
    """Each saved tensor's change from `initial` against `reference`'s, relative to the reference change's largest
    entry: (difference, name), largest first."""
    differences = []
    for name, tensor in load_weights(run).items():
        if name in skip:
            continue
        change, reference_change = tensor - initial[name], load_weights(reference)[name] - initial[name]
        scale = reference_change.abs().max().clamp(min=1e-12)
        differences.append((((change - reference_change).abs().max() / scale).item(), name))
    return sorted(differences, reverse=True)


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor for file in sorted(directory.glob("*.safetensors")) for name, tensor in load_file(file).items()
    }


@pytest.mark.parametrize("how", LAUNCHES[1:], ids=["ddp", "zero2"])
def test_the_reward_model_on_two_processes_is_the_reward_model_on_one(reward_runs, assets, how):
    """Every step's loss and accuracy, both normalizations, and the trained weights: 2 processes (32 labels a step,
    16 on each; under ZeRO-2 in 2 micro-batches of 8) as 1 process (all 32). The final layer norm's bias and the head's
    bias shift all 4 samples' rewards alike, so best-of-4 gives them a gradient of exactly 0 and rounding noise moves
    them by whole Adam steps: they are left out, and the normalization after training (which takes such a shift out)
    is compared instead."""
    run, reference = reward_runs[how], reward_runs["1 process"]
    assert how != "2 processes, ZeRO-2" or trained_by_zero2(run)
    metrics = metric_differences(run, reference)
    print(f"reward model, {how}: largest metric difference {metrics[0][0]:.1e} ({metrics[0][1]})")
    assert metrics[0][0] <= METRICS_RTOL, metrics[:3]
    noise = {"ln_f.bias", "scalar_head.bias", "score.weight"}  # score.weight: the head with its gain and bias folded in
    set_by_normalization = {"reward_gain", "reward_bias"}  # compared above, as normalization/*/mean and std
    weights = weight_differences(run / "reward_model", reference / "reward_model", initial_reward_model(assets / "base"),
                                 skip=noise | set_by_normalization)  # fmt: skip
    print(f"reward model, {how}: largest weight difference {weights[0][0]:.1e} ({weights[0][1]})")
    assert weights[0][0] <= WEIGHTS_RTOL, weights[:3]
    # the saved gain and bias are the normalization's (the gain set before training survived ZeRO's fp32 copy of the
    # weights, or the steps above would differ), in the units of the gain
    head, reference_head = (load_file(path / "reward_model" / "reward_head.safetensors") for path in (run, reference))
    scale = reference_head["reward_gain"].abs().item()
    for name in set_by_normalization:
        assert abs(head[name].item() - reference_head[name].item()) <= METRICS_RTOL * scale, name


def initial_reward_model(base: Path) -> dict[str, torch.Tensor]:
    """The reward model's weights before training, named as its saved files name them: the base model and the head
    train_reward_accelerate.py draws from the seed (1) before the processes part."""
    from transformers import AutoModel

    import train_reward_accelerate as R

    torch.manual_seed(1)
    model = R.RewardModel(R.load_pretrained(AutoModel, str(base)), R.load_tokenizer(str(base)).pad_token_id)
    return {name.removeprefix("backbone."): tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("how", LAUNCHES[1:], ids=["ddp", "zero2"])
def test_ppo_on_two_processes_is_ppo_on_one(policy_runs, assets, how):
    """Every metric of every update (the KL controller's coefficient from update 2 on fed the KL of both processes,
    the lr schedule, Adam's state carried over) and the trained policy's weights and value head: 2 processes (32 rows
    each, 16 a minibatch; under ZeRO-2 in 2 micro-batches of 8) as 1 process with --ppo.whitening-ranks 2 (64 rows in
    two whitening shares of 32)."""
    run, reference = policy_runs[how], policy_runs["1 process"]
    assert how != "2 processes, ZeRO-2" or trained_by_zero2(run)
    coefficients = [row["objective/kl_coef"] for row in read_jsonl(reference / "metrics.jsonl") if "update" in row]
    assert len(set(coefficients)) == len(coefficients) == POLICY_UPDATES  # the controller moved at every update
    kls = [row["objective/kl"] for row in read_jsonl(reference / "metrics.jsonl") if "update" in row][:-1]
    assert sum(abs(kl / KL_TARGET - 1) < 0.2 for kl in kls) >= 3, kls  # its proportional path, inside the clip
    metrics = metric_differences(run, reference)
    print(f"PPO, {how}: largest metric difference {metrics[0][0]:.1e} ({metrics[0][1]})")
    assert metrics[0][0] <= METRICS_RTOL, metrics[:3]
    initial = load_weights(assets / "warm_policy_ranks_2")
    weights = weight_differences(run / "policy", reference / "policy", initial)
    print(f"PPO, {how}: largest weight difference {weights[0][0]:.1e} ({weights[0][1]})")
    assert weights[0][0] <= WEIGHTS_RTOL, weights[:3]


# ---------------------------------------------------------------------------------------------------------------------
# a chat task whose reward function reads the dataset's fields

CHAT_UPDATES, CHAT_ROWS, CHAT_LENGTH = 3, 32, 16


@pytest.fixture(scope="module")
def chat_replay(tiny_chat_assets, tmp_path_factory) -> Path:
    """Draws for CHAT_UPDATES updates of the tiny chat task: CHAT_ROWS templated questions an update, each with its
    dataset row (whose `prompt` and `word` fields the reward function reads), and full-length responses of the tiny
    chat model, sampled here once (seed 7): given to both launches, which cut them where the batch's last response
    ends (--task.stop-when-ended), on 2 processes after agreeing on that column."""
    from transformers import AutoModelForCausalLM

    import rlhf_data
    import run_utils
    import train_policy_accelerate as P

    tokenizer = P.load_tokenizer(str(tiny_chat_assets["model"]))
    task = run_utils.task_cli(P.task_defaults, [*chat_flags(tiny_chat_assets)[:-6]]).task
    texts = rlhf_data.QueryTexts(str(tiny_chat_assets["questions"]), None, "text")
    rows = list(texts.epoch(0, seed=11, rank=0, world_size=1))
    prompts = tokenizer(rlhf_data.query_texts([texts[row] for row in rows], task, tokenizer), add_special_tokens=False)
    queries = [P.query_from_text(tokenizer, tokens, task, S.OPENAI_PAD_ID) for tokens in prompts["input_ids"]]
    rows, queries = zip(
        *[(row, query) for row, query in zip(rows, queries, strict=True) if query is not None], strict=True
    )
    rows, queries = rows[: CHAT_UPDATES * CHAT_ROWS], queries[: CHAT_UPDATES * CHAT_ROWS]  # questions that fit
    lm = P.load_pretrained(AutoModelForCausalLM, str(tiny_chat_assets["model"])).eval()
    contexts = P.right_padding_to_left_padding(torch.tensor(queries), S.OPENAI_PAD_ID)
    contexts = torch.where(contexts == S.OPENAI_PAD_ID, tokenizer.pad_token_id, contexts)
    torch.manual_seed(7)
    responses = P.sample_responses(lm, contexts, tokenizer.pad_token_id, CHAT_LENGTH, task.temperature)
    shape = (CHAT_UPDATES, CHAT_ROWS)
    call_sites = {"rows": CHAT_ROWS // 2, "ranks": 2, "response_length": CHAT_LENGTH, "samples_per_query": 1,
                  "temperature": task.temperature, "sampler": "policy", "pad_id": S.OPENAI_PAD_ID,
                  "query_stream": {"seed": 1, "excluded": 0}}  # fmt: skip
    path = tmp_path_factory.mktemp("chat-replay") / "replay.npz"
    np.savez(path, queries=np.array(queries).reshape(*shape, -1), responses=responses.numpy().reshape(*shape, -1),
             rows=np.array(rows).reshape(shape), call_sites=np.array(json.dumps(call_sites)))  # fmt: skip
    return path


def chat_flags(assets, *extra) -> list[str]:
    return ["--base-model", str(assets["model"]), "--task.chat-template", "--task.query-dataset",
            str(assets["questions"]), "--task.query-length", "40", "--task.response-length", str(CHAT_LENGTH),
            "--rewards.function", "tests.chat_rewards:word_count", "--ppo.whitening-ranks", "2", "--ppo.batch-size",
            str(CHAT_ROWS), "--ppo.total-episodes", str(CHAT_UPDATES * CHAT_ROWS), "--ppo.lr", "1e-3",
            "--local-rollout-forward-batch-size", "4", *extra]  # fmt: skip


@pytest.mark.parametrize("shares", [2, 4], ids=["1 share a process", "2 shares a process"])
def test_a_chat_task_with_fields_on_two_processes_is_the_task_on_one(tiny_chat_assets, chat_replay, tmp_path, shares):
    """The tiny chat task, its reward reading each query's `prompt` and `word` fields, the rollout cut where its last
    response ends: 2 processes (16 rows each, in chunks of 4, which agree on that column: each process's own responses
    end sooner or later) compute what 1 process computes, every metric of every update and the trained weights, and
    every field reaches the reward function beside its own query (tests/chat_rewards.py). The replay gives no epoch
    orders here, so the script's own minibatches() shuffles: with --ppo.whitening-ranks 4 each process holds 2 of the
    4 whitening shares (the default 8 shares on 2-4 GPUs is this case) and must draw what 1 process draws for them."""
    log, replay = tmp_path / "alignment.log", tmp_path / "replay.npz"
    given = dict(np.load(chat_replay))
    given["call_sites"] = np.array(json.dumps({**json.loads(str(given["call_sites"])), "ranks": shares,
                                               "rows": CHAT_ROWS // shares}))  # fmt: skip
    np.savez(replay, **given)
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"chat {nproc}"
        result = run_script("benchmark.openai.replay", "train_policy_accelerate.py", str(replay),
                            *chat_flags(tiny_chat_assets, "--output-dir", str(out), "--checkpoint-every",
                                        str(CHAT_UPDATES), "--ppo.whitening-ranks", str(shares)), nproc=nproc,
                            env={"CHAT_ALIGNMENT_LOG": str(log)})  # fmt: skip
        assert result.returncode == 0, failure(result)
        assert json.loads((out / "args.json").read_text())["ppo"]["whitening_ranks"] == shares
        runs[nproc] = out
    assert not log.exists(), log.read_text()
    lengths = [row["objective/sampled_length"] for row in read_jsonl(runs[1] / "metrics.jsonl")]
    assert all(length <= CHAT_LENGTH for length in lengths) and min(lengths) < CHAT_LENGTH  # the cut happened
    metrics = metric_differences(runs[2], runs[1])
    print(f"chat PPO, 2 processes: largest metric difference {metrics[0][0]:.1e} ({metrics[0][1]})")
    assert metrics[0][0] <= METRICS_RTOL, metrics[:3]
    initial = {**load_weights(tiny_chat_assets["model"]), "weight": torch.zeros(1, 64), "bias": torch.zeros(1)}
    weights = weight_differences(runs[2] / "policy", runs[1] / "policy", initial)  # the value head starts at 0
    print(f"chat PPO, 2 processes: largest weight difference {weights[0][0]:.1e} ({weights[0][1]})")
    assert weights[0][0] <= WEIGHTS_RTOL, weights[:3]
