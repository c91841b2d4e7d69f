"""--mixed-precision bf16 (a GPU speed option) checked on CPU: forwards under bf16 autocast stay within a stated
tolerance of fp32, the quantities PPO computes with stay fp32, and both scripts run end to end with it."""

import pytest
import torch
from conftest import read_jsonl, run_script
from transformers import GPT2Config, GPT2LMHeadModel

import train_policy_accelerate as P
import train_reward_accelerate as R

PAD = 999
LOGPROB_TOLERANCE = 0.05  # nats per token: bf16 keeps 8 bits of mantissa, ~3 significant digits per activation
VALUE_TOLERANCE = 0.02


def tiny_policy(seed: int = 0) -> P.PolicyAndValueWrapper:
    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_embd=64, n_head=4, n_positions=64))
    policy = P.PolicyAndValueWrapper(lm).eval()
    torch.nn.init.normal_(policy.value_head.weight, std=0.1)  # the zero init would make the value check trivial
    return policy


def test_bf16_autocast_logprobs_and_values_stay_within_tolerance_of_fp32():
    policy = tiny_policy()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, PAD, (8, 24), generator=generator)
    tokens[:3, :5] = PAD  # left-padded rows
    responses = tokens[:, 16:]
    with torch.no_grad():
        logits, values = policy(tokens, 16, PAD, 0.7)
        reference = P.logprobs_from_logits(logits, responses)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_bf16, values_bf16 = policy(tokens, 16, PAD, 0.7)
            logprobs_bf16 = P.logprobs_from_logits(logits_bf16, responses)
    assert values_bf16.dtype == torch.bfloat16  # autocast really ran in bf16 ...
    assert logits_bf16.dtype == logprobs_bf16.dtype == torch.float32  # ... but not logits / T nor the log-softmax
    difference = (logprobs_bf16 - reference).abs().max().item()
    assert 0 < difference < LOGPROB_TOLERANCE, difference
    assert (values_bf16.float() - values).abs().max().item() < VALUE_TOLERANCE


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_ppo_ratios_start_at_exactly_1_also_under_bf16(precision):
    """The rollout's policy log-probs and values (rollout_logprobs, no grad, under the main loop's autocast) are what
    the PPO epochs' first forward computes (with grad, under the autocast accelerate wraps the prepared model in),
    bit for bit, in PPO's shuffled row order: the first ratios are exactly 1 before any optimizer step, in fp32 and
    under bf16. The sampling loop's own KV-cached forwards differ from a full forward by up to 0.2 nats under bf16
    (measured on SmolLM2-135M): reusing them, as the earlier --logprobs-from-generation did, gave first ratios of
    0.82-1.21 and a first approxkl of 1.5e-3."""
    policy, ref_lm = tiny_policy(), tiny_policy(1).lm
    contexts = torch.randint(0, PAD, (8, 10), generator=torch.Generator().manual_seed(2))
    contexts[:3, :4] = PAD
    args = P.Args(local_rollout_forward_batch_size=8)
    args.task = P.TaskHParams(response_length=6, truncate_after=1, temperature=0.7)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    torch.manual_seed(0)
    with autocast:
        responses = P.generate_responses(policy.lm, contexts, PAD, args)
        query_responses = torch.cat([contexts, responses], 1)
        logprobs, _, values = P.rollout_logprobs(policy, ref_lm, query_responses, 10, PAD, args)
        order = torch.randperm(8)  # the first minibatch: the same rows in PPO's shuffled order
        logits, vpred = policy(query_responses[order], 10, PAD, 0.7)
        new_logprobs = P.logprobs_from_logits(logits, responses[order])
    assert vpred.requires_grad and vpred.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert torch.equal(new_logprobs, logprobs[order]) and torch.equal(vpred.float(), values[order])


def test_reward_loss_under_bf16_stays_within_tolerance_of_fp32():
    torch.manual_seed(0)
    backbone = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_embd=64, n_head=4)).transformer
    model = R.RewardModel(backbone, PAD).eval()
    queries, samples = torch.randint(0, PAD, (4, 12)), torch.randint(0, PAD, (4, 4, 6))
    best = torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        loss, _ = R.best_of_4_loss(model, queries, samples, best)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_bf16, _ = R.best_of_4_loss(model, queries, samples, best)
    assert loss_bf16.dtype == torch.float32
    assert loss_bf16.item() != loss.item()  # the forward really ran in bf16 (the same loss would pass trivially)
    assert loss_bf16.item() == pytest.approx(loss.item(), abs=0.02)


def test_both_scripts_run_end_to_end_with_bf16(tiny_assets, tmp_path):
    common = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"])]
    reward_flags = [*common, "--label-dataset", str(tiny_assets["small_labels"]), "--labels.num-train", "32",
                    "--batch-size", "16", "--rollout-batch-size", "16", "--normalize-samples", "16",
                    "--no-normalize-before", "--print-sample-output-freq", "2"]  # fmt: skip
    losses = {}
    for precision in ("no", "bf16"):
        output_dir = tmp_path / f"reward-{precision}"
        result = run_script("train_reward_accelerate.py", *reward_flags, "--mixed-precision", precision,
                            "--output-dir", str(output_dir))  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        losses[precision] = read_jsonl(output_dir / "metrics.jsonl")[0]["train/loss"]  # step 1: same weights, labels
    assert losses["bf16"] == pytest.approx(losses["no"], abs=0.02) and losses["bf16"] != losses["no"]

    policy_dir = tmp_path / "policy"
    result = run_script("train_policy_accelerate.py", *common, "--rewards.trained-model",
                        str(tmp_path / "reward-bf16" / "reward_model"), "--mixed-precision", "bf16",
                        "--task.query-length", "16", "--task.response-length", "8", "--task.truncate-after", "2",
                        "--ppo.batch-size", "16", "--ppo.whitening-ranks", "1", "--ppo.total-episodes", "32",
                        "--output-dir", str(policy_dir))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    updates = [row for row in read_jsonl(policy_dir / "metrics.jsonl") if "objective/kl" in row]
    assert len(updates) == 2 and updates[0]["objective/kl"] == 0.0  # policy and reference agree exactly at the start
    assert 0 <= updates[0]["ppo/policy/approxkl"] < 0.05
