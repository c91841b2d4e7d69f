"""The estimated peak GPU memory of a run, per process, before it starts: a model of both scripts' tensors (the
formulas of docs/memory.md, which says what they count and what they leave out).

`estimate_peak_memory(args, processes, zero_stage)` is what `--dry-run` prints and what run_utils checks against a
GPU's memory (`memory_check`, `flags_that_fit`, `warn_if_memory_short`); benchmark/launch/memory_table.py prints the
README's table from it. It must change when a script's tensors change: the reward script's best-of-4 rows, the PPO
step's logits, the rollout's chunks. It reads a model's config only (on the meta device), never its weights, and
imports nothing of the project.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch

ZERO_BUCKET_VALUES = 50_000_000  # gradients per ZeRO-2 reduction (and weights per all-gather): 191 MiB in fp32, where
# DeepSpeed's default 5e8 allocates 1.86 GiB whatever the model; NCCL reaches its bandwidth with far smaller messages

GB = 2**30  # the unit of time/peak_memory_gb and --gpu-memory-gb
GPT2_SIZES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
              "gpt2-xl": (48, 1600, 25)}  # fmt: skip
"""OpenAI's GPT-2 sizes (n_layer, n_embd, n_head): a --dry-run estimates them without their config file"""
NUM_SAMPLES = 4  # train_reward_accelerate.NUM_SAMPLES: a label record holds a query and 4 samples, read as one row
LOGIT_COPIES = 5  # (rows, T, V) fp32 tensors live at once in a PPO micro-batch's backward: the scaled logits kept for
# it, the gather's scattered gradient (autograd runs the gather's backward first), and logsumexp's backward's
# logits - logsumexp, its exp and their product with the incoming gradient
ROLLOUT_LOGIT_COPIES = 3  # a rollout chunk's policy and reference logits, and a log-softmax temporary
ZERO_REDUCE_BUCKET = 4 * ZERO_BUCKET_VALUES  # bytes: ZeRO-2's fp32 reduce bucket (check_launch), allocated whole


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameters counted exactly, and the sizes of its activations."""

    lm_parameters: int  # the causal LM's, a tied LM head counted once (GPT-2's is its token embedding)
    backbone_parameters: int  # without the LM head: the reward model's backbone
    lm_bf16_parameters: int  # of those, the ones a frozen copy keeps in bf16 under bf16 autocast (bf16_modules)
    backbone_bf16_parameters: int
    layers: int
    width: int  # d_model
    inner: int  # the MLP's hidden width (4 * d_model in GPT-2)
    vocab: int  # rows of the LM head


@functools.cache
def model_shape(name: str) -> Optional[ModelShape]:
    """The shape of a model, built from its config on the meta device (no memory, no weights read): the config of a
    local directory or of the Hugging Face cache, or OpenAI's GPT-2 sizes; None when there is none (a dry run
    downloads nothing)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):  # not local, not cached (or not a valid name at all)
        if name.removeprefix("openai-community/") not in GPT2_SIZES:
            return None
        n_layer, n_embd, n_head = GPT2_SIZES[name.removeprefix("openai-community/")]
        config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731 (shared tensors once)
    in_bf16 = lambda model: sum(count(module) for module in bf16_modules(model))  # noqa: E731
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    return ModelShape(lm_parameters=count(lm), backbone_parameters=count(lm.base_model),
                      lm_bf16_parameters=in_bf16(lm), backbone_bf16_parameters=in_bf16(lm.base_model),
                      layers=config.num_hidden_layers, width=config.hidden_size, inner=inner,
                      vocab=lm.get_output_embeddings().weight.shape[0])  # fmt: skip


def bf16_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of a frozen model whose weights every product under bf16 autocast reads as bf16 (autocast casts
    the weight and bias of a linear layer, nn.Linear or GPT-2's Conv1D, at each product): stored in bf16 they take
    half the memory and give those products the same operands. Not the output embeddings (the LM head, whose logits
    are fp32 products) nor what runs outside autocast's bf16 list: embeddings, norms."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {id(parameter) for parameter in head.parameters()} if head is not None else set()
    return [module for module in model.modules() if isinstance(module, (torch.nn.Linear, Conv1D))
            and module is not head and not heads & {id(parameter) for parameter in module.parameters()}]  # fmt: skip


def frozen_bytes(parameters: int, bf16_parameters: int, bf16: bool) -> int:
    """A frozen model's weights: fp32, its linear layers bf16 under bf16 autocast (bf16_modules)."""
    return 4 * parameters - (2 * bf16_parameters if bf16 else 0)


def peak_memory_parts(args, base: ModelShape, reward: Optional[ModelShape], processes: int, zero_stage: int) -> dict:
    """The estimated peak GPU memory of one process, in bytes per part, for a script's `args` (the policy script's
    when they have `ppo`, else the reward script's) launched on `processes` processes, under ZeRO-2 when
    `zero_stage` is not 0 (DeepSpeed's other stages are estimated as 2). `base` is --base-model's shape, `reward` the
    policy's reward model's (None: --rewards.function). Assumptions (docs/memory.md: ±25%):

    - the trained model: fp32 weights, gradients and Adam's m and v (16 bytes per parameter); DDP keeps the
      gradients as views into its all-reduce buckets (ddp_options), no second copy; ZeRO-2 splits gradients and
      Adam over the processes, and adds its fp32 copy of each process's partition and its reduce bucket; bf16
      autocast adds bf16 copies of the weights (its cache) and keeps everything else fp32;
    - frozen models (the policy's reference and reward models, the reward script's sampler): fp32 weights, but for
      their linear layers' in bf16 under bf16 autocast (bf16_modules);
    - activations saved for the backward, per token and layer of a GPT-2 block with SDPA attention (no T x T
      matrix): 9 d_model + 2 inner values (input, layer-norm outputs, q k v, the attention's output and its
      merged heads, the MLP's hidden and its activation), fp32; under bf16 the matrix products' inputs are bf16
      and the layer norms' inputs fp32; with gradient checkpointing each layer keeps only its fp32 input, and one
      layer is recomputed at a time; the reward script adds each record's (L, L) attention mask;
    - the policy's logits: LOGIT_COPIES fp32 (rows, T, V) tensors per micro-batch;
    - the rollout, which never overlaps the training peak: the largest of sampling a chunk of
      --local-rollout-forward-batch-size rows (its KV cache and a step's logits), the policy's log-prob forwards of a
      micro-batch (ROLLOUT_LOGIT_COPIES of its logits, a layer's no-grad temporaries), the reward model's scoring of
      a chunk, and in the reward script the held-out evaluation's forward;
    - the query's prefix and suffix tokens, SDPA's log-sum-exp and the value / reward heads' outputs are left out.
    """
    task, d, bf16 = args.task, base.width, args.mixed_precision == "bf16"
    if hasattr(args, "ppo"):  # as the policy script's validate_args splits the batch
        trained = base.lm_parameters + d + 1  # the LM and the value head
        frozen = {"reference_model": frozen_bytes(base.lm_parameters, base.lm_bf16_parameters, bf16)}
        if reward is not None:
            backbone = frozen_bytes(reward.backbone_parameters, reward.backbone_bf16_parameters, bf16)
            frozen["reward_model"] = backbone + 4 * (reward.width + 3)
        ppo = args.ppo
        rows = ppo.batch_size // processes // ppo.nminibatches // ppo.gradient_accumulation_steps
        tokens = task.query_length + task.response_length
        rollout_rows = min(args.local_rollout_forward_batch_size, ppo.batch_size // processes)  # sampling, scoring
    else:  # the reward script: micro-batches of label records, each one row of a query and its 4 samples
        trained = base.backbone_parameters + d + 3  # the backbone, the scalar head, the gain and the bias
        frozen = {"sampler": frozen_bytes(base.lm_parameters, base.lm_bf16_parameters, bf16)}
        rows = args.batch_size // processes // args.gradient_accumulation_steps
        tokens = task.query_length + NUM_SAMPLES * task.response_length
        rollout_rows = min(args.local_rollout_forward_batch_size, args.rollout_batch_size // processes)
    parts = {"weights": 4 * trained, "bf16_weight_copies": 2 * trained if bf16 else 0}
    if zero_stage:
        parts["gradients"] = 4 * trained / processes + ZERO_REDUCE_BUCKET
        parts["optimizer"] = 12 * trained / processes  # Adam's m and v, and ZeRO's fp32 copy of the partition
    else:
        parts["gradients"] = 4 * trained  # on several processes: DDP's buckets themselves (ddp_options)
        parts["optimizer"] = 8 * trained  # Adam's m and v
    parts.update(frozen)
    values = 2 if bf16 else 4  # bytes of a saved matrix-product input
    per_token_layer = 4 * (2 * d) + values * (7 * d + 2 * base.inner)  # the two layer norms' fp32 inputs, the rest
    if args.gradient_checkpointing:  # each layer's fp32 input, and one layer recomputed during the backward
        parts["activations"] = rows * tokens * (base.layers * 4 * d + per_token_layer)
    else:
        parts["activations"] = rows * tokens * base.layers * per_token_layer
    forward_temporaries = 4 * tokens * (d + 2 * base.inner)  # per row: a no-grad layer's residual and MLP values
    kv_cache = 2 * base.layers * (task.query_length + task.response_length) * d * values  # per row
    sampling = rollout_rows * (kv_cache + 2 * 4 * base.vocab)  # the cache, a step's logits and their softmax
    if hasattr(args, "ppo"):
        parts["logits"] = LOGIT_COPIES * 4 * rows * task.response_length * base.vocab
        logits = ROLLOUT_LOGIT_COPIES * 4 * task.response_length * base.vocab
        # the log-prob forwards take the PPO micro-batch's rows (rollout_logprobs), sampling and scoring the chunks
        parts["rollout"] = max(sampling, rows * (logits + forward_temporaries), rollout_rows * forward_temporaries)
    else:
        mask = 5 * tokens**2  # per record: the fp32 (L, L) attention mask and its boolean source
        parts["activations"] += rows * mask
        evaluation = args.eval_batch_size // processes * (mask + forward_temporaries)
        parts["rollout"] = max(sampling, evaluation)
    return {name: value for name, value in parts.items() if value}


def peak_memory_phases(parts: dict) -> tuple[float, float, float]:
    """(static, training, rollout) bytes: what lives the whole run, the training peak (activations and logits), and
    the rollout's (sampling, scoring, evaluation), which never overlaps the training peak."""
    training = parts.get("activations", 0) + parts.get("logits", 0)
    static = sum(value for name, value in parts.items() if name not in ("activations", "logits", "rollout"))
    return static, training, parts.get("rollout", 0)


def peak_memory_total(parts: dict) -> float:
    static, training, rollout = peak_memory_phases(parts)
    return static + max(training, rollout)


def estimate_peak_memory(args, processes: int, zero_stage: int) -> Optional[dict[str, float]]:
    """peak_memory_parts in GB, with their "total"; None when --base-model's config is not here."""
    base = model_shape(args.base_model)
    if base is None:
        return None
    parts = peak_memory_parts(args, base, reward_model_shape(args, base), processes, zero_stage)
    in_gb = {name: round(value / GB, 2) for name, value in parts.items()}
    return {**in_gb, "total": round(peak_memory_total(parts) / GB, 2)}


def reward_model_shape(args, base: ModelShape) -> Optional[ModelShape]:
    """The policy's reward model: its own directory's config when it is here, else the base model's size; None for
    --rewards.function (and for the reward script, which has none)."""
    rewards = getattr(args, "rewards", None)
    if rewards is None or rewards.function is not None:
        return None
    return (rewards.trained_model and model_shape(rewards.trained_model)) or base
