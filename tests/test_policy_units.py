"""Unit tests of train_policy_accelerate.py: post-processing, rewards, whitening, GAE, PPO losses, KL controllers,
generation, log-probs and the value head.

Tiny random models built here, no network, no subprocess. Every expected number is written out by hand (the
derivation is in the comment next to it).
"""

import math
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM

import rlhf_data
import train_policy_accelerate as P
from tests.conftest import dominated_lm, one_line_error, tiny_gpt2_config, tiny_llama_config

PAD = 50257  # GPT-2's [PAD]: one past the 50257-token vocabulary
EOS = 50256
DOT = 13  # '.'


# ---------------------------------------------------------------------------------------------------------------
# 2. post-process responses (OAI lm_tasks.py, train_policy.py make_score_fn)


def response_with_dots(*positions: int) -> list[int]:
    row = [100 + i for i in range(24)]  # no '.' anywhere
    for position in positions:
        row[position] = DOT
    return row


def test_truncate_responses_by_hand():
    rows = [
        response_with_dots(18),  # cut after 18
        response_with_dots(10),  # only before truncate_after: kept whole, no cut
        response_with_dots(20, 22),  # cut after the first one at >= 16
        response_with_dots(),  # no '.'
        response_with_dots(3, 16),  # exactly at truncate_after counts
        response_with_dots(23),  # the last token: cut, nothing to pad
    ]
    postprocessed, has_cut = P.truncate_responses(torch.tensor(rows), DOT, 16, PAD)
    expected = [
        rows[0][:19] + [PAD] * 5,  # indices 19..23 padded
        rows[1],
        rows[2][:21] + [PAD] * 3,  # 21..23 padded, including the '.' at 22
        rows[3],
        rows[4][:17] + [PAD] * 7,
        rows[5],
    ]
    assert postprocessed.tolist() == expected
    assert has_cut.tolist() == [True, False, True, False, True, True]


class ConstantReward(nn.Module):
    """A stand-in reward model: 0.5 for every row; remembers what it was asked to score."""

    pad_id = PAD

    def forward(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        self.seen = torch.cat([queries, responses], 1)
        return torch.full((queries.shape[0],), 0.5)


def test_score_responses_scores_postprocessed_text_and_penalizes_uncut():
    args = P.Args()
    args.task = P.TaskHParams(response_length=24, truncate_after=16, penalty_reward_value=-1.0)
    responses = torch.tensor([response_with_dots(18), response_with_dots(10)])
    queries = torch.tensor([[PAD, 15496, 995], [15496, 995, 11]])
    reward_model = ConstantReward()
    postprocessed, scores = P.score_responses(reward_model, queries, responses, DOT, args.task, 64, {})
    assert scores.tolist() == [0.5, -1.0]
    assert torch.equal(reward_model.seen, torch.cat([queries, postprocessed], 1))
    assert postprocessed[0, 19:].tolist() == [PAD] * 5


def test_no_rejection_sampling_scores_every_response_whole_and_never_penalizes():
    args = P.Args()
    args.task = P.TaskHParams(response_length=24, truncate_after=16, rejection_sampling=False)
    responses = torch.tensor([response_with_dots(18), response_with_dots(10)])  # the first would be cut, the second
    queries = torch.tensor([[PAD, 15496, 995], [15496, 995, 11]])  # penalized, with rejection sampling
    reward_model = ConstantReward()
    postprocessed, scores = P.score_responses(reward_model, queries, responses, DOT, args.task, 64, {})
    assert scores.tolist() == [0.5, 0.5]
    assert torch.equal(postprocessed, responses) and torch.equal(reward_model.seen, torch.cat([queries, responses], 1))


def write_reward_module(directory, body: str, monkeypatch) -> None:
    """A user's reward module `user_rewards` in `directory`, on sys.path (and not the one an earlier test imported)."""
    (directory / "user_rewards.py").write_text(body)
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)


def test_reward_function_scores_the_decoded_texts_with_the_same_truncation_and_penalty(
    gpt2_tokenizer_dir, tmp_path, monkeypatch
):
    """--rewards.function module:callable: called with the decoded (bare) queries and truncated responses, its scores
    take a reward model's place in score_responses, where an uncut response still gets the penalty."""
    tokenizer = P.load_tokenizer(str(gpt2_tokenizer_dir))
    write_reward_module(tmp_path, "SEEN = []\ndef score(queries, responses):\n    SEEN.append((queries, responses))\n"
                                  "    return [len(q) + 0.5 * len(r) for q, r in zip(queries, responses)]\n", monkeypatch)  # fmt: skip
    function = P.RewardFunction("user_rewards:score", tokenizer)
    args = P.Args()
    args.task = P.TaskHParams(response_length=24, truncate_after=16, penalty_reward_value=-1.0)
    responses = torch.tensor([response_with_dots(18), response_with_dots(10)])  # cut after 18; never cut
    queries = torch.tensor([[PAD, 15496, 995], [15496, 995, 11]])  # "Hello world", "Hello world,"
    postprocessed, scores = P.score_responses(function, queries, responses, DOT, args.task, 64, {})
    seen_queries, seen_responses = __import__("user_rewards").SEEN[0]
    assert seen_queries == ["Hello world", "Hello world,"]
    assert seen_responses == tokenizer.batch_decode(postprocessed, skip_special_tokens=True)
    assert scores.dtype == torch.float32
    assert scores.tolist() == [11 + 0.5 * len(seen_responses[0]), -1.0]  # the second never cut: the penalty


def test_reward_function_by_labeler_name_is_the_labelers_score_of_the_response(gpt2_tokenizer_dir):
    tokenizer = P.load_tokenizer(str(gpt2_tokenizer_dir))
    queries = tokenizer(["I hate it.", "So bad."], padding=True, return_tensors="pt")["input_ids"]
    responses = tokenizer([" A wonderful, lovely day", " A terrible, awful day"], padding=True, return_tensors="pt")
    responses = responses["input_ids"]
    scores = P.RewardFunction("sentiment", tokenizer)(queries, responses)
    expected = P.simulated_labeler_scores("sentiment", [" A wonderful, lovely day", " A terrible, awful day"])
    assert scores.tolist() == pytest.approx(expected, abs=1e-6) and expected[0] > 0.5 > -0.5 > expected[1]


@pytest.mark.parametrize(
    ("spec", "body", "words"),
    [
        ("user_rewards", None, "expected module:callable"),
        ("no_such_module:score", None, "cannot import it"),
        ("user_rewards:missing", "x = 1\n", "cannot import it"),
        ("user_rewards:x", "x = 1\n", "not callable"),
    ],
)
def test_reward_function_that_cannot_be_used_is_one_line_naming_the_flag(
    gpt2_tokenizer_dir, tmp_path, monkeypatch, spec, body, words
):
    if body is not None:
        write_reward_module(tmp_path, body, monkeypatch)
    with pytest.raises(SystemExit) as failure:
        P.RewardFunction(spec, P.load_tokenizer(str(gpt2_tokenizer_dir)))
    message = one_line_error(failure)
    assert "--rewards.function" in message and spec in message and words in message


def test_reward_function_returning_the_wrong_number_of_scores_is_one_line(gpt2_tokenizer_dir, tmp_path, monkeypatch):
    write_reward_module(tmp_path, "def score(queries, responses):\n    return [1.0]\n", monkeypatch)
    function = P.RewardFunction("user_rewards:score", P.load_tokenizer(str(gpt2_tokenizer_dir)))
    with pytest.raises(SystemExit) as failure:
        function(torch.tensor([[15496], [995]]), torch.tensor([[13], [11]]))
    message = one_line_error(failure)
    assert "--rewards.function user_rewards:score" in message and "(1,) scores for 2 responses" in message


# ---------------------------------------------------------------------------------------------------------------
# 3. per-token rewards


def test_compute_rewards_kl_penalty_everywhere_score_on_the_last_token():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, -0.6]])
    non_score_reward, rewards = P.compute_rewards(torch.tensor([2.0, -1.0]), logprobs, ref_logprobs, 0.1)
    # kl = [[0.5, -1, 0], [-0.2, 0, 0.5]] (k1); non_score = -0.1 kl; the score added at index T-1 only
    kl = P.kl_estimates(logprobs, ref_logprobs)["k1"]
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [-0.2, 0.0, 0.5]]))
    torch.testing.assert_close(non_score_reward, torch.tensor([[-0.05, 0.1, 0.0], [0.02, 0.0, -0.05]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 2.0], [0.02, 0.0, -1.05]]))


def test_compute_rewards_score_at_t_minus_1_even_when_truncated_earlier():
    responses = torch.tensor([response_with_dots(18)])
    postprocessed, has_cut = P.truncate_responses(responses, DOT, 16, PAD)
    assert has_cut.item() and postprocessed[0, 19].item() == PAD  # the response ends at index 18
    zeros = torch.zeros(1, 24)
    _, rewards = P.compute_rewards(torch.tensor([1.5]), zeros, zeros, 0.15)
    assert rewards[0, 23].item() == 1.5
    assert rewards[0, :23].abs().sum().item() == 0.0  # not at 18, the last real token


def test_no_per_token_kl_puts_the_same_total_penalty_on_the_last_token_only():
    """--rewards.no-per-token-kl (an ablation): the example above, with each row's whole KL penalty at T-1."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, -0.6]])
    scores = torch.tensor([2.0, -1.0])
    non_score_reward, rewards = P.compute_rewards(scores, logprobs, ref_logprobs, 0.1, per_token=False)
    # row sums of -0.1 kl: 0.05 and -0.03, at index T-1 only
    torch.testing.assert_close(non_score_reward, torch.tensor([[0.0, 0.0, 0.05], [0.0, 0.0, -0.03]]))
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.05], [0.0, 0.0, -1.03]]))


# ---------------------------------------------------------------------------------------------------------------
# 4. whitening and 5. GAE

X = [[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]]
WHITENED_NO_SHIFT = [[0.0508, 0.4381, 0.8254], [1.2127, 1.6000, 1.9873], [2.3746, 2.7619, 3.1492]]


def test_whiten_by_hand():
    x = torch.tensor(X)
    torch.testing.assert_close(P.whiten(x, shift_mean=False), torch.tensor(WHITENED_NO_SHIFT), atol=1e-4, rtol=0)
    # shift_mean=True: the same minus the mean 1.6; biased variance (an unbiased one would give 0.9428 here)
    whitened = P.whiten(x)
    torch.testing.assert_close(whitened, torch.tensor(WHITENED_NO_SHIFT) - 1.6, atol=1e-4, rtol=0)
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)


def test_gae_by_hand_without_reward_whitening():
    ppo = P.PpoHParams(gamma=1.0, lam=0.95, whiten_rewards=False)
    rewards, values = torch.tensor([[0.1, -0.2, 1.0]]), torch.tensor([[0.5, 0.4, 0.3]])
    advantages, returns = P.compute_advantages(rewards, values, ppo)
    # δ = [0.1 + 0.4 - 0.5, -0.2 + 0.3 - 0.4, 1.0 - 0.3] = [0, -0.3, 0.7]; A_2 = 0.7, A_1 = -0.3 + 0.95 * 0.7 = 0.365,
    # A_0 = 0 + 0.95 * 0.365 = 0.34675; returns = A + V
    torch.testing.assert_close(returns, torch.tensor([[0.84675, 0.765, 1.0]]), atol=1e-6, rtol=0)
    # whiten([0.34675, 0.365, 0.7]): mean 0.470583, biased std 0.162394
    torch.testing.assert_close(advantages, torch.tensor([[-0.762553, -0.650171, 1.412724]]), atol=1e-5, rtol=0)


def test_no_whiten_advantages_returns_gae_as_it_is():
    """--ppo.no-whiten-advantages (an ablation): the advantages of the example above before whitening; the returns
    do not change."""
    ppo = P.PpoHParams(gamma=1.0, lam=0.95, whiten_rewards=False, whiten_advantages=False)
    rewards, values = torch.tensor([[0.1, -0.2, 1.0]]), torch.tensor([[0.5, 0.4, 0.3]])
    advantages, returns = P.compute_advantages(rewards, values, ppo)
    torch.testing.assert_close(advantages, torch.tensor([[0.34675, 0.365, 0.7]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[0.84675, 0.765, 1.0]]), atol=1e-6, rtol=0)


def test_gae_with_reward_whitening_uses_the_whitened_rewards():
    ppo = P.PpoHParams(gamma=1.0, lam=0.95, whiten_rewards=True)
    _, returns = P.compute_advantages(torch.tensor(X), torch.zeros(3, 3), ppo)
    # V = 0: returns = λ-discounted sums of the whitened rewards (shift_mean=False), e.g. row 0:
    # 0.8254; 0.4381 + 0.95 * 0.8254 = 1.22223; 0.0508 + 0.95 * 1.22223 = 1.21192
    w = WHITENED_NO_SHIFT
    expected = [[r[0] + 0.95 * (r[1] + 0.95 * r[2]), r[1] + 0.95 * r[2], r[2]] for r in w]
    assert expected[0] == pytest.approx([1.21192, 1.22223, 0.8254], abs=1e-5)
    torch.testing.assert_close(returns, torch.tensor(expected), atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 6. PPO losses


def ppo_example():
    ppo = P.PpoHParams(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    ratio = torch.tensor([[1.5, 0.9], [0.5, 1.5]])
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    new_logprobs = (logprobs + ratio.log()).requires_grad_()
    advantages = torch.tensor([[1.0, -2.0], [-1.0, -1.0]])
    values = torch.zeros(2, 2)
    vpred = torch.tensor([[0.5, 0.1], [-0.5, 0.3]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0], [0.0, 0.3]])
    loss, stats = P.ppo_losses(new_logprobs, vpred, logprobs, values, advantages, returns, ppo)
    return loss, stats, new_logprobs, vpred


def test_ppo_losses_by_hand_with_and_without_clipping():
    loss, stats, new_logprobs, vpred = ppo_example()
    # policy, -A r vs -A clip(r, 0.8, 1.2), the max:
    #   r 1.5, A  1: -1.5 vs -1.2 -> -1.2 (clipped)    r 0.9, A -2: 1.8 vs 1.8 -> 1.8 (inside the range)
    #   r 0.5, A -1:  0.5 vs  0.8 ->  0.8 (clipped)    r 1.5, A -1: 1.5 vs 1.2 -> 1.5 (outside, unclipped wins)
    #   mean = (-1.2 + 1.8 + 0.8 + 1.5) / 4 = 0.725
    # value (V_old = 0, vpred clipped to ±0.2), max of squared errors:
    #   0.5 -> 0.2, R 1: 0.25 vs 0.64 -> 0.64     0.1 -> 0.1, R 0: 0.01 vs 0.01 -> 0.01
    #   -0.5 -> -0.2, R 0: 0.25 vs 0.04 -> 0.25   0.3 -> 0.2, R 0.3: 0 vs 0.01 -> 0.01
    #   vf_loss = 0.5 * 0.91 / 4 = 0.11375; loss = 0.725 + 0.1 * 0.11375 = 0.736375
    assert stats["ppo/loss/policy"].item() == pytest.approx(0.725, abs=1e-6)
    assert stats["ppo/loss/value"].item() == pytest.approx(0.11375, abs=1e-6)
    assert loss.item() == pytest.approx(0.736375, abs=1e-6)
    assert stats["ppo/loss/total"].item() == pytest.approx(0.736375, abs=1e-6)
    # approxkl = 0.5 mean(log r ^ 2) = 0.5 (0.164402 + 0.011101 + 0.480453 + 0.164402) / 4
    assert stats["ppo/policy/approxkl"].item() == pytest.approx(0.102545, abs=1e-6)
    assert stats["ppo/val/vpred"].item() == pytest.approx(0.1, abs=1e-6)
    assert stats["ppo/val/error"].item() == pytest.approx(0.1275, abs=1e-6)  # mean(0.25, 0.01, 0.25, 0)
    # gradients flow only through the unclipped terms: d/dlogp (-A r) / 4 = -A r / 4
    loss.backward()
    torch.testing.assert_close(new_logprobs.grad, torch.tensor([[0.0, 0.45], [0.0, 0.375]]))
    # d loss / d vpred = 0.1 * 0.5 * 2 (vpred - R) / 4 = 0.025 (vpred - R) where the unclipped term wins (or the
    # clip is inactive), 0 where the saturated clipped term wins
    torch.testing.assert_close(vpred.grad, torch.tensor([[0.0, 0.0025], [-0.0125, 0.0]]))


def test_no_clip_value_takes_the_plain_squared_error():
    """--ppo.no-clip-value (an ablation): in the example above the value loss is 0.5 mean((vpred - R)^2) =
    0.5 * (0.25 + 0.01 + 0.25 + 0) / 4 = 0.06375 instead of 0.11375; the policy loss is unchanged, and the gradient
    reaches vpred at every token: 0.025 (vpred - R)."""
    ppo = P.PpoHParams(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, clip_value=False)
    _, _, new_logprobs, vpred = ppo_example()
    vpred = vpred.detach().requires_grad_()
    logprobs, values = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]), torch.zeros(2, 2)
    advantages, returns = torch.tensor([[1.0, -2.0], [-1.0, -1.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.3]])
    loss, stats = P.ppo_losses(new_logprobs.detach(), vpred, logprobs, values, advantages, returns, ppo)
    assert stats["ppo/loss/value"].item() == pytest.approx(0.06375, abs=1e-6)
    assert stats["ppo/loss/policy"].item() == pytest.approx(0.725, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(vpred.grad, torch.tensor([[-0.0125, 0.0025], [-0.0125, 0.0]]))


def test_ppo_clipfrac_counts_tokens_where_the_clipped_term_wins_like_oai():
    """OAI train_policy.py: pg_clipfrac = mean(pg_losses2 > pg_losses), vf_clipfrac = mean(vf_losses2 > vf_losses1).
    In the example above the clipped policy term wins at 2 of 4 tokens (r 1.5 with A 1, r 0.5 with A -1); r 1.5
    with A -1 is outside the range but the unclipped term wins. Same for the value: 2 of 4 (R 1 and R 0.3)."""
    _, stats, _, _ = ppo_example()
    clipfracs = stats["ppo/policy/clipfrac"].item(), stats["ppo/val/clipfrac"].item()
    assert clipfracs == (0.5, 0.5)


# ---------------------------------------------------------------------------------------------------------------
# KL controllers (OAI train_policy.py AdaptiveKLController)


@pytest.mark.parametrize("kl, expected", [(3.0, 0.148464), (6.6, 0.150768), (12.0, 0.151536), (6.0, 0.15)])
def test_adaptive_kl_controller_by_hand(kl, expected):
    # e = clip(KL/6 - 1, ±0.2) = -0.2, 0.1, 0.2, 0; 0.15 * (1 + e * 512 / 10000)
    controller = P.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    controller.update(kl, 512)
    assert controller.value == pytest.approx(expected, abs=1e-9)


def test_fixed_kl_controller_stays_fixed():
    controller = P.FixedKLController(0.03)
    for kl in (0.0, 3.0, 100.0):
        controller.update(kl, 512)
    assert controller.value == 0.03


# ---------------------------------------------------------------------------------------------------------------
# learning-rate schedule (OAI train_policy.py: lr_u = lr (1 - (u-1)/N), u = 1..N)


def test_policy_lr_schedule_first_and_last_update():
    assert P.linear_lr(1e-5, 1 - 1, 1954) == 1e-5
    assert P.linear_lr(1e-5, 1954 - 1, 1954) == pytest.approx(1e-5 / 1954, rel=1e-12)
    assert P.linear_lr(2e-6, 500, 1000) == pytest.approx(1e-6, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# derived batch sizes


def policy_args(**ppo) -> P.Args:
    return P.Args(rewards=P.RewardHParams(trained_model="reward_model"), ppo=P.PpoHParams(**ppo))


def test_validate_args_derives_per_process_sizes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = P.validate_args(policy_args(nminibatches=2, gradient_accumulation_steps=4))
    assert (args.local_batch_size, args.local_mini_batch_size, args.micro_batch_size) == (64, 32, 8)
    assert args.num_updates == 1954  # ceil(1,000,000 / 512)


@pytest.mark.parametrize(
    "world_size, ppo, flag",
    [
        ("2", dict(batch_size=15), "--ppo.batch-size"),
        ("2", dict(nminibatches=3), "--ppo.nminibatches"),
        ("2", dict(gradient_accumulation_steps=3), "--ppo.gradient-accumulation-steps"),
        ("2", dict(batch_size=32, nminibatches=4), "--ppo.whiten-rewards"),  # 4 rows per process-minibatch
        ("8", dict(batch_size=32), "--ppo.whiten-rewards"),
    ],
)
def test_validate_args_rejects_inconsistent_sizes_naming_the_flag(monkeypatch, world_size, ppo, flag):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as failure:
        P.validate_args(policy_args(**ppo))
    assert flag in one_line_error(failure)


@pytest.mark.parametrize("world_size, local_shares", [("1", 8), ("2", 4), ("8", 1)])
def test_whitening_shares_come_from_the_global_batch_not_the_processes(monkeypatch, world_size, local_shares):
    """OAI's 8 ranks each whitened their own 64 of the 512 rows: every process count here holds the same shares."""
    monkeypatch.setenv("WORLD_SIZE", world_size)
    args = P.validate_args(policy_args())
    assert args.local_whitening_ranks == local_shares
    assert args.local_batch_size // args.local_whitening_ranks == 64


def test_validate_args_whitening_ranks_must_be_a_multiple_of_the_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(SystemExit) as failure:
        P.validate_args(policy_args())
    assert "--ppo.whitening-ranks 8" in one_line_error(failure)


def test_validate_args_small_minibatches_are_fine_without_whitening(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = P.validate_args(policy_args(batch_size=32, nminibatches=4, whiten_rewards=False))
    assert args.local_mini_batch_size == 4


def test_validate_args_truncate_after_must_be_inside_the_response(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = policy_args()
    args.task = P.TaskHParams(response_length=24, truncate_after=24)
    with pytest.raises(SystemExit) as failure:
        P.validate_args(args)
    assert "--task.truncate-after" in one_line_error(failure)


# ---------------------------------------------------------------------------------------------------------------
# generation


def test_sampling_returns_exactly_t_tokens_even_when_eos_dominates():
    lm = dominated_lm(EOS)
    queries = torch.tensor([[PAD, PAD, 15496, 995], [15496, 995, 11, 339]])  # left-padded, pad id out of vocab
    responses = P.sample_responses(lm, queries, PAD, 6, 0.7)
    assert responses.shape == (2, 6)
    assert responses.eq(EOS).all()  # the policy is free to emit EOS, and sampling goes on after it
    with pytest.raises(AssertionError):  # guard: stock generate() with the model's own settings stops at EOS
        lm.generation_config.eos_token_id = EOS
        assert lm.generate(queries[1:], max_new_tokens=6, do_sample=True).shape[1] == 4 + 6


def test_a_pad_id_inside_the_models_vocabulary_is_never_sampled_and_has_no_probability():
    """A tokenizer with a pad token of its own (or a head larger than the tokenizer): the pad id is a row of the LM
    head. Here the model would emit it with probability ~1 (logit 64 vs 0): the sampler never does, and the
    log-probs and entropies of the rollout and the PPO epochs give it none (OAI cuts the logits to the vocabulary);
    the earlier code sampled it, and its log-prob (recomputed with the pad masked out of attention) was off."""
    pad_id = 7
    lm = dominated_lm(pad_id)
    policy, ref_lm = P.PolicyAndValueWrapper(lm), dominated_lm(pad_id)
    contexts = torch.tensor([[pad_id, 15496, 995, 11], [15496, 995, 11, 339]])  # left-padded with that pad id
    torch.manual_seed(0)
    responses = P.sample_responses(lm, contexts, pad_id, 6, 0.7)
    assert responses.shape == (2, 6) and not (responses == pad_id).any(), "the pad id was sampled"
    args = P.Args(local_rollout_forward_batch_size=2)
    args.task = P.TaskHParams(response_length=6, truncate_after=1, temperature=0.7)
    logprobs, ref_logprobs, _ = P.rollout_logprobs(
        policy, ref_lm, torch.cat([contexts, responses], 1), 4, pad_id, 0.7, 2
    )
    with torch.no_grad():
        logits, _ = policy(torch.cat([contexts, responses], 1), 4, pad_id, 0.7)
        _, entropy = P.logprobs_from_logits(logits, responses, with_entropy=True)
    probabilities = logits.softmax(-1)
    assert probabilities[..., pad_id].max() == 0 and torch.isfinite(entropy).all()
    # the other 50,256 tokens share the mass evenly: log-prob -ln(50256), entropy ln(50256)
    torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(50256)))
    torch.testing.assert_close(entropy, torch.full_like(entropy, math.log(50256)))
    torch.testing.assert_close(ref_logprobs, logprobs)


def sample_without_cache(lm, contexts: torch.Tensor, pad_id: int, length: int, temperature: float):
    """The reference the loop must equal: a full forward over context ⊕ the tokens so far for every new token (no KV
    cache), softmax(logits / T), and one uniform per row by inverse CDF, drawn in the same order."""
    responses = contexts[:, :0]
    for _ in range(length):
        with torch.no_grad():
            hidden = P.padded_forward(lm.base_model, torch.cat([contexts, responses], 1), pad_id)[:, -1]
        probabilities = F.softmax(lm.get_output_embeddings()(hidden) / temperature, dim=-1).double()
        uniform = torch.rand(len(contexts), 1, dtype=torch.float64)
        cdf = probabilities.cumsum(-1)
        responses = torch.cat([responses, (cdf <= uniform * cdf[:, -1:]).sum(-1, keepdim=True)], 1)
    return responses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sampling_loop_draws_what_full_forwards_draw(kind):
    """The loop (KV cache, logits / T, one inverse-CDF draw per step) draws exactly what full forwards without a
    cache draw from the same RNG state, on left-padded contexts, and other seeds give other responses. With several
    samples per context it draws what the repeated contexts draw: the shared context forward changes nothing."""
    lm = make_lm(kind)
    pad_id = lm.config.vocab_size
    contexts = torch.randint(0, 1000, (6, 7), generator=torch.Generator().manual_seed(0))
    contexts[1, :3], contexts[4, :6] = pad_id, pad_id
    torch.manual_seed(5)
    responses = P.sample_responses(lm, contexts, pad_id, 8, 0.7)
    torch.manual_seed(5)
    assert torch.equal(responses, sample_without_cache(lm, contexts, pad_id, 8, 0.7))
    torch.manual_seed(6)
    assert not torch.equal(responses, P.sample_responses(lm, contexts, pad_id, 8, 0.7))
    torch.manual_seed(7)
    shared = P.sample_responses(lm, contexts[:3], pad_id, 8, 0.7, samples_per_context=4)
    torch.manual_seed(7)
    repeated = P.sample_responses(lm, contexts[:3].repeat_interleave(4, 0), pad_id, 8, 0.7)
    assert shared.shape == (12, 8) and torch.equal(shared, repeated)
    assert len(set(map(tuple, shared[:4].tolist()))) > 1  # a context's samples differ from each other


def test_sampling_is_softmax_of_logits_over_temperature_whatever_the_model_config_says():
    """A model whose generation_config sets a repetition penalty and bans repeated tokens (stock generate() samples
    from other scores then): the loop's draws follow softmax(logits / T) of the full forward. Checked as frequencies:
    2,000 draws of the first token of one context against the exact probabilities."""
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=8)).eval()
    lm.generation_config.repetition_penalty, lm.generation_config.no_repeat_ngram_size = 5.0, 1
    contexts = torch.tensor([[5, 6, 5, 7]]).repeat(2000, 1)
    torch.manual_seed(1)
    responses = P.sample_responses(lm, contexts, PAD, 1, 0.7)
    with torch.no_grad():
        probabilities = F.softmax(lm(contexts[:1]).logits[0, -1] / 0.7, dim=-1)  # (V,)
    frequencies = torch.bincount(responses[:, 0], minlength=8).float() / 2000
    assert (frequencies - probabilities).abs().max() < 0.04  # 3.5 sigma of a binomial at p = 0.5, n = 2000
    assert frequencies[[5, 6, 7]].sum() > 0.05  # tokens of the context are drawn: nothing is banned or penalised


# ---------------------------------------------------------------------------------------------------------------
# log-probs, values


def make_lm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(tiny_gpt2_config()).eval()
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logits_are_full_model_logits_of_the_response_positions_over_temperature(kind):
    lm = make_lm(kind)
    pad_id = lm.config.vocab_size  # one past the vocabulary, like GPT-2's [PAD]
    generator = torch.Generator().manual_seed(0)
    context_length, temperature = 5, 0.7
    query_responses = torch.randint(0, 1000, (3, context_length + 4), generator=generator)
    query_responses[1, :2] = pad_id  # left-padded queries
    query_responses[2, :4] = pad_id
    mask = query_responses != pad_id
    with torch.no_grad():
        full = lm(
            input_ids=torch.where(mask, query_responses, 0),
            attention_mask=mask,
            position_ids=mask.cumsum(1) - mask.long(),
        ).logits  # (3, C + T, V)
        expected = full[:, context_length - 1 : -1] / temperature  # (3, T, V)
        logits = P.lm_logits(lm, query_responses, context_length, pad_id, temperature)
        policy = P.PolicyAndValueWrapper(lm)
        policy_logits, values = policy(query_responses, context_length, pad_id, temperature)
        unpadded = lm(query_responses[:1]).logits[:, context_length - 1 : -1] / temperature  # no pad: plain forward
    assert logits.shape == (3, 4, lm.config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(policy_logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[:1], unpadded, atol=1e-5, rtol=1e-5)
    assert torch.equal(values, torch.zeros(3, 4))


def test_value_head_starts_at_exactly_zero():
    policy = P.PolicyAndValueWrapper(make_lm("gpt2"))
    assert policy.value_head.weight.abs().sum().item() == 0.0 and policy.value_head.bias.item() == 0.0
    query_responses = torch.tensor([[PAD, 15496, 995, 11, 339, 561]])
    with torch.no_grad():
        _, values = policy(query_responses, 3, PAD, 0.7)
    assert values.tolist() == [[0.0, 0.0, 0.0]]
    assert policy.value_head.weight.requires_grad  # trained with the trunk (one optimizer)


def test_no_zero_value_head_keeps_a_random_init_and_nothing_else_changes():
    """--no-zero-value-head (an ablation): nn.Linear's default init, so the first values are not 0; the LM is the
    same model and its logits do not change."""
    lm = make_lm("gpt2")
    query_responses = torch.tensor([[PAD, 15496, 995, 11, 339, 561]])
    with torch.no_grad():
        zero_logits, _ = P.PolicyAndValueWrapper(lm)(query_responses, 3, PAD, 0.7)
        policy = P.PolicyAndValueWrapper(lm, zero_init=False)
        logits, values = policy(query_responses, 3, PAD, 0.7)
    assert policy.value_head.weight.abs().min().item() > 0 and values.abs().min().item() > 0
    assert torch.equal(logits, zero_logits)


def test_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # p = [1/4, 3/4] then [1/2, 1/2]
    logprobs = P.logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(logprobs, torch.tensor([[math.log(0.75), math.log(0.5)]]))  # -0.287682, -0.693147
    same_logprobs, entropy = P.logprobs_from_logits(logits, torch.tensor([[1, 0]]), with_entropy=True)
    torch.testing.assert_close(same_logprobs, logprobs)
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335; ln 2 = 0.693147
    torch.testing.assert_close(entropy, torch.tensor([[0.562335, 0.693147]]), atol=1e-6, rtol=0)


def test_no_scale_logprobs_takes_the_log_probs_of_the_raw_logits_but_samples_at_the_temperature():
    """--task.no-scale-logprobs (an ablation): the same draws (sampling stays at T = 0.7), but the policy and
    reference log-probs are those of logits / 1, not logits / 0.7; values unchanged."""
    lm, ref_lm = make_lm("gpt2"), make_lm("gpt2")
    pad_id = lm.config.vocab_size
    policy = P.PolicyAndValueWrapper(lm)
    contexts = torch.randint(0, 1000, (4, 6), generator=torch.Generator().manual_seed(0))
    args = P.Args(local_rollout_forward_batch_size=4)
    results = {}
    for scale in (True, False):
        args.task = P.TaskHParams(response_length=5, truncate_after=1, temperature=0.7, scale_logprobs=scale)
        torch.manual_seed(0)
        responses = P.generate_responses(lm, contexts, pad_id, 5, 0.7, 4)
        query_responses = torch.cat([contexts, responses], 1)
        results[scale] = (
            responses,
            *P.rollout_logprobs(policy, ref_lm, query_responses, 6, pad_id, 0.7 if scale else 1.0, 4),
        )
    (responses, logprobs, ref_logprobs, values), raw = results[True], results[False]
    assert torch.equal(raw[0], responses) and torch.equal(raw[3], values)
    query_responses = torch.cat([contexts, responses], 1)
    with torch.no_grad():
        for model, scaled, unscaled in ((lm, logprobs, raw[1]), (ref_lm, ref_logprobs, raw[2])):
            expected = {t: P.logprobs_from_logits(P.lm_logits(model, query_responses, 6, pad_id, t), responses)
                        for t in (0.7, 1.0)}  # fmt: skip
            torch.testing.assert_close(scaled, expected[0.7], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(unscaled, expected[1.0], atol=1e-5, rtol=1e-5)
            assert (scaled - unscaled).abs().max() > 0.05  # a difference worth the name


# ---------------------------------------------------------------------------------------------------------------
# whitening groups: OpenAI's 8 ranks, whatever the number of processes (OAI train_policy.py PPOTrainer.loss)


def openai_whiten(x, shift_mean=True):
    """OAI utils/core.py whiten: tf.nn.moments over all axes (biased variance), rsqrt(var + 1e-8)."""
    mean, var = x.mean(), x.var()
    whitened = (x - mean) / np.sqrt(var + 1e-8)
    return whitened + mean if not shift_mean else whitened


def openai_rank_advantages(rewards, values, gamma=1.0, lam=0.95):
    """OAI train_policy.py PPOTrainer.loss on one rank's minibatch: whitened rewards, GAE, whitened advantages."""
    rewards, last, advantages = openai_whiten(rewards, shift_mean=False), 0.0, []
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
        last = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last
        advantages.append(last)
    advantages = np.stack(advantages[::-1], axis=1)
    return openai_whiten(advantages), advantages + values


def synthetic_batch():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(512, 24, generator=generator, dtype=torch.float64) * torch.rand(512, 1, generator=generator)
    values = torch.randn(512, 24, generator=generator, dtype=torch.float64)
    return rewards, values


def our_advantages(rank: int, processes: int):
    """What process `rank` of `processes` computes for its rows of the global batch of 512 (one minibatch), by the
    script's own sizes, minibatches and compute_advantages; returned in row order."""
    args = P.validate_args(policy_args())  # WORLD_SIZE set by the caller
    assert args.world_size == processes
    rewards, values = (x[rank * args.local_batch_size :][: args.local_batch_size] for x in synthetic_batch())
    (mini_ids,) = P.minibatches(args.local_batch_size, args.local_whitening_ranks, 1, "cpu")
    advantages, returns = P.compute_advantages(rewards[mini_ids], values[mini_ids], args.ppo)  # (G, rows, T)
    ordered = torch.zeros(2, *rewards.shape, dtype=rewards.dtype)
    ordered[:, mini_ids.flatten()] = torch.stack([advantages.flatten(0, 1), returns.flatten(0, 1)])
    return ordered


def whitening_process(rank: int, port: int, output) -> None:
    import os

    import torch.distributed as dist

    os.environ["WORLD_SIZE"] = "2"  # this is a fresh process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gathered = [torch.zeros(2, 256, 24, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(gathered, our_advantages(rank, 2))
    if rank == 0:
        torch.save(torch.cat(gathered, 1), output)
    dist.destroy_process_group()


def test_whitening_on_1_and_2_processes_equals_openais_8_ranks(tmp_path, monkeypatch):
    import socket

    import torch.multiprocessing as mp

    monkeypatch.setenv("WORLD_SIZE", "1")
    one_process = our_advantages(0, 1)  # (2, 512, 24): advantages, returns
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(whitening_process, args=(port, tmp_path / "two.pt"), nprocs=2, start_method="spawn")
    two_processes = torch.load(tmp_path / "two.pt")
    rewards, values = (x.numpy() for x in synthetic_batch())
    openai = [openai_rank_advantages(rewards[64 * r : 64 * (r + 1)], values[64 * r : 64 * (r + 1)]) for r in range(8)]
    openai = torch.from_numpy(np.stack([np.concatenate([rank[i] for rank in openai]) for i in (0, 1)]))  # 8 × 64 rows
    torch.testing.assert_close(one_process, two_processes, atol=1e-12, rtol=0)
    torch.testing.assert_close(one_process, openai, atol=1e-9, rtol=0)
    whole, _ = P.compute_advantages(*synthetic_batch(), P.validate_args(policy_args()).ppo)  # one group of 512 rows
    assert (whole - openai[0]).abs().mean() > 0.01  # what whitening over the whole process batch used to give


def test_share_moments_are_openais_per_rank_statistics_averaged():
    """ppo/returns/{mean,var}, ppo/val/{mean,var}: OAI's tf.nn.moments of each rank's minibatch, then the mean over
    ranks (mpi_allreduce_mean); computed on whole shares, so gradient accumulation cannot change them."""
    generator = torch.Generator().manual_seed(0)
    returns, values = torch.randn(4, 8, 5, generator=generator), torch.randn(4, 8, 5, generator=generator) * 3
    stats = P.share_moments(returns, values)
    assert stats["ppo/returns/var"].item() == pytest.approx(returns.reshape(4, -1).var(1, unbiased=False).mean().item())
    assert stats["ppo/val/var"].item() == pytest.approx(values.reshape(4, -1).var(1, unbiased=False).mean().item())
    assert stats["ppo/val/mean"].item() == pytest.approx(values.mean().item())
    micro_batches = returns.reshape(-1, 5).split(4)  # the old way: the average of micro-batch variances reads low
    assert torch.stack([m.var(unbiased=False) for m in micro_batches]).mean() < stats["ppo/returns/var"]


def test_elapsed_fps_is_the_current_updates_like_openai_and_the_average_is_kept_apart(monkeypatch):
    args = P.validate_args(policy_args(batch_size=64))
    timer = types.SimpleNamespace(times={"time/generation": 1.0}, device=torch.device("cpu"), start=10.0)
    run = types.SimpleNamespace(elapsed=lambda: 100.0)
    monkeypatch.setattr(P.time, "perf_counter", lambda: 12.0)
    stats = P.timing_stats(run, None, timer, torch.zeros(64, 64), 5, args)
    assert stats["elapsed/fps"] == 64 * 24 / 2.0  # this update took 2 s (OAI train_policy.py: per update)
    assert stats["elapsed/fps_average"] == 5 * 64 * 24 / 100.0  # since the start


def test_held_out_queries_keep_every_text_read_for_them_out_of_training(gpt2_tokenizer_dir, tmp_path):
    """The gold evaluation's queries come from the first texts of a fixed order; every text read for them, also one
    that yielded no query, is kept out of the training stream, which then never meets a held-out text."""
    tokenizer = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    lines = [f"Sentence {i} has no period" if i % 3 == 0 else f"Sentence {i} ends here." for i in range(60)]
    (tmp_path / "queries.txt").write_text("\n".join(lines) + "\n")
    texts = rlhf_data.QueryTexts(str(tmp_path / "queries.txt"), None, "text")
    task = P.TaskHParams(query_length=8, end_text=".", query_prefix="", query_suffix="")
    queries, _, contexts, held_out = P.held_out_queries(texts, tokenizer, task, 8)
    assert contexts.shape == queries.shape == (8, 8)
    assert set(P.decode(tokenizer, queries)) < held_out <= set(lines)  # the queries' texts, and more texts read
    assert any("no period" in text for text in held_out) and len(held_out) % 8 == 0  # whole chunks of 8 texts
    training = P.QueryStream(texts, tokenizer, task, tokenizer.pad_token_id, seed=1, exclude=held_out)
    usable = {line for line in lines if line.endswith(".")} - held_out
    seen = set(P.decode(tokenizer, training.next_batch(3 * len(usable))[0]))  # three epochs of the training stream
    assert seen == usable


def test_vocabulary_logits_are_the_heads_on_either_product_orientation():
    """vocabulary_logits: on a CPU the product as W @ hidden^T copied back to rows, elsewhere hidden @ W^T
    (head_product; the meta device stands in for a GPU: shapes only): the head's own logits in fp32 for a sampling step's (B, d) and
    the log-probs' (B, T, d), bias included, the pad id's logit masked."""
    head = nn.Linear(16, 40)
    lm = types.SimpleNamespace(get_output_embeddings=lambda: head)
    for hidden in (torch.randn(3, 16), torch.randn(2, 5, 16)):
        logits = P.vocabulary_logits(lm, hidden, pad_id=7)
        expected = head(hidden).index_fill(-1, torch.tensor([7]), P.NEVER_SAMPLED_LOGIT)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert logits.dtype == torch.float32 and logits.is_contiguous()
    rows, weight = torch.randn(6, 16, device="meta"), head.weight.to("meta")
    assert P.head_product(rows, weight).shape == (6, 40) and P.head_product(rows, weight).is_contiguous()


def test_record_update_logs_the_kl_by_three_estimators_and_approxkls_largest(monkeypatch):
    """record_update (OAI record_step_stats): objective/kl is k1, OAI's Σ_t log π − log π_ref; kl_k2 and kl_k3 are
    Σ_t ½(log r)² and Σ_t (r − 1 − log r) with r = π_ref / π, batch means; approxkl is the mean over the update's
    micro-batches and approxkl_max the largest minibatch's (the mean of its micro-batches); first_ratio_max_deviation
    the first minibatch's largest |ratio - 1| (its micro-batches run before any optimizer step). Hand-checked on two
    responses of two tokens, and 3 minibatches of 1 and of 2 micro-batches."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = P.validate_args(policy_args(batch_size=8, total_episodes=24, whitening_ranks=1))
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0], [-0.5, -1.5]])  # log r: [[-0.5, 1.0], [0.0, -1.0]]
    rollout = dict(queries=torch.zeros(2, 3, dtype=torch.long), contexts=torch.zeros(2, 3, dtype=torch.long),
                   responses=torch.zeros(2, 2, dtype=torch.long), scores=torch.tensor([1.0, 0.0]), logprobs=logprobs,
                   ref_logprobs=ref_logprobs, non_score_reward=-0.1 * (logprobs - ref_logprobs))  # fmt: skip
    stats = {key: [torch.tensor(value) for value in values] for key, values in {
        "ppo/policy/approxkl": [0.01, 0.04, 0.02], "ppo/loss/total": [1.0, 1.0, 1.0], "ppo/returns/var": [2.0] * 3,
        "ppo/val/error": [1.0] * 3, "ppo/policy/ratio_max_deviation": [0.0, 0.3, 0.2]}.items()}  # fmt: skip
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), process_index=0, gather=lambda tensor: tensor)
    run = types.SimpleNamespace(accelerator=accelerator, stop_if_not_finite=lambda row, update, where: None,
                                elapsed=lambda: 1.0, samples=lambda *a: None, print=lambda *a: None)  # fmt: skip
    timer = types.SimpleNamespace(times={}, device=torch.device("cpu"), start=0.0)
    row = P.record_update(run, 2, stats, rollout, timer, args, kl_coef=0.1, lr=1e-5,
                            policy=types.SimpleNamespace(lm=None), tokenizer=None)  # fmt: skip
    log_r = ref_logprobs - logprobs
    assert row["objective/kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 1.0) / 2)
    assert row["objective/kl_k2"] == pytest.approx((0.125 + 0.5 + 0.0 + 0.5) / 2)
    assert row["objective/kl_k3"] == pytest.approx(((log_r.exp() - 1 - log_r).sum(1)).mean().item())
    assert row["ppo/policy/approxkl"] == pytest.approx(0.07 / 3) and row["ppo/policy/approxkl_max"] == pytest.approx(
        0.04
    )
    assert row["objective/kl_coef"] == 0.1 and row["ppo/episode"] == 16 and row["update"] == 2
    assert row["ppo/policy/first_ratio_max_deviation"] == 0.0 and "ppo/policy/ratio_max_deviation" not in row
    args = P.validate_args(
        policy_args(batch_size=8, total_episodes=24, whitening_ranks=1, gradient_accumulation_steps=2)
    )
    stats["ppo/policy/approxkl"] = [torch.tensor(value) for value in (0.01, 0.05, 0.04, 0.04, 0.02, 0.0)]
    stats["ppo/policy/ratio_max_deviation"] = [torch.tensor(value) for value in (0.0, 2e-3, 0.5, 0.1, 0.2, 0.3)]
    row = P.record_update(run, 2, {**stats, "ppo/loss/total": [torch.tensor(1.0)] * 6}, rollout, timer, args,
                          kl_coef=0.1, lr=1e-5, policy=types.SimpleNamespace(lm=None), tokenizer=None)  # fmt: skip
    assert row["ppo/policy/approxkl_max"] == pytest.approx(0.04)  # the minibatches' means: 0.03, 0.04, 0.01
    assert row["ppo/policy/first_ratio_max_deviation"] == pytest.approx(2e-3)  # the first minibatch's 2 micro-batches


def test_minibatches_shuffle_each_share_afresh_every_epoch():
    """detail: batches and minibatches — every epoch a new permutation of each whitening share's own rows (OAI's ranks
    each shuffled their part of the batch), split into nminibatches; two epochs' orders differ."""
    torch.manual_seed(0)
    epochs = [P.minibatches(16, 2, 4, "cpu") for _ in range(2)]
    for epoch in epochs:
        assert len(epoch) == 4 and all(part.shape == (2, 2) for part in epoch)
        order = torch.cat(epoch, 1)  # (shares, rows): each share a permutation of its own rows
        assert torch.equal(order.sort(1).values, torch.arange(16).view(2, 8))
        assert not torch.equal(order, torch.arange(16).view(2, 8))  # shuffled
    assert not torch.equal(torch.cat(epochs[0], 1), torch.cat(epochs[1], 1))  # afresh every epoch
