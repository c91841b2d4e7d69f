"""Unit tests of train_reward_accelerate.py and of the pipeline both scripts share: padding, the reward model,
dropout, TF-style Adam, the lr schedule, normalization, the best-of-4 loss, label files, sizes, queries, labelers.

Tiny random models built here, the exact GPT-2 tokenizer from the `gpt2_tokenizer_dir` fixture; no network, no
subprocess. Every expected number is written out by hand (the derivation is in the comment next to it).
"""

import contextlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaModel,
)

import rlhf_data
import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import dominated_lm, one_line_error, tiny_gpt2_config, tiny_llama_config

PAD = 50257  # GPT-2's [PAD]: one past the 50257-token vocabulary
EOS = 50256
DOT = 13  # '.'


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer_dir):
    return R.load_tokenizer(str(gpt2_tokenizer_dir))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, gpt2_tokenizer_dir):
    """A tiny random GPT-2 saved like a Hub checkpoint (config + weights + tokenizer)."""
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(directory)
    R.load_tokenizer(str(gpt2_tokenizer_dir)).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------------------------
# padding


def left_padding_reference(row: list[int], pad_id: int) -> list[int]:
    tokens = [t for t in row if t != pad_id]
    return [pad_id] * (len(row) - len(tokens)) + tokens


def test_right_padding_to_left_padding_matches_a_python_reference():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (64, 12), generator=generator)
    tokens[torch.rand(64, 12, generator=generator) < 0.4] = PAD  # pads anywhere, also in the middle
    tokens[0] = PAD  # all pad
    tokens[1] = torch.arange(12)  # no pad
    tokens[2] = torch.tensor([5, 6, PAD, PAD, 7, PAD, 8, 9, 10, 11, PAD, PAD])  # middle and trailing pads
    expected = torch.tensor([left_padding_reference(row, PAD) for row in tokens.tolist()])
    result = R.right_padding_to_left_padding(tokens, PAD)
    assert result.dtype == tokens.dtype
    assert torch.equal(result, expected)
    assert result[2].tolist() == [PAD] * 5 + [5, 6, 7, 8, 9, 10, 11]
    assert result[1].tolist() == list(range(12)) and result[0].tolist() == [PAD] * 12


# ---------------------------------------------------------------------------------------------------------------
# padded_forward: unpadded vs left-padded hidden states are equal for real tokens, through the Auto classes


def check_padding_invariance(backbone: nn.Module, vocab_size: int, pad_id: int) -> None:
    generator = torch.Generator().manual_seed(1)
    lengths, width = [7, 4, 1, 7], 7
    rows = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    padded = torch.stack([torch.cat([torch.full((width - len(r),), pad_id), r]) for r in rows])  # (4, 7) left-padded
    with torch.no_grad():
        hidden = R.padded_forward(backbone, padded, pad_id)  # (4, 7, d)
        for i, row in enumerate(rows):
            alone = backbone(input_ids=row[None]).last_hidden_state[0]  # (n, d), no padding at all
            torch.testing.assert_close(hidden[i, width - len(row) :], alone, atol=1e-5, rtol=0)


def test_padded_forward_gpt2_left_padding_changes_nothing_for_real_tokens(gpt2_dir):
    backbone = R.load_pretrained(AutoModel, str(gpt2_dir)).eval()
    assert isinstance(backbone, GPT2Model)
    check_padding_invariance(backbone, vocab_size=50257, pad_id=PAD)


def test_padded_forward_llama_left_padding_changes_nothing_for_real_tokens(tmp_path):
    torch.manual_seed(0)
    LlamaModel(tiny_llama_config()).save_pretrained(tmp_path)
    backbone = R.load_pretrained(AutoModel, str(tmp_path)).eval()
    assert isinstance(backbone, LlamaModel)
    check_padding_invariance(backbone, vocab_size=1000, pad_id=1000)


def test_padded_forward_needs_the_position_ids():
    """Guard that the invariance test can fail: without position ids the padded rows shift position by n_pad."""
    torch.manual_seed(0)
    backbone = GPT2Model(tiny_gpt2_config()).eval()
    row = torch.tensor([15496, 995, 11, 339])
    padded = torch.tensor([[PAD, PAD, 15496, 995, 11, 339]])
    mask = padded != PAD
    with torch.no_grad():
        alone = backbone(input_ids=row[None]).last_hidden_state[0]
        no_positions = backbone(input_ids=torch.where(mask, padded, 0), attention_mask=mask).last_hidden_state[0, 2:]
    assert (no_positions - alone).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# reward model


class HiddenSize(nn.Module):
    """Stands in for a backbone when only `config.hidden_size` matters (the head init)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.config = GPT2Config(n_embd=hidden_size)


def test_reward_head_init_std_is_one_over_sqrt_d_plus_one_bias_zero_gain_one():
    torch.manual_seed(0)
    model = R.RewardModel(HiddenSize(768), PAD)
    weight = model.scalar_head.weight.detach().double()
    assert weight.shape == (1, 768)
    # 1 / sqrt(768 + 1) = 0.036061 (OAI language/model.py); the empirical std of 768 normal draws is within ~3 standard
    # errors (2.6% each) of it; HF's default init (0.02) or 1/sqrt(768) * 10 would be far off
    assert weight.std().item() == pytest.approx(0.036061, rel=0.08)
    assert abs(weight.mean().item()) < 3 * 0.036061 / math.sqrt(768)
    assert model.scalar_head.bias.item() == 0.0
    assert model.reward_gain.item() == 1.0 and model.reward_bias.item() == 0.0
    assert model.reward_gain.requires_grad and model.reward_bias.requires_grad  # trained with the head (OAI)
    torch.manual_seed(1)
    large = R.RewardModel(HiddenSize(65535), PAD).scalar_head.weight.detach().double()
    assert large.std().item() == pytest.approx(1 / 256, rel=0.03)  # 1/sqrt(65535 + 1); standard error 0.3%
    # the "+ 1": 1/sqrt(768) is only 0.065% larger, far inside any sample's noise, so the scale itself is checked on
    # the same draws: the head's own nn.Linear init, then 768 standard normals, times 1/sqrt(769) = 0.036061
    torch.manual_seed(0)
    nn.Linear(768, 1)
    standard_normals = torch.randn(1, 768).double()
    torch.testing.assert_close(weight, standard_normals * 0.0360609, rtol=1e-5, atol=0)


def test_saved_reward_model_loads_in_the_policy_script_and_scores_identically(gpt2_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = R.BestOfNRewardModel(R.load_pretrained(AutoModel, str(gpt2_dir)), PAD).eval()
    with torch.no_grad():
        model.reward_gain.fill_(2.5)
        model.reward_bias.fill_(-0.75)
    (tmp_path / "rm").mkdir()
    R.save_reward_model(model, tmp_path / "rm", tokenizer, "tiny-gpt2", R.TaskHParams())
    torch.manual_seed(123)  # a different head init: only loading the saved head can give equal scores
    P.check_reward_model(str(tmp_path / "rm"), tokenizer)
    loaded = P.load_reward_model(str(tmp_path / "rm")).eval()
    assert loaded.pad_id == PAD
    assert loaded.reward_gain.item() == 2.5 and loaded.reward_bias.item() == -0.75
    queries, responses = (
        torch.tensor([[PAD, PAD, 15496, 995], [23073, 11, 339, 561]]),
        torch.tensor([[13, 11, PAD], [13, 50256, 13]]),
    )
    with torch.no_grad():
        assert torch.equal(loaded(queries, responses), model(queries, responses))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_check_reward_model_rejects_a_non_reward_directory(tmp_path, tokenizer):
    with pytest.raises(SystemExit) as failure:
        P.check_reward_model(str(tmp_path), tokenizer)
    message = one_line_error(failure)
    assert "--rewards.trained-model" in message and str(tmp_path) in message


def test_reward_reads_the_last_real_token_whatever_the_padding(gpt2_dir):
    """query ⊕ truncated response (pads in the middle of the row) scores like the unpadded real tokens."""
    torch.manual_seed(0)
    model = R.BestOfNRewardModel(R.load_pretrained(AutoModel, str(gpt2_dir)), PAD).eval()
    query, response = torch.tensor([[15496, 995]]), torch.tensor([[23073, 11, 339, 13]])
    padded_query, padded_response = torch.tensor([[PAD, PAD, 15496, 995]]), torch.tensor([[23073, 11, 339, 13, PAD]])
    with torch.no_grad():
        torch.testing.assert_close(model(padded_query, padded_response), model(query, response), atol=1e-5, rtol=0)
        different_last = model(query, torch.tensor([[23073, 11, 339, 11]]))
    assert (different_last - model(query, response)).abs().item() > 1e-4


def records_with_every_kind_of_padding(vocab_size: int, pad_id: int):
    """4 queries (C=5, left-padded, one of them without pads) x 3 responses (T=4): whole, cut (pads after), a pad in the
    middle, and one response that is all pads (its reward is the query's last token's)."""
    generator = torch.Generator().manual_seed(3)
    queries = torch.randint(0, vocab_size, (4, 5), generator=generator)
    queries[0, :2], queries[2, :1] = pad_id, pad_id
    responses = torch.randint(0, vocab_size, (4, 3, 4), generator=generator)
    responses[0, 1, 2:], responses[1, 2, 1], responses[3, 0, :] = pad_id, pad_id, pad_id
    return queries, responses


def one_row_per_response(model, queries, responses):
    """The reward of each query ⊕ response as its own row, the query repeated: (B, n)."""
    batch, n, _ = responses.shape
    return model(queries.repeat_interleave(n, 0), responses.flatten(0, 1)).view(batch, n)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_responses_sharing_their_query_score_and_train_like_one_row_each(family, attention, checkpointing):
    """The best-of-4 forward reads each query once for its samples: rewards and every gradient of the best-of-n loss
    as from one row per sample, also under gradient checkpointing (which rules out a KV cache)."""
    torch.manual_seed(0)
    if family == "gpt2":
        backbone, vocab_size, pad_id = (
            GPT2Model(tiny_gpt2_config(attn_pdrop=0, resid_pdrop=0, embd_pdrop=0)),
            50257,
            PAD,
        )
    else:
        backbone, vocab_size, pad_id = LlamaModel(tiny_llama_config()), 1000, 1000
    backbone.config._attn_implementation = attention
    model = R.BestOfNRewardModel(backbone, pad_id).train()
    if checkpointing:
        run_utils.enable_gradient_checkpointing(backbone)
    queries, responses = records_with_every_kind_of_padding(vocab_size, pad_id)
    best = torch.tensor([0, 2, 1, 0])
    gradients = []
    for rewards_of in (one_row_per_response, R.BestOfNRewardModel.forward):
        rewards = rewards_of(model, queries, responses)
        F.cross_entropy(rewards, best).backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
        gradients[-1]["rewards"] = rewards.detach()
    reference, shared = gradients
    assert reference.keys() == shared.keys() and len(reference) > 10
    # to float rounding of the largest gradient (the biases that shift all n rewards alike have a gradient of 0, so
    # only rounding noise, on both sides)
    scale = max(gradient.abs().max().item() for gradient in reference.values())
    for name, expected in reference.items():
        torch.testing.assert_close(shared[name], expected, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert reference["rewards"].std() > 0.1  # the rewards differ: the test could tell them apart


def test_responses_sharing_their_query_see_only_the_query_and_themselves():
    """Guard that the test above can fail: a response's reward changes with its own tokens and its query's, never
    with another response's."""
    torch.manual_seed(0)
    model = R.BestOfNRewardModel(GPT2Model(tiny_gpt2_config()), PAD).eval()
    queries, responses = records_with_every_kind_of_padding(50257, PAD)
    changed = responses.clone()
    changed[0, 0, 0] = (changed[0, 0, 0] + 1) % 50257
    with torch.no_grad():
        before, after = model(queries, responses), model(queries, changed)
        other_query = model(queries.flip(0), responses)
    assert (after[0, 0] - before[0, 0]).abs() > 1e-4  # its own token
    torch.testing.assert_close(after[:, 1:], before[:, 1:], atol=0, rtol=0)  # not the other responses of its query
    assert ((other_query - before).abs() > 1e-4).all()  # every response reads its query


# ---------------------------------------------------------------------------------------------------------------
# dropout off


def test_load_pretrained_sets_every_dropout_to_zero(tmp_path):
    config = tiny_gpt2_config(resid_pdrop=0.3, embd_pdrop=0.2, attn_pdrop=0.25, summary_first_dropout=0.4)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path)  # the saved checkpoint really has dropout
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in plain.modules())
    model = R.load_pretrained(AutoModelForCausalLM, str(tmp_path))
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"):
        assert getattr(model.config, key) == 0.0, key
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    model.train()  # no randomness even in train mode
    ids = torch.tensor([[15496, 995, 11, 339, 561]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)


def test_load_pretrained_runs_gpt2s_gelu_as_torchs_fused_kernel_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path)
    stock = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert stock.config.activation_function == "gelu_new"  # the saved model's own (GPT-2's) activation
    model = R.load_pretrained(AutoModelForCausalLM, str(tmp_path)).eval()
    assert model.config.activation_function == "gelu_pytorch_tanh"
    assert type(model.transformer.h[0].mlp.act).__name__ == "GELUTanh"  # F.gelu(x, approximate="tanh")
    ids = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, stock(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)  # the same function, to float rounding
    assert not torch.equal(ours, theirs)  # ... computed by another kernel


def test_load_pretrained_sets_llama_attention_dropout_to_zero(tmp_path):
    LlamaModel(tiny_llama_config(attention_dropout=0.3)).save_pretrained(tmp_path)
    model = R.load_pretrained(AutoModel, str(tmp_path))
    assert model.config.attention_dropout == 0.0


# ---------------------------------------------------------------------------------------------------------------
# TF-style Adam


def one_adam_step(optimizer_class, gradient: float, **kwargs) -> float:
    param = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = optimizer_class([param], lr=1e-3, eps=1e-5, **kwargs)
    param.grad = torch.full_like(param, gradient)
    optimizer.step()
    return -param.item()


@pytest.mark.parametrize(
    "gradient, torch_update, tf_update",
    [(0.5, 9.99980e-4, 9.99368e-4), (1e-4, 9.0909e-4, 2.4025e-4), (1e-6, 9.0909e-5, 3.1523e-6)],
)
def test_adam_one_step_matches_the_closed_form(gradient, torch_update, tf_update):
    # t = 1: m = 0.1 g, v = 0.001 g². PyTorch: lr g / (|g| + eps). TF: lr sqrt(0.001)|g| / (sqrt(0.001)|g| + eps).
    assert one_adam_step(R.AdamTensorFlowStyle, gradient) == pytest.approx(tf_update, rel=1e-4)
    assert one_adam_step(torch.optim.Adam, gradient) == pytest.approx(torch_update, rel=1e-4)
    optimizer = R.make_optimizer([nn.Parameter(torch.zeros(1))], lr=1e-3, eps=1e-5, use_tensorflow_adam=True)
    assert isinstance(optimizer, R.AdamTensorFlowStyle) and optimizer.defaults["fused"]  # one kernel per step
    optimizer = R.make_optimizer([nn.Parameter(torch.zeros(1))], lr=1e-3, eps=1e-5, use_tensorflow_adam=False)
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["eps"] == 1e-5


def test_tf_adam_equals_torch_adam_with_per_step_eps():
    """Cross-check: torch Adam with eps_t = eps / sqrt(1 - b2^t) takes exactly TF-style steps."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    tf_param, torch_param = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    eps, beta2 = 1e-5, 0.999
    tf_adam = R.AdamTensorFlowStyle([tf_param], lr=1e-3, eps=eps)
    torch_adam = torch.optim.Adam([torch_param], lr=1e-3, eps=eps)
    for t in range(1, 7):
        gradient = torch.randn(5, 3, generator=generator, dtype=torch.float64) * 10.0**-t  # also tiny gradients
        tf_param.grad, torch_param.grad = gradient.clone(), gradient.clone()
        torch_adam.param_groups[0]["eps"] = eps / math.sqrt(1 - beta2**t)
        tf_adam.step()
        torch_adam.step()
        torch.testing.assert_close(tf_param.data, torch_param.data, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(tf_param.data, start)


def test_tf_adam_state_dict_round_trip_continues_identically():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4, generator=generator)
    gradients = [torch.randn(4, generator=generator) for _ in range(6)]
    reference = nn.Parameter(start.clone())
    reference_adam = R.AdamTensorFlowStyle([reference], lr=1e-2, eps=1e-5)
    interrupted = nn.Parameter(start.clone())
    interrupted_adam = R.AdamTensorFlowStyle([interrupted], lr=1e-2, eps=1e-5)
    for gradient in gradients[:3]:
        for param, adam in ((reference, reference_adam), (interrupted, interrupted_adam)):
            param.grad = gradient.clone()
            adam.step()
    saved = interrupted_adam.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and saved["state"][0]["step"] == 3
    resumed = nn.Parameter(interrupted.detach().clone())
    resumed_adam = R.AdamTensorFlowStyle([resumed], lr=0.5, eps=0.1)  # hyperparameters come from the state dict
    resumed_adam.load_state_dict(saved)
    for gradient in gradients[3:]:
        for param, adam in ((reference, reference_adam), (resumed, resumed_adam)):
            param.grad = gradient.clone()
            adam.step()
    assert torch.equal(resumed.data, reference.data)


# ---------------------------------------------------------------------------------------------------------------
# learning-rate schedule (OAI train_reward.py: lr_k = lr (1 - k/N), k = 0..N-1)


def test_reward_lr_schedule_first_and_last_step():
    assert R.linear_lr(5e-5, 0, 156) == 5e-5
    assert R.linear_lr(5e-5, 78, 156) == pytest.approx(2.5e-5, rel=1e-12)
    assert R.linear_lr(5e-5, 155, 156) == pytest.approx(5e-5 / 156, rel=1e-12)  # last step: lr / N, never 0


# ---------------------------------------------------------------------------------------------------------------
# reward normalization


class IdentityAccelerator:
    """One process in fp32: reduce over processes, unwrap and autocast are identities."""

    def unwrap_model(self, model):
        return model

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, tensor, reduction="mean"):
        assert reduction == "mean"
        return tensor


class CyclingQueries:
    """The same 8 queries again every 8 rows, so the check sample equals the one used for μ and σ."""

    def __init__(self, queries: torch.Tensor):
        self.queries, self.position = queries, 0

    def next_batch(self, n: int, device="cpu") -> tuple[torch.Tensor, dict]:
        index = (self.position + torch.arange(n)) % len(self.queries)
        self.position += n
        return self.queries[index].to(device), {}

    def format(self, queries: torch.Tensor) -> torch.Tensor:
        return queries  # no prefix or suffix


def test_normalize_reward_sets_population_mean_0_std_1(gpt2_dir):
    args = R.Args(normalize_samples=8, rollout_batch_size=8, local_rollout_forward_batch_size=3)
    args.local_rollout_batch_size = 8
    args.task = R.TaskHParams(response_length=3, temperature=0.7)
    ref_lm = dominated_lm(DOT)  # samples '.' every time: scores depend on the queries only
    torch.manual_seed(0)
    model = R.BestOfNRewardModel(R.load_pretrained(AutoModel, str(gpt2_dir)), PAD).eval()
    generator = torch.Generator().manual_seed(2)
    queries = torch.randint(0, 50257, (8, 5), generator=generator)
    queries[:3, :2] = PAD  # some left padding
    responses = torch.full((8, 3), DOT)
    with torch.no_grad():
        raw = model(queries, responses).double()  # gain 1, bias 0
        model.reward_gain.fill_(3.0)  # normalization must reset these first
        model.reward_bias.fill_(-2.0)
    mean, std = raw.mean().item(), raw.std(unbiased=False).item()  # population std (8 samples: 7% below sample std)
    stats = R.normalize_reward(IdentityAccelerator(), ref_lm, model, CyclingQueries(queries), args, "before")
    assert stats["normalization/before/mean"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
    assert stats["normalization/before/std"] == pytest.approx(std, rel=1e-3)
    assert model.reward_gain.item() == pytest.approx(1 / std, rel=1e-3)
    assert model.reward_bias.item() == pytest.approx(-mean / std, rel=1e-3, abs=1e-5)
    assert stats["normalization/before/normalized_mean"] == pytest.approx(0.0, abs=1e-3)
    assert stats["normalization/before/normalized_std"] == pytest.approx(1.0, rel=1e-3)
    with torch.no_grad():
        normalized = model(queries, responses).double()
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert normalized.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# best-of-4 loss


class LastTokenScores(nn.Module):
    """Reward = last token id - 10, so the scores of a hand-built batch are set by the samples' last tokens."""

    def forward(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        self.seen = queries, responses
        return responses[..., -1].float() - 10


def test_best_of_4_loss_and_accuracy_by_hand():
    queries = torch.tensor([[PAD, 1, 2], [3, 4, 5]])  # (B=2, C=3)
    samples = torch.tensor([[[7, 11], [7, 12], [7, 13], [7, 14]], [[8, 12], [8, 10], [8, 10], [8, 10]]])  # (2, 4, T=2)
    best = torch.tensor([3, 1])
    model = LastTokenScores()
    loss, accuracy = R.best_of_4_loss(model, queries, samples, best)
    # record 0: logits [1, 2, 3, 4], best 3: CE = logsumexp - 4 = log(1 + e^-1 + e^-2 + e^-3) = 0.440190, right
    # record 1: logits [2, 0, 0, 0], best 1: CE = log(e^2 + 3) - 0 = 2.340753, wrong (argmax 0)
    assert loss.item() == pytest.approx((0.440190 + 2.340753) / 2, abs=1e-5)
    assert accuracy.item() == 0.5
    assert model.seen[0] is queries and model.seen[1] is samples  # one call: each record's query with its 4 samples
    chance, _ = R.best_of_4_loss(model, queries, torch.full((2, 4, 2), 10), best)
    assert chance.item() == pytest.approx(math.log(4), abs=1e-6)  # equal scores: ln 4 = 1.386294


# ---------------------------------------------------------------------------------------------------------------
# label files (and OAI's pad 50259 remapped)


def label_args() -> R.Args:
    return R.Args(
        batch_size=1,
        labels=R.LabelHParams(num_train=2),
        task=R.TaskHParams(query_length=4, response_length=3),
    )


def label_record(seed: int) -> dict:
    return {
        "query": [15496 + seed, 995, 13, 11],
        **{f"sample{i}": [23073, 11 + i, 339] for i in range(4)},
        "best": seed % 4,
    }


def write_labels(tmp_path, records) -> str:
    path = tmp_path / "labels.json"
    path.write_text(records if isinstance(records, str) else json.dumps(records))
    return str(path)


def test_load_labels_remaps_openai_pads_and_left_pads_queries(tmp_path, tokenizer):
    records = [label_record(i) for i in range(3)]
    records[0]["query"] = [15496, 50259, 995, 50259]  # OAI pads, one in the middle
    records[1]["sample2"] = [23073, 50259, 50259]
    path = write_labels(tmp_path, records)
    labels = R.load_labels(path, tokenizer, label_args())
    assert labels["queries"].tolist()[0] == [PAD, PAD, 15496, 995]
    assert labels["queries"].tolist()[2] == [15498, 995, 13, 11]
    assert labels["samples"].shape == (3, 4, 3)
    assert labels["samples"][1, 2].tolist() == [23073, PAD, PAD]  # responses keep their right pads (remapped)
    assert labels["samples"][0, 3].tolist() == [23073, 14, 339]
    assert labels["best"].tolist() == [0, 1, 2]
    assert 50259 not in labels["queries"] and 50259 not in labels["samples"]


@pytest.mark.parametrize(
    "corrupt, words",
    [
        (lambda r: r.pop("sample2"), ["'sample2'"]),
        (lambda r: r.pop("best"), ["'best'"]),
        (lambda r: r.update(query=[1, 2, 3]), ["'query'", "list of 4"]),
        (lambda r: r.update(sample0=[1, 2, 3, 4]), ["'sample0'", "list of 3"]),
        (lambda r: r.update(sample1="abc"), ["'sample1'"]),
        (lambda r: r.update(best=4), ["'best'", "0..3"]),
        (lambda r: r.update(best=-1), ["'best'", "0..3"]),
        (lambda r: r.update(best="1"), ["'best'"]),
        (lambda r: r.update(query=[15496, 995, 50258, 11]), ["'query'", "50258"]),
        (lambda r: r.update(sample3=[23073, -1, 339]), ["'sample3'", "-1"]),
    ],
    ids=[
        "missing-sample",
        "missing-best",
        "short-query",
        "long-sample",
        "sample-not-list",
        "best-4",
        "best-negative",
        "best-string",
        "query-token-out-of-vocab",
        "negative-token",
    ],
)
def test_load_labels_bad_record_is_one_line_naming_file_and_record(tmp_path, tokenizer, corrupt, words):
    records = [label_record(i) for i in range(4)]
    corrupt(records[1])
    path = write_labels(tmp_path, records)
    with pytest.raises(SystemExit) as failure:
        R.load_labels(path, tokenizer, label_args())
    message = one_line_error(failure)
    assert path in message and "record 1" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "content, words",
    [
        ('[{"query": [1, 2', ["not a readable JSON"]),
        ('{"query": [1, 2, 3, 4]}', ["JSON list", "dict"]),
        (json.dumps([label_record(0), "not a record"]), ["record 1", "not an object"]),
        (json.dumps([label_record(0)]), ["1 records", "fewer than --labels.num-train 2"]),
    ],
    ids=["corrupt-json", "not-a-list", "record-not-an-object", "too-few-records"],
)
def test_load_labels_bad_file_is_one_line_naming_the_file(tmp_path, tokenizer, content, words):
    path = write_labels(tmp_path, content)
    with pytest.raises(SystemExit) as failure:
        R.load_labels(path, tokenizer, label_args())
    message = one_line_error(failure)
    assert path in message
    for word in words:
        assert word in message


# ---------------------------------------------------------------------------------------------------------------
# derived batch sizes


def test_validate_args_derives_per_process_sizes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = R.validate_args(R.Args(gradient_accumulation_steps=2))
    assert (args.world_size, args.local_batch_size, args.micro_batch_size) == (8, 4, 2)  # 32 / 8 / 2
    assert (args.local_rollout_batch_size, args.local_eval_batch_size) == (64, 32)  # 512 / 8, 256 / 8
    assert args.num_updates == 156  # 4992 // 32


@pytest.mark.parametrize(
    "world_size, kwargs, flag",
    [
        ("2", dict(batch_size=33), "--batch-size"),
        ("2", dict(gradient_accumulation_steps=3), "--gradient-accumulation-steps"),
        ("3", dict(batch_size=33), "--rollout-batch-size"),
        ("3", dict(batch_size=33, rollout_batch_size=513), "--eval-batch-size"),
        ("1", dict(task=R.TaskHParams(truncate_after=24)), "--task.truncate-after"),
        ("1", dict(labels=R.LabelHParams(num_train=16)), "--labels.num-train"),
    ],
)
def test_validate_args_rejects_inconsistent_sizes_naming_the_flag(monkeypatch, world_size, kwargs, flag):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as failure:
        R.validate_args(R.Args(**kwargs))
    assert flag in one_line_error(failure)


# ---------------------------------------------------------------------------------------------------------------
# queries


def test_query_from_text_start_and_end_text(tokenizer):
    task = R.TaskHParams(query_length=6, start_text=".", end_text=".")
    # "Hello world. usually, he would. Hello" = [15496, 995, 13, 23073, 11, 339, 561, 13, 15496]
    text = [15496, 995, 13, 23073, 11, 339, 561, 13, 15496]
    # after the first '.', keep 6 tokens [23073, 11, 339, 561, 13, 15496], cut after the last '.', right-pad
    assert R.query_from_text(tokenizer, text, task, PAD) == [23073, 11, 339, 561, 13, PAD]
    assert R.query_from_text(tokenizer, [15496, 995], task, PAD) is None  # no start text
    assert R.query_from_text(tokenizer, [13, 23073, 11, 339, 561], task, PAD) is None  # no end text after the start
    short = R.TaskHParams(query_length=3, start_text="")  # the '.' at index 3 falls outside the 3 kept tokens
    assert R.query_from_text(tokenizer, [23073, 11, 339, 13], short, PAD) is None
    assert R.query_from_text(tokenizer, [], R.TaskHParams(query_length=4), PAD) is None  # empty text


def query_texts(tmp_path, lines: list[str], rows_per_text: int = 1) -> rlhf_data.QueryTexts:
    """The query texts of a local one-text-per-line file holding `lines`."""
    path = tmp_path / "queries.txt"
    path.write_text("\n".join(lines) + "\n")
    return rlhf_data.QueryTexts(str(path), None, "text", rows_per_text)


def test_query_from_text_keeps_a_text_whose_first_start_text_is_its_last_token(tokenizer):
    """OAI language/datasets.py: `first_index < len(tokens)` or the text stays whole."""
    task = R.TaskHParams(query_length=6, start_text=".", end_text="")
    assert R.query_from_text(tokenizer, [15496, 995, 13], task, PAD) == [15496, 995, 13, PAD, PAD, PAD]
    assert R.query_from_text(tokenizer, [15496, 13, 995], task, PAD) == [995] + [PAD] * 5


def test_queries_add_no_special_tokens_with_a_bos_adding_tokenizer(gpt2_tokenizer_dir, tmp_path):
    """Llama/Mistral-style tokenizers prepend BOS in `encode`: start/end text, prefix and suffix must be encoded
    without special tokens, or the start text is never found and a BOS lands in the middle of every query."""
    bos_tokenizer = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir), add_bos_token=True)
    bos_tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert bos_tokenizer.encode(".") == [EOS, DOT]  # GPT-2's BOS is <|endoftext|> = 50256
    task = R.TaskHParams(query_length=6, start_text=".", end_text=".", query_prefix="Hello", query_suffix=" world")
    text = [15496, 995, 13, 23073, 11, 339, 561, 13, 15496]
    assert R.query_from_text(bos_tokenizer, text, task, PAD) == [23073, 11, 339, 561, 13, PAD]  # no 50256
    stream = R.QueryStream(query_texts(tmp_path, ["x"]), bos_tokenizer, task, PAD, seed=0)
    contexts = stream.format(torch.tensor([[PAD, 23073, 11, 339, 561, 13]]))
    assert contexts.tolist() == [[PAD, 15496, 23073, 11, 339, 561, 13, 995]]  # "Hello" ⊕ query ⊕ " world", no 50256


def test_query_stream_prefix_suffix_and_middle_pads_go_left(tokenizer, tmp_path):
    # "Hello" = [15496], " world" = [995]; no start or end text
    task = R.TaskHParams(query_length=4, query_prefix="Hello", query_suffix=" world", start_text="", end_text="")
    assert R.query_from_text(tokenizer, [23073, 11], task, PAD) == [23073, 11, PAD, PAD]  # bare, right-padded
    stream = R.QueryStream(query_texts(tmp_path, ["", "usually,", ""]), tokenizer, task, PAD, seed=0)  # [23073, 11]
    queries = stream.next_batch(3)[0]  # empty texts skipped; the one real text repeats over epochs
    assert queries.tolist() == [[PAD, PAD, 23073, 11]] * 3  # what the reward model reads
    # the policy's context: "Hello" ⊕ [23073, 11, PAD, PAD] ⊕ " world" (pads in the middle) -> pads to the left
    assert stream.format(queries).tolist() == [[PAD, PAD, 15496, 23073, 11, 995]] * 3


def test_query_stream_without_any_query_names_the_flag(tokenizer, tmp_path):
    task = R.TaskHParams(query_dataset="empty.txt", query_length=4, start_text="|")
    stream = R.QueryStream(query_texts(tmp_path, ["", "no start marker here", ""]), tokenizer, task, PAD, seed=0)
    with pytest.raises(SystemExit) as failure:
        stream.next_batch(1)
    message = one_line_error(failure)
    assert "--task.query-dataset" in message and "empty.txt" in message


def test_query_stream_ranks_are_disjoint_within_an_epoch(tokenizer, tmp_path):
    texts = [f"Text number {i} of the corpus" for i in range(20)]
    task = R.TaskHParams(query_length=8, start_text="", end_text="")
    source = query_texts(tmp_path, texts)
    streams = [R.QueryStream(source, tokenizer, task, PAD, seed=3, rank=r, world_size=2, chunk=4) for r in (0, 1)]
    epochs = [set(R.decode(tokenizer, s.next_batch(10)[0])) for s in streams]
    assert len(epochs[0]) == len(epochs[1]) == 10
    assert epochs[0].isdisjoint(epochs[1]) and epochs[0] | epochs[1] == set(texts)
    second = [set(R.decode(tokenizer, s.next_batch(10)[0])) for s in streams]  # a new order, shared by both ranks
    assert second[0].isdisjoint(second[1]) and second[0] | second[1] == set(texts)
    assert second[0] != epochs[0]


# ---------------------------------------------------------------------------------------------------------------
# simulated labelers


def test_the_simulated_labeler_picks_each_sample_with_softmax_beta_score():
    """The noisy labeler's pick (OAI's human labelers, simulated): sample i with probability softmax(beta * score)_i,
    so a better-scored sample is picked more often, not always. 4,000 records: each frequency within 4 standard
    errors (0.032) of its probability."""
    records = [{"scores": [1.0, 0.0, 0.0, -1.0]} for _ in range(4000)]
    labels = R.LabelHParams(source="sentiment", labeler_beta=1.0)
    picks = np.bincount([record["best"] for record in R.labeler_picks(records, labels, seed=0)], minlength=4) / 4000
    probabilities = np.exp([1.0, 0.0, 0.0, -1.0]) / np.exp([1.0, 0.0, 0.0, -1.0]).sum()  # 0.53, 0.20, 0.20, 0.07
    assert np.abs(picks - probabilities).max() < 0.032, (picks, probabilities)


def test_simulated_sentiment_labeler_prefers_positive_text():
    positive, negative = R.simulated_labeler_scores(
        "sentiment", ["What a wonderful, delightful day. I love it!", "This is a horrible, terrible disaster."]
    )
    assert -1 <= negative < 0 < positive <= 1
    assert positive - negative > 1


def test_simulated_descriptiveness_labeler_prefers_adjectives():
    rich, plain = R.simulated_labeler_scores(
        "descriptiveness",
        ["The tall, ancient, beautiful oak stood silently in the quiet green meadow.", "He went to the store."],
    )
    assert rich > plain + 0.2
    assert plain == 0.0  # no adjective or adverb tag among the 5 words
