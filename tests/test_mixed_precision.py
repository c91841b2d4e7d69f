"""--mixed-precision bf16 (a GPU speed option) checked on CPU: forwards under bf16 autocast stay within a stated
tolerance of fp32, the quantities PPO computes with stay fp32, and both scripts run end to end with it."""

import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import read_jsonl, run_script

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
    # the trunk ran in bf16 (the log-probs differ), the heads and the log-softmax in fp32
    assert logits_bf16.dtype == logprobs_bf16.dtype == values_bf16.dtype == torch.float32
    difference = (logprobs_bf16 - reference).abs().max().item()
    assert 0 < difference < LOGPROB_TOLERANCE, difference
    assert 0 < (values_bf16 - values).abs().max().item() < VALUE_TOLERANCE


def gpt2_sized_hidden_and_head(rows: int, d: int = 768, vocabulary: int = 50257):
    """Final hidden states and an LM head whose logits have GPT-2's magnitudes: a shared component of about -60 nats
    (GPT-2's raw logits lie between about -20 and -150) plus a spread of about 5 nats per token."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, d, generator=generator)
    hidden[:, 0] = 30.0  # the shared direction
    head = torch.nn.Linear(d, vocabulary, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocabulary, d, generator=generator) * 5 / d**0.5)
        head.weight[:, 0] = -2.0
    return hidden, head


def test_gpt2_sized_logits_give_fp32_logprobs_under_bf16_autocast():
    """OpenAI computed every logit in fp32. bf16 keeps 8 significant bits: a logit near -60 rounds by up to 0.125,
    which the log-softmax does not cancel (the product in bf16 puts these likely tokens' log-probs 0.07 nats off);
    the LM head's product runs in fp32 also under autocast, so the log-probs are fp32's to 1e-3 nats."""
    hidden, head = gpt2_sized_hidden_and_head(16)
    lm = types.SimpleNamespace(get_output_embeddings=lambda: head)
    logits = P.vocabulary_logits(lm, hidden, pad_id=50257) / 0.7
    assert -150 < logits.min() < logits.max() < -20
    tokens = logits.argmax(-1, keepdim=True)  # likely tokens, whose log-probs matter most
    reference = P.logprobs_from_logits(logits[:, None], tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_bf16 = P.vocabulary_logits(lm, hidden, pad_id=50257) / 0.7
        bf16_product = (hidden @ head.weight.T) / 0.7  # what the head computed before: its product under autocast
    assert logits_bf16.dtype == torch.float32
    error = (P.logprobs_from_logits(logits_bf16[:, None], tokens) - reference).abs().max().item()
    assert error < 1e-3, error
    assert (P.logprobs_from_logits(bf16_product.float()[:, None], tokens) - reference).abs().max() > 0.05


def test_value_and_reward_heads_are_fp32_under_bf16_autocast():
    """The value head and the reward head read hidden states with a large shared component (a random head on GPT-2's
    final hidden states gives outputs of mean/std ~10): their affine outputs are computed in fp32, not rounded to
    bf16's 3 digits after the normalization's gain and bias."""
    hidden, _ = gpt2_sized_hidden_and_head(32, d=64)
    policy = tiny_policy()
    torch.nn.init.normal_(policy.value_head.weight, std=0.5)
    reward_model = R.RewardModel(types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64)), PAD)
    with torch.no_grad():
        reward_model.reward_gain.fill_(0.1), reward_model.reward_bias.fill_(-3.0)
        value = policy.value_head(hidden).squeeze(-1)
        reward = reward_model.reward_gain * reward_model.scalar_head(hidden).squeeze(-1) + reward_model.reward_bias
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value_bf16, reward_bf16 = policy.value_of(hidden), reward_model.normalized_reward(hidden)
            assert (policy.value_head(hidden).float() - value).abs().max() > 1e-3  # what bf16 would have given
    assert value_bf16.dtype == reward_bf16.dtype == torch.float32
    torch.testing.assert_close(value_bf16, value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reward_bf16, reward, rtol=1e-6, atol=1e-6)


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
        responses = P.generate_responses(policy.lm, contexts, PAD, 6, 0.7, 8)
        query_responses = torch.cat([contexts, responses], 1)
        logprobs, _, values = P.rollout_logprobs(policy, ref_lm, query_responses, 10, PAD, 0.7, 8)
        order = torch.randperm(8)  # the first minibatch: the same rows in PPO's shuffled order
        logits, vpred = policy(query_responses[order], 10, PAD, 0.7)
        new_logprobs = P.logprobs_from_logits(logits, responses[order])
    assert vpred.requires_grad and vpred.dtype == torch.float32  # the value head is fp32 also under bf16
    assert torch.equal(new_logprobs, logprobs[order]) and torch.equal(vpred, values[order])


def test_reward_loss_under_bf16_stays_within_tolerance_of_fp32():
    torch.manual_seed(0)
    backbone = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_embd=64, n_head=4)).transformer
    model = R.BestOfNRewardModel(backbone, PAD).eval()
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


def test_the_heads_compute_in_fp32_under_allow_tf32_also_when_compiled(monkeypatch):
    """--allow-tf32 turns TF32 on for the whole process (run_utils.setup_device), the trunk's products and gradients:
    the LM, value and reward heads turn it off around their forward products and restore it after (the flag is read
    inside them; on a CPU it changes no number). torch.compile does not trace them: a compiled kernel reads the flag
    when it runs, where it is on, so the heads run eagerly also inside the compiled PPO forward."""
    seen = []

    def record(name):
        seen.append((name, torch.backends.cuda.matmul.allow_tf32, torch.compiler.is_compiling()))

    head_product = P.head_product
    monkeypatch.setattr(P, "head_product", lambda rows, weight: record("lm") or head_product(rows, weight))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    policy = tiny_policy()
    policy.value_head.register_forward_pre_hook(lambda module, inputs: record("value"))
    torch.manual_seed(0)
    backbone = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_embd=64, n_head=4)).transformer
    reward_model = R.RewardModel(backbone, PAD).eval()
    reward_model.scalar_head.register_forward_pre_hook(lambda module, inputs: record("reward"))
    tokens = torch.randint(0, PAD, (4, 12), generator=torch.Generator().manual_seed(0))
    tokens[:2, :3] = PAD
    for run_policy, run_reward in ((policy, reward_model), (torch.compile(policy, backend="eager"),
                                                            torch.compile(reward_model, backend="eager"))):  # fmt: skip
        seen.clear()
        logits, values = run_policy(tokens, 8, PAD, 0.7)
        run_reward(tokens[:, :8], tokens[:, 8:])
        assert sorted({name for name, *_ in seen}) == ["lm", "reward", "value"]
        assert all(not tf32 and not compiling for _, tf32, compiling in seen), seen
        assert torch.backends.cuda.matmul.allow_tf32  # restored for the trunk
        assert logits.dtype == values.dtype == torch.float32


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_frozen_models_stored_in_bf16_give_the_same_bits_under_bf16_autocast(architecture):
    """Under --mixed-precision bf16 the frozen models (the reference, the reward model's backbone, the reward script's
    sampler) keep their linear layers in bf16 (run_utils.frozen_for_autocast): half their memory, and every product
    reads the operands autocast gave it from the fp32 weights before. The reference's log-probs, its samples and the
    reward model's scores are bit for bit today's (GPT-2's Conv1D and tied head; a Llama with biases and its own
    head), and the embeddings, norms and heads stay fp32."""
    from copy import deepcopy

    from transformers import AutoModel, AutoModelForCausalLM

    import run_utils
    from tests.conftest import tiny_gpt2_config, tiny_llama_config

    config = (tiny_gpt2_config(vocab_size=1000) if architecture == "gpt2"
              else tiny_llama_config(attention_bias=True, mlp_bias=True))  # fmt: skip
    bf16 = types.SimpleNamespace(mixed_precision="bf16")
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config).eval()
    stored = run_utils.frozen_for_autocast(deepcopy(lm), bf16)
    dtypes = {name: parameter.dtype for name, parameter in stored.named_parameters()}
    assert {dtype for name, dtype in dtypes.items() if "norm" in name or "ln_" in name or "wte" in name
            or "embed" in name or "lm_head" in name} == {torch.float32}  # fmt: skip
    assert sum(dtype == torch.bfloat16 for dtype in dtypes.values()) >= 8  # every block's linear layers
    torch.manual_seed(0)
    reward = P.RewardModel(AutoModel.from_config(config), PAD).eval()
    torch.nn.init.normal_(reward.scalar_head.weight, std=0.1)
    stored_reward = deepcopy(reward)
    run_utils.frozen_for_autocast(stored_reward.backbone, bf16)
    assert stored_reward.scalar_head.weight.dtype == torch.float32
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, PAD, (6, 20), generator=generator)
    tokens[:2, :4] = PAD  # left-padded rows
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for model in (lm, stored):
            assert next(model.parameters()).dtype == torch.float32  # the token embedding: what model.dtype reads
        assert torch.equal(P.lm_logits(lm, tokens, 12, PAD, 0.7), P.lm_logits(stored, tokens, 12, PAD, 0.7))
        samples = []
        for model in (lm, stored):
            torch.manual_seed(2)
            samples.append(P.sample_responses(model, tokens[:, :12], PAD, 8, 0.7))
        assert torch.equal(*samples)
        assert torch.equal(reward(tokens[:, :12], tokens[:, 12:]), stored_reward(tokens[:, :12], tokens[:, 12:]))
