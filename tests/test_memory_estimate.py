"""run_utils' memory estimate: the parameter counts against real models, each part's formula on a hand-checked
example, that the memory knobs lower it, the flags it names when a run does not fit, the --dry-run line of both
scripts, and the README's table (benchmark/launch/memory_table.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import memory_estimate
import run_utils
import train_policy_accelerate
import train_reward_accelerate
from tests.conftest import REPO, run_script, tiny_gpt2_config, tiny_llama_config, unreachable_hub

GPT2_COUNTS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
"""GPT-2's parameters, the LM head tied to the token embedding (the published model cards' counts)"""


def policy_args(**overrides) -> train_policy_accelerate.Args:
    return run_utils.replace_fields(
        train_policy_accelerate.task_defaults(), {"rewards.trained_model": "rm", **overrides}
    )


def reward_args(**overrides) -> train_reward_accelerate.Args:
    return run_utils.replace_fields(train_reward_accelerate.task_defaults(), overrides)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_parameters_counted_on_the_meta_device_are_the_real_models(kind, tmp_path):
    """A tiny GPT-2 (LM head tied to the embedding) and a tiny Llama (untied head), built for real and saved: the
    counts from their config alone equal theirs, with and without the LM head."""
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=48, n_head=4, vocab_size=1000, n_positions=64))
    else:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=900, tie_word_embeddings=False)  # fmt: skip
        model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    shape = memory_estimate.model_shape(str(tmp_path))
    assert shape.lm_parameters == count(model) and shape.backbone_parameters == count(model.base_model)
    assert (shape.lm_parameters == shape.backbone_parameters) == (kind == "gpt2")
    assert (shape.layers, shape.width, shape.vocab) == (model.config.num_hidden_layers, model.config.hidden_size,
                                                        model.config.vocab_size)  # fmt: skip
    assert shape.inner == (4 * 48 if kind == "gpt2" else 96)


@pytest.mark.parametrize("name", sorted(GPT2_COUNTS))
def test_gpt2_sizes_are_counted_exactly(name):
    """OpenAI's four sizes (known without a download): the published counts, and GPT-2's own formula: token and
    position embeddings, per block 12 d^2 + 13 d (4 d^2 + 4 d attention, 8 d^2 + 5 d MLP, 4 d layer norms), the
    final layer norm."""
    shape = memory_estimate.model_shape(name)
    layers, d, _ = memory_estimate.GPT2_SIZES[name]
    assert shape.lm_parameters == GPT2_COUNTS[name] == 50257 * d + 1024 * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert shape.backbone_parameters == shape.lm_parameters  # the head is the embedding
    assert memory_estimate.model_shape(f"openai-community/{name}") == shape


SMALL = memory_estimate.ModelShape(lm_parameters=1000, backbone_parameters=900, lm_bf16_parameters=600,
                                   backbone_bf16_parameters=600, layers=3, width=8, inner=32, vocab=50)  # fmt: skip
"""A made-up model for the hand-checked examples: d = 8, MLP 32, V = 50"""


def small_policy(**overrides):
    """Batch 16 on 2 processes, 2 accumulation steps: micro-batches of 4 rows, 4 + 3 tokens; rollout chunks of 4."""
    return policy_args(**{"ppo.batch_size": 16, "ppo.gradient_accumulation_steps": 2, "task.query_length": 4,
                          "task.response_length": 3, "local_rollout_forward_batch_size": 4, **overrides})  # fmt: skip


def test_policy_parts_on_a_hand_checked_example():
    parts = memory_estimate.peak_memory_parts(small_policy(), SMALL, SMALL, processes=2, zero_stage=0)
    trained = 1000 + 8 + 1  # the LM and the value head
    assert parts == {
        "weights": 4 * trained,
        "gradients": 4 * trained,  # DDP's buckets are the gradients (a view: run_utils.ddp_options)
        "optimizer": 8 * trained,
        "reference_model": 4 * 1000,
        "reward_model": 4 * (900 + 8 + 3),  # backbone, scalar head, gain, bias
        # 4 rows x 7 tokens x 3 layers x (9 d + 2 inner) fp32 values = 4 * 7 * 3 * 136 * 4
        "activations": 4 * 7 * 3 * 544,
        # 5 copies, fp32, (4 rows, 3 positions, 50): the saved logits, the gather's gradient, logsumexp's backward's
        # logits - logsumexp, its exp and their product
        "logits": 5 * 4 * (4 * 3 * 50),
        # the larger of sampling: 4 rows x (KV cache 2 x 3 layers x 7 tokens x 8 x 4 B + 2 fp32 step logits) = 6976,
        # and scoring: 4 rows x (3 copies of 3 x 50 fp32 logits + 7 tokens x (8 + 2 x 32) fp32) = 4 * (1800 + 2016)
        "rollout": 4 * (1800 + 2016),
    }
    static = 4 * trained * 2 + 8 * trained + 4000 + 3644
    assert memory_estimate.peak_memory_total(parts) == static + 4 * 7 * 3 * 544 + 5 * 4 * (
        4 * 3 * 50
    )  # training > rollout


def test_bf16_checkpointing_zero2_and_direct_rl_parts_on_the_example():
    bf16 = memory_estimate.peak_memory_parts(small_policy(mixed_precision="bf16"), SMALL, SMALL, 2, 0)
    assert bf16["bf16_weight_copies"] == 2 * 1009
    # the frozen models' linear layers in bf16 (600 of their parameters), the rest and the reward head fp32
    assert bf16["reference_model"] == 4 * 400 + 2 * 600 and bf16["reward_model"] == 4 * 300 + 2 * 600 + 4 * (8 + 3)
    assert bf16["activations"] == 4 * 7 * 3 * (4 * 2 * 8 + 2 * (7 * 8 + 2 * 32))  # fp32 layer-norm inputs, bf16 rest
    checkpointed = memory_estimate.peak_memory_parts(small_policy(gradient_checkpointing=True), SMALL, SMALL, 2, 0)
    assert checkpointed["activations"] == 4 * 7 * (3 * 4 * 8 + 544)  # each layer's fp32 input, one layer recomputed
    zero2 = memory_estimate.peak_memory_parts(small_policy(), SMALL, SMALL, 2, zero_stage=2)
    # the reduce bucket: 5e7 fp32 values (check_launch sets DeepSpeed's reduce_bucket_size; its own default is 5e8)
    assert zero2["gradients"] == 4 * 1009 / 2 + 200_000_000 and zero2["optimizer"] == 12 * 1009 / 2
    assert zero2["weights"] == 4 * 1009
    direct = memory_estimate.peak_memory_parts(small_policy(), SMALL, None, 2, 0)  # --rewards.function: no reward model
    assert "reward_model" not in direct
    one = memory_estimate.peak_memory_parts(small_policy(), SMALL, SMALL, 1, 0)
    assert one["activations"] == 2 * 4 * 7 * 3 * 544  # micro-batches of 8 rows


def test_reward_script_parts_on_a_hand_checked_example():
    """Batch 8 on 2 processes: micro-batches of 4 records, each one row of the query (4) and 4 samples of 3 tokens."""
    args = reward_args(**{"batch_size": 8, "task.query_length": 4, "task.response_length": 3,
                          "local_rollout_forward_batch_size": 4, "rollout_batch_size": 8, "eval_batch_size": 8})  # fmt: skip
    assert memory_estimate.NUM_SAMPLES == train_reward_accelerate.NUM_SAMPLES  # one number of samples per record
    parts = memory_estimate.peak_memory_parts(args, SMALL, None, processes=2, zero_stage=0)
    trained = 900 + 8 + 3
    mask = 5 * 16 * 16  # a record's fp32 (16, 16) attention mask and its boolean source
    assert parts == {
        "weights": 4 * trained,
        "gradients": 4 * trained,
        "optimizer": 8 * trained,
        "sampler": 4 * 1000,
        "activations": 4 * 16 * 3 * 544 + 4 * mask,
        "rollout": 4 * (mask + 4 * 16 * (8 + 2 * 32)),  # evaluation: 4 records per process, larger than sampling
    }


def test_each_memory_knob_lowers_the_estimate():
    """gpt2-xl at OpenAI's defaults: more accumulation, checkpointing, ZeRO-2 and bf16 each lower the total."""
    total = lambda args, processes=1, zero=0: memory_estimate.estimate_peak_memory(args, processes, zero)["total"]  # noqa: E731
    defaults = policy_args(base_model="gpt2-xl")
    totals = [total(policy_args(**{"base_model": "gpt2-xl", "ppo.gradient_accumulation_steps": s})) for s in (1, 2, 8)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 3
    assert total(policy_args(base_model="gpt2-xl", gradient_checkpointing=True)) < totals[0]
    assert total(policy_args(base_model="gpt2-xl", mixed_precision="bf16")) < totals[0]
    assert total(defaults, 8, zero=2) < total(defaults, 8)
    reward = reward_args(base_model="gpt2-xl")
    assert total(run_utils.replace_fields(reward, {"gradient_accumulation_steps": 4})) < total(reward)
    assert 250 < totals[0] < 300  # GB: the review's ~285 GB (10^9 bytes), here in 2^30


def test_the_warning_names_the_flags_that_fit():
    """gpt2-xl at the defaults on one 80 GB GPU: the smallest accumulation that fits; on a 40 GB one, accumulation
    alone would need micro-batches too small to run well (fewer than 16 rows), checkpointing with it fits; the reward
    script names its own flag. gpt2 fits as it is; a model whose config is not here is not estimated."""
    memory, warning = run_utils.memory_check(policy_args(base_model="gpt2-xl"), 1, 0, budget_gb=80)
    assert memory["total"] > 80 and warning.count("\n") == 0
    assert warning.startswith("warning: ") and "--ppo.gradient-accumulation-steps 8 would fit" in warning
    _, warning = run_utils.memory_check(policy_args(base_model="gpt2-xl"), 1, 0, budget_gb=40)
    assert "--gradient-checkpointing --ppo.gradient-accumulation-steps" in warning
    _, warning = run_utils.memory_check(reward_args(base_model="gpt2-xl"), 1, 0, budget_gb=48)
    assert "--gradient-accumulation-steps 2 would fit" in warning and "--ppo." not in warning
    _, warning = run_utils.memory_check(policy_args(base_model="gpt2-xl"), 1, 0, budget_gb=10)
    assert "processes under ZeRO-2" in warning or "no flag" in warning
    assert run_utils.memory_check(policy_args(base_model="gpt2"), 1, 0, budget_gb=80)[1] is None
    assert run_utils.memory_check(policy_args(base_model="no-such/model"), 1, 0, budget_gb=80) == (None, None)


def test_warn_if_memory_short_on_a_gpu_only(capsys):
    """The real run's check at start: the same line on a CUDA device (here a stand-in), nothing on a CPU."""
    gpu = SimpleNamespace(device=torch.device("cuda"), is_main_process=True, num_processes=1,
                          state=SimpleNamespace(deepspeed_plugin=None))  # fmt: skip
    run_utils.warn_if_memory_short(policy_args(base_model="gpt2-xl", gpu_memory_gb=80.0), gpu)
    assert capsys.readouterr().err.startswith("warning: the estimated peak memory per process")
    run_utils.warn_if_memory_short(policy_args(base_model="gpt2-xl", gpu_memory_gb=80.0),
                                   SimpleNamespace(**{**vars(gpu), "device": torch.device("cpu")}))  # fmt: skip
    assert capsys.readouterr().err == ""


def test_dry_run_of_both_scripts_prints_the_estimate_and_the_flags(tiny_assets, gpt2_tokenizer_dir, tmp_path):
    """--dry-run on a tiny local model: the estimate in the JSON line (the same as run_utils computes for these flags
    here, which on a CPU, without --gpu-memory-gb, warns of nothing); with --gpu-memory-gb below it, one line on
    stderr naming the flags; without a config here (a Hub model not in the cache) the estimate is listed as not
    checked. The model: 2 random layers with GPT-2's vocabulary, whose 13 MB of weights show in an estimate rounded
    to 0.01 GB (the tiny task's model, ~400 tokens, weighs 0.4 MB)."""
    (tmp_path / "constant_reward.py").write_text("def score(queries, responses):\n    return [0.0] * len(queries)\n")
    model = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64)).save_pretrained(model)
    AutoTokenizer.from_pretrained(gpt2_tokenizer_dir).save_pretrained(model)
    common = ["--base-model", str(model), "--task.query-dataset", str(tiny_assets["corpus"]),
              "--task.passage-rows", "1", "--dry-run", "--output-dir", str(tmp_path / "run")]  # fmt: skip
    policy = [*common, "--rewards.function", "constant_reward:score", "--ppo.batch-size", "64"]
    reward = [*common, "--label-dataset", str(tiny_assets["small_labels"]), "--labels.num-train", "64"]
    for module, flags, accumulation in ((train_policy_accelerate, policy, "--ppo.gradient-accumulation-steps"),
                                        (train_reward_accelerate, reward, "--gradient-accumulation-steps")):  # fmt: skip
        args = run_utils.task_cli(module.task_defaults, flags)
        expected, no_warning = run_utils.memory_check(args, 1, 0, run_utils.gpu_memory_gb(args))
        assert no_warning is None and expected["total"] > expected["weights"] > 0 and "activations" in expected
        tight = run_script(f"{module.__name__}.py", *flags, "--gpu-memory-gb", str(expected["total"] / 2),
                           env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
        assert json.loads(tight.stdout.strip().splitlines()[-1])["estimated_peak_memory_gb"] == expected
        assert "reward_model" not in expected
        (warning,) = [line for line in tight.stderr.splitlines() if line.startswith("warning: the estimated")]
        assert tight.returncode == 0 and accumulation in warning, tight.stderr
    result = run_script(
        "train_reward_accelerate.py", *reward, "--base-model", "no-such-org/no-such-model", env=unreachable_hub()
    )  # online: offline, a Hub model the cache lacks is refused
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["estimated_peak_memory_gb"] is None and any("memory estimate" in x for x in report["not_checked"])


def test_the_readme_holds_the_memory_table_of_benchmark_memory_table():
    table = subprocess.run([sys.executable, "-m", "benchmark.launch.memory_table"], capture_output=True, text=True,
                           timeout=300, check=True, cwd=REPO).stdout.strip()  # fmt: skip
    assert len(table.splitlines()) == 6 and table in (REPO / "README.md").read_text()


def test_the_bf16_modules_of_a_frozen_model_are_its_linear_layers_but_the_lm_head():
    """What a frozen model stores in bf16 under bf16 autocast, counted by the estimate as the scripts store it: GPT-2's
    Conv1D and Llama's nn.Linear layers, not the embeddings, the norms or the LM head (tied to the token embedding in
    GPT-2, a Linear of its own in this Llama)."""
    from transformers import AutoModelForCausalLM

    for config in (tiny_gpt2_config(), tiny_llama_config()):
        lm = AutoModelForCausalLM.from_config(config)
        modules = memory_estimate.bf16_modules(lm)
        names = {name for name, module in lm.named_modules() if any(module is m for m in modules)}
        assert names and all(".mlp." in name or ".attn" in name or ".self_attn." in name for name in names), names
        assert lm.get_output_embeddings() not in modules
