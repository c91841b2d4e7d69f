"""Fine-tune a language model with PPO against a learned reward model, as OpenAI's lm-human-preferences did.

Reproduces `lm_human_preferences/train_policy.py` (TF1, https://github.com/openai/lm-human-preferences; Ziegler et
al. 2019) with every detail of "The N Implementation Details of RLHF with PPO" (Huang, Liu, von Werra, 2023): sample
fixed-length responses at temperature 0.7, cut them after a '.' (or score them -1), reward = reward-model score on
the last token minus kl_coef * KL(policy || pretrained) on every token, whitened rewards, GAE, 4 PPO epochs with
clipped policy and value losses, TF-style Adam, and an adaptive KL coefficient. Specified in SPEC §1–3 and §5; the
summarization tasks (--task.name tldr / cnndm: 500-token queries, 75-token responses cut after a newline, a fixed KL
coefficient, no reward whitening) in §6.

Launch (batch sizes are global: the same flags give the same optimization on any number of processes):
    python train_policy_accelerate.py --rewards.trained-model runs/RM_RUN/reward_model                # 1 GPU
    accelerate launch --num_processes 8 train_policy_accelerate.py --rewards.trained-model DIR         # 8 GPUs
    accelerate launch --num_processes 8 train_policy_accelerate.py --task.name tldr --rewards.trained-model DIR
    python train_policy_accelerate.py --base-model models/tiny-gpt2 --rewards.trained-model DIR \\
        --task.query-dataset corpus.txt --ppo.total-episodes 64 --ppo.batch-size 16                   # CPU smoke
Outputs in --output-dir: args.json, metrics.jsonl (one row per update), samples.jsonl, policy/ (a Hugging Face
causal LM directory with its tokenizer) and, with --task.gold-labeler, eval_samples.jsonl.
"""

import ctypes
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NoReturn, Optional
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import gather_object
from rich.console import Console
from rich.progress import track
from rich.table import Table
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig


@dataclass
class AdaptiveKLParams:
    target: float = 6.0
    """KL (nats per response) the adaptive controller steers towards"""
    horizon: int = 10000
    """episodes over which the controller closes the gap to the target"""


@dataclass
class RewardHParams:
    trained_model: Optional[str] = None
    """reward model directory written by train_reward_accelerate.py (OUTPUT_DIR/reward_model); required"""
    kl_coef: Optional[float] = None
    """initial coefficient of the per-token KL penalty, beta (per task: sentiment/descriptiveness 0.15, tldr 0.03,
    cnndm 0.01)"""
    use_adaptive_kl: Optional[bool] = None
    """adapt kl_coef towards adaptive_kl.target; False keeps it fixed (per task: sentiment/descriptiveness True,
    tldr/cnndm False)"""
    adaptive_kl: AdaptiveKLParams = field(default_factory=AdaptiveKLParams)


@dataclass
class PpoHParams:
    total_episodes: int = 1_000_000
    """episodes (query + response pairs) to train on; updates = ceil(total_episodes / batch_size)"""
    batch_size: Optional[int] = None
    """episodes per PPO update, over all processes (per task: sentiment/descriptiveness 512, tldr/cnndm 32)"""
    nminibatches: int = 1
    """minibatches per PPO epoch (one optimizer step each)"""
    noptepochs: int = 4
    """PPO epochs over each batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch (memory knob; does not change the math)"""
    lr: Optional[float] = None
    """learning rate, annealed linearly to 0 per update (per task: sentiment/descriptiveness 1e-5, tldr/cnndm 2e-6)"""
    eps: float = 1e-5
    """Adam epsilon"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    cliprange: float = 0.2
    """policy ratio clip range"""
    cliprange_value: float = 0.2
    """value prediction clip range (around the rollout values)"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: Optional[bool] = None
    """whiten the per-token rewards (without shifting their mean) before GAE (per task: sentiment/descriptiveness
    True, tldr/cnndm False)"""


@dataclass
class TaskHParams:
    name: Literal["sentiment", "descriptiveness", "tldr", "cnndm"] = "sentiment"
    """OAI's task (launch.py; SPEC §6): sets the default of every flag documented "per task" to this task's value"""
    query_dataset: Optional[str] = None
    """query texts: a Hugging Face Hub dataset name, or a local .txt (one text per line) / .json / .jsonl file (per
    task: sentiment/descriptiveness 'bookcorpus', tldr 'webis/tldr-17', cnndm 'cnn_dailymail')"""
    query_dataset_config: Optional[str] = None
    """configuration name of a Hub --task.query-dataset (per task: cnndm '3.0.0', the others none)"""
    query_field: Optional[str] = None
    """the field of each dataset row that holds the text (per task: sentiment/descriptiveness 'text', tldr 'content',
    cnndm 'article')"""
    query_length: Optional[int] = None
    """tokens per query, without prefix and suffix (per task: sentiment/descriptiveness 64, tldr/cnndm 500; the
    blog's code later regressed the books tasks to 24)"""
    query_prefix: Optional[str] = None
    """text put before every query in the policy's input; the reward model reads the bare query, as OAI's did (per
    task: cnndm 'Article:\\n\\n', the others '')"""
    query_suffix: Optional[str] = None
    """text put after every (padded) query in the policy's input (per task: tldr/cnndm '\\n\\nTL;DR:', the others '')"""
    start_text: Optional[str] = None
    """if set, a query starts after the first occurrence of this text (texts without it are skipped); OAI books:
    '.', but Hub `bookcorpus` is already one sentence per row"""
    end_text: Optional[str] = None
    """if set, a query is cut after the last occurrence of this text (texts without it are skipped); OAI cnndm: '\\n',
    but Hub `cnn_dailymail` joins an article's paragraphs with spaces, so it is not set here"""
    response_length: Optional[int] = None
    """tokens sampled per response, never stopped early at EOS (per task: sentiment/descriptiveness 24, tldr/cnndm 75)"""
    truncate_token: Optional[str] = None
    """text of the token that ends a response after `truncate_after`, resolved with the tokenizer (per task:
    sentiment/descriptiveness '.' (13 in GPT-2), tldr/cnndm '\\n' (198))"""
    truncate_after: Optional[int] = None
    """a response is cut after the first truncate token at response index >= this (per task:
    sentiment/descriptiveness 16, tldr/cnndm 55)"""
    temperature: Optional[float] = None
    """sampling temperature; log-probs are always computed from logits divided by it (per task: cnndm 0.5, the
    others 0.7)"""
    penalty_reward_value: float = -1.0
    """score of a response with no truncate token at index >= truncate_after"""
    gold_labeler: Optional[Literal["sentiment", "descriptiveness"]] = None
    """score held-out samples with a simulated labeler too (eval/gold_score next to eval/rm_score): shows whether the
    policy really improves or exploits the reward model"""


@dataclass
class Args:
    exp_name: str = "train_policy_accelerate"
    """experiment name, the first part of the run name"""
    seed: int = 1
    """global seed: head init comes from it; process i samples with seed + i * 100003"""
    track: bool = False
    """log to Weights & Biases (works with WANDB_MODE=offline)"""
    wandb_project_name: str = "lm-human-preferences"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user)"""
    output_dir: Optional[str] = None
    """where args.json, metrics.jsonl, samples.jsonl and policy/ go (default: runs/<run_name>)"""
    overwrite: bool = False
    """start again in an output directory that holds a previous run (its metrics, samples and checkpoints go)"""
    resume: bool = False
    """continue the run in --output-dir from its newest checkpoint (from scratch if it has none; at once done if it
    finished); every flag that changes the math must be as before"""
    checkpoint_every: int = 0
    """write a checkpoint (model, optimizer, KL controller, RNG states, data position, logs) every this many updates
    into --output-dir/checkpoints (0: only when stopped by SIGTERM)"""
    checkpoint_keep: int = 2
    """keep the newest this many checkpoints"""
    dry_run: bool = False
    """validate every flag, print the derived sizes and exit before loading any model or data"""
    base_model: str = "gpt2"
    """pretrained causal LM for the policy and the reference policy: a Hub id or a local directory"""
    use_tensorflow_adam: bool = True
    """TF1-style Adam (eps outside the bias correction, as in OAI); --no-use-tensorflow-adam: torch.optim.Adam"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: forwards under bf16 autocast with fp32 master weights and optimizer state; log-softmax, losses, rewards
    and advantages stay fp32 (a GPU speed option: on CPUs without bf16 units it is slower)"""
    allow_tf32: bool = False
    """TF32 matmuls on Ampere and newer GPUs (faster, ~1e-3 relative error per matmul); no effect on CPU"""
    peak_tflops: Optional[float] = None
    """the device's peak TFLOP/s (per process); with it, MFU (model FLOPs per second / peak) is logged as time/mfu_*
    (benchmark/throughput.py measures a peak with a matmul benchmark)"""
    local_rollout_forward_batch_size: int = 64
    """rows per rollout generation / forward on one process (memory knob; does not change the math)"""
    compile: bool = False
    """torch.compile the policy's training forward (PPO epochs); the first update pays the compilation (tens of
    seconds on a CPU), later ones run the compiled kernels; same math to float rounding"""
    logprobs_from_generation: bool = False
    """take the policy's rollout log-probs and values from generate()'s own forwards (the LM head's inputs and outputs
    at each step) instead of one more policy forward over query ⊕ response: saves that forward; the KV-cached
    forwards agree with the full one to float rounding, so PPO's first ratios are 1 ± ~1e-6 instead of exactly 1"""
    print_sample_output_freq: int = 10
    """print (and save to samples.jsonl) a table of sample responses every this many updates"""
    eval_every: int = 10
    """with --task.gold-labeler: evaluate the held-out queries every this many updates (and at update 0 and the end)"""
    eval_queries: int = 64
    """with --task.gold-labeler: held-out queries (kept out of training)"""
    eval_samples_per_query: int = 4
    """with --task.gold-labeler: responses sampled per held-out query"""
    upload_model: bool = False
    """push the final policy to the Hugging Face Hub as --hf-repo-id"""
    hf_repo_id: Optional[str] = None
    """Hub repo for --upload-model (default: the run name)"""
    task: TaskHParams = field(default_factory=TaskHParams)
    rewards: RewardHParams = field(default_factory=RewardHParams)
    ppo: PpoHParams = field(default_factory=PpoHParams)
    world_size: tyro.conf.Suppress[Optional[int]] = None
    local_batch_size: tyro.conf.Suppress[Optional[int]] = None
    local_mini_batch_size: tyro.conf.Suppress[Optional[int]] = None
    micro_batch_size: tyro.conf.Suppress[Optional[int]] = None
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    run_name: tyro.conf.Suppress[Optional[str]] = None


GLIBC_M_TRIM_THRESHOLD, GLIBC_M_MMAP_THRESHOLD = -1, -3  # mallopt() parameter numbers from glibc's malloc.h
RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")  # copied into each checkpoint
RESUME_MAY_CHANGE = {
    "resume",
    "overwrite",
    "run_name",
    "checkpoint_every",
    "checkpoint_keep",
    "track",
    "dry_run",
    "wandb_project_name",
    "wandb_entity",
    "upload_model",
    "hf_repo_id",
    "world_size",
    "local_batch_size",
    "local_mini_batch_size",
    "micro_batch_size",
    "local_rollout_batch_size",
    "local_eval_batch_size",
}  # fmt: skip (per-process sizes: checked against the checkpoint instead)
EXIT_STOPPED = 143  # 128 + SIGTERM: stopped on request after writing a checkpoint (a requeued job resumes from it)
RANK_SEED_STRIDE = 100003  # process i samples with seed + i * RANK_SEED_STRIDE (a prime, so streams never collide)
KL_ERROR_CLIP = 0.2  # OAI AdaptiveKLController clips the proportional error to +-0.2
MIN_WHITEN_ROWS = 8  # whitening statistics over fewer rows per process-minibatch are too noisy (OAI asserts it)
EVAL_SEED = 1234  # held-out evaluation samples with its own RNG, identical at every evaluation (paired comparison)
SAMPLE_ROWS = 4  # rows of the sample table printed to the console

# OAI's tasks (launch.py books_task, summarize_tldr_task, summarize_cnndm_task; SPEC §6): validate_args gives
# every TaskHParams field left at None (its flag not given) the value of --task.name
BOOKS_TASK = {"query_dataset": "bookcorpus", "query_field": "text", "query_length": 64, "response_length": 24,
              "query_prefix": "", "query_suffix": "", "truncate_token": ".", "truncate_after": 16, "temperature": 0.7}  # fmt: skip
SUMMARIZATION_TASK = {"query_length": 500, "response_length": 75, "query_prefix": "", "query_suffix": "\n\nTL;DR:",
                      "truncate_token": "\n", "truncate_after": 55, "temperature": 0.7}  # fmt: skip
TASK_DEFAULTS = {
    "sentiment": BOOKS_TASK,
    "descriptiveness": BOOKS_TASK,
    "tldr": {**SUMMARIZATION_TASK, "query_dataset": "webis/tldr-17", "query_field": "content"},
    "cnndm": {**SUMMARIZATION_TASK, "query_dataset": "cnn_dailymail", "query_dataset_config": "3.0.0",
              "query_field": "article", "query_prefix": "Article:\n\n", "temperature": 0.5},
}  # fmt: skip

# OAI's PPO settings per task (launch.py get_experiments), for the Args left at None: the summarization tasks train
# with a 16x smaller batch and a 5x smaller lr, a fixed KL coefficient and no reward whitening
BOOKS_PPO = {"ppo.batch_size": 512, "ppo.lr": 1e-5, "ppo.whiten_rewards": True, "rewards.use_adaptive_kl": True}
SUMMARIZATION_PPO = {"ppo.batch_size": 32, "ppo.lr": 2e-6, "ppo.whiten_rewards": False,
                     "rewards.use_adaptive_kl": False}  # fmt: skip
PPO_TASK_DEFAULTS = {
    "sentiment": {**BOOKS_PPO, "rewards.kl_coef": 0.15},
    "descriptiveness": {**BOOKS_PPO, "rewards.kl_coef": 0.15},
    "tldr": {**SUMMARIZATION_PPO, "rewards.kl_coef": 0.03},
    "cnndm": {**SUMMARIZATION_PPO, "rewards.kl_coef": 0.01},
}


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers: this block is copied verbatim into train_policy_accelerate.py (tests/test_shared_helpers.py fails
# when the two copies drift apart). Each script stays a single file a reader can follow top to bottom.
# ---------------------------------------------------------------------------------------------------------------------
def fail(message: str) -> NoReturn:
    """Stop with a one-line error (no traceback) and a non-zero exit code."""
    raise SystemExit(f"error: {message}")


def hub_is_reachable(timeout: float = 3.0) -> bool:
    """A TCP connect to the Hub endpoint; the libraries themselves retry for ~25 s per file when offline."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def require_local_or_hub(value: str, flag: str) -> None:
    """Local paths always work; a Hub name needs the Hub (or HF_HUB_OFFLINE=1 and a warm HF cache)."""
    if os.path.exists(value) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    if not hub_is_reachable():
        fail(
            f"{flag} {value!r} is not a local path and the Hugging Face Hub is unreachable: pass a local path to {flag}"
        )


def fill_task_defaults(config, defaults: dict) -> None:
    """Give every field of `config` still at None (its flag not given) the task's default; `defaults` maps field
    paths relative to `config` (e.g. "ppo.lr") to values."""
    for path, value in defaults.items():
        *parents, name = path.split(".")
        owner = config
        for parent in parents:
            owner = getattr(owner, parent)
        if getattr(owner, name) is None:
            setattr(owner, name, value)


def derive_batch_size(total: int, parts: int, flags: str) -> int:
    """Exact division of a global size into per-process / per-micro-batch sizes, or a one-line error."""
    if total <= 0 or total % parts != 0:
        fail(f"{flags}: {total} is not divisible into {parts} equal parts; change the flags so that it is")
    return total // parts


def load_tokenizer(name_or_path: str, flag: str):
    """The base model's tokenizer with a pad token distinct from EOS, so the policy stays free to emit EOS.

    detail: pad token — GPT-2 has none; we add `[PAD]`, which gets id 50257, one past the vocabulary. The embedding
    matrix is not resized: pad ids are replaced by 0 before every forward (see `padded_forward`)."""
    require_local_or_hub(name_or_path, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        fail(f"{flag} {name_or_path!r}: cannot load a tokenizer ({str(error).splitlines()[0]})")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the token → id map: the reward model and the policy must read tokens the same way."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def config_without_dropout(name_or_path: str, flag: str):
    """detail: dropout off — every dropout probability of the config set to 0 (OAI trains without dropout; eval mode
    alone would leave it on in the PPO forward passes, making the ratio at the first minibatch != 1)."""
    require_local_or_hub(name_or_path, flag)
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        fail(f"{flag} {name_or_path!r}: not a model directory or Hub id ({str(error).splitlines()[0]})")
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def require_causal_lm(name_or_path: str, flag: str) -> None:
    """Fail before any weights load unless the model was saved as a causal LM (its config's `architectures`, e.g.
    GPT2LMHeadModel or LlamaForCausalLM; an encoder such as BertModel would load with a random LM head)."""
    architectures = config_without_dropout(name_or_path, flag).architectures or []
    if architectures and not any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures):
        fail(f"{flag} {name_or_path!r} is not a causal LM (saved as {', '.join(architectures)})")


def assert_dropout_disabled(model: nn.Module) -> None:
    for key, value in model.config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            assert value == 0.0, f"config.{key} = {value}"
    for name, module in model.named_modules():
        assert not isinstance(module, nn.Dropout) or module.p == 0.0, f"{name}.p = {module.p}"


def load_pretrained(model_class, name_or_path: str, flag: str) -> nn.Module:
    """A pretrained model through the Auto classes with dropout forced to 0, in fp32."""
    config = config_without_dropout(name_or_path, flag)
    try:
        model = model_class.from_pretrained(name_or_path, config=config, dtype=torch.float32)
    except (OSError, ValueError) as error:
        fail(f"{flag} {name_or_path!r}: cannot load as {model_class.__name__} ({str(error).splitlines()[0]})")
    assert_dropout_disabled(model)
    return model


def disable_eos_stopping(lm: nn.Module) -> None:
    """detail: fixed-length responses — OAI samples exactly response_length tokens and never stops at EOS. The
    backbone's own generation_config must lose eos/pad ids: a fresh GenerationConfig alone is merged with it."""
    lm.generation_config.eos_token_id = None
    lm.generation_config.pad_token_id = None


def right_padding_to_left_padding(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Move every pad of each row to the left, keeping the real tokens in order (also pads in the middle).

    detail: left padding — with it the last column is always a real token (OAI reads values at the last token).
    Vectorised: a stable sort on the pad mask puts pads (key 0) before real tokens (key 1)."""
    is_token = (tokens != pad_id).to(torch.int8)
    order = torch.sort(is_token, dim=1, stable=True).indices  # (B, L)
    return torch.gather(tokens, 1, order)


def padded_forward(backbone: nn.Module, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Final hidden states (after the final layer norm) of left-padded `tokens`: (B, L, d_model).

    detail: attention mask + position ids — pads are masked, real tokens get positions 0, 1, ... (exclusive cumsum of
    the mask, so pads don't advance it) and pad ids never reach the embedding."""
    attention_mask = tokens != pad_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.where(attention_mask, tokens, 0)
    output = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return output.last_hidden_state


def generate_responses(lm: nn.Module, queries: torch.Tensor, pad_id: int, response_length: int, temperature: float):
    """Sample exactly `response_length` tokens per left-padded query: (B, T).

    Position ids are not passed: generate() derives them from the attention mask (passing them broke sampling)."""
    attention_mask = queries != pad_id
    config = GenerationConfig(
        max_new_tokens=response_length,
        min_new_tokens=response_length,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=temperature,
    )
    output = lm.generate(
        input_ids=torch.where(attention_mask, queries, 0), attention_mask=attention_mask, generation_config=config
    )
    responses = output[:, queries.shape[1] :]
    assert responses.shape[1] == response_length, f"generated {responses.shape[1]} tokens, not {response_length}"
    return responses


def truncate_responses(responses: torch.Tensor, truncate_token_id: int, truncate_after: int, pad_id: int):
    """Post-processed responses and whether each had a truncate token at index >= truncate_after: ((B, T), (B,)).

    detail: rejection sampling / truncation — every token strictly after the first truncate token at index >=
    truncate_after becomes pad (OAI lm_tasks.py postprocess)."""
    index = torch.arange(responses.shape[1], device=responses.device)  # (T,)
    is_cut = (responses == truncate_token_id) & (index >= truncate_after)  # (B, T)
    has_cut = is_cut.any(1)
    first_cut = torch.where(has_cut, is_cut.int().argmax(1), responses.shape[1])  # (B,)
    postprocessed = torch.where(index > first_cut[:, None], pad_id, responses)
    return postprocessed, has_cut


def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """OAI's whiten: biased variance (like tf.nn.moments) over the whole tensor; mean added back if not shift_mean."""
    mean, var = values.mean(), values.var(unbiased=False)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


class AdamTensorFlowStyle(torch.optim.Optimizer):
    """Adam as in TF1 (and so OAI): eps is added to sqrt(v) outside the bias correction,
    `p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`.

    detail: TF-style Adam — PyTorch's update divides by sqrt(v / (1 - b2^t)) + eps, i.e. its effective eps is
    eps * sqrt(1 - b2^t) (~0.03 eps at t=1), so early updates are larger (blog: ~6x the approxkl early on)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-5):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                denominator = state["exp_avg_sq"].sqrt().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denominator, value=-step_size)
        return loss


def linear_lr(base_lr: float, step: int, num_steps: int) -> float:
    """detail: linear lr anneal — lr * (1 - step / num_steps) for step = 0 .. num_steps - 1 (never exactly 0)."""
    return base_lr * (1 - step / num_steps)


def make_optimizer(params, lr: float, eps: float, use_tensorflow_adam: bool) -> torch.optim.Optimizer:
    if use_tensorflow_adam:
        return AdamTensorFlowStyle(params, lr=lr, eps=eps)
    return torch.optim.Adam(params, lr=lr, eps=eps)


def load_query_texts(task: TaskHParams):
    """The query texts: a local .txt (one per line) / .json / .jsonl file, or a Hub dataset (train split, in the
    configuration --task.query-dataset-config if set)."""
    import datasets

    datasets.disable_progress_bars()
    path = task.query_dataset
    if os.path.isfile(path):
        if os.path.getsize(path) == 0:
            fail(f"--task.query-dataset {path!r} is empty")
        kind = "json" if path.endswith((".json", ".jsonl")) else "text"
        try:
            dataset = datasets.load_dataset(kind, data_files=path, split="train")
        except Exception as error:  # datasets wraps every parse error in its own exception types
            cause = error.__cause__ or error
            fail(f"--task.query-dataset {path!r}: cannot read it as {kind} ({type(cause).__name__}: {cause})")
    else:
        require_local_or_hub(path, "--task.query-dataset")
        try:
            dataset = datasets.load_dataset(path, task.query_dataset_config, split="train")
        except (OSError, ValueError, ConnectionError) as error:
            fail(
                f"--task.query-dataset {path!r} (--task.query-dataset-config {task.query_dataset_config!r}): "
                f"cannot load ({str(error).splitlines()[0]})"
            )
    if task.query_field not in dataset.column_names:
        fail(f"--task.query-field {task.query_field!r} is not a column of {path} (columns: {dataset.column_names})")
    return dataset


def clean_query_text(text: str, task_name: str) -> str:
    """OAI's clean-up of the summarization texts (datasets/tldr.py, cnndm.py); book sentences stay as they are.

    Both: straight quotes (OAI: ftfy), Unix newlines, at most one empty line in a row, no surrounding whitespace.
    cnndm also cuts at "@highlight" and drops the header before the story: the byline ("By . NAME ." in the Hub's
    `cnn_dailymail`, whose loader joins lines with spaces and ends them with " ."; "By\\nNAME\\n" in .story files),
    the Daily Mail date lines up to the last "PUBLISHED:/UPDATED: 15:36 EST, 25 October 2013" and the CNN dateline
    up to "(CNN) --" (in the first 100 characters, like OAI)."""
    if task_name not in ("tldr", "cnndm"):
        return text
    if task_name == "cnndm":
        text = text.split("@highlight")[0]
        text = re.sub(r"^\s*By(?: \. .{0,80}? \. |\s*\n[^\n]*\n)", "", text)
        date = r"(?:PUBLISHED:|UPDATED:|Last updated at)[\s.]*\d{1,2}:\d{2}.*?\b(?:19|20)\d{2}\b[\s.|]*"
        headers = list(re.finditer(date, text[:500]))
        text = text[headers[-1].end() :] if headers else text
        text = re.sub(r"^[\s\S]{0,100}\(CNN\)\s*(?:--)?", "", text)
    text = text.translate(str.maketrans("\u2018\u2019\u201c\u201d", "''\"\"")).replace("\r\n", "\n")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def query_from_text(tokenizer, text_tokens: list[int], task: TaskHParams, pad_id: int) -> Optional[list[int]]:
    """OAI's query algorithm: start after start_text, keep query_length tokens, end after the last end_text,
    right-pad to query_length. None: the text yields no query. The prefix and suffix come later (`QueryStream.format`):
    the reward model and the label files see the bare query."""
    tokens = text_tokens
    if task.start_text:
        start = tokenizer.encode(task.start_text, add_special_tokens=False)
        hits = [i for i in range(len(tokens) - len(start) + 1) if tokens[i : i + len(start)] == start]
        if not hits:
            return None
        tokens = tokens[hits[0] + len(start) :]
    tokens = tokens[: task.query_length]
    if task.end_text:
        end = tokenizer.encode(task.end_text, add_special_tokens=False)
        hits = [i for i in range(len(tokens) - len(end) + 1) if tokens[i : i + len(end)] == end]
        if not hits:
            return None
        tokens = tokens[: hits[-1] + len(end)]
    if not tokens:
        return None
    return tokens + [pad_id] * (task.query_length - len(tokens))


class QueryStream:
    """Endless batches of left-padded queries (B, query_length): texts in a seeded random order per epoch, cleaned and
    tokenized lazily in chunks; `format` turns them into the policy's contexts.

    All processes share the order (global seed); process r takes every world_size-th text, so none repeats a text
    another process uses in the same epoch. `position` counts the texts consumed (for resuming)."""

    def __init__(self, texts, tokenizer, task, pad_id, seed, rank=0, world_size=1, text_ids=None, chunk=256):
        self.texts, self.tokenizer, self.task, self.pad_id = texts, tokenizer, task, pad_id
        self.seed, self.rank, self.world_size, self.chunk = seed, rank, world_size, chunk
        self.text_ids = np.arange(len(texts)) if text_ids is None else np.asarray(text_ids)
        self.epoch, self.position, self.produced_in_epoch, self.buffer = 0, 0, 0, []
        self.order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.text_ids))
        return self.text_ids[order][self.rank :: self.world_size]

    def next_batch(self, n: int) -> torch.Tensor:
        while len(self.buffer) < n:
            if self.position >= len(self.order):
                if self.produced_in_epoch == 0:
                    fail(f"--task.query-dataset {self.task.query_dataset!r}: no text yields a query")
                self.epoch, self.position, self.produced_in_epoch = self.epoch + 1, 0, 0
                self.order = self._epoch_order()
            ids = self.order[self.position : self.position + self.chunk]
            self.position += len(ids)
            texts = [clean_query_text(self.texts[int(i)], self.task.name) for i in ids]
            for tokens in self.tokenizer(texts, add_special_tokens=False)["input_ids"]:
                query = query_from_text(self.tokenizer, tokens, self.task, self.pad_id)
                if query is not None:
                    self.buffer.append(query)
                    self.produced_in_epoch += 1
        batch, self.buffer = self.buffer[:n], self.buffer[n:]
        return right_padding_to_left_padding(torch.tensor(batch), self.pad_id)

    def state(self) -> dict:
        return dict(epoch=self.epoch, position=self.position, produced=self.produced_in_epoch, buffer=self.buffer)

    def load_state(self, state: dict) -> None:
        self.epoch, self.position, self.produced_in_epoch = state["epoch"], state["position"], state["produced"]
        self.buffer, self.order = [list(query) for query in state["buffer"]], self._epoch_order()

    def format(self, queries: torch.Tensor) -> torch.Tensor:
        """The policy's contexts prefix ⊕ query ⊕ suffix (OAI's query_formatter): (B, prefix + query_length + suffix),
        left-padded again, which moves the query's pads (now between prefix and query) to the front. OAI's reward
        model scores the bare query ⊕ response, and its label files hold bare queries."""
        prefix, suffix = (
            queries.new_tensor(self.tokenizer.encode(text, add_special_tokens=False)).expand(len(queries), -1)
            for text in (self.task.query_prefix, self.task.query_suffix)
        )
        return right_padding_to_left_padding(torch.cat([prefix, queries, suffix], 1), self.pad_id)


class RewardModel(nn.Module):
    """A pretrained backbone (no LM head) + a scalar head on the last token's final hidden state, with OAI's
    `reward_gain` / `reward_bias`: r = gain * head(h_last) + bias. Inputs are left-padded query ⊕ response."""

    def __init__(self, backbone: nn.Module, pad_id: int):
        super().__init__()
        self.backbone, self.pad_id = backbone, pad_id
        hidden_size = backbone.config.hidden_size
        self.scalar_head = nn.Linear(hidden_size, 1)
        # detail: reward head init — N(0, 1/sqrt(d_model + 1)), bias 0 (OAI model.py)
        nn.init.normal_(self.scalar_head.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.scalar_head.bias)
        self.reward_gain = nn.Parameter(torch.tensor(1.0))
        self.reward_bias = nn.Parameter(torch.tensor(0.0))

    def forward(self, query_responses: torch.Tensor) -> torch.Tensor:
        query_responses = right_padding_to_left_padding(query_responses, self.pad_id)  # pads of responses go left
        hidden = padded_forward(self.backbone, query_responses, self.pad_id)[:, -1]  # (B, d_model)
        return self.reward_gain * self.scalar_head(hidden).squeeze(-1) + self.reward_bias  # (B,)

    def save(self, directory: Path, tokenizer, base_model: str) -> None:
        self.backbone.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        head = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        save_file(
            {k: v for k, v in head.items() if not k.startswith("backbone.")}, directory / "reward_head.safetensors"
        )
        info = dict(base_model=base_model, pad_id=self.pad_id, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
        (directory / "reward_model.json").write_text(json.dumps(info, indent=2))

    @classmethod
    def from_saved(cls, directory: str, flag: str) -> "RewardModel":
        if not os.path.isfile(os.path.join(directory, "reward_head.safetensors")):
            fail(f"{flag} {directory!r}: not a reward model directory (no reward_head.safetensors)")
        info = json.loads(Path(directory, "reward_model.json").read_text())
        model = cls(load_pretrained(AutoModel, directory, flag), info["pad_id"])
        missing, unexpected = model.load_state_dict(
            load_file(os.path.join(directory, "reward_head.safetensors")), strict=False
        )
        if unexpected or any(not key.startswith("backbone.") for key in missing):
            fail(
                f"{flag} {directory!r}: reward_head.safetensors does not match (missing {missing}, unexpected {unexpected})"
            )
        return model


def simulated_labeler_scores(labeler: str, texts: list[str]) -> list[float]:
    """Offline stand-ins for OAI's human labelers (SPEC §9): `sentiment` = VADER compound score in [-1, 1];
    `descriptiveness` = share of adjective/adverb tags (textblob's offline PatternTagger) among the words."""
    if labeler == "sentiment":
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        analyzer = SentimentIntensityAnalyzer()
        return [analyzer.polarity_scores(text)["compound"] for text in texts]
    if labeler == "descriptiveness":
        from textblob.en.taggers import PatternTagger

        tagger, scores = PatternTagger(), []
        for text in texts:
            tags = [tag for word, tag in tagger.tag(text) if any(c.isalpha() for c in word)]
            scores.append(sum(tag.startswith(("JJ", "RB")) for tag in tags) / max(len(tags), 1))
        return scores
    raise ValueError(f"unknown labeler {labeler!r}")


def decode(tokenizer, tokens: torch.Tensor) -> list[str]:
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)


def prepare_output_dir(output_dir: str, finished_marker: str, overwrite: bool, resume: bool) -> Path:
    """Create the output directory, refusing to touch a previous run unless told how (--resume or --overwrite), and
    check it is writable now, not after hours of training."""
    path = Path(output_dir)
    finished = (path / finished_marker).exists()
    if not (overwrite or resume) and (
        finished or any((path / name).exists() for name in ("metrics.jsonl", "checkpoints"))
    ):
        what = "a finished run" if finished else "an unfinished run"
        fail(
            f"--output-dir {output_dir!r} already holds {what}; pass --resume to continue it, --overwrite to start "
            "again, or another --output-dir"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        fail(f"--output-dir {output_dir!r} is not writable ({error.strerror})")
    return path


def check_resume_args(output_dir: Path, args) -> None:
    """--resume continues the same run: every flag that changes the math must equal the first attempt's."""
    saved_path = output_dir / "args.json"
    if not saved_path.is_file():
        return  # the first attempt died before writing anything: resuming starts from scratch

    def flat(config: dict, prefix: str = "") -> dict:
        items = [
            flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(prefix + k, v)] for k, v in config.items()
        ]
        return dict(item for group in items for item in group)

    saved, current = flat(json.loads(saved_path.read_text())), flat(json.loads(json.dumps(asdict(args))))
    changed = sorted(key for key in current if key not in RESUME_MAY_CHANGE and saved.get(key) != current[key])
    if changed:
        fail(f"--resume: {', '.join('--' + key.replace('_', '-') for key in changed)} differ from {saved_path}")


def write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def save_directory_atomic(path: Path, write) -> None:
    """write(tmp_dir) then rename: a crash never leaves a half-written directory under the final name."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    write(temporary)
    if path.exists():
        previous = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, previous)
        os.replace(temporary, path)
        shutil.rmtree(previous)
    else:
        os.replace(temporary, path)


def reuse_freed_host_memory() -> None:
    """CPU speed: glibc hands every freed block above its mmap threshold (a (B, T, V) logits tensor is tens of MB)
    back to the kernel, and the next allocation of that size page-faults it in again, zeroed; raising the thresholds
    keeps such blocks for reuse (the math is unchanged). A no-op where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(GLIBC_M_MMAP_THRESHOLD, 2**30)
    libc.mallopt(GLIBC_M_TRIM_THRESHOLD, 2**31 - 1)


def trunk_parameters(model: nn.Module) -> int:
    """Parameters a token's forward pass multiplies with (2 FLOPs each, for MFU): all but the embedding lookup and
    the LM head, which is counted apart on the positions that use it."""
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def parameter_spread(accelerator: Accelerator, model: nn.Module) -> float:
    """max - min over processes of a float64 checksum of all parameters: 0 when every process holds the same model
    (DDP averages gradients, so any other value means the processes drifted apart)."""
    checksum = sum(
        param.detach().double().sum() + param.detach().double().square().sum() for param in model.parameters()
    )
    checksums = accelerator.gather(checksum.reshape(1))
    return (checksums.max() - checksums.min()).item()


def track_progress(iterable, description: str, enabled: bool, log_every_s: float = 60.0):
    """rich's progress bar on a terminal. rich draws nothing into a file until the loop ends, so when stdout is a log
    (sbatch, nohup, a pipe) print a plain line instead after the first item and then every `log_every_s` seconds."""
    if not enabled:
        yield from iterable
    elif sys.stdout.isatty():
        yield from track(iterable, description)
    else:
        total, start, last_line = len(iterable), time.perf_counter(), -math.inf
        for done, item in enumerate(iterable, 1):
            yield item
            now = time.perf_counter()
            if done == total or now - last_line >= log_every_s:  # the first item too: last_line starts at -inf
                last_line, elapsed = now, now - start
                left = elapsed / done * (total - done)
                print(
                    f"{description}: {done}/{total} ({done / total:.0%}), {elapsed:.0f} s, ~{left:.0f} s left",
                    flush=True,
                )


class RunLogger:
    """metrics.jsonl (one JSON object per logged step, flushed), wandb behind --track, rich console (rank 0 only)."""

    def __init__(self, accelerator: Accelerator, output_dir: Path, args, track: bool):
        self.enabled, self.console, self.wandb = accelerator.is_main_process, Console(), None
        if not self.enabled:
            return
        self.file = open(output_dir / "metrics.jsonl", "a")  # fresh runs start without one (start_run_files)
        if track:
            import wandb

            # --resume continues the same wandb run: its id is kept next to the logs
            id_file = output_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if args.resume and id_file.is_file() else os.urandom(4).hex()
            write_text_atomic(id_file, run_id)
            self.wandb = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                name=args.run_name,
                config=asdict(args),
                id=run_id,
                resume="allow",
            )
            self.first_new_step = self.wandb.step  # 0, or one past the steps an interrupted attempt already sent

    def log(self, row: dict, step: int) -> None:
        if self.enabled:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            if self.wandb is not None and step >= self.first_new_step:  # a resumed run repeats the same rows
                self.wandb.log(row, step=step)

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        if self.enabled:
            table = Table(title=title, show_lines=True)
            for column in columns:
                table.add_column(column)
            for row in rows:
                table.add_row(*[f"{value:.3f}" if isinstance(value, float) else str(value) for value in row])
            self.console.print(table)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


class StopSignal:
    """SIGTERM (Slurm preemption or requeue, `scancel`, torchrun stopping its workers) only sets a flag; the training
    loop checks it once per step, in the step's one reduction so every process agrees, writes a checkpoint and exits
    with EXIT_STOPPED. A second SIGTERM is ignored too; SIGKILL is not catchable (the last checkpoint remains)."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        self.requested = True


def rng_states() -> dict:
    """Every random number generator a process draws from (sampling, PPO minibatch order, dropout if any)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first: a checkpoint is written under a temporary name and renamed when complete,
    so a process killed mid-write leaves only a hidden temporary directory, never a checkpoint that looks complete."""
    return sorted((output_dir / "checkpoints").glob("step-*"))


def start_run_files(accelerator: Accelerator, output_dir: Path, resume: bool) -> Optional[Path]:
    """The newest complete checkpoint when resuming (None: start from scratch). The run's logs are put back to what
    they were at that checkpoint, dropping rows the killed process wrote after it, so metrics.jsonl ends up with
    exactly one row per step. A fresh start (or --resume with no checkpoint) removes the logs of any earlier attempt."""
    checkpoint = (checkpoint_dirs(output_dir) or [None])[-1] if resume else None
    if accelerator.is_main_process:
        for stale in (output_dir / "checkpoints").glob(".step-*"):
            shutil.rmtree(stale)  # temporaries of a process killed while writing a checkpoint
        if checkpoint is None:
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
        for name in RUN_LOGS:
            if checkpoint is not None and (checkpoint / name).exists():
                shutil.copyfile(checkpoint / name, output_dir / name)
            else:
                (output_dir / name).unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    return checkpoint


def save_checkpoint(accelerator, output_dir: Path, step: int, keep: int, model, optimizer, state: dict, process_state):
    """checkpoints/step-N: all that continuing exactly after step N needs — the model, the optimizer (moments, step
    counts), `state` (counters, KL controller, elapsed time), every process's `process_state` (RNG states, query
    stream position) and copies of the run's logs. Written by process 0 into a temporary directory, then renamed;
    only the newest `keep` are kept."""
    process_states = gather_object([process_state])  # one per process, in process order
    path = output_dir / "checkpoints" / f"step-{step:08d}"
    if accelerator.is_main_process:

        def write(directory: Path) -> None:
            torch.save(accelerator.unwrap_model(model).state_dict(), directory / "model.pt")
            torch.save(optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(process_states, directory / "processes.pt")
            for name in RUN_LOGS:
                if (output_dir / name).exists():
                    shutil.copyfile(output_dir / name, directory / name)
            state_json = dict(step=step, world_size=accelerator.num_processes, **state)
            (directory / "state.json").write_text(json.dumps(state_json, indent=2))

        path.parent.mkdir(exist_ok=True)
        save_directory_atomic(path, write)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator, checkpoint: Path, model, optimizer) -> tuple[dict, dict]:
    """Restore the model and optimizer of `checkpoint`; returns (state, this process's process_state)."""
    state = json.loads((checkpoint / "state.json").read_text())
    if state["world_size"] != accelerator.num_processes:
        fail(
            f"--resume: {checkpoint} was written by {state['world_size']} processes, this run has "
            f"{accelerator.num_processes}; resume with the same number"
        )
    device = accelerator.device
    accelerator.unwrap_model(model).load_state_dict(torch.load(checkpoint / "model.pt", map_location=device))
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", map_location=device))
    # our own file: holds Python / NumPy RNG states, which need the full unpickler
    process_state = torch.load(checkpoint / "processes.pt", weights_only=False)[accelerator.process_index]
    return state, process_state


# ---------------------------------------------------------------------------------------------------------------------
# End of the shared helpers.
# ---------------------------------------------------------------------------------------------------------------------
def validate_args(args: Args) -> Args:
    """Fill in the task's defaults, derive every per-process size in one place and reject inconsistent flags before
    anything is loaded."""
    fill_task_defaults(args.task, TASK_DEFAULTS[args.task.name])
    fill_task_defaults(args, PPO_TASK_DEFAULTS[args.task.name])
    ppo = args.ppo
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.local_batch_size = derive_batch_size(ppo.batch_size, args.world_size, "--ppo.batch-size / number of processes")
    args.local_mini_batch_size = derive_batch_size(
        args.local_batch_size, ppo.nminibatches, "--ppo.batch-size / (processes * --ppo.nminibatches)"
    )
    args.micro_batch_size = derive_batch_size(
        args.local_mini_batch_size,
        ppo.gradient_accumulation_steps,
        "--ppo.batch-size / (processes * --ppo.nminibatches * --ppo.gradient-accumulation-steps)",
    )
    if ppo.whiten_rewards and args.local_mini_batch_size < MIN_WHITEN_ROWS:
        fail(
            f"--ppo.whiten-rewards needs >= {MIN_WHITEN_ROWS} rows per process-minibatch, got "
            f"{args.local_mini_batch_size}: raise --ppo.batch-size or lower --ppo.nminibatches / processes"
        )
    if not 0 <= args.task.truncate_after < args.task.response_length:
        fail("--task.truncate-after must be >= 0 and < --task.response-length")
    if args.rewards.trained_model is None:
        fail("--rewards.trained-model is required: the reward_model/ directory written by train_reward_accelerate.py")
    args.num_updates = math.ceil(ppo.total_episodes / ppo.batch_size)
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        fail("--peak-tflops must be positive")
    if args.checkpoint_every < 0 or args.checkpoint_keep < 1:
        fail("--checkpoint-every must be >= 0 and --checkpoint-keep >= 1")
    if args.resume and args.overwrite:
        fail("--resume continues the run in --output-dir and --overwrite starts it again: pass one of them")
    if args.resume and args.output_dir is None:
        fail("--resume needs the --output-dir of the run to continue")
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)
    return args


class AdaptiveKLController:
    """OAI's controller: kl_coef *= 1 + clip(KL / target - 1, ±0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -KL_ERROR_CLIP, KL_ERROR_CLIP))
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class PolicyAndValueWrapper(nn.Module):
    """The policy LM and a value head sharing its trunk (one model, one optimizer, like OAI).

    The value head is zero-initialised (weight 0, bias 0), so the first values are exactly 0."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, query_responses: torch.Tensor, context_length: int, pad_id: int, temperature: float):
        """Logits / temperature and values at the T positions that predict the response: ((B, T, V), (B, T))."""
        hidden = padded_forward(self.lm.base_model, query_responses, pad_id)[:, context_length - 1 : -1]  # (B, T, d)
        return response_logits(self.lm, hidden, temperature), self.value_head(hidden).squeeze(-1)


def response_logits(lm: nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """The LM head applied to hidden / temperature: equals logits / temperature, but divides a (B, T, d) tensor
    instead of a (B, T, V) one."""
    head = lm.get_output_embeddings()
    bias = None if head.bias is None else head.bias / temperature
    return F.linear(hidden / temperature, head.weight, bias)


@contextmanager
def recorded_head_steps(lm: nn.Module):
    """Record the LM head's input (final hidden state) and output (logits) at the last position of every forward
    while in the block: inside generate() one entry per sampled token, the entries of step t being the hidden state
    and logits that predicted token t: yields a list of ((B, d), (B, V)) pairs."""
    steps = []

    def record(module, inputs, output):
        steps.append((inputs[0][:, -1].clone(), output[:, -1].clone()))  # clone: don't keep a prefill's (B, C, V)

    handle = lm.get_output_embeddings().register_forward_hook(record)
    try:
        yield steps
    finally:
        handle.remove()


def lm_logits(lm: nn.Module, query_responses: torch.Tensor, context_length: int, pad_id: int, temperature: float):
    """detail: LM head only where needed — vocabulary logits of the response positions only, divided by the sampling
    temperature (detail: without it the KL grows too fast): (B, T, V)."""
    hidden = padded_forward(lm.base_model, query_responses, pad_id)[:, context_length - 1 : -1]  # (B, T, d)
    return response_logits(lm, hidden, temperature)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False):
    """log p(token) under the logits, (B, T); with_entropy: also the entropy of the full distribution, (B, T),
    from the same log-softmax (one pass fewer over the (B, T, V) tensor than recomputing it)."""
    all_logprobs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    logprobs = torch.gather(all_logprobs, 2, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs
    with torch.no_grad():
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return logprobs, entropy


def score_responses(reward_model, queries, responses, truncate_token_id, args: Args):
    """Post-process responses and score them, the penalty replacing the score of responses never cut: (B, T), (B,)."""
    postprocessed, has_cut = truncate_responses(
        responses, truncate_token_id, args.task.truncate_after, reward_model.pad_id
    )
    scores = reward_model(torch.cat([queries, postprocessed], 1))  # (B,)
    return postprocessed, torch.where(has_cut, scores, torch.full_like(scores, args.task.penalty_reward_value))


def compute_rewards(scores, logprobs, ref_logprobs, kl_coef: float):
    """Per-token rewards: -kl_coef * (logprobs - ref_logprobs) everywhere, plus the score on the last token T-1 —
    always the last, even when the response was truncated earlier (OAI). Returns (kl, non_score_reward, rewards)."""
    kl = logprobs - ref_logprobs  # (B, T)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[:, -1] += scores
    return kl, non_score_reward, rewards


def compute_advantages(rewards: torch.Tensor, values: torch.Tensor, ppo: PpoHParams):
    """Whitened rewards → GAE → returns and whitened advantages, over the rows given: ((B, T), (B, T)).

    GAE with bootstrap value 0 after the last token: δ_t = r_t + γ V_{t+1} - V_t, A_t = δ_t + γ λ A_{t+1}."""
    if ppo.whiten_rewards:
        rewards = whiten(rewards, shift_mean=False)  # detail: reward whitening (OAI ppo.py, shift_mean=False)
    last_advantage, advantages = 0.0, []
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + ppo.gamma * next_value - values[:, t]
        last_advantage = delta + ppo.gamma * ppo.lam * last_advantage
        advantages.append(last_advantage)
    advantages = torch.stack(advantages[::-1], 1)  # (B, T)
    returns = advantages + values
    return whiten(advantages), returns  # detail: advantage whitening (shift_mean=True)


def ppo_losses(new_logprobs, vpred, logprobs, values, advantages, returns, ppo: PpoHParams):
    """Clipped policy and value losses, means over all B×T tokens (OAI: no response mask), and their statistics."""
    vpred_clipped = values + torch.clamp(vpred - values, -ppo.cliprange_value, ppo.cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * torch.max(vf_losses1, vf_losses2).mean()
    log_ratio = new_logprobs - logprobs
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - ppo.cliprange, 1 + ppo.cliprange)
    pg_loss = torch.max(pg_losses1, pg_losses2).mean()
    loss = pg_loss + ppo.vf_coef * vf_loss
    with torch.no_grad():
        stats = {
            "ppo/loss/policy": pg_loss,
            "ppo/loss/value": vf_loss,
            "ppo/loss/total": loss,
            "ppo/policy/approxkl": 0.5 * (log_ratio**2).mean(),
            "ppo/policy/clipfrac": (pg_losses2 > pg_losses1).float().mean(),  # OAI: where the clipped term wins
            "ppo/val/vpred": vpred.mean(),
            "ppo/val/error": ((vpred - returns) ** 2).mean(),
            "ppo/val/clipfrac": (vf_losses2 > vf_losses1).float().mean(),
            "ppo/returns/mean": returns.mean(),
            "ppo/returns/var": returns.var(unbiased=False),
        }
    return loss, stats


@torch.no_grad()
def rollout(policy, ref_lm, reward_model, queries, contexts, truncate_token_id, args: Args, timer=None):
    """Sample responses and compute everything PPO needs, in chunks of --local-rollout-forward-batch-size rows.
    Like OAI, the policies read the contexts (prefix ⊕ query ⊕ suffix), the reward model the bare query ⊕ response.
    `timer(phase)` (optional) closes the timing of a phase: generation, logprobs (policy + reference), scoring."""
    pad_id, context_length, temperature = reward_model.pad_id, contexts.shape[1], args.task.temperature
    timer = timer or (lambda phase: None)
    outputs = []
    for start in range(0, queries.shape[0], args.local_rollout_forward_batch_size):
        rows = slice(start, start + args.local_rollout_forward_batch_size)
        query, context = queries[rows], contexts[rows]
        with recorded_head_steps(policy.lm) if args.logprobs_from_generation else nullcontext([]) as steps:
            response = generate_responses(policy.lm, context, pad_id, args.task.response_length, temperature)
        timer("time/generation")
        query_response = torch.cat([context, response], 1)  # (b, C' + T), C' = prefix + C + suffix
        if args.logprobs_from_generation:
            assert len(steps) == response.shape[1], f"{len(steps)} LM-head calls for {response.shape[1]} tokens"
            hidden = torch.stack([step[0] for step in steps], 1)  # (b, T, d)
            logits = torch.stack([step[1] for step in steps], 1)  # (b, T, V)
            logits, value = logits.float() / temperature, policy.value_head(hidden).squeeze(-1)
        else:
            logits, value = policy(query_response, context_length, pad_id, temperature)
        logprobs = logprobs_from_logits(logits, response)
        ref_logprobs = logprobs_from_logits(
            lm_logits(ref_lm, query_response, context_length, pad_id, temperature), response
        )
        timer("time/logprobs")
        postprocessed, score = score_responses(reward_model, query, response, truncate_token_id, args)
        timer("time/scoring")
        outputs.append(
            dict(
                responses=response,
                postprocessed_responses=postprocessed,
                logprobs=logprobs,
                ref_logprobs=ref_logprobs,
                values=value.float(),  # rewards, advantages and losses in fp32, also under --mixed-precision bf16
                scores=score.float(),
            )
        )
    return {key: torch.cat([output[key] for output in outputs]) for key in outputs[0]}


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: GPU memory allocated by torch on CUDA, the process's peak resident size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class PhaseTimer:
    """Wall time per phase of an update (`time/...` metrics); waits for the GPU so that a phase owns its kernels."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.last = device, {}, time.perf_counter()

    def __call__(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - self.last
        self.last = now


@torch.no_grad()
def evaluate_gold(
    accelerator, policy, ref_lm, reward_model, eval_queries, eval_contexts, tokenizer, truncate_token_id, args, update
):
    """Held-out evaluation: the same queries and sampling seed every time; the learned reward model's score
    (eval/rm_score, penalty applied) next to the simulated labeler's (eval/gold_score) on the post-processed text."""
    queries, contexts = (
        x[accelerator.process_index :: accelerator.num_processes]
        .repeat_interleave(args.eval_samples_per_query, 0)
        .to(accelerator.device)
        for x in (eval_queries, eval_contexts)
    )
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(EVAL_SEED + accelerator.process_index)
        data = rollout(policy, ref_lm, reward_model, queries, contexts, truncate_token_id, args)
    kl = (data["logprobs"] - data["ref_logprobs"]).sum(1)
    texts = decode(tokenizer, data["postprocessed_responses"])
    gold = simulated_labeler_scores(args.task.gold_labeler, texts)
    query_ids = torch.arange(len(eval_queries))[accelerator.process_index :: accelerator.num_processes]
    rows = [
        dict(update=update, query_index=int(q), query=text_q, response=text, gold_score=g, rm_score=s, kl=k)
        for q, text_q, text, g, s, k in zip(
            query_ids.repeat_interleave(args.eval_samples_per_query).tolist(),
            decode(tokenizer, queries),
            texts,
            gold,
            data["scores"].tolist(),
            kl.tolist(),
            strict=True,
        )
    ]
    rows = gather_object(rows)
    metrics = {
        "eval/gold_score": float(np.mean([r["gold_score"] for r in rows])),
        "eval/rm_score": float(np.mean([r["rm_score"] for r in rows])),
        "eval/kl": float(np.mean([r["kl"] for r in rows])),
    }
    return metrics, rows


def check_finite(row: dict, ppo_stats: torch.Tensor, update: int, args: Args, rank: int) -> None:
    """Stop at the first non-finite metric (a NaN/inf loss, reward, advantage or KL poisons the averages), saying
    where: the update and, when the PPO losses went bad on this process, the first epoch / minibatch / micro-batch."""
    bad = [key for key, value in row.items() if not math.isfinite(value)]
    if not bad:
        return
    where = ""
    bad_rows = (~torch.isfinite(ppo_stats).all(1)).nonzero()
    if len(bad_rows):
        index, per_epoch = bad_rows[0].item(), args.ppo.nminibatches * args.ppo.gradient_accumulation_steps
        minibatch, micro = divmod(index % per_epoch, args.ppo.gradient_accumulation_steps)
        where = (
            f", first in PPO epoch {index // per_epoch}, minibatch {minibatch}, micro-batch {micro} on process {rank}"
        )
    good = checkpoint_dirs(Path(args.output_dir))
    fail(
        f"non-finite {', '.join(bad)} at update {update}{where}; stopped before saving: policy/ not written, last good "
        f"checkpoint: {good[-1] if good else 'none'}"
    )


def check_reward_model(directory: str, tokenizer) -> None:
    """The reward model must read tokens exactly as the policy writes them; checked before any model is loaded."""
    info_path = Path(directory, "reward_model.json")
    if not info_path.is_file():
        fail(f"--rewards.trained-model {directory!r}: not a reward model directory (no reward_model.json)")
    info = json.loads(info_path.read_text())
    if info.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        fail(
            f"--rewards.trained-model {directory!r} was trained with another tokenizer/vocabulary "
            f"({info.get('base_model')}) than --base-model"
        )


def main(args: Args) -> None:
    args = validate_args(args)
    if args.dry_run:
        keys = ("world_size", "local_batch_size", "local_mini_batch_size", "micro_batch_size", "num_updates")
        print(json.dumps({"dry_run": "ok", **{key: getattr(args, key) for key in keys}}))
        return
    tokenizer = load_tokenizer(args.base_model, "--base-model")
    require_causal_lm(args.base_model, "--base-model")
    pad_id = tokenizer.pad_token_id
    truncate_token_ids = tokenizer.encode(args.task.truncate_token, add_special_tokens=False)
    if len(truncate_token_ids) != 1:
        fail(f"--task.truncate-token {args.task.truncate_token!r} is {len(truncate_token_ids)} tokens, not 1")
    truncate_token_id = truncate_token_ids[0]
    check_reward_model(args.rewards.trained_model, tokenizer)
    output_dir = prepare_output_dir(args.output_dir, "policy", args.overwrite, args.resume)
    if args.resume and (output_dir / "policy").is_dir():
        print(f"--resume: {output_dir} holds a finished run (policy/ exists); nothing to do")
        return
    if args.resume:
        check_resume_args(output_dir, args)
    texts = load_query_texts(args.task)[args.task.query_field]
    QueryStream(texts, tokenizer, args.task, pad_id, args.seed).next_batch(1)  # no query: fail before any model loads
    stop = StopSignal()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.ppo.gradient_accumulation_steps, mixed_precision=args.mixed_precision
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
    device = accelerator.device
    if device.type == "cpu":
        reuse_freed_host_memory()
    checkpoint = start_run_files(accelerator, output_dir, args.resume)
    logger = RunLogger(accelerator, output_dir, args, args.track)
    if accelerator.is_main_process and checkpoint is None:  # a resumed run keeps its first attempt's args.json
        write_text_atomic(output_dir / "args.json", json.dumps(asdict(args), indent=2))
    torch.manual_seed(args.seed)
    policy = PolicyAndValueWrapper(load_pretrained(AutoModelForCausalLM, args.base_model, "--base-model"))
    disable_eos_stopping(policy.lm)
    ref_lm = load_pretrained(AutoModelForCausalLM, args.base_model, "--base-model").to(device).eval()
    reward_model = RewardModel.from_saved(args.rewards.trained_model, "--rewards.trained-model").to(device).eval()
    for param in [*ref_lm.parameters(), *reward_model.parameters()]:
        param.requires_grad_(False)
    optimizer = make_optimizer(policy.parameters(), args.ppo.lr, args.ppo.eps, args.use_tensorflow_adam)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    unwrapped = accelerator.unwrap_model(policy)
    train_forward = torch.compile(policy) if args.compile else policy  # fixed shapes: compiled once
    trunk_params = trunk_parameters(unwrapped.lm)
    head_flops = 2 * unwrapped.lm.config.hidden_size * unwrapped.lm.get_output_embeddings().weight.shape[0]
    torch.manual_seed(args.seed + accelerator.process_index * RANK_SEED_STRIDE)  # detail: per-process sampling seed
    eval_queries, eval_contexts, train_text_ids = None, None, None
    if args.task.gold_labeler is not None:  # held-out queries: the first of a fixed text order, kept out of training
        held_out = QueryStream(texts, tokenizer, args.task, pad_id, seed=EVAL_SEED)
        eval_queries = held_out.next_batch(args.eval_queries)
        eval_contexts = held_out.format(eval_queries)
        train_text_ids = held_out.order[held_out.position :]
    stream = QueryStream(
        texts,
        tokenizer,
        args.task,
        pad_id,
        args.seed,
        accelerator.process_index,
        accelerator.num_processes,
        train_text_ids,
    )
    if args.rewards.use_adaptive_kl:
        kl_ctl = AdaptiveKLController(
            args.rewards.kl_coef, args.rewards.adaptive_kl.target, args.rewards.adaptive_kl.horizon
        )
    else:
        kl_ctl = FixedKLController(args.rewards.kl_coef)
    ppo, start_time = args.ppo, time.time()

    def run_eval(update: int) -> dict:
        with accelerator.autocast():
            metrics, rows = evaluate_gold(
                accelerator,
                unwrapped,
                ref_lm,
                reward_model,
                eval_queries,
                eval_contexts,
                tokenizer,
                truncate_token_id,
                args,
                update,
            )
        if accelerator.is_main_process:
            with open(output_dir / "eval_samples.jsonl", "a") as file:
                file.writelines(json.dumps(row) + "\n" for row in rows)
            logger.console.print(f"update {update}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    start_update, initial_eval, row = 1, {}, {}
    if checkpoint is not None:  # continue exactly where the checkpoint left off
        state, process_state = load_checkpoint(accelerator, checkpoint, policy, optimizer)
        start_update, initial_eval, row, kl_ctl.value = (
            state["step"] + 1,
            state["initial_eval"],
            state["row"],
            state["kl_coef"],
        )
        start_time -= state["elapsed"]
        stream.load_state(process_state["stream"])
        set_rng_states(process_state["rng"])
        logger.console.print(f"resumed from {checkpoint} at update {start_update}")
    elif eval_queries is not None:
        initial_eval = run_eval(0)
    for update in track_progress(range(start_update, args.num_updates + 1), "PPO", accelerator.is_main_process):
        lr = linear_lr(ppo.lr, update - 1, args.num_updates)  # per update, constant within it
        for group in optimizer.param_groups:
            group["lr"] = lr
        kl_coef = kl_ctl.value  # the rewards of this update use the coefficient from before its KL update
        # 1. rollout
        queries = stream.next_batch(args.local_batch_size).to(device)  # (B, C): what the reward model reads
        contexts = stream.format(queries)  # (B, C'): prefix ⊕ query ⊕ suffix, what the policy reads (C' = C: books)
        timer = PhaseTimer(device)
        with accelerator.autocast():  # a no-op unless --mixed-precision bf16
            data = rollout(unwrapped, ref_lm, reward_model, queries, contexts, truncate_token_id, args, timer)
        responses, logprobs, values = data["responses"], data["logprobs"], data["values"]  # (B, T) each
        query_responses = torch.cat([contexts, responses], 1)  # (B, C' + T)
        context_length = contexts.shape[1]
        # 2. post-process responses and score: done in `rollout` (truncate after the truncate token, penalty)
        scores = data["scores"]  # (B,)
        # 3. per-token KL rewards, the score added on the last token (even when the response was cut earlier)
        kl, non_score_reward, rewards = compute_rewards(scores, logprobs, data["ref_logprobs"], kl_coef)  # (B, T)
        # 4. whiten rewards and 5. GAE: per minibatch inside the epochs, like OAI's ppo.py (once per batch when
        # nminibatches = 1, OAI's setting for every task)
        # 6. PPO epochs
        ppo_stats = []
        for _ in range(ppo.noptepochs):
            permutation = torch.randperm(args.local_batch_size, device=device)
            for mini_start in range(0, args.local_batch_size, args.local_mini_batch_size):
                mini_ids = permutation[mini_start : mini_start + args.local_mini_batch_size]
                advantages, returns = compute_advantages(rewards[mini_ids], values[mini_ids], ppo)
                for micro_start in range(0, args.local_mini_batch_size, args.micro_batch_size):
                    micro = slice(micro_start, micro_start + args.micro_batch_size)
                    ids = mini_ids[micro]
                    with accelerator.accumulate(policy):
                        logits, vpred = train_forward(
                            query_responses[ids], context_length, pad_id, args.task.temperature
                        )
                        new_logprobs, entropy = logprobs_from_logits(logits, responses[ids], with_entropy=True)
                        loss, stats = ppo_losses(
                            new_logprobs,
                            vpred.float(),
                            logprobs[ids],
                            values[ids],
                            advantages[micro],
                            returns[micro],
                            ppo,
                        )
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                    stats["ppo/policy/entropy"] = entropy.mean()
                    ppo_stats.append(torch.stack(list(stats.values())))
        timer("time/ppo_epochs")
        # 7. log: every metric averaged over all micro-batches and processes, in one reduction
        sequence_kl = kl.sum(1)  # (B,)
        rollout_stats = {
            "objective/kl": sequence_kl.mean(),
            "objective/entropy": (-logprobs).sum(1).mean(),
            "objective/non_score_reward": non_score_reward.sum(1).mean(),
            "objective/scores": scores.mean(),
            "objective/score_total": (scores + non_score_reward.sum(1)).mean(),
            "ppo/val/mean": values.mean(),
            "ppo/val/var": values.var(unbiased=False),
        }
        local = torch.cat([torch.stack(list(rollout_stats.values())), torch.stack(ppo_stats).mean(0)])
        local = torch.cat([local, torch.tensor([kl_coef, stop.requested], device=device)])
        gathered = accelerator.gather(local[None])  # (processes, metrics): one collective for every metric
        row = dict(zip([*rollout_stats, *stats], gathered[:, :-2].mean(0).tolist(), strict=True))
        row["sync/kl_coef_spread"] = (gathered[:, -2].max() - gathered[:, -2].min()).item()  # 0: all in step
        stop_now = gathered[:, -1].max().item() > 0  # SIGTERM on any process: all stop after this update
        check_finite(row, torch.stack(ppo_stats), update, args, accelerator.process_index)
        # detail: adaptive KL from the KL averaged over all processes (the blog's code used one process's KL)
        kl_ctl.update(row["objective/kl"], ppo.batch_size)
        elapsed = time.time() - start_time
        row.update({
            "objective/kl_coef": kl_coef,
            "ppo/val/var_explained": 1 - row["ppo/val/error"] / max(row["ppo/returns/var"], 1e-8),
            "ppo/lr": lr,
            "ppo/episode": update * ppo.batch_size,
            "elapsed/time": elapsed,
            "elapsed/fps": update * ppo.batch_size * args.task.response_length / elapsed,
            **timer.times,
            "time/peak_memory_gb": peak_memory_gb(device),
        })  # fmt: skip
        if args.peak_tflops:  # per process: trunk 2·N FLOPs per token, LM head 2·d·V per response token, backward 2x
            forward = 2 * trunk_params * query_responses.numel() + head_flops * responses.numel()
            train, peak = ppo.noptepochs * 3 * forward, args.peak_tflops * 1e12
            row["time/mfu_ppo_epochs"] = train / timer.times["time/ppo_epochs"] / peak
            # generation, policy (unless --logprobs-from-generation) and reference log-probs, scoring: ~4 forwards
            rollout_forwards = 3 if args.logprobs_from_generation else 4
            row["time/mfu_update"] = (train + rollout_forwards * forward) / sum(timer.times.values()) / peak
        if eval_queries is not None and (update % args.eval_every == 0 or update == args.num_updates):
            row.update(run_eval(update))
        if update % args.print_sample_output_freq == 0 or update == 1 or update == args.num_updates:
            total_reward = scores + non_score_reward.sum(1)
            samples = [
                dict(update=update, query=q, response=r, score=s, kl=k, total_reward=t)
                for q, r, s, k, t in zip(
                    decode(tokenizer, queries[:SAMPLE_ROWS]),
                    decode(tokenizer, data["postprocessed_responses"][:SAMPLE_ROWS]),
                    scores[:SAMPLE_ROWS].tolist(),
                    sequence_kl[:SAMPLE_ROWS].tolist(),
                    total_reward[:SAMPLE_ROWS].tolist(),
                    strict=True,
                )
            ]
            if accelerator.is_main_process:
                with open(output_dir / "samples.jsonl", "a") as file:
                    file.writelines(json.dumps(sample) + "\n" for sample in samples)
            logger.table(f"update {update}", ["query", "response", "score", "kl", "total reward"],
                         [list(sample.values())[1:] for sample in samples])  # fmt: skip
            logger.console.print(
                f"update {update}/{args.num_updates}: score {row['objective/scores']:.3f} kl {row['objective/kl']:.3f} "
                f"kl_coef {kl_coef:.4f} approxkl {row['ppo/policy/approxkl']:.4f} {row['elapsed/fps']:.0f} tokens/s"
            )
        logger.log({"update": update, "episode": update * ppo.batch_size, **row}, update)
        # 8. checkpoint
        if stop_now or (args.checkpoint_every and update % args.checkpoint_every == 0):
            state = dict(kl_coef=kl_ctl.value, initial_eval=initial_eval, row=row, elapsed=time.time() - start_time)
            process_state = dict(rng=rng_states(), stream=stream.state())
            path = save_checkpoint(
                accelerator, output_dir, update, args.checkpoint_keep, policy, optimizer, state, process_state
            )
            if stop_now:
                logger.console.print(f"stopped by SIGTERM after update {update}: wrote {path}; continue with --resume")
                logger.close()
                raise SystemExit(EXIT_STOPPED)
    if initial_eval:
        final = row
        logger.console.print(
            f"gold score {initial_eval['eval/gold_score']:.4f} -> {final['eval/gold_score']:.4f}, "
            f"rm score {initial_eval['eval/rm_score']:.4f} -> {final['eval/rm_score']:.4f}, kl {final['eval/kl']:.3f}"
        )
    logger.log(
        {"update": args.num_updates, "sync/param_spread": parameter_spread(accelerator, policy)}, args.num_updates
    )
    # 9. save
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped.lm.generation_config.eos_token_id = (
            tokenizer.eos_token_id
        )  # users of the saved policy may stop at EOS

        def write(directory: Path) -> None:
            unwrapped.lm.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            save_file(
                {k: v.contiguous() for k, v in unwrapped.value_head.state_dict().items()},
                directory / "value_head.safetensors",
            )

        save_directory_atomic(output_dir / "policy", write)
        logger.console.print(f"saved {output_dir / 'policy'}")
        if args.upload_model:
            unwrapped.lm.push_to_hub(args.hf_repo_id or args.run_name)
            tokenizer.push_to_hub(args.hf_repo_id or args.run_name)
    accelerator.wait_for_everyone()
    logger.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
