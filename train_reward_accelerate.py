"""Train the reward model of OpenAI's lm-human-preferences (Ziegler et al. 2019) from best-of-4 labels.

Reproduces `lm_human_preferences/train_reward.py` (TF1, https://github.com/openai/lm-human-preferences) with the
details documented in "The N Implementation Details of RLHF with PPO" (Huang, Liu, von Werra, 2023): a pretrained
LM with a scalar head reads `query ⊕ sample_i` for the 4 samples of a label, and a softmax cross-entropy over the 4
scores learns which one the human picked. The reward is normalized before and after training so that responses of
the pretrained policy score mean 0 and std 1. Every detail is specified in SPEC §1–4 and tagged `# detail:` below.

Launch (batch sizes are global: the same flags give the same optimization on any number of processes):
    python train_reward_accelerate.py --label-dataset sentiment/offline_5k.json          # 1 GPU
    accelerate launch --num_processes 8 train_reward_accelerate.py --seed 1               # 8 GPUs
    accelerate launch --num_processes 8 train_reward_accelerate.py --task.name tldr       # tldr (or cnndm): 8 GPUs
    python train_reward_accelerate.py --base-model models/tiny-gpt2 --labels.source sentiment \\
        --task.query-dataset corpus.txt --labels.num-train 64 --labels.simulated-num-test 32 \\
        --rollout-batch-size 16 --normalize-samples 16 --batch-size 8                    # CPU smoke
Outputs in --output-dir: args.json, metrics.jsonl, reward_model/ (loaded by train_policy_accelerate.py via
--rewards.trained-model), and labels.json when the labels are simulated.
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
from accelerate.utils import broadcast_object_list, gather_object
from rich.console import Console
from rich.progress import track
from rich.table import Table
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig


@dataclass
class LabelHParams:
    type: Literal["best_of_4"] = "best_of_4"
    """label type: a query, 4 sampled responses and the index of the one the labeler liked best (OAI, all 4 tasks)"""
    num_train: Optional[int] = None
    """number of label records to train on (the first ones of the file); the rest, cut to whole batches, is the
    held-out test set (per task: sentiment/descriptiveness 4992, tldr/cnndm 46000)"""
    source: Literal["file", "sentiment", "descriptiveness"] = "file"
    """`file`: human labels from --label-dataset; `sentiment` / `descriptiveness`: make best-of-4 labels here by
    sampling 4 responses per query from the base model and letting a noisy simulated labeler pick (offline)"""
    simulated_num_test: int = 512
    """with a simulated labeler: how many extra label records to make for the held-out test set"""
    labeler_beta: float = 10.0
    """with a simulated labeler: the labeler picks sample i with probability softmax(beta * score)_i"""


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


@dataclass
class Args:
    exp_name: str = "train_reward_accelerate"
    """experiment name, the first part of the run name"""
    seed: int = 1
    """global seed: label order and head init come from it; process i samples with seed + i * 100003"""
    track: bool = False
    """log to Weights & Biases (works with WANDB_MODE=offline)"""
    wandb_project_name: str = "lm-human-preferences"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user)"""
    output_dir: Optional[str] = None
    """where args.json, metrics.jsonl and reward_model/ go (default: runs/<run_name>)"""
    overwrite: bool = False
    """start again in an output directory that holds a previous run (its metrics and checkpoints go)"""
    resume: bool = False
    """continue the run in --output-dir from its newest checkpoint (from scratch if it has none; at once done if it
    finished); every flag that changes the math must be as before"""
    checkpoint_every: int = 0
    """write a checkpoint (reward model, optimizer, RNG states, data position, logs) every this many steps into
    --output-dir/checkpoints (0: only when stopped by SIGTERM)"""
    checkpoint_keep: int = 2
    """keep the newest this many checkpoints"""
    dry_run: bool = False
    """validate every flag, print the derived sizes and exit before loading any model or data"""
    base_model: str = "gpt2"
    """pretrained causal LM: a Hub id or a local directory (any AutoModelForCausalLM)"""
    label_dataset: Optional[str] = None
    """best-of-4 label file: a file name in the Hub dataset --label-dataset-repo, or a local JSON path (per task:
    'sentiment/offline_5k.json', 'descriptiveness/offline_5k.json', 'tldr/online_45k.json', 'cnndm/online_45k.json')"""
    label_dataset_repo: str = "vwxyzjn/lm-human-preferences"
    """Hub dataset repo holding OAI's label files (mirror of OAI's public blob storage)"""
    batch_size: Optional[int] = None
    """label records per optimizer step, over all processes (per task: sentiment/descriptiveness 32, tldr/cnndm 16)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step (memory knob; does not change the math)"""
    lr: Optional[float] = None
    """learning rate, annealed linearly to 0 over the training steps (per task: sentiment/descriptiveness 5e-5,
    tldr/cnndm 2.5e-5)"""
    eps: float = 1e-5
    """Adam epsilon"""
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
    rollout_batch_size: Optional[int] = None
    """responses per normalization round, over all processes (per task: sentiment/descriptiveness 512, tldr/cnndm
    128)"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / scoring forward on one process (memory knob; does not change the math)"""
    normalize_before: bool = True
    """normalize the reward on pretrained-policy samples before training (OAI books: True)"""
    normalize_after: bool = True
    """normalize again after training (OAI books: True)"""
    normalize_samples: int = 256
    """samples that estimate the reward mean/std; drawn as ceil(normalize_samples / rollout_batch_size) rollout
    batches, i.e. one batch of 512 (books tasks) or two of 128 (summarization) with OAI's settings"""
    eval_batch_size: int = 256
    """label records per no-grad forward when evaluating, over all processes"""
    print_sample_output_freq: int = 60
    """evaluate on the held-out labels and print sample responses every this many steps (and at the end)"""
    labels: LabelHParams = field(default_factory=LabelHParams)
    task: TaskHParams = field(default_factory=TaskHParams)
    world_size: tyro.conf.Suppress[Optional[int]] = None
    local_batch_size: tyro.conf.Suppress[Optional[int]] = None
    micro_batch_size: tyro.conf.Suppress[Optional[int]] = None
    local_rollout_batch_size: tyro.conf.Suppress[Optional[int]] = None
    local_eval_batch_size: tyro.conf.Suppress[Optional[int]] = None
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    run_name: tyro.conf.Suppress[Optional[str]] = None


OPENAI_PAD_ID = 50259  # OAI's label files pad queries and samples with this id (one past GPT-2's 50257 + 2)
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
NUM_SAMPLES = 4  # best-of-4
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

# OAI's reward-model training per task (launch.py get_train_reward_experiments), for the Args left at None
BOOKS_REWARD_TRAINING = {"labels.num_train": 4992, "batch_size": 32, "lr": 5e-5, "rollout_batch_size": 512}
SUMMARIZATION_REWARD_TRAINING = {"labels.num_train": 46000, "batch_size": 16, "lr": 2.5e-5, "rollout_batch_size": 128}
REWARD_TASK_DEFAULTS = {
    "sentiment": {"label_dataset": "sentiment/offline_5k.json", **BOOKS_REWARD_TRAINING},
    "descriptiveness": {"label_dataset": "descriptiveness/offline_5k.json", **BOOKS_REWARD_TRAINING},
    "tldr": {"label_dataset": "tldr/online_45k.json", **SUMMARIZATION_REWARD_TRAINING},
    "cnndm": {"label_dataset": "cnndm/online_45k.json", **SUMMARIZATION_REWARD_TRAINING},
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
    fill_task_defaults(args, REWARD_TASK_DEFAULTS[args.task.name])
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.local_batch_size = derive_batch_size(args.batch_size, args.world_size, "--batch-size / number of processes")
    args.micro_batch_size = derive_batch_size(
        args.local_batch_size,
        args.gradient_accumulation_steps,
        "--batch-size / (processes * --gradient-accumulation-steps)",
    )
    args.local_rollout_batch_size = derive_batch_size(
        args.rollout_batch_size, args.world_size, "--rollout-batch-size / number of processes"
    )
    args.local_eval_batch_size = derive_batch_size(
        args.eval_batch_size, args.world_size, "--eval-batch-size / number of processes"
    )
    if args.labels.type != "best_of_4":
        fail(f"--labels.type {args.labels.type!r}: only best_of_4 labels are supported")
    args.num_updates = args.labels.num_train // args.batch_size
    if args.num_updates < 1:
        fail(f"--labels.num-train {args.labels.num_train} is smaller than one --batch-size {args.batch_size}")
    if not 0 <= args.task.truncate_after < args.task.response_length:
        fail("--task.truncate-after must be >= 0 and < --task.response-length")
    if args.labels.source != "file" and args.labels.simulated_num_test < args.batch_size:
        fail("--labels.simulated-num-test must hold at least one --batch-size of records")
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


def label_type(record: dict) -> str:
    """The label type of a record, told by its answer key like OAI's label_types.py: best_of_N (`best`, N samples),
    scalar_rating (`score`), scalar_compare (`difference`); `choice`: a pairwise comparison (sample0 vs sample1)."""
    for key, kind in (("score", "scalar_rating"), ("difference", "scalar_compare"), ("choice", "pairwise")):
        if key in record and "best" not in record:
            return kind
    samples = [int(key[6:]) for key in record if key.startswith("sample") and key[6:].isdigit()]
    return f"best_of_{max(samples, default=NUM_SAMPLES - 1) + 1}"


def load_labels(path: str, tokenizer, pad_id: int, args: Args) -> dict[str, torch.Tensor]:
    """Read and validate a best-of-4 label file (OAI's books and summarization files alike: queries of the task's
    --task.query-length, bare, without prefix/suffix); every problem is one line naming the file and the record."""
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        fail(f"--label-dataset {path}: not a readable JSON file ({error})")
    if not isinstance(records, list):
        fail(f"--label-dataset {path}: expected a JSON list of label records, got {type(records).__name__}")
    vocab_size = len(tokenizer) - (1 if tokenizer.pad_token == "[PAD]" else 0)  # our added pad is not in the files
    lengths = {"query": args.task.query_length, **{f"sample{i}": args.task.response_length for i in range(NUM_SAMPLES)}}
    for index, record in enumerate(records):
        where = f"--label-dataset {path}: record {index}"
        if not isinstance(record, dict):
            fail(f"{where} is not an object")
        if label_type(record) != "best_of_4":
            fail(
                f"{where}: label type {label_type(record)} not supported (keys: {', '.join(sorted(record))}); "
                "only best_of_4 labels (query, sample0..sample3, best)"
            )
        for key, length in lengths.items():
            if key not in record:
                fail(f"{where} has no {key!r} (best-of-4 records need query, sample0..sample3, best)")
            ids = record[key]
            if not isinstance(ids, list) or len(ids) != length:
                fail(
                    f"{where}: {key!r} must be a list of {length} token ids (--task.query-length/--task.response-length)"
                )
            bad = [
                i for i in ids if not isinstance(i, int) or not (0 <= i < vocab_size or i in (OPENAI_PAD_ID, pad_id))
            ]
            if bad:
                fail(f"{where}: {key!r} has token id {bad[0]!r} outside the vocabulary of {vocab_size} tokens")
        if "best" not in record:
            fail(f"{where} has no 'best'")
        if not isinstance(record["best"], int) or not 0 <= record["best"] < NUM_SAMPLES:
            fail(f"{where}: 'best' must be an integer in 0..3, got {record['best']!r}")
    needed = args.labels.num_train + args.batch_size
    if len(records) < needed:
        fail(f"--label-dataset {path}: {len(records)} records, need --labels.num-train + one --batch-size = {needed}")
    queries = torch.tensor([r["query"] for r in records])  # (N, C)
    samples = torch.tensor([[r[f"sample{i}"] for i in range(NUM_SAMPLES)] for r in records])  # (N, 4, T)
    # detail: OAI pad remap — OAI's files pad with 50259; map it to our pad id
    queries, samples = (torch.where(x == OPENAI_PAD_ID, pad_id, x) for x in (queries, samples))
    best = torch.tensor([r["best"] for r in records])
    return dict(queries=right_padding_to_left_padding(queries, pad_id), samples=samples, best=best)


def best_of_4_loss(reward_model: RewardModel, queries, samples, best):
    """Cross-entropy of the 4 rewards against the labeler's pick, and accuracy; the 4 samples of a record go in one
    forward. Shapes: queries (B, C), samples (B, 4, T), best (B,)."""
    batch = samples.shape[0]
    query_responses = torch.cat([queries.repeat_interleave(NUM_SAMPLES, 0), samples.flatten(0, 1)], 1)  # (4B, C+T)
    logits = reward_model(query_responses).float().view(batch, NUM_SAMPLES)  # (B, 4), fp32 also under bf16
    loss = F.cross_entropy(logits, best)
    accuracy = (logits.argmax(1) == best).float().mean()
    return loss, accuracy


@torch.no_grad()
def sample_and_score(ref_lm, reward_model, queries: QueryStream, n: int, args: Args):
    """Sample n responses of the pretrained policy and score them (raw, not truncated): (queries, responses, scores).
    Like OAI, the policy reads the formatted context (prefix ⊕ query ⊕ suffix), the reward model query ⊕ response."""
    all_queries, all_responses, all_scores = [], [], []
    chunk = args.local_rollout_forward_batch_size
    for start in range(0, n, chunk):
        query = queries.next_batch(min(chunk, n - start)).to(ref_lm.device)  # (b, C)
        response = generate_responses(
            ref_lm, queries.format(query), reward_model.pad_id, args.task.response_length, args.task.temperature
        )
        all_scores.append(reward_model(torch.cat([query, response], 1)))
        all_queries.append(query)
        all_responses.append(response)
    return torch.cat(all_queries), torch.cat(all_responses), torch.cat(all_scores)


@torch.no_grad()
def normalize_reward(accelerator, ref_lm, reward_model: RewardModel, queries: QueryStream, args: Args, phase: str):
    """detail: reward normalization — reset gain/bias, then set gain = 1/σ, bias = -μ/σ with μ, σ (population std,
    sqrt(E[r²] - μ²), all-reduced over processes: OAI's formula) of the pretrained policy's rewards; a fresh sample
    then verifies mean ~0, std ~1. Returns the statistics to log."""
    model, start = accelerator.unwrap_model(reward_model), time.perf_counter()
    n = math.ceil(args.normalize_samples / args.rollout_batch_size) * args.local_rollout_batch_size

    def stats():
        with accelerator.autocast():
            scores = sample_and_score(ref_lm, model, queries, n, args)[2].float()
        sums = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), "mean")
        mean, square_mean = sums.tolist()
        return mean, math.sqrt(max(square_mean - mean**2, 0.0))

    model.reward_gain.fill_(1.0)
    model.reward_bias.fill_(0.0)
    mean, std = stats()
    model.reward_gain.fill_(1.0 / std)
    model.reward_bias.fill_(-mean / std)
    check_mean, check_std = stats()
    return {
        f"normalization/{phase}/mean": mean,
        f"normalization/{phase}/std": std,
        f"normalization/{phase}/normalized_mean": check_mean,
        f"normalization/{phase}/normalized_std": check_std,
        f"time/normalization_{phase}": time.perf_counter() - start,
    }


@torch.no_grad()
def simulate_labels(accelerator, ref_lm, queries: QueryStream, tokenizer, pad_id, truncate_token_id, args: Args):
    """Best-of-4 labels from a noisy simulated labeler, in OAI's schema: 4 sampled (and truncated, as OAI's labelers
    saw them) responses per query; the labeler picks i with probability softmax(beta * score)_i."""
    total = args.labels.num_train + args.labels.simulated_num_test
    local = math.ceil(total / args.world_size)
    chunk = max(args.local_rollout_forward_batch_size // NUM_SAMPLES, 1)
    records = []
    for start in track_progress(range(0, local, chunk), "simulating labels", accelerator.is_main_process):
        query = queries.next_batch(min(chunk, local - start)).to(ref_lm.device)  # (b, C): bare, as in OAI's files
        contexts = queries.format(query).repeat_interleave(NUM_SAMPLES, 0)  # (4b, prefix + C + suffix)
        response = generate_responses(ref_lm, contexts, pad_id, args.task.response_length, args.task.temperature)
        response, _ = truncate_responses(response, truncate_token_id, args.task.truncate_after, pad_id)
        scores = simulated_labeler_scores(args.labels.source, decode(tokenizer, response))
        for i in range(query.shape[0]):
            rows = response[i * NUM_SAMPLES : (i + 1) * NUM_SAMPLES].tolist()
            unpadded_query = query[i][query[i] != pad_id].tolist()
            query_ids = unpadded_query + [OPENAI_PAD_ID] * (args.task.query_length - len(unpadded_query))
            record = {
                "query": query_ids,
                **{f"sample{j}": [OPENAI_PAD_ID if t == pad_id else t for t in row] for j, row in enumerate(rows)},
            }
            record["scores"] = scores[i * NUM_SAMPLES : (i + 1) * NUM_SAMPLES]
            records.append(record)
    records = gather_object(records)[:total]
    rng = np.random.default_rng(args.seed)
    for record in records:
        logits = args.labels.labeler_beta * np.asarray(record["scores"])
        probabilities = np.exp(logits - logits.max())
        record["best"] = int(rng.choice(NUM_SAMPLES, p=probabilities / probabilities.sum()))
    return records


def main(args: Args) -> None:
    args = validate_args(args)
    if args.dry_run:
        derived = {k: getattr(args, k) for k in ("world_size", "local_batch_size", "micro_batch_size", "num_updates")}
        print(json.dumps({"dry_run": "ok", **derived}))
        return
    tokenizer = load_tokenizer(args.base_model, "--base-model")
    require_causal_lm(args.base_model, "--base-model")
    pad_id = tokenizer.pad_token_id
    truncate_token_ids = tokenizer.encode(args.task.truncate_token, add_special_tokens=False)
    if len(truncate_token_ids) != 1:
        fail(f"--task.truncate-token {args.task.truncate_token!r} is {len(truncate_token_ids)} tokens, not 1")
    if args.labels.source == "file":
        label_path = args.label_dataset
        if not os.path.isfile(label_path):
            require_local_or_hub(args.label_dataset_repo, "--label-dataset")
            from huggingface_hub import hf_hub_download

            label_path = hf_hub_download(args.label_dataset_repo, args.label_dataset, repo_type="dataset")
        labels = load_labels(label_path, tokenizer, pad_id, args)  # validated before any model is loaded
    output_dir = prepare_output_dir(args.output_dir, "reward_model", args.overwrite, args.resume)
    if args.resume and (output_dir / "reward_model").is_dir():
        print(f"--resume: {output_dir} holds a finished run (reward_model/ exists); nothing to do")
        return
    if args.resume:
        check_resume_args(output_dir, args)
    texts = load_query_texts(args.task)[args.task.query_field]
    QueryStream(texts, tokenizer, args.task, pad_id, args.seed).next_batch(1)  # no query: fail before any model loads
    stop = StopSignal()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
    if accelerator.device.type == "cpu":
        reuse_freed_host_memory()
    checkpoint = start_run_files(accelerator, output_dir, args.resume)
    logger = RunLogger(accelerator, output_dir, args, args.track)
    if accelerator.is_main_process and checkpoint is None:  # a resumed run keeps its first attempt's args.json
        write_text_atomic(output_dir / "args.json", json.dumps(asdict(args), indent=2))
    torch.manual_seed(args.seed)  # the head init agrees on every process
    reward_model = RewardModel(load_pretrained(AutoModel, args.base_model, "--base-model"), pad_id)
    ref_lm = load_pretrained(AutoModelForCausalLM, args.base_model, "--base-model").to(accelerator.device).eval()
    disable_eos_stopping(ref_lm)
    for param in ref_lm.parameters():
        param.requires_grad_(False)
    torch.manual_seed(args.seed + accelerator.process_index * RANK_SEED_STRIDE)  # detail: per-process sampling seed
    query_stream = QueryStream(
        texts,
        tokenizer,
        args.task,
        pad_id,
        seed=args.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    if args.labels.source != "file":
        reward_model.to(accelerator.device)
        label_path = output_dir / "labels.json"
        if checkpoint is None:  # a resumed run trains on the labels its first attempt made
            with accelerator.autocast():  # a no-op unless --mixed-precision bf16
                records = simulate_labels(
                    accelerator, ref_lm, query_stream, tokenizer, pad_id, truncate_token_ids[0], args
                )
            if accelerator.is_main_process:
                write_text_atomic(label_path, json.dumps(records))
        accelerator.wait_for_everyone()
        labels = load_labels(str(label_path), tokenizer, pad_id, args)
    optimizer = make_optimizer(reward_model.parameters(), args.lr, args.eps, args.use_tensorflow_adam)
    reward_model, optimizer = accelerator.prepare(reward_model, optimizer)
    trunk_params = trunk_parameters(accelerator.unwrap_model(reward_model).backbone)
    num_test = (len(labels["best"]) - args.labels.num_train) // args.batch_size * args.batch_size
    test_ids = torch.arange(args.labels.num_train, args.labels.num_train + num_test)
    # detail: label order — one permutation drawn on process 0 and broadcast, so all processes agree on it
    order = [torch.randperm(args.labels.num_train, generator=torch.Generator().manual_seed(args.seed))]
    order = broadcast_object_list(order)[0]
    start_time = time.time()

    @torch.no_grad()
    def evaluate(step: int) -> dict:
        local_ids = test_ids[accelerator.process_index :: accelerator.num_processes]
        losses, accuracies = [], []
        for start in range(0, len(local_ids), args.local_eval_batch_size):
            ids = local_ids[start : start + args.local_eval_batch_size]
            batch = [labels[k][ids].to(accelerator.device) for k in ("queries", "samples", "best")]
            loss, accuracy = best_of_4_loss(reward_model, *batch)
            losses.append(loss * len(ids))
            accuracies.append(accuracy * len(ids))
        totals = torch.stack([sum(losses), sum(accuracies), torch.tensor(float(len(local_ids)))])
        loss_sum, accuracy_sum, count = accelerator.reduce(totals.to(accelerator.device), "sum").tolist()
        with accelerator.autocast():
            query, response, score = sample_and_score(
                ref_lm, accelerator.unwrap_model(reward_model), query_stream, SAMPLE_ROWS, args
            )
        rows = zip(decode(tokenizer, query), decode(tokenizer, response), score.tolist(), strict=True)
        logger.table(f"samples at step {step}", ["query", "response", "reward"], [list(row) for row in rows])
        return {"test/loss": loss_sum / count, "test/accuracy": accuracy_sum / count}

    start_step = 0
    if checkpoint is not None:  # continue exactly where the checkpoint left off (normalized before, N steps done)
        state, process_state = load_checkpoint(accelerator, checkpoint, reward_model, optimizer)
        start_step, start_time = state["step"], start_time - state["elapsed"]
        query_stream.load_state(process_state["stream"])
        set_rng_states(process_state["rng"])
        logger.console.print(f"resumed from {checkpoint} at step {start_step + 1}")
    # 1. normalize before
    elif args.normalize_before:
        logger.log({"step": 0, **normalize_reward(accelerator, ref_lm, reward_model, query_stream, args, "before")}, 0)
    # 2. train
    reward_model.train()
    steps = range(start_step, args.num_updates)
    for update in track_progress(steps, "training reward model", accelerator.is_main_process):
        lr = linear_lr(args.lr, update, args.num_updates)  # per step, k = 0 .. N - 1
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_start = time.perf_counter()
        global_ids = order[update * args.batch_size : (update + 1) * args.batch_size]
        local_ids = global_ids[accelerator.process_index * args.local_batch_size :][: args.local_batch_size]
        stats = []
        for micro in range(args.gradient_accumulation_steps):
            ids = local_ids[micro * args.micro_batch_size : (micro + 1) * args.micro_batch_size]
            batch = [labels[k][ids].to(accelerator.device) for k in ("queries", "samples", "best")]
            with accelerator.accumulate(reward_model):
                loss, accuracy = best_of_4_loss(reward_model, *batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            stats.append(torch.stack([loss.detach(), accuracy]))
        local = torch.cat([torch.stack(stats).mean(0), torch.tensor([stop.requested], device=accelerator.device)])
        loss, accuracy, stop_now = accelerator.reduce(local, "mean").tolist()  # stop_now > 0: SIGTERM somewhere
        if not math.isfinite(loss):
            micro = next((i for i, stat in enumerate(stats) if not torch.isfinite(stat).all()), None)
            where = (
                "another process" if micro is None else f"micro-batch {micro} on process {accelerator.process_index}"
            )
            good = checkpoint_dirs(output_dir)
            fail(
                f"non-finite train/loss at step {update + 1} ({where}); stopped before saving: no reward_model/ "
                f"written, last good checkpoint: {good[-1] if good else 'none'}"
            )
        row = {
            "step": update + 1,
            "train/loss": loss,
            "train/accuracy": accuracy,
            "train/lr": lr,
            "elapsed/time": time.time() - start_time,
            "time/train_step": time.perf_counter() - step_start,
        }
        if args.peak_tflops:  # per process: 4 samples per label, 2·N FLOPs per token forward, backward 2x
            tokens = NUM_SAMPLES * args.local_batch_size * (args.task.query_length + args.task.response_length)
            row["time/mfu_train_step"] = 6 * trunk_params * tokens / row["time/train_step"] / (args.peak_tflops * 1e12)
        # 3. evaluate
        if (update + 1) % args.print_sample_output_freq == 0 or update + 1 == args.num_updates:
            evaluation_start = time.perf_counter()
            row.update(evaluate(update + 1))
            row["time/evaluation"] = time.perf_counter() - evaluation_start
            logger.console.print(
                f"step {update + 1}: test/loss {row['test/loss']:.4f} accuracy {row['test/accuracy']:.4f}"
            )
        logger.log(row, update + 1)
        if stop_now > 0 or (args.checkpoint_every and (update + 1) % args.checkpoint_every == 0):
            state, process_state = (
                dict(elapsed=time.time() - start_time),
                dict(rng=rng_states(), stream=query_stream.state()),
            )
            path = save_checkpoint(
                accelerator, output_dir, update + 1, args.checkpoint_keep, reward_model, optimizer, state, process_state
            )
            if stop_now > 0:
                logger.console.print(
                    f"stopped by SIGTERM after step {update + 1}: wrote {path}; continue with --resume"
                )
                logger.close()
                raise SystemExit(EXIT_STOPPED)
    reward_model.eval()
    # 4. normalize after
    if args.normalize_after:
        stats = normalize_reward(accelerator, ref_lm, reward_model, query_stream, args, "after")
        logger.log({"step": args.num_updates, **stats}, args.num_updates)
    logger.log(
        {"step": args.num_updates, "sync/param_spread": parameter_spread(accelerator, reward_model)}, args.num_updates
    )
    # 5. save
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(reward_model)
        save_directory_atomic(output_dir / "reward_model", lambda d: model.save(d, tokenizer, args.base_model))
        logger.console.print(f"saved {output_dir / 'reward_model'}")
    accelerator.wait_for_everyone()
    logger.close()


if __name__ == "__main__":
    main(tyro.cli(Args))
