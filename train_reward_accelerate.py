"""Train the reward model of OpenAI's lm-human-preferences (Ziegler et al. 2019) from best-of-4 labels.

Reproduces `lm_human_preferences/train_reward.py` (TF1, https://github.com/openai/lm-human-preferences) with the
details documented in "The N Implementation Details of RLHF with PPO" (Huang, Liu, von Werra, 2023), each tagged
`# detail:` where it is implemented: a pretrained LM with a scalar head reads `query ⊕ sample_i` for the 4 samples
of a label, and a softmax cross-entropy over the 4 scores learns which one the labeler picked. The reward is
normalized before and after training so that responses of the pretrained policy score mean 0 and std 1.

Launch (batch sizes are global: the same flags give the same optimization on any number of processes):
    python train_reward_accelerate.py --seed 1                                            # 1 GPU, OpenAI's settings
    accelerate launch --num_processes 8 train_reward_accelerate.py --seed 1               # 8 GPUs
    accelerate launch --num_processes 8 train_reward_accelerate.py --task.name tldr       # tldr (or cnndm)
    python train_reward_accelerate.py --base-model DIR --task.query-dataset corpus.txt --labels.source sentiment \\
        --labels.num-train 64 --labels.simulated-num-test 32 --batch-size 8 --rollout-batch-size 16 \\
        --normalize-samples 16                                                            # CPU, no Hub: a smoke run
Reading order: from here to the end of `main` is the algorithm: the config, the pipeline both scripts share, the
reward model's own parts, then `main` with its numbered phases (1-6). Below `main`: the machine (input checks,
loading, the record of each step, saving, speed). Shapes, per process: B label records, n = 4 samples of a record, C
query tokens, T response tokens, L = C + nT tokens of a record's one row, d hidden size.
Outputs in --output-dir: args.json, metrics.jsonl, TensorBoard events, reward_model/ (read by
train_policy_accelerate.py via --rewards.trained-model) and labels.json when the labels are simulated.
"""

import contextlib
import inspect
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache

import rlhf_data
import run_utils


@dataclass
class LabelHParams:
    num_train: int = 4992
    """number of label records to train on (the first ones of the file); the rest, cut to whole batches, is the
    held-out test set"""
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
    """OAI's task (launch.py); it sets the defaults of the other flags to its own (`--task.name tldr --help`)"""
    query_dataset: str = "bookcorpus/bookcorpus"
    """query texts: a Hugging Face Hub dataset (downloaded once into the datasets cache) or a local .txt (one text per
    line) / .json / .jsonl file"""
    query_dataset_config: Optional[str] = None
    """configuration name of a Hub --task.query-dataset"""
    query_field: str = "text"
    """the field of each dataset row that holds the text"""
    passage_rows: int = 8
    """consecutive rows of --task.query-dataset joined into one text (Hub `bookcorpus` has one sentence per row, in
    book order, and OAI's queries were multi-sentence passages)"""
    query_length: int = 64
    """tokens per query, without prefix and suffix (the blog's code later regressed the books tasks to 24)"""
    query_prefix: str = ""
    """text put before every query in the policy's input; the reward model reads the bare query, as OAI's did"""
    query_suffix: str = ""
    """text put after every (padded) query in the policy's input"""
    start_text: str = "."
    """a query starts after the first occurrence of this text; texts without it are skipped; '' for none"""
    end_text: str = "."
    """a query is cut after the last occurrence of this text in its first query_length tokens; texts without it are
    skipped; '' for none"""
    response_length: int = 24
    """tokens sampled per response, never stopped early at EOS"""
    truncate_token: str = "."
    """text of the token that ends a response after `truncate_after`, one token ('' with --task.chat-template: its own)"""
    truncate_after: int = 16
    """a response is cut after the first truncate token at response index >= this"""
    temperature: float = 0.7
    """sampling temperature"""
    chat_template: bool = False
    """each text whole, between --task.query-prefix and --task.query-suffix, as the user's turn in the base model's chat
    template (--task.query-length counts it all: a longer prompt is skipped); the template's end-of-turn token ends a
    response. Defaults then: no start, end or truncate text, --task.passage-rows 1 --task.truncate-after 0, stopping"""
    stop_when_ended: bool = False
    """stop sampling once every response of the batch has ended (truncate token at index >= truncate_after); OAI: never"""


@dataclass
class Args(run_utils.RunArgs):
    exp_name: str = "train_reward_accelerate"
    """experiment name, the first part of the run name"""
    seed: int = 1
    """global seed: label order and head init come from it; process i samples with seed + i * 100003"""
    base_model: str = "gpt2"
    """pretrained causal LM: a Hub id or a local directory (any AutoModelForCausalLM)"""
    label_dataset: str = "sentiment/offline_5k.json"
    """best-of-4 label file: a file name in the Hub dataset --label-dataset-repo, or a local JSON path"""
    label_dataset_repo: str = "vwxyzjn/lm-human-preferences"
    """Hub dataset repo holding OAI's label files (mirror of OAI's public blob storage), or a local directory"""
    batch_size: int = 32
    """label records per optimizer step, over all processes"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step (memory knob; does not change the math)"""
    lr: float = 5e-5
    """learning rate, annealed linearly to 0 over the training steps"""
    eps: float = 1e-5
    """Adam epsilon"""
    use_tensorflow_adam: bool = True
    """TF1-style Adam (eps outside the bias correction, as in OAI); --no-use-tensorflow-adam: torch.optim.Adam"""
    rollout_batch_size: int = 512
    """responses per normalization round, over all processes"""
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
    local_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """--batch-size / processes: a step's label records on one process (computed in validate_args)"""
    local_rollout_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """--rollout-batch-size / processes: a normalization round's responses on one process (computed)"""
    local_eval_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """--eval-batch-size / processes: the held-out records of one evaluation forward on one process (computed)"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """--labels.num-train / --batch-size: the training steps of the run (computed)"""


OPENAI_PAD_ID = 50259  # OAI's pad id, len(encoder) + 2 (language/encodings.py): its label files use it
RANK_SEED_STRIDE = 100003  # process i samples with seed + i * RANK_SEED_STRIDE (a prime, so streams never collide)
NUM_SAMPLES = 4  # best-of-4


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline both scripts share, copied verbatim into each (tests/test_shared_helpers.py fails when the copies
# drift apart): tokens and padding, models without dropout, sampling, truncation, TF-style Adam, the lr schedule,
# queries, the reward model's forward, the simulated labelers (the speed substitutions they call are a
# second shared block, below main).
# ---------------------------------------------------------------------------------------------------------------------
NEVER_SAMPLED_LOGIT = -1e9  # the pad id's logit: exp() of it is exactly 0 in fp32, and (unlike -inf) 0 * it is 0


def load_tokenizer(name_or_path: str):
    """The base model's tokenizer with a pad token distinct from EOS, so the policy stays free to emit EOS."""
    # detail: pad token — GPT-2 has none; we add `[PAD]`, id 50257, one past the vocabulary, as OAI padded with an id
    # outside it (language/encodings.py). The embedding is not resized: pads become 0 before every forward.
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def config_without_dropout(name_or_path: str):
    """The model's config with every dropout probability set to 0."""
    # detail: dropout disabled — OAI trains without dropout (policy.py do_dropout=False); eval mode alone would leave
    # it on in the PPO forward passes, making the ratio at the first minibatch != 1
    config = AutoConfig.from_pretrained(name_or_path)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def load_pretrained(model_class, name_or_path: str) -> nn.Module:
    """A pretrained model through the Auto classes, in fp32, with every dropout probability 0 (asserted)."""
    config = fused_gelu(config_without_dropout(name_or_path))
    model = model_class.from_pretrained(name_or_path, config=config, dtype=torch.float32)
    for key, value in model.config.to_dict().items():
        assert not (("dropout" in key or "pdrop" in key) and isinstance(value, float) and value), f"config.{key}"
    for name, module in model.named_modules():
        assert not isinstance(module, nn.Dropout) or module.p == 0.0, f"{name}.p = {module.p}"
    return model


def right_padding_to_left_padding(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Move every pad of each row to the left, keeping the real tokens in order (also pads in the middle): the last
    column is then always a real token. Vectorised: a stable sort on the pad mask puts pads (key 0) before the rest."""
    is_token = (tokens != pad_id).to(torch.int8)
    order = torch.sort(is_token, dim=1, stable=True).indices  # (B, L)
    return torch.gather(tokens, 1, order)


def padded_forward(backbone: nn.Module, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Final hidden states (after the final layer norm) of left-padded `tokens`: (B, L, d_model)."""
    # detail: position ids for padding — pads are masked, real tokens get positions 0, 1, ... (exclusive cumsum of the
    # mask, so pads don't advance it) and pad ids never reach the embedding (OAI language/model.py Model.__call__)
    attention_mask = tokens != pad_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.where(attention_mask, tokens, 0)
    output = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return output.last_hidden_state


@torch.compiler.disable
def vocabulary_logits(lm: nn.Module, hidden: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The LM head's logits, computed in fp32 (not bf16, not TF32) also under bf16 autocast and --allow-tf32, the pad
    id's never a candidate: (..., V)."""
    # OAI policy.py step_core cuts the logits to the vocabulary, so its pad id (past it) is never sampled and has no
    # probability; ours is inside the head when the tokenizer has a pad token of its own or the head is larger than
    # the tokenizer: its logit is masked then (finite, so that entropies over the masked softmax stay numbers)
    head = lm.get_output_embeddings()  # (V, d)
    rows = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    # OAI computed every logit in fp32: a bf16 product rounds GPT-2's logits (tens of nats) by up to 0.25 each, TF32
    # rounds the head's inputs to 10 bits of mantissa
    with fp32_products(hidden.device.type):
        logits = head_product(rows.to(head.weight.dtype), head.weight).view(*hidden.shape[:-1], -1).float()
        if head.bias is not None:
            logits = logits + head.bias
    if pad_id < logits.shape[-1]:
        logits = logits.index_fill(-1, torch.full((1,), pad_id, device=logits.device), NEVER_SAMPLED_LOGIT)
    return logits


@torch.no_grad()
def sample_responses(lm: nn.Module, contexts: torch.Tensor, pad_id: int, response_length: int, temperature: float,
                     samples_per_context: int = 1, stop: Optional[tuple[int, int]] = None):  # fmt: skip
    """Sample `response_length` tokens after each left-padded context, one at a time with the KV cache, as OAI's
    language/sample.py sample_sequence: (B, T) responses, B = contexts x samples_per_context (each context's rows
    together; its forward runs once and its keys and values are shared by its samples). With `stop` (the truncate
    token's id, truncate_after: --task.stop-when-ended), the sampling stops once every row has ended: (B, T' <= T)."""
    # detail: fixed-length responses — exactly response_length tokens drawn from softmax(logits / temperature): no
    # top-k, no top-p, never stopped at EOS (OAI language/sample.py sample_sequence)
    attention_mask = contexts != pad_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()  # as padded_forward: pads don't count
    input_ids, steps = torch.where(attention_mask, contexts, 0), []
    ended = torch.zeros(len(contexts) * samples_per_context, dtype=torch.bool, device=contexts.device)  # (B,)
    kv_cache = DynamicCache()  # the keys and values of every position so far, filled in place by each forward
    for step in range(response_length):
        output = lm.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **cache_argument(lm, kv_cache))  # fmt: skip
        hidden = output.last_hidden_state[:, -1]  # (B, d): the newest position
        if step == 0 and samples_per_context > 1:  # from here on, one row per sample
            kv_cache.batch_repeat_interleave(samples_per_context)
            hidden, attention_mask, position_ids = (
                x.repeat_interleave(samples_per_context, 0) for x in (hidden, attention_mask, position_ids)
            )
        logits = vocabulary_logits(lm, hidden, pad_id) / temperature  # (B, V)
        token = draw_tokens(F.softmax(logits, dim=-1))  # (B, 1)
        steps.append(token)
        if stop is not None:  # a row has ended at its truncate token at index >= truncate_after (truncate_responses)
            ended |= (token[:, 0] == stop[0]) & (step >= stop[1])
            if ended.all():
                break
        input_ids, position_ids = token, position_ids[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
    return torch.cat(steps, 1)


def truncate_responses(responses: torch.Tensor, truncate_token_id: int, truncate_after: int, pad_id: int):
    """Post-processed responses and whether each had a truncate token at index >= truncate_after: ((B, T), (B,))."""
    # detail: rejection sampling — every token strictly after the first truncate token at index >= truncate_after
    # becomes pad; a response without one is scored the penalty (OAI train_policy.py make_score_fn, lm_tasks.py)
    index = torch.arange(responses.shape[1], device=responses.device)  # (T,)
    is_cut = (responses == truncate_token_id) & (index >= truncate_after)  # (B, T)
    has_cut = is_cut.any(1)
    first_cut = torch.where(has_cut, is_cut.int().argmax(1), responses.shape[1])  # (B,)
    postprocessed = torch.where(index > first_cut[:, None], pad_id, responses)
    return postprocessed, has_cut


class AdamTensorFlowStyle(torch.optim.Adam):
    """Adam as in TF1 (and so OAI): eps is added to sqrt(v) outside the bias correction,
    `p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`."""

    # detail: TF-style Adam — PyTorch's update divides by sqrt(v / (1 - b2^t)) + eps, i.e. its effective eps is
    # eps * sqrt(1 - b2^t) (~0.03 eps at t=1), so early updates are larger (blog: ~6x the approxkl early on; OAI
    # utils/core.py minimize: tf.train.AdamOptimizer). The TF step is PyTorch's with eps / sqrt(1 - b2^t) at step t:
    # set before each step, so that torch's fused kernel makes it in one pass over the weights
    # (docs/speed.md#each-speed-detail-on-its-own)
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-5):
        super().__init__(params, lr=lr, betas=betas, eps=eps, fused=True)
        for group in self.param_groups:
            group["tensorflow_eps"] = eps

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            states = [self.state[param] for param in group["params"] if param.grad is not None]
            t = 1 + int(states[0]["step"]) if states and states[0] else 1  # this step's t, the same for every weight
            group["eps"] = group["tensorflow_eps"] / math.sqrt(1 - group["betas"][1] ** t)
        return super().step(closure)


def make_optimizer(params, lr: float, eps: float, use_tensorflow_adam: bool) -> torch.optim.Optimizer:
    if use_tensorflow_adam:
        return AdamTensorFlowStyle(params, lr=lr, eps=eps)
    return torch.optim.Adam(params, lr=lr, eps=eps)


def linear_lr(base_lr: float, step: int, num_steps: int) -> float:
    """lr * (1 - step / num_steps) for step = 0 .. num_steps - 1, never exactly 0."""
    # detail: learning rate annealing — linear to 0 (OAI train_reward.py per step, train_policy.py per update)
    return base_lr * (1 - step / num_steps)


def query_from_text(tokenizer, text_tokens: list[int], task, pad_id: int) -> Optional[list[int]]:
    """A query of `task.query_length` token ids, right-padded, or None if the text yields none. The prefix and suffix
    come later (`QueryStream.format`): the reward model and the label files see the bare query. A chat prompt
    (--task.chat-template) is kept whole or, longer than query_length, not at all: cut, it loses the opened turn."""
    if task.chat_template:
        fits = len(text_tokens) <= task.query_length
        return text_tokens + [pad_id] * (task.query_length - len(text_tokens)) if fits else None
    # detail: queries that start and end with a period — OAI language/datasets.py: start after the first start_text
    # (a text whose first one is its last token is kept whole), keep query_length tokens, end after the last
    # end_text; texts without start or end text yield no query
    tokens = text_tokens
    if task.start_text:
        start, hits = find(tokenizer, tokens, task.start_text)
        if not hits:
            return None
        if hits[0] + len(start) < len(tokens):
            tokens = tokens[hits[0] + len(start) :]
    tokens = tokens[: task.query_length]
    if task.end_text:
        end, hits = find(tokenizer, tokens, task.end_text)
        if not hits:
            return None
        tokens = tokens[: hits[-1] + len(end)]
    if not tokens:
        return None
    return tokens + [pad_id] * (task.query_length - len(tokens))


def find(tokenizer, tokens: list[int], text: str) -> tuple[list[int], list[int]]:
    """`text`'s tokens and where they start in `tokens`."""
    pattern = tokenizer.encode(text, add_special_tokens=False)
    return pattern, [i for i in range(len(tokens) - len(pattern) + 1) if tokens[i : i + len(pattern)] == pattern]


class QueryStream:
    """Endless batches of left-padded queries (B, query_length) from `texts` (an rlhf_data.QueryTexts), each with the
    dataset's fields of its text that `texts` carries (for --rewards.function): every epoch in a seeded order that all
    processes share (process r reads every world_size-th text, so none repeats a text another process uses in the same
    epoch), cleaned and tokenized lazily in chunks, the texts in `exclude` skipped (the policy's held-out queries).
    `format` turns queries into the policy's contexts."""

    def __init__(self, texts, tokenizer, task, pad_id, seed, rank=0, world_size=1, exclude=frozenset(), chunk=256):
        self.texts, self.tokenizer, self.task, self.pad_id, self.exclude = texts, tokenizer, task, pad_id, exclude
        self.seed, self.rank, self.world_size, self.chunk = seed, rank, world_size, chunk
        self.epoch, self.used, self.produced, self.buffer = 0, 0, 0, []  # buffer: [text index, query] pairs
        self.source = texts.epoch(self.epoch, seed, rank, world_size)  # the text indices, in this epoch's order

    def next_batch(self, n: int, device="cpu") -> tuple[torch.Tensor, dict[str, list]]:
        """n queries (n, C) on `device`, and their texts' fields (texts.fields: name -> n values, or {})."""
        while len(self.buffer) < n:
            rows = list(itertools.islice(self.source, self.chunk))
            if not rows:  # the end of an epoch
                if self.produced == 0:
                    run_utils.fail(rlhf_data.no_query_message(self.task))
                self.epoch, self.used, self.produced = self.epoch + 1, 0, 0
                self.source = self.texts.epoch(self.epoch, self.seed, self.rank, self.world_size)
                continue
            self.used += len(rows)
            rows = [row for row in rows if self.texts[row] not in self.exclude]
            cleaned = rlhf_data.query_texts([self.texts[row] for row in rows], self.task, self.tokenizer)
            tokenized = self.tokenizer(cleaned, add_special_tokens=False)["input_ids"] if rows else []
            for row, tokens in zip(rows, tokenized, strict=True):
                query = query_from_text(self.tokenizer, tokens, self.task, self.pad_id)
                if query is not None:
                    self.buffer.append([row, query])
                    self.produced += 1
        batch, self.buffer = self.buffer[:n], self.buffer[n:]
        queries = right_padding_to_left_padding(torch.tensor([query for _, query in batch]), self.pad_id)
        return queries.to(device), self.texts.fields([row for row, _ in batch])

    def state(self) -> dict:
        return dict(epoch=self.epoch, used=self.used, produced=self.produced, buffer=self.buffer)

    def load_state(self, state: dict) -> None:
        self.epoch, self.used, self.produced, self.buffer = (state[k] for k in ("epoch", "used", "produced", "buffer"))
        self.source = self.texts.epoch(self.epoch, self.seed, self.rank, self.world_size, start=self.used)

    def format(self, queries: torch.Tensor) -> torch.Tensor:
        """The policy's contexts prefix ⊕ query ⊕ suffix (OAI lm_tasks.py query_formatter): (B, prefix + query_length
        + suffix), left-padded again, which moves the query's pads (now between prefix and query) to the front. OAI's
        reward model scores the bare query ⊕ response, and its label files hold bare queries. With
        --task.chat-template the query is the prompt in the template, prefix and suffix inside: both models read it."""
        if self.task.chat_template:
            return queries
        prefix, suffix = (
            queries.new_tensor(self.tokenizer.encode(text, add_special_tokens=False)).expand(len(queries), -1)
            for text in (self.task.query_prefix, self.task.query_suffix)
        )
        return right_padding_to_left_padding(torch.cat([prefix, queries, suffix], 1), self.pad_id)


class RewardModel(nn.Module):
    """A pretrained backbone (no LM head) + a scalar head on the last token's final hidden state, with OAI's
    `reward_gain` / `reward_bias`: r = gain * head(h_last) + bias of query ⊕ response. Queries (B, C), left-padded;
    responses (B, T), padded anywhere -> rewards (B,). (The reward script's best-of-n forward reads n responses of
    each query in one row: BestOfNRewardModel.)"""

    def __init__(self, backbone: nn.Module, pad_id: int):
        super().__init__()
        self.backbone, self.pad_id = backbone, pad_id
        hidden_size = backbone.config.hidden_size
        self.scalar_head = nn.Linear(hidden_size, 1)
        # detail: reward head initialization — N(0, 1/sqrt(d_model + 1)), bias 0 (OAI language/model.py fc_layer)
        nn.init.normal_(self.scalar_head.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.scalar_head.bias)
        self.reward_gain = nn.Parameter(torch.tensor(1.0))
        self.reward_bias = nn.Parameter(torch.tensor(0.0))

    def forward(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        # detail: query ⊕ response input — the reward model (like the policy's value head) reads the concatenation
        # (OAI rewards.py get_rewards_op); the pads of the responses go left
        query_responses = right_padding_to_left_padding(torch.cat([queries, responses], 1), self.pad_id)
        # detail: reward from the last token — the hidden state of the last real token, the last column once left
        # padded (OAI rewards.py TrainedRewardModel)
        hidden = padded_forward(self.backbone, query_responses, self.pad_id)[:, -1]  # (B, d_model)
        return self.normalized_reward(hidden)

    @torch.compiler.disable
    def normalized_reward(self, hidden: torch.Tensor) -> torch.Tensor:
        """gain * head(h) + bias of last hidden states (..., d_model) -> (...), in the weights' fp32 also under bf16
        autocast and --allow-tf32."""
        with fp32_products(hidden.device.type):  # as OAI's: a bf16 output would keep 3 digits
            return self.reward_gain * self.scalar_head(hidden.to(self.reward_gain.dtype)).squeeze(-1) + self.reward_bias


def decode(tokenizer, tokens: torch.Tensor) -> list[str]:
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------------
# End of the shared pipeline.
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def label_records(ref_lm, query_stream: QueryStream, tokenizer, truncate_token_id: int, n: int, args: Args):
    """n best-of-4 records in OAI's schema (query and samples padded with OPENAI_PAD_ID), without their pick yet: 4
    sampled responses per query, truncated as OAI's labelers saw them, and the simulated labeler's score of each."""
    pad_id, task = tokenizer.pad_token_id, args.task
    queries = query_stream.next_batch(n, ref_lm.device)[0]  # (n, C): bare, as in OAI's files
    contexts = query_stream.format(queries)
    stop = (truncate_token_id, task.truncate_after) if task.stop_when_ended else None  # OAI: a fixed length
    responses = sample_responses(ref_lm, contexts, pad_id, task.response_length, task.temperature, NUM_SAMPLES, stop)
    responses = F.pad(responses, (0, task.response_length - responses.shape[1]), value=pad_id)  # a stop: pads after
    responses, _ = truncate_responses(responses, truncate_token_id, task.truncate_after, pad_id)  # (4n, T)
    scores = simulated_labeler_scores(args.labels.source, decode(tokenizer, responses))
    records = []
    for i in range(n):
        rows = responses[i * NUM_SAMPLES : (i + 1) * NUM_SAMPLES].tolist()  # each query's 4 samples together
        unpadded_query = queries[i][queries[i] != pad_id].tolist()
        records.append({
            "query": unpadded_query + [OPENAI_PAD_ID] * (task.query_length - len(unpadded_query)),
            **{f"sample{j}": [OPENAI_PAD_ID if t == pad_id else t for t in row] for j, row in enumerate(rows)},
            "scores": scores[i * NUM_SAMPLES : (i + 1) * NUM_SAMPLES],
        })  # fmt: skip
    return records


def labeler_picks(records: list[dict], labels: LabelHParams, seed: int) -> list[dict]:
    """The noisy simulated labeler's pick of each record: sample i with probability softmax(beta * score)_i."""
    rng = np.random.default_rng(seed)
    for record in records:
        logits = labels.labeler_beta * np.asarray(record["scores"])
        probabilities = np.exp(logits - logits.max())
        record["best"] = int(rng.choice(NUM_SAMPLES, p=probabilities / probabilities.sum()))
    return records


@torch.no_grad()
def sample_and_score(ref_lm, reward_model, query_stream: QueryStream, n: int, args: Args):
    """Sample n responses of the pretrained policy and score them (raw, not truncated): (queries, responses, scores).
    Like OAI, the policy reads the formatted context (prefix ⊕ query ⊕ suffix), the reward model query ⊕ response."""
    all_queries, all_responses, all_scores = [], [], []
    chunk = args.local_rollout_forward_batch_size
    for start in range(0, n, chunk):
        queries = query_stream.next_batch(min(chunk, n - start), ref_lm.device)[0]  # (b, C)
        contexts, task = query_stream.format(queries), args.task
        responses = sample_responses(ref_lm, contexts, reward_model.pad_id, task.response_length, task.temperature)
        all_scores.append(reward_model(queries, responses))
        all_queries.append(queries)
        all_responses.append(responses)
    return torch.cat(all_queries), torch.cat(all_responses), torch.cat(all_scores)


@torch.no_grad()
def normalize_reward(accelerator, ref_lm, reward_model: RewardModel, query_stream: QueryStream, args: Args,
                     phase: str):  # fmt: skip
    """Reset gain/bias, then set gain = 1/σ, bias = -μ/σ from the pretrained policy's rewards; a fresh sample then
    verifies mean ~0, std ~1. Returns the statistics to log."""
    # detail: reward normalization before and after — μ and the population σ, sqrt(E[r²] - μ²), all-reduced over
    # processes (OAI train_reward.py normalize, run before and after training)
    model, start = accelerator.unwrap_model(reward_model), time.perf_counter()
    n = math.ceil(args.normalize_samples / args.rollout_batch_size) * args.local_rollout_batch_size

    def stats():
        with accelerator.autocast():
            scores = sample_and_score(ref_lm, model, query_stream, n, args)[2].double()  # float64: E[r²] - μ² cancels
        sums = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), "mean")
        mean, square_mean = sums.tolist()
        return mean, math.sqrt(max(square_mean - mean**2, 0.0))

    model.reward_gain.fill_(1.0)
    model.reward_bias.fill_(0.0)
    mean, std = stats()
    if not std > 0:
        run_utils.fail(
            f"normalization {phase}: the reward model scores every sample {mean} (std {std}); cannot normalize"
        )
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


def best_of_4_loss(reward_model: RewardModel, queries, samples, best):
    """Cross-entropy of the 4 rewards against the labeler's pick, and accuracy (OAI label_types.py BestOfN); the 4
    samples of a record go in one forward, which reads their query once (BestOfNRewardModel, below main). Shapes: queries (B, C),
    samples (B, 4, T), best (B,)."""
    logits = reward_model(queries, samples).float()  # (B, 4), fp32 also under bf16
    loss = F.cross_entropy(logits, best)
    accuracy = (logits.argmax(1) == best).float().mean()
    return loss, accuracy


@torch.no_grad()
def evaluate(accelerator, reward_model, labels: dict, test_ids: torch.Tensor, batch_size: int) -> dict:
    """Loss and accuracy on the held-out label records, over all processes (each takes every world_size-th, in
    batches of `batch_size`)."""
    local_ids = test_ids[accelerator.process_index :: accelerator.num_processes]
    losses, accuracies = [], []
    for ids in local_ids.split(batch_size):
        batch = [labels[k][ids].to(accelerator.device) for k in ("queries", "samples", "best")]
        loss, accuracy = best_of_4_loss(reward_model, *batch)
        losses.append(loss * len(ids))
        accuracies.append(accuracy * len(ids))
    totals = torch.stack([sum(losses), sum(accuracies), torch.tensor(float(len(local_ids)), device=accelerator.device)])
    loss_sum, accuracy_sum, count = accelerator.reduce(totals, "sum").tolist()
    return {"test/loss": loss_sum / count, "test/accuracy": accuracy_sum / count}


def main(args: Args) -> None:
    args = validate_args(args)  # derived sizes, flag checks (this and the other named tooling: below main)
    tokenizer, labels, texts = read_inputs(args)  # checked before any model loads
    if args.dry_run:
        return run_utils.print_dry_run(args, DRY_RUN_SIZES)
    task, pad_id = args.task, tokenizer.pad_token_id
    truncate_token_id = rlhf_data.truncate_token_id(tokenizer, task)  # '.', '\n' (tldr), <|im_end|> (chat)
    accelerator = run_utils.make_accelerator(args, args.gradient_accumulation_steps)
    run = run_utils.Run(args, accelerator, "reward_model", RESUME_MAY_CHANGE)  # output dir, logs, resume, signals
    if run.finished:
        return
    device = run_utils.setup_device(accelerator, args)
    reward_model, ref_lm = load_reward_model_and_sampler(args, pad_id, device)
    # detail: different seeds for different processes — seed + rank * 100003 (OAI utils/core.py set_mpi_seed)
    torch.manual_seed(args.seed + accelerator.process_index * RANK_SEED_STRIDE)
    query_stream = QueryStream(
        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes
    )
    # 1. labels: from --label-dataset (read before any model loaded), or made here by a simulated labeler, once (a
    # resumed run reads what its first attempt made)
    if args.labels.source != "file":
        labels = simulated_labels(run, accelerator, ref_lm, query_stream, tokenizer, truncate_token_id, args)
    # 2. normalize before (before the optimizer holds the weights: DeepSpeed's fp32 copy then starts from gain and bias)
    if run.checkpoint is None and args.normalize_before:
        run.log({"step": 0, **normalize_reward(accelerator, ref_lm, reward_model, query_stream, args, "before")}, 0)
    optimizer = make_optimizer(reward_model.parameters(), args.lr, args.eps, args.use_tensorflow_adam)
    reward_model, optimizer = accelerator.prepare(reward_model, optimizer)
    state = run.resume()  # on --resume: the newest checkpoint's model, optimizer and RNG states; None when fresh
    if state is not None:
        query_stream.load_state(state["process"]["stream"])
    test_ids = held_out_ids(labels, args, run)  # the records past --labels.num-train, in whole batches
    # the label order: OAI's own for the same seed (train_reward.py: numpy seeded with the seed, its first draw),
    # drawn on process 0 and broadcast, so all processes agree on it
    order = broadcast_object_list(
        [torch.from_numpy(np.random.RandomState(args.seed).permutation(args.labels.num_train))]
    )[0]
    unwrapped = accelerator.unwrap_model(reward_model)

    # 3. train: one epoch over the label records, in the shared order
    reward_model.train()
    for step in run.progress(range(run.start_step + 1, args.num_updates + 1), "training reward model"):
        lr = linear_lr(args.lr, step - 1, args.num_updates)  # per step, k = 0 .. N - 1
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_start = time.perf_counter()
        global_ids = order[(step - 1) * args.batch_size : step * args.batch_size]
        local_ids = global_ids.chunk(accelerator.num_processes)[accelerator.process_index]  # this process's block
        stats = []
        for ids in local_ids.split(args.micro_batch_size):  # gradient accumulation: micro-batches of one step
            batch = [labels[k][ids].to(accelerator.device) for k in ("queries", "samples", "best")]
            with accelerator.accumulate(reward_model):
                loss, accuracy = best_of_4_loss(reward_model, *batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            stats.append(torch.stack([loss.detach(), accuracy]))
        row = record_step(run, step, torch.stack(stats), lr, step_start, unwrapped, args)  # over all processes
        # 4. evaluate on the held-out labels, and show what the reward model thinks of some samples
        if step % args.print_sample_output_freq == 0 or step == args.num_updates:
            evaluation_start = time.perf_counter()
            if len(test_ids):
                row.update(evaluate(accelerator, reward_model, labels, test_ids, args.local_eval_batch_size))
            show_samples(run, step, row, ref_lm, unwrapped, query_stream, tokenizer, args)
            row["time/evaluation"] = time.perf_counter() - evaluation_start
        run.log(row, step)
        run.checkpoint_if_due(step, state={}, process_state={"stream": query_stream.state()})  # and on SIGTERM
    reward_model.eval()
    # 5. normalize after
    row = {"step": args.num_updates}
    if args.normalize_after:
        row.update(normalize_reward(accelerator, ref_lm, reward_model, query_stream, args, "after"))
    run.log({**row, "sync/param_spread": run_utils.parameter_spread(accelerator, reward_model)}, args.num_updates)
    # 6. save
    run.save_result(lambda directory: save_reward_model(unwrapped, directory, tokenizer, args.base_model, task))
    run.close()


# =====================================================================================================================
# Below: not the algorithm. The machine around it: the tasks' defaults, input checks, loading, the labels' file and
# resumption, the record of each step, saving, and the speed substitutions the pipeline calls.
# =====================================================================================================================
SAMPLE_ROWS = 4  # rows of the sample table printed to the console
DRY_RUN_SIZES = ("world_size", "local_batch_size", "micro_batch_size", "num_updates")
RESUME_MAY_CHANGE = {"local_batch_size", "micro_batch_size", "local_rollout_batch_size", "local_eval_batch_size"}
"""Per-process sizes a resumed run may recompute (the checkpoint's number of processes is checked instead)."""
LABELER_PACKAGES = {"sentiment": "vaderSentiment", "descriptiveness": "textblob"}
"""each simulated labeler's package (its import name is its pip name): checked before any model loads"""
REWARD_FLAG_RANGES = {
    **dict.fromkeys(("batch_size", "gradient_accumulation_steps", "rollout_batch_size", "normalize_samples",
                     "eval_batch_size", "print_sample_output_freq", "local_rollout_forward_batch_size",
                     "labels.num_train"), run_utils.COUNT),
    "lr": run_utils.POSITIVE, "eps": run_utils.POSITIVE,  # Adam's (eps 0 divides 0 by 0 on a zero gradient)
    "labels.simulated_num_test": run_utils.NON_NEGATIVE,  # checked against --batch-size when labels are simulated
    "labels.labeler_beta": run_utils.NON_NEGATIVE,  # 0: the labeler picks at random; < 0 would prefer the worst
}  # fmt: skip
"""The range of every numeric flag of this script; run_utils.RUN_RANGES and TASK_RANGES hold those both share."""


# OAI's tldr and cnndm (launch.py summarize_tldr_task, summarize_cnndm_task, get_experiments) where they differ from
# books_task, whose values are the fields' defaults: `--task.name X` makes TASK_OVERRIDES[X] the defaults (flags given
# still win). OAI's cnndm end_text was '\n', but Hub `cnn_dailymail` joins an article's paragraphs with spaces.
TLDR_OVERRIDES = {"task.query_dataset": "webis/tldr-17", "task.query_field": "content", "task.passage_rows": 1,
                  "task.query_length": 500, "task.response_length": 75, "task.query_suffix": "\n\nTL;DR:",
                  "task.start_text": "", "task.end_text": "", "task.truncate_token": "\n", "task.truncate_after": 55,
                  "label_dataset": "tldr/online_45k.json", "labels.num_train": 46000, "batch_size": 16, "lr": 2.5e-5,
                  "rollout_batch_size": 128}  # fmt: skip
TASK_OVERRIDES = {
    "sentiment": {},
    "descriptiveness": {"label_dataset": "descriptiveness/offline_5k.json"},
    "tldr": TLDR_OVERRIDES,
    "cnndm": {**TLDR_OVERRIDES, "task.query_dataset": "abisee/cnn_dailymail", "task.query_dataset_config": "3.0.0",
              "task.query_field": "article", "task.query_prefix": "Article:\n\n", "task.temperature": 0.5,
              "label_dataset": "cnndm/online_45k.json"},
}  # fmt: skip


def task_defaults(name: Optional[str] = None) -> Args:
    """Args at OAI's defaults for task `name`: the fields' own (books_task's) with TASK_OVERRIDES[name] on top; a
    name that is no task (or None) keeps the fields' own, and tyro rejects it."""
    overrides = {"task.name": name, **TASK_OVERRIDES[name]} if name in TASK_OVERRIDES else {}
    return run_utils.replace_fields(Args(), overrides)


def validate_args(args: Args) -> Args:
    """Derive every per-process size in one place and reject inconsistent flags before anything is loaded."""
    run_utils.check_run_args(args, REWARD_FLAG_RANGES)
    args.local_batch_size = run_utils.exact_div(args.batch_size, args.world_size, "--batch-size / number of processes")
    args.micro_batch_size = run_utils.exact_div(
        args.local_batch_size,
        args.gradient_accumulation_steps,
        "--batch-size / (processes * --gradient-accumulation-steps)",
    )
    args.local_rollout_batch_size = run_utils.exact_div(
        args.rollout_batch_size, args.world_size, "--rollout-batch-size / number of processes"
    )
    args.local_eval_batch_size = run_utils.exact_div(
        args.eval_batch_size, args.world_size, "--eval-batch-size / number of processes"
    )
    if args.labels.num_train % args.batch_size:  # OAI train_reward.py: exact_div
        run_utils.fail(
            f"--labels.num-train {args.labels.num_train} is not a multiple of --batch-size {args.batch_size}"
        )
    args.num_updates = args.labels.num_train // args.batch_size
    if not 0 <= args.task.truncate_after < args.task.response_length:
        run_utils.fail("--task.truncate-after must be >= 0 and < --task.response-length")
    per_normalization = -(-args.normalize_samples // args.rollout_batch_size) * args.rollout_batch_size  # ceil
    if (args.normalize_before or args.normalize_after) and per_normalization < 2:  # one sample has no spread (N10)
        run_utils.fail(f"--normalize-samples {args.normalize_samples} with --rollout-batch-size {args.rollout_batch_size}"
                       f": a normalization of {per_normalization} sample has no std; raise --normalize-samples")  # fmt: skip
    if args.labels.source != "file":
        if args.labels.simulated_num_test < args.batch_size:
            run_utils.fail("--labels.simulated-num-test must hold at least one --batch-size of records")
        package = LABELER_PACKAGES[args.labels.source]
        run_utils.require_package(package, package, f"--labels.source {args.labels.source}")
    run_utils.check_chat_task(args.task)
    return args


def read_inputs(args: Args):
    """What the run reads, checked before any model loads or anything is written: --output-dir, the services of
    --track / --upload-model, the base model (its tokenizer and config, a causal LM, its weight files, positions for
    the longest sequence), the label file (schema, token ids, size), the query texts (they must yield a query).
    Returns (tokenizer, labels, query texts). A --dry-run fetches nothing from the Hub: it checks every local input
    and lists what it could not check (None for it)."""
    task, dry_run, local_labels = args.task, args.dry_run, os.path.isdir(args.label_dataset_repo)
    run_utils.check_services(args)
    run_utils.check_output_dir(args, "reward_model", RESUME_MAY_CHANGE)
    tokenizer = labels = texts = None
    if run_utils.available(args.base_model, "--base-model", dry_run):
        with run_utils.flag_errors("--base-model", args.base_model, "cannot load a tokenizer and model config"):
            tokenizer, config = load_tokenizer(args.base_model), config_without_dropout(args.base_model)
        run_utils.check_base_model(args, tokenizer, config)
        rlhf_data.truncate_token_id(tokenizer, task)
    else:
        run_utils.NOT_CHECKED.append("what needs --base-model's tokenizer: --task.truncate-token, the lengths against "
                                     "its positions, the label file's token ids, that the query texts yield queries")  # fmt: skip
    if args.labels.source == "file" and os.path.isdir(args.label_dataset):  # not a Hub name (N24)
        run_utils.fail(f"--label-dataset {args.label_dataset!r}: a directory, not a label file")
    if args.labels.source == "file" and run_utils.available(
        args.label_dataset, "--label-dataset", dry_run, local=os.path.isfile(args.label_dataset) or local_labels
    ):
        labels = load_labels(
            run_utils.hub_file(args.label_dataset_repo, args.label_dataset, "--label-dataset"), tokenizer, args
        )
    if run_utils.available(task.query_dataset, "--task.query-dataset", dry_run):
        texts = rlhf_data.QueryTexts.of_task(task)
        if tokenizer is not None:
            QueryStream(texts, tokenizer, task, tokenizer.pad_token_id, args.seed).next_batch(1)  # yields a query
    return tokenizer, labels, texts


def load_labels(path: str, tokenizer, args: Args) -> Optional[dict[str, torch.Tensor]]:
    """A best-of-4 label file as tensors (OAI's books and summarization files alike: queries of --task.query-length,
    bare, without prefix/suffix), checked by rlhf_data.read_label_records; without a tokenizer (a --dry-run of a Hub
    --base-model), checked but for the token ids' vocabulary, and None."""
    # our added pad is not in the files
    vocab_size = None if tokenizer is None else len(tokenizer) - (1 if tokenizer.pad_token == "[PAD]" else 0)
    lengths = {"query": args.task.query_length, **{f"sample{i}": args.task.response_length for i in range(NUM_SAMPLES)}}
    pad_ids = (OPENAI_PAD_ID,) if tokenizer is None else (OPENAI_PAD_ID, tokenizer.pad_token_id)
    records = rlhf_data.read_label_records(path, lengths, vocab_size, pad_ids, NUM_SAMPLES)
    trained = {json.dumps(record, sort_keys=True) for record in records[: args.labels.num_train]}
    repeated = sum(json.dumps(record, sort_keys=True) in trained for record in records[args.labels.num_train :])
    if repeated and os.environ.get("RANK", "0") == "0":  # (N19) a user's file, not refused; said once
        run_utils.console.print(f"warning: --label-dataset {path}: {repeated} held-out records (past --labels.num-train)"
                                " repeat training records: test/accuracy measures those on what was trained",
                                markup=False)  # fmt: skip
    if len(records) < args.labels.num_train:  # OAI reads num_train records; the held-out rest is ours
        run_utils.fail(
            f"--label-dataset {path}: {len(records)} records, fewer than --labels.num-train {args.labels.num_train}"
        )
    if tokenizer is None:
        return None
    queries = torch.tensor([r["query"] for r in records])  # (N, C)
    samples = torch.tensor([[r[f"sample{i}"] for i in range(NUM_SAMPLES)] for r in records])  # (N, 4, T)
    # OAI's files pad with OPENAI_PAD_ID: our pad id instead
    queries, samples = (torch.where(x == OPENAI_PAD_ID, tokenizer.pad_token_id, x) for x in (queries, samples))
    best = torch.tensor([r["best"] for r in records])
    return dict(queries=right_padding_to_left_padding(queries, tokenizer.pad_token_id), samples=samples, best=best)


class BestOfNRewardModel(RewardModel):
    """A speed substitution (docs/speed.md): the reward model as this script trains it, RewardModel, whose forward also
    takes n responses to each query,
    (B, C) and (B, n, T) -> (B, n), from one row [query, response_1, ..., response_n] per query, so that each query's
    tokens go through the backbone once: its attention mask lets response i see the query and itself only, and its
    positions restart after the query for each response (the same rewards as RewardModel's forward of the n rows
    query ⊕ response_i, up to float rounding)."""

    def forward(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        # plain form: return super().forward(queries.repeat_interleave(n, 0), responses.flatten(0, 1)).view(B, n)
        if responses.dim() == 2:
            return super().forward(queries, responses)
        (batch, n, length), query_length = responses.shape, queries.shape[1]
        tokens = torch.cat([queries, responses.flatten(1)], 1)  # (B, L = C + nT)
        is_token, index = tokens != self.pad_id, torch.arange(tokens.shape[1], device=tokens.device)
        part = F.pad(index[: n * length] // length + 1, (query_length, 0))  # (L,): 0 the query, i response i
        sees = (index[None] <= index[:, None]) & ((part[None] == 0) | (part[None] == part[:, None]))  # (L, L)
        # as padded_forward: no token sees a pad, pads don't advance the positions (a pad sees itself, so that no
        # softmax row is empty; nothing reads its output)
        sees = sees & is_token[:, None, :] | torch.eye(len(index), dtype=torch.bool, device=tokens.device)  # (B, L, L)
        dtype = self.backbone.dtype  # an additive mask: eager and sdpa attention both take it as it is
        mask = torch.zeros(sees.shape, dtype=dtype, device=tokens.device).masked_fill(~sees, torch.finfo(dtype).min)
        in_query, in_response = is_token[:, :query_length], is_token[:, query_length:].view(batch, n, length)
        query_positions = in_query.cumsum(1) - in_query.long()  # (B, C)
        response_positions = in_query.sum(1)[:, None, None] + in_response.cumsum(2) - in_response.long()  # (B, n, T)
        hidden = self.backbone(
            input_ids=torch.where(is_token, tokens, 0),
            attention_mask=mask[:, None],  # (B, 1, L, L)
            position_ids=torch.cat([query_positions, response_positions.flatten(1)], 1),
            use_cache=False,
        ).last_hidden_state  # (B, L, d_model)
        last_in_response = length - 1 - in_response.flip(2).int().argmax(2)  # (B, n)
        last = torch.where(
            in_response.any(2), query_length + length * torch.arange(n, device=tokens.device) + last_in_response,
            query_length - 1,  # an empty response: the query's last token
        )  # fmt: skip
        return self.normalized_reward(hidden[torch.arange(batch, device=tokens.device)[:, None], last])


def load_reward_model_and_sampler(args: Args, pad_id: int, device) -> tuple[RewardModel, nn.Module]:
    """The reward model to train (the base model with a scalar head, initialized alike on every process) and the
    frozen base model that samples the labels' candidates and the normalization's responses."""
    torch.manual_seed(args.seed)  # the head's init
    with run_utils.flag_errors("--base-model", args.base_model, "cannot load its weights"):
        reward_model = BestOfNRewardModel(load_pretrained(AutoModel, args.base_model), pad_id)
        ref_lm = load_pretrained(AutoModelForCausalLM, args.base_model)
    if args.gradient_checkpointing:
        run_utils.enable_gradient_checkpointing(reward_model.backbone)
    ref_lm = run_utils.frozen_for_autocast(ref_lm.to(device).eval(), args)  # bf16: linear layers in bf16, same numbers
    return reward_model.to(device), ref_lm.requires_grad_(False)


def simulated_labels(run, accelerator, ref_lm, query_stream: QueryStream, tokenizer, truncate_token_id: int,
                     args: Args) -> dict[str, torch.Tensor]:  # fmt: skip
    """--labels.source sentiment|descriptiveness: label records made here (label_records, labeler_picks) into
    OUTPUT_DIR/labels.json, once: a resumed run reads them, or, stopped while making them, goes on from there; as
    load_labels gives a label file."""
    path, total = run.output_dir / "labels.json", args.labels.num_train + args.labels.simulated_num_test
    if run.checkpoint is None:
        local, chunk = math.ceil(total / args.world_size), max(args.local_rollout_forward_batch_size // NUM_SAMPLES, 1)
        records = []

        def restore(saved: dict) -> None:  # on --resume after a stop here: the labels made so far, then the rest
            records.extend(saved["records"])
            query_stream.load_state(saved["stream"])

        keep = lambda: {"records": records, "stream": query_stream.state()}  # noqa: E731
        for start in run.resumable("labels", range(0, local, chunk), "simulating labels", keep, restore):
            with accelerator.autocast():
                records += label_records(ref_lm, query_stream, tokenizer, truncate_token_id, min(chunk, local - start),
                                         args)  # fmt: skip
        records = labeler_picks(gather_object(records)[:total], args.labels, args.seed)
        if accelerator.is_main_process:
            run_utils.write_text_atomic(path, json.dumps(records))
        run.discard_partial("labels")
    accelerator.wait_for_everyone()
    return load_labels(str(path), tokenizer, args)


def held_out_ids(labels: dict, args: Args, run) -> torch.Tensor:
    """The held-out records' indices: those past --labels.num-train, cut to whole --batch-size batches (none: a
    notice)."""
    num_test = (len(labels["best"]) - args.labels.num_train) // args.batch_size * args.batch_size
    if num_test == 0:
        run.print(
            f"--label-dataset: no records beyond --labels.num-train {args.labels.num_train}: no held-out evaluation"
        )
    return torch.arange(args.labels.num_train, args.labels.num_train + num_test)


def record_step(run, step: int, stats: torch.Tensor, lr: float, step_start: float, model, args: Args) -> dict:
    """The step's metrics row: train/loss and train/accuracy averaged over the micro-batches (`stats`, (micro-batches,
    2)) and the processes, the lr, the time and, with --peak-tflops, MFU (per process: a label's query once and its 4
    samples, 2 FLOPs per trunk parameter and token forward, twice that backward); the run stops, saying where, if the
    loss is not finite."""
    means = {"train/loss": stats[:, 0].mean(), "train/accuracy": stats[:, 1].mean()}
    row = {"step": step, **run_utils.reduce_metrics(run.accelerator, means)}
    run.stop_if_not_finite(row, step, run_utils.first_non_finite(stats, {"micro-batch": len(stats)},
                                                                 run.accelerator.process_index))  # fmt: skip
    seconds = time.perf_counter() - step_start
    row.update({"train/lr": lr, "elapsed/time": run.elapsed(), "time/train_step": seconds,
                "time/peak_memory_gb": run_utils.peak_memory_gb(run.accelerator.device)})  # fmt: skip
    if args.peak_tflops:
        tokens = args.local_batch_size * (args.task.query_length + NUM_SAMPLES * args.task.response_length)
        flops = 6 * run_utils.trunk_parameters(model.backbone) * tokens
        row["time/mfu_train_step"] = run_utils.mfu(flops, seconds, args.peak_tflops)
    return row


def show_samples(run, step: int, row: dict, ref_lm, model, query_stream: QueryStream, tokenizer, args: Args) -> None:
    """The held-out evaluation's line, and a table of new samples of the pretrained policy with the reward model's
    scores (console, TensorBoard, wandb, samples.jsonl)."""
    if "test/loss" in row:
        run.print(f"step {step}: test/loss {row['test/loss']:.4f} accuracy {row['test/accuracy']:.4f}")
    with run.accelerator.autocast():
        query, response, reward = sample_and_score(ref_lm, model, query_stream, SAMPLE_ROWS, args)
    columns = {"query": decode(tokenizer, query), "response": decode(tokenizer, response), "reward": reward.tolist()}
    run.samples("samples.jsonl", step, columns)


def save_reward_model(model: RewardModel, directory: Path, tokenizer, base_model: str, task: TaskHParams) -> None:
    """reward_model/: the backbone in Hugging Face format with its tokenizer, reward_head.safetensors (scalar head,
    gain, bias) and reward_model.json (with whether its queries were in the chat template). Its weights file also holds the whole head as `score.weight` = [gain·w,
    gain·b + bias], shape (1, d + 1), so that AutoModelForSequenceClassification, whose head has no bias and would
    otherwise load a random one, refuses it loudly (a size mismatch) instead of scoring with random weights."""
    head = {name: tensor.cpu() for name, tensor in model.state_dict().items() if not name.startswith("backbone.")}
    gain, bias = head["reward_gain"], head["reward_bias"]
    score = torch.cat([gain * head["scalar_head.weight"], (gain * head["scalar_head.bias"] + bias).reshape(1, 1)], 1)
    model.backbone.save_pretrained(directory, state_dict={**model.backbone.state_dict(), "score.weight": score})
    tokenizer.save_pretrained(directory)
    save_file({name: tensor.contiguous() for name, tensor in head.items()}, directory / "reward_head.safetensors")
    info = dict(base_model=base_model, pad_id=model.pad_id, chat_template=task.chat_template,
                tokenizer_fingerprint=run_utils.tokenizer_fingerprint(tokenizer))  # fmt: skip
    (directory / "reward_model.json").write_text(json.dumps(info, indent=2))


# ---------------------------------------------------------------------------------------------------------------------
# Speed substitutions the shared pipeline calls, copied verbatim into each script (tests/test_shared_helpers.py):
# each computes what its plain form (the comment that opens its body) computes, to float rounding, in less time;
# docs/speed.md has the measurements.
# ---------------------------------------------------------------------------------------------------------------------
def head_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight^T: (N, d) x (V, d) -> (N, V). On a CPU as W @ rows^T copied back to rows, which MKL runs faster
    (docs/speed.md#each-speed-detail-on-its-own)."""
    # plain form: return rows @ weight.T
    return (weight @ rows.T).T.contiguous() if rows.device.type == "cpu" else rows @ weight.T


def draw_tokens(probabilities: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from (B, V) probabilities: (B, 1). By inverse CDF, one uniform per draw: the same
    distribution as torch.multinomial, which draws an exponential per vocabulary entry
    (docs/speed.md#sampling-the-scripts-loop-against-generate)."""
    # plain form: return torch.multinomial(probabilities, 1)
    cdf = probabilities.double().cumsum(-1)  # (B, V)
    uniform = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # (B, 1)
    return torch.searchsorted(cdf, uniform, right=True).clamp_max(cdf.shape[1] - 1)


def fused_gelu(config):
    """The config with GPT-2's "gelu_new" (the tanh GELU, OAI's gelu, written as 8 tensor operations) replaced by
    torch's fused kernel of the same function (docs/speed.md#each-speed-detail-on-its-own)."""
    # plain form: return config
    if getattr(config, "activation_function", None) == "gelu_new":
        config.activation_function = "gelu_pytorch_tanh"
    return config


# ---------------------------------------------------------------------------------------------------------------------
# Numerics and compatibility the shared pipeline calls, in the same verbatim copy: the heads' products in fp32 as
# OAI computed them, and the KV cache's keyword across transformers versions.
# ---------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fp32_products(device_type: str):
    """Inside: matrix products in IEEE fp32, as OAI computed its heads: bf16 autocast off, and TF32 off also where
    --allow-tf32 turned it on for the trunk (restored on leaving). The functions that use it are kept out of
    torch.compile (torch.compiler.disable): a compiled kernel reads the TF32 flag when it runs, not where the code
    set it."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def cache_argument(lm: nn.Module, kv_cache) -> dict:
    """The KV cache as the keyword lm.base_model's forward takes it: newer transformers name it `cache`, older ones
    (those the GPU nodes may have preinstalled) `past_key_values`."""
    # plain form: return {"past_key_values": kv_cache}
    parameters = inspect.signature(lm.base_model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": kv_cache}


# ---------------------------------------------------------------------------------------------------------------------
# The simulated labelers: offline stand-ins for OAI's human labelers (--labels.source, --task.gold-labeler,
# --rewards.function), in the same verbatim copy.
# ---------------------------------------------------------------------------------------------------------------------
def simulated_labeler_scores(labeler: str, texts: list[str]) -> list[float]:
    """Offline stand-ins for OAI's human labelers: `sentiment` = VADER compound score in [-1, 1]; `descriptiveness` =
    share of adjective/adverb tags (textblob's offline PatternTagger) among the words."""
    if labeler == "sentiment":
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        analyzer = SentimentIntensityAnalyzer()
        return [analyzer.polarity_scores(text)["compound"] for text in texts]
    from textblob.en.taggers import PatternTagger

    tagger, scores = PatternTagger(), []
    for text in texts:
        tags = [tag for word, tag in tagger.tag(text) if any(c.isalpha() for c in word)]
        scores.append(sum(tag.startswith(("JJ", "RB")) for tag in tags) / max(len(tags), 1))
    return scores


# ---------------------------------------------------------------------------------------------------------------------
# End of the speed substitutions.
# ---------------------------------------------------------------------------------------------------------------------


if __name__ == "__main__":
    main(run_utils.task_cli(task_defaults))
