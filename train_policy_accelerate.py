"""Fine-tune a language model with PPO against a learned reward model, as OpenAI's lm-human-preferences did.

Reproduces `lm_human_preferences/train_policy.py` (TF1, https://github.com/openai/lm-human-preferences; Ziegler et
al. 2019) with the details of "The N Implementation Details of RLHF with PPO" (Huang, Liu, von Werra, 2023), each
tagged `# detail:` where it is implemented: sample fixed-length responses at temperature 0.7, cut them after a '.'
(or score them -1), reward = reward-model score on the last token minus kl_coef * KL(policy || pretrained) on every
token, whitened rewards, GAE, 4 PPO epochs with clipped policy and value losses, TF-style Adam, and an adaptive KL
coefficient. --task.name tldr / cnndm: OpenAI's summarization tasks (500-token queries, 75-token responses cut after
a newline, a fixed KL coefficient, no reward whitening).

Launch (batch sizes are global: the same flags give the same optimization on any number of processes):
    python train_policy_accelerate.py --rewards.trained-model runs/RM_RUN/reward_model                # 1 GPU
    accelerate launch --num_processes 8 train_policy_accelerate.py --rewards.trained-model DIR         # 8 GPUs
    accelerate launch --num_processes 8 train_policy_accelerate.py --task.name tldr --rewards.trained-model DIR
    python train_policy_accelerate.py --base-model DIR --rewards.trained-model DIR --task.query-dataset corpus.txt \\
        --ppo.total-episodes 64 --ppo.batch-size 16 --ppo.whitening-ranks 1                 # CPU, no Hub: a smoke run

Reading order: from here to the end of `main` is the algorithm, in the blog's order: the config, the pipeline both
scripts share, PPO's own parts, then `main`, whose numbered phases are one update (1-8) and the save (9). Below
`main`: the machine (input checks, loading, the record of each update, the gold evaluation, saving, speed).
Shapes, per process: B rollout rows (episodes), C query tokens, C' context tokens (prefix ⊕ query ⊕ suffix), T
response tokens, V vocabulary, d hidden size, G whitening shares of a minibatch (OpenAI's ranks).
Outputs in --output-dir: args.json, metrics.jsonl (one row per update, and update 0 with --task.gold-labeler),
samples.jsonl, TensorBoard events, policy/ (a Hugging Face causal LM directory with its tokenizer) and, with
--task.gold-labeler, eval_samples.jsonl.
"""

import contextlib
import inspect
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from accelerate.utils import gather_object
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

import rlhf_data
import run_utils


@dataclass
class AdaptiveKLParams:
    target: float = 6.0
    """KL (nats per response) the adaptive controller steers towards"""
    horizon: int = 10000
    """episodes over which the controller closes the gap to the target"""


@dataclass
class RewardHParams:
    trained_model: Annotated[
        Optional[str], tyro.conf.arg(help_behavior_hint="(required unless --rewards.function)")
    ] = None
    """reward model directory written by train_reward_accelerate.py (OUTPUT_DIR/reward_model)"""
    function: Optional[str] = None
    """direct RL: train against a known reward instead of a reward model — `sentiment` or `descriptiveness` (a
    simulated labeler's score of the response), or `module:callable`, called with the decoded queries and responses
    (two lists of str) and returning one number per pair; truncation and the penalty as with a reward model"""
    kl_coef: float = 0.15
    """initial coefficient of the per-token KL penalty, beta"""
    use_adaptive_kl: bool = True
    """adapt kl_coef towards adaptive_kl.target; False keeps it fixed"""
    per_token_kl: bool = True
    """the KL penalty on every token; --rewards.no-per-token-kl puts the response's whole KL on its last token"""
    adaptive_kl: AdaptiveKLParams = field(default_factory=AdaptiveKLParams)


@dataclass
class PpoHParams:
    total_episodes: int = 1_000_000
    """episodes (query + response pairs) to train on; updates = ceil(total_episodes / batch_size)"""
    batch_size: int = 512
    """episodes per PPO update, over all processes"""
    nminibatches: int = 1
    """minibatches per PPO epoch (one optimizer step each)"""
    noptepochs: int = 4
    """PPO epochs over each batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch (memory knob; does not change the math)"""
    lr: float = 1e-5
    """learning rate, annealed linearly to 0 per update"""
    eps: float = 1e-5
    """Adam epsilon"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    cliprange: float = 0.2
    """policy ratio clip range"""
    cliprange_value: float = 0.2
    """value prediction clip range (around the rollout values)"""
    clip_value: bool = True
    """clip the value prediction around the rollout values; --ppo.no-clip-value: the plain squared error"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = True
    """whiten the per-token rewards (without shifting their mean) before GAE"""
    whiten_advantages: bool = True
    """whiten the advantages (mean 0, std 1 per whitening share); --ppo.no-whiten-advantages leaves them as GAE gives"""
    whitening_ranks: int = 8
    """OAI ran on 8 MPI ranks, each shuffling its own share of the batch into minibatches and whitening rewards and
    advantages over its share of a minibatch: the batch is split into this many shares so that every number of
    processes (a divisor of it) computes exactly that; 1: one share, whitened over the whole minibatch"""


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
    scale_logprobs: bool = True
    """compute every log-prob from logits / temperature, as sampled; --task.no-scale-logprobs: from the raw logits"""
    penalty_reward_value: float = -1.0
    """score of a response with no truncate token at index >= truncate_after"""
    rejection_sampling: bool = True
    """truncate responses and score the uncut ones the penalty; --task.no-rejection-sampling: score them as sampled"""
    gold_labeler: Optional[str] = None
    """score held-out samples with a simulated labeler too (eval/gold_score next to eval/rm_score): shows whether the
    policy really improves or exploits the reward model; sentiment, descriptiveness, or a module:callable as
    --rewards.function (an answer check)"""


@dataclass
class Args(run_utils.RunArgs):
    exp_name: str = "train_policy_accelerate"
    """experiment name, the first part of the run name"""
    seed: int = 1
    """global seed: process i samples with seed + i * 100003"""
    base_model: str = "gpt2"
    """pretrained causal LM for the policy and the reference policy: a Hub id or a local directory"""
    zero_value_head: bool = True
    """start the value head at exactly 0; --no-zero-value-head: nn.Linear's default (random) initialization"""
    use_tensorflow_adam: bool = True
    """TF1-style Adam (eps outside the bias correction, as in OAI); --no-use-tensorflow-adam: torch.optim.Adam"""
    local_rollout_forward_batch_size: int = 64
    """rows per rollout generation and scoring forward on one process (memory knob; with more than the local batch
    size, or a multiple of it on every process, the same samples: the draws follow the chunks); the policy's and
    the reference's log-prob forwards take the PPO micro-batch's rows, the shapes of the PPO epochs' forwards"""
    compile: bool = False
    """torch.compile the policy's training forward (PPO epochs): the first update pays the compilation; the same math
    to float rounding (docs/speed.md)"""
    print_sample_output_freq: int = 10
    """print (and save to samples.jsonl) a table of sample responses every this many updates"""
    eval_every: int = 10
    """with --task.gold-labeler: evaluate the held-out queries every this many updates (and at update 0 and the end)"""
    eval_queries: int = 64
    """with --task.gold-labeler: held-out queries (kept out of training)"""
    eval_samples_per_query: int = 4
    """with --task.gold-labeler: responses sampled per held-out query"""
    task: TaskHParams = field(default_factory=TaskHParams)
    rewards: RewardHParams = field(default_factory=RewardHParams)
    ppo: PpoHParams = field(default_factory=PpoHParams)
    local_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """--ppo.batch-size / processes: the rollout's rows on one process (computed in validate_args)"""
    local_mini_batch_size: tyro.conf.Suppress[Optional[int]] = None
    """local_batch_size / --ppo.nminibatches: a minibatch's rows on one process (computed)"""
    local_whitening_ranks: tyro.conf.Suppress[Optional[int]] = None
    """--ppo.whitening-ranks / processes: the whitening shares of one process's rows (computed)"""
    num_updates: tyro.conf.Suppress[Optional[int]] = None
    """ceil(--ppo.total-episodes / --ppo.batch-size): the PPO updates of the run (computed)"""


RANK_SEED_STRIDE = 100003  # process i samples with seed + i * RANK_SEED_STRIDE (a prime, so streams never collide)
KL_ERROR_CLIP = 0.2  # OAI AdaptiveKLController clips the proportional error to +-0.2
MIN_WHITEN_ROWS = 8  # whitening statistics over fewer rows are too noisy (OAI train_policy.py asserts it)
WHITEN_EPSILON = 1e-8  # OAI utils/core.py whiten: rsqrt(var + 1e-8)


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


class AdaptiveKLController:
    """kl_coef *= 1 + clip(KL / target - 1, ±0.2) * n_steps / horizon."""

    # detail: adaptive KL — OAI train_policy.py AdaptiveKLController; fed the KL averaged over all processes (the
    # blog's code used one process's KL)

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
    """The policy LM and a value head sharing its trunk (one model, one optimizer, like OAI)."""

    def __init__(self, lm: nn.Module, zero_init: bool = True):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        # detail: value head initialization — zeros, weight and bias (OAI language/model.py): first values exactly 0
        # (--no-zero-value-head keeps nn.Linear's random init)
        if zero_init:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, query_responses: torch.Tensor, context_length: int, pad_id: int, temperature: float):
        """Logits / temperature and values at the T positions that predict the response: ((B, T, V), (B, T))."""
        hidden = padded_forward(self.lm.base_model, query_responses, pad_id)[:, context_length - 1 : -1]  # (B, T, d)
        return response_logits(self.lm, hidden, temperature, pad_id), self.value_of(hidden)

    @torch.compiler.disable
    def value_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value head's output (..., d) -> (...), in the weights' fp32 also under bf16 autocast and --allow-tf32."""
        with fp32_products(hidden.device.type):  # as OAI's: a bf16 output would keep 3 digits
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def response_logits(lm: nn.Module, hidden: torch.Tensor, temperature: float, pad_id: int) -> torch.Tensor:
    """The LM head's logits at the response positions only, divided by the sampling temperature: (B, T, V)."""
    # detail: logits scaled by the sampling temperature — for the log-probs too (OAI policy.py analyze_responses_op;
    # without it the KL grows too fast; --task.no-scale-logprobs passes temperature 1 here)
    return vocabulary_logits(lm, hidden, pad_id) / temperature  # fp32 also under bf16 autocast, before the division


def lm_logits(lm: nn.Module, query_responses: torch.Tensor, context_length: int, pad_id: int, temperature: float):
    """Logits / temperature of a plain LM (the reference policy) at the response positions: (B, T, V)."""
    hidden = padded_forward(lm.base_model, query_responses, pad_id)[:, context_length - 1 : -1]  # (B, T, d)
    return response_logits(lm, hidden, temperature, pad_id)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False):
    """log p(token) under the logits, (B, T); with_entropy: also the entropy of the full distribution, (B, T)."""
    logits = logits.float()
    # logit - logsumexp, as OAI's (utils/core.py logprobs_from_logits): on a CPU, torch's fp32 log_softmax is less
    # exact over a 50k-token vocabulary (docs/side-by-side.md)
    log_normalizer = logits.logsumexp(-1)  # (B, T)
    logprobs = logits.gather(2, tokens.unsqueeze(-1)).squeeze(-1) - log_normalizer
    if not with_entropy:
        return logprobs
    with torch.no_grad():  # OAI utils/core.py entropy_from_logits: logsumexp - E_p[logits]
        entropy = log_normalizer - ((logits - log_normalizer.unsqueeze(-1)).exp() * logits).sum(-1)
    return logprobs, entropy


@torch.no_grad()
def generate_responses(lm: nn.Module, contexts: torch.Tensor, pad_id: int, response_length: int, temperature: float,
                       chunk: int, samples_per_context: int = 1, stop=None) -> torch.Tensor:  # fmt: skip
    """Responses to the contexts (prefix ⊕ query ⊕ suffix), `chunk` rows at a time: (B, T), B = contexts x
    samples_per_context. With `stop` (--task.stop-when-ended), (B, T' <= T): as long as the longest response of the
    batch, on any process, needs; every row has ended before the columns left out."""
    chunks = contexts.split(max(chunk // samples_per_context, 1))
    drawn = [sample_responses(lm, c, pad_id, response_length, temperature, samples_per_context, stop) for c in chunks]
    if stop is not None:  # one length for the whole batch: a chunk that ended sooner samples on to it (below main)
        drawn = sampled_to_one_length(lm, chunks, drawn, pad_id, temperature, samples_per_context, stop)
    return torch.cat(drawn)


@torch.no_grad()
def rollout_logprobs(policy: PolicyAndValueWrapper, ref_lm, query_responses, context_length: int, pad_id: int,
                     scale: float, chunk: int):  # fmt: skip
    """Log-probs of the responses under the policy and the reference policy, and the values: one forward each over
    query ⊕ response, the policy's the same computation as the PPO epochs' first forward (in chunks of the PPO
    micro-batch: the same shapes run the same kernels), so that their first ratios are exactly 1; the sampling loop's
    KV-cached forwards are another computation (docs/speed.md). `scale` divides the logits (the sampling
    temperature), `chunk` rows a forward: (B, T) each."""
    outputs = []
    for rows in query_responses.split(chunk):
        response = rows[:, context_length:]
        logits, values = policy(rows, context_length, pad_id, scale)
        ref_logits = lm_logits(ref_lm, rows, context_length, pad_id, scale)
        outputs.append([logprobs_from_logits(logits, response), logprobs_from_logits(ref_logits, response), values])
    return [torch.cat(tensors).float() for tensors in zip(*outputs, strict=True)]


@torch.no_grad()
def score_responses(reward_model: RewardModel, queries, responses, truncate_token_id: int, task: TaskHParams,
                    chunk: int, fields: dict):  # fmt: skip
    """Post-processed responses and their scores: the reward model reads the bare query ⊕ the truncated response, and
    a response never cut scores --task.penalty-reward-value instead (OAI train_policy.py make_score_fn): (B, T), (B,).
    --task.no-rejection-sampling switches that detail off: every response is scored whole, none is penalized.
    `fields`: the dataset's fields of each query, which a --rewards.function may ask for (a reward model reads none)."""
    postprocessed, has_cut = truncate_responses(responses, truncate_token_id, task.truncate_after, reward_model.pad_id)
    if not task.rejection_sampling:
        postprocessed, has_cut = responses, torch.ones_like(has_cut)
    fields = fields if isinstance(reward_model, RewardFunction) else {}
    scores = [reward_model(queries[i : i + chunk], postprocessed[i : i + chunk],
                           **{name: values[i : i + chunk] for name, values in fields.items()})
              for i in range(0, len(queries), chunk)]  # fmt: skip
    scores = torch.cat(scores).float()
    return postprocessed, torch.where(has_cut, scores, torch.full_like(scores, task.penalty_reward_value))


def compute_rewards(scores, logprobs, ref_logprobs, kl_coef: float, per_token: bool = True):
    """Per-token rewards and their KL part: (non_score_reward, rewards), (B, T) each."""
    # detail: per-token KL penalty — -kl_coef * (logprobs - ref_logprobs) on every token, plus the score on the last
    # token T-1, always the last, even when the response was truncated earlier (OAI train_policy.py compute_rewards);
    # --rewards.no-per-token-kl: the same total penalty, all of it on the last token
    kl = logprobs - ref_logprobs
    non_score_reward = -kl_coef * kl
    if not per_token:
        non_score_reward = F.pad(non_score_reward.sum(1, keepdim=True), (kl.shape[1] - 1, 0))  # (B, T): 0, ..., total
    rewards = non_score_reward.clone()
    rewards[:, -1] += scores
    return non_score_reward, rewards


def kl_estimates(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token estimators of KL(policy || reference) from the policy's own samples (Schulman, "Approximating KL
    divergence"), (B, T) each: k1 = log p / p_ref (OAI's, the penalty's), k2 = ½ (log p_ref / p)², k3 = p_ref / p - 1 -
    log p_ref / p. The penalty above uses k1; k2 or k3 in its place is a change of this one line there."""
    log_ratio = ref_logprobs - logprobs  # log(p_ref / p) of each sampled token
    return {"k1": -log_ratio, "k2": 0.5 * log_ratio**2, "k3": log_ratio.exp() - 1 - log_ratio}


def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """OAI's whiten (utils/core.py) over the last two dimensions (rows × tokens) of `values`, so a (G, rows, T) tensor
    is whitened per group: biased variance like tf.nn.moments, mean added back if not shift_mean."""
    mean = values.mean((-2, -1), keepdim=True)
    var = values.var((-2, -1), unbiased=False, keepdim=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPSILON)
    return whitened + mean if not shift_mean else whitened


def compute_advantages(rewards: torch.Tensor, values: torch.Tensor, ppo: PpoHParams):
    """Whitened rewards → GAE → returns and whitened advantages, over each whitening share of a minibatch: rewards and
    values (G, rows, T), or (rows, T) for one share; returns (advantages, returns) of the same shape. GAE with
    bootstrap value 0 after the last token: δ_t = r_t + γ V_{t+1} - V_t, A_t = δ_t + γ λ A_{t+1}."""
    # detail: per-minibatch reward and advantage whitening — rewards with shift_mean=False, advantages with
    # shift_mean=True, over what one OAI rank held of a minibatch (OAI train_policy.py PPOTrainer.loss);
    # --ppo.no-whiten-rewards, --ppo.no-whiten-advantages switch each off
    # detail: discount factor 1 — γ = --ppo.gamma = 1 by default (OAI train_policy.py PpoHParams)
    if ppo.whiten_rewards:
        rewards = whiten(rewards, shift_mean=False)
    last_advantage, advantages, length = 0.0, [], rewards.shape[-1]
    for t in reversed(range(length)):
        next_value = values[..., t + 1] if t + 1 < length else 0.0
        delta = rewards[..., t] + ppo.gamma * next_value - values[..., t]
        last_advantage = delta + ppo.gamma * ppo.lam * last_advantage
        advantages.append(last_advantage)
    advantages = torch.stack(advantages[::-1], -1)
    returns = advantages + values
    return (whiten(advantages) if ppo.whiten_advantages else advantages), returns


def ppo_losses(new_logprobs, vpred, logprobs, values, advantages, returns, ppo: PpoHParams):
    """Clipped policy and value losses, means over all B×T tokens (OAI: no response mask), and their statistics."""
    # detail: clipped value function — the value prediction may move at most cliprange_value from the rollout value,
    # the larger of the two squared errors counts (OAI train_policy.py PPOTrainer.loss, as baselines' ppo2);
    # --ppo.no-clip-value: the plain squared error
    vpred_clipped = values + torch.clamp(vpred - values, -ppo.cliprange_value, ppo.cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * (torch.max(vf_losses1, vf_losses2) if ppo.clip_value else vf_losses1).mean()
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
            "ppo/policy/ratio_max_deviation": (ratio - 1).abs().max(),
            "ppo/policy/clipfrac": (pg_losses2 > pg_losses1).float().mean(),  # OAI: where the clipped term wins
            "ppo/val/vpred": vpred.mean(),
            "ppo/val/error": ((vpred - returns) ** 2).mean(),
            "ppo/val/clipfrac": (vf_losses2 > vf_losses1).float().mean(),
        }
    return loss, stats


def minibatches(batch_size: int, shares: int, nminibatches: int, device) -> tuple[torch.Tensor, ...]:
    """One epoch's minibatches of row indices, (shares, rows) each: the batch is split into whitening shares (OAI's
    ranks: see --ppo.whitening-ranks), and each share shuffles its own rows into the minibatches, as each OAI rank did."""
    rows = torch.arange(batch_size, device=device).view(shares, -1)  # (G, B/G)
    order = torch.stack([share[torch.randperm(share.numel(), device=device)] for share in rows])
    return order.chunk(nminibatches, dim=1)


def main(args: Args) -> None:
    args = validate_args(args)  # derived sizes, flag checks (this and the other named tooling: below main)
    tokenizer, texts = read_inputs(args)  # checked before any model loads
    if args.dry_run:
        return run_utils.print_dry_run(args, DRY_RUN_SIZES)
    task, ppo, pad_id, chunk = args.task, args.ppo, tokenizer.pad_token_id, args.local_rollout_forward_batch_size
    truncate_token_id = rlhf_data.truncate_token_id(tokenizer, task)  # '.', '\n' (tldr), <|im_end|> (chat)
    stop = (truncate_token_id, task.truncate_after) if task.stop_when_ended else None  # OAI: a fixed length
    scale = task.temperature if task.scale_logprobs else 1.0  # the log-probs' logits are divided by it
    accelerator = run_utils.make_accelerator(args, ppo.gradient_accumulation_steps)
    run = run_utils.Run(args, accelerator, "policy", RESUME_MAY_CHANGE, step_name="update")  # files, resume, signals
    if run.finished:
        return
    device = run_utils.setup_device(accelerator, args)
    policy, ref_lm, reward_model = load_models(args, tokenizer, device)
    optimizer = make_optimizer(policy.parameters(), ppo.lr, ppo.eps, args.use_tensorflow_adam)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    unwrapped = accelerator.unwrap_model(policy)
    train_forward = torch.compile(policy) if args.compile else policy  # fixed shapes: compiled once
    # detail: different seeds for different processes — seed + rank * 100003 (OAI utils/core.py set_mpi_seed)
    torch.manual_seed(args.seed + accelerator.process_index * RANK_SEED_STRIDE)
    gold = GoldEvaluation(args, texts, tokenizer, scale)  # --task.gold-labeler: held-out queries (else no-ops)
    stream = QueryStream(
        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes, gold.texts
    )
    kl_ctl = FixedKLController(args.rewards.kl_coef)
    if args.rewards.use_adaptive_kl:
        kl_ctl = AdaptiveKLController(args.rewards.kl_coef, **vars(args.rewards.adaptive_kl))
    state = run.resume()  # on --resume: the newest checkpoint's model, optimizer and RNG states; None when fresh
    if state is not None:
        stream.load_state(state["process"]["stream"])
        kl_ctl.value = state["kl_coef"]
    gold.start(run, accelerator, (unwrapped, ref_lm, reward_model), state)  # update 0, the "before" point
    for update in run.progress(range(run.start_step + 1, args.num_updates + 1), "PPO"):
        timer = run_utils.PhaseTimer(device)
        lr = linear_lr(ppo.lr, update - 1, args.num_updates)  # per update, constant within it
        for group in optimizer.param_groups:
            group["lr"] = lr
        kl_coef = kl_ctl.value  # the rewards of this update use the coefficient from before its KL update
        queries, fields = stream.next_batch(args.local_batch_size, device)  # (B, C) and their dataset fields
        contexts = stream.format(queries)  # (B, C'): prefix ⊕ query ⊕ suffix, what the policy reads (C' = C: books)
        with accelerator.autocast():  # a no-op unless --mixed-precision bf16
            # 1. rollout: sample responses, then the log-probs of the policy and of the reference policy and the
            # values, from one forward each over query ⊕ response
            responses = generate_responses(
                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk, stop=stop
            )
            timer("time/generation")
            query_responses = torch.cat([contexts, responses], 1)  # (B, C' + T)
            logprobs, ref_logprobs, values = rollout_logprobs(
                unwrapped, ref_lm, query_responses, contexts.shape[1], pad_id, scale, args.micro_batch_size
            )
            timer("time/logprobs")
            # 2. post-process responses and score them: truncation after the truncate token, and the penalty score
            # for a response without one after truncate_after
            postprocessed_responses, scores = score_responses(
                reward_model, queries, responses, truncate_token_id, task, chunk, fields
            )
        timer("time/scoring")
        # 3. per-token KL rewards, the score added on the last token
        non_score_reward, rewards = compute_rewards(scores, logprobs, ref_logprobs, kl_coef, args.rewards.per_token_kl)
        # 4. PPO epochs; in each minibatch: whiten the rewards, GAE, whiten the advantages, clipped losses, one step
        # detail: batches and minibatches — a fresh shuffle every epoch, one optimizer step per minibatch, its
        # micro-batches only accumulate gradients (OAI train_policy.py PPOTrainer.train)
        stats = {}
        policy.train()  # dropout is 0 everywhere; train mode only lets --gradient-checkpointing recompute
        for _ in range(ppo.noptepochs):
            for share_rows in minibatches(args.local_batch_size, args.local_whitening_ranks, ppo.nminibatches, device):
                # (G, rows) row ids: whitening and GAE per share of the minibatch, as each of OAI's ranks did
                advantages, returns = compute_advantages(rewards[share_rows], values[share_rows], ppo)  # (G, rows, T)
                append_stats(stats, share_moments(returns, values[share_rows]))
                pieces = (share_rows.flatten(), advantages.flatten(0, 1), returns.flatten(0, 1))  # the minibatch's rows
                for ids, mb_advantage, mb_return in zip(*(x.split(args.micro_batch_size) for x in pieces), strict=True):
                    with accelerator.accumulate(policy):
                        logits, vpred = train_forward(query_responses[ids], contexts.shape[1], pad_id, scale)
                        new_logprobs, entropy = logprobs_from_logits(logits, responses[ids], with_entropy=True)
                        loss, micro_stats = ppo_losses(
                            new_logprobs, vpred.float(), logprobs[ids], values[ids], mb_advantage, mb_return, ppo
                        )
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                    append_stats(stats, {**micro_stats, "ppo/policy/entropy": entropy.mean()})
        policy.eval()
        timer("time/ppo_epochs")
        # 5. statistics: every metric averaged over all micro-batches and processes in one collective, OAI's names
        rollout = dict(queries=queries, contexts=contexts, responses=postprocessed_responses, scores=scores)
        rollout.update(logprobs=logprobs, ref_logprobs=ref_logprobs, non_score_reward=non_score_reward)
        row = record_update(
            run, update, stats, rollout, timer, args, kl_coef=kl_coef, lr=lr, policy=unwrapped, tokenizer=tokenizer
        )
        # 6. adaptive KL: kl_coef moves towards the KL target, from this update's KL averaged over all processes
        kl_ctl.update(row["objective/kl"], ppo.batch_size)
        # 7. log: the metrics, with every --eval-every updates the gold evaluation of the held-out queries
        run.log({**row, **gold.evaluate_if_due(update)}, update)
        # 8. checkpoint: every --checkpoint-every updates, and on SIGTERM / Ctrl-C, after which the run stops
        shared_state = {"kl_coef": kl_ctl.value, **gold.state()}
        run.checkpoint_if_due(update, state=shared_state, process_state={"stream": stream.state()})
    gold.summary()
    # 9. save
    run.save_result(lambda directory: save_policy(unwrapped, directory, args.base_model))
    run.close()


# =====================================================================================================================
# Below: not the algorithm. The machine around it: the tasks' defaults, input checks, loading, the record of each
# update, the gold evaluation, saving, and the speed substitutions the pipeline calls.
# =====================================================================================================================
EVAL_SEED = 1234  # held-out evaluation samples with its own RNG, identical at every evaluation (paired comparison)
SAMPLE_ROWS = 4  # rows of the sample table printed to the console
DRY_RUN_SIZES = ("world_size", "local_batch_size", "local_mini_batch_size", "micro_batch_size", "num_updates")
RESUME_MAY_CHANGE = {"local_batch_size", "local_mini_batch_size", "micro_batch_size", "local_whitening_ranks"}
"""Per-process sizes a resumed run may recompute (the checkpoint's number of processes is checked instead)."""
LABELER_PACKAGES = {"sentiment": "vaderSentiment", "descriptiveness": "textblob"}
"""each simulated labeler's package (its import name is its pip name): checked before any model loads"""
POLICY_FLAG_RANGES = {
    **dict.fromkeys(("ppo.total_episodes", "ppo.batch_size", "ppo.nminibatches", "ppo.noptepochs",
                     "ppo.gradient_accumulation_steps", "ppo.whitening_ranks", "rewards.adaptive_kl.horizon",
                     "local_rollout_forward_batch_size", "print_sample_output_freq", "eval_every", "eval_queries",
                     "eval_samples_per_query"), run_utils.COUNT),
    # Adam's lr and epsilon (eps 0 divides 0 by 0 on a zero gradient), the PPO clip ranges (0 leaves no step to
    # take), the adaptive KL target (the controller divides by it)
    **dict.fromkeys(("ppo.lr", "ppo.eps", "ppo.cliprange", "ppo.cliprange_value", "rewards.adaptive_kl.target"),
                    run_utils.POSITIVE),
    # a negative KL coefficient would reward moving away from the reference; a negative value-loss one, a worse value
    "rewards.kl_coef": run_utils.NON_NEGATIVE, "ppo.vf_coef": run_utils.NON_NEGATIVE,
    "ppo.gamma": run_utils.UNIT_INTERVAL, "ppo.lam": run_utils.UNIT_INTERVAL,  # GAE: 0 (one-step TD) to 1 (Monte Carlo)
    "task.penalty_reward_value": run_utils.FINITE,
}  # fmt: skip
"""The range of every numeric flag of this script; run_utils.RUN_RANGES and TASK_RANGES hold those both share."""


# OAI's tldr and cnndm (launch.py summarize_tldr_task, summarize_cnndm_task, get_experiments) where they differ from
# books_task, whose values are the fields' defaults: `--task.name X` makes TASK_OVERRIDES[X] the defaults (flags given
# still win). OAI's cnndm end_text was '\n', but Hub `cnn_dailymail` joins an article's paragraphs with spaces.
TLDR_OVERRIDES = {"task.query_dataset": "webis/tldr-17", "task.query_field": "content", "task.passage_rows": 1,
                  "task.query_length": 500, "task.response_length": 75, "task.query_suffix": "\n\nTL;DR:",
                  "task.start_text": "", "task.end_text": "", "task.truncate_token": "\n", "task.truncate_after": 55,
                  "ppo.batch_size": 32, "ppo.lr": 2e-6, "ppo.whiten_rewards": False, "rewards.kl_coef": 0.03,
                  "rewards.use_adaptive_kl": False}  # fmt: skip
TASK_OVERRIDES = {
    "sentiment": {},
    "descriptiveness": {},
    "tldr": TLDR_OVERRIDES,
    "cnndm": {**TLDR_OVERRIDES, "task.query_dataset": "abisee/cnn_dailymail", "task.query_dataset_config": "3.0.0",
              "task.query_field": "article", "task.query_prefix": "Article:\n\n", "task.temperature": 0.5,
              "rewards.kl_coef": 0.01},
}  # fmt: skip


def task_defaults(name: Optional[str] = None) -> Args:
    """Args at OAI's defaults for task `name`: the fields' own (books_task's) with TASK_OVERRIDES[name] on top; a
    name that is no task (or None) keeps the fields' own, and tyro rejects it."""
    overrides = {"task.name": name, **TASK_OVERRIDES[name]} if name in TASK_OVERRIDES else {}
    return run_utils.replace_fields(Args(), overrides)


def validate_args(args: Args) -> Args:
    """Derive every per-process size in one place and reject inconsistent flags before anything is loaded."""
    run_utils.check_run_args(args, POLICY_FLAG_RANGES)
    if (args.rewards.trained_model is None) == (args.rewards.function is None):
        run_utils.fail("give one of --rewards.trained-model (a reward model directory) and --rewards.function")
    ppo, processes = args.ppo, args.world_size
    if ppo.total_episodes < ppo.batch_size:
        run_utils.fail(f"--ppo.total-episodes {ppo.total_episodes} is less than one update of --ppo.batch-size "
                       f"{ppo.batch_size}")  # fmt: skip
    args.local_batch_size = run_utils.exact_div(ppo.batch_size, processes, "--ppo.batch-size / number of processes")
    args.local_mini_batch_size = run_utils.exact_div(
        args.local_batch_size, ppo.nminibatches, "--ppo.batch-size / (processes * --ppo.nminibatches)"
    )
    args.micro_batch_size = run_utils.exact_div(
        args.local_mini_batch_size, ppo.gradient_accumulation_steps,
        "--ppo.batch-size / (processes * --ppo.nminibatches * --ppo.gradient-accumulation-steps)",
    )  # fmt: skip
    if args.compile and args.gradient_checkpointing and processes > 1:
        run_utils.fail(
            "--compile with --gradient-checkpointing on several processes: DDP's graph splitting for "
            "compiled models does not handle activation checkpoints (pytorch#104674): drop one of them"
        )
    if ppo.whitening_ranks % processes:
        run_utils.fail(f"--ppo.whitening-ranks {ppo.whitening_ranks} must be a multiple of the {processes} processes")
    args.local_whitening_ranks = ppo.whitening_ranks // processes
    share = run_utils.exact_div(ppo.batch_size, ppo.whitening_ranks * ppo.nminibatches,
                                "--ppo.batch-size / (--ppo.whitening-ranks * --ppo.nminibatches)")  # fmt: skip
    if ppo.whiten_rewards and share < MIN_WHITEN_ROWS:
        run_utils.fail(f"--ppo.whiten-rewards needs >= {MIN_WHITEN_ROWS} rows per whitening share of a minibatch, got "
                       f"{share}: raise --ppo.batch-size or lower --ppo.whitening-ranks / --ppo.nminibatches")  # fmt: skip
    if not 0 <= args.task.truncate_after < args.task.response_length:
        run_utils.fail("--task.truncate-after must be >= 0 and < --task.response-length")
    if args.task.gold_labeler in LABELER_PACKAGES:  # a module:callable is imported with the other inputs
        package = LABELER_PACKAGES[args.task.gold_labeler]
        run_utils.require_package(package, package, f"--task.gold-labeler {args.task.gold_labeler}")
    run_utils.check_chat_task(args.task)
    args.num_updates = math.ceil(ppo.total_episodes / ppo.batch_size)
    return args


def read_inputs(args: Args):
    """What the run reads, checked before any model loads or anything is written: --output-dir, the services of
    --track / --upload-model, the reward model directory by its files' content (and that it reads tokens as the
    policy writes them) or --rewards.function (it imports, and scores a probe pair), the base model (its tokenizer and config, a causal LM, its
    weight files, positions for the longest sequence), the query texts (they must yield queries, and leave some to
    train on beside --eval-queries). Returns (tokenizer, query texts). A --dry-run fetches nothing from the Hub: it
    checks every local input and lists what it could not check (None for it)."""
    task, dry_run = args.task, args.dry_run
    run_utils.check_services(args)
    run_utils.check_output_dir(args, "policy", RESUME_MAY_CHANGE)
    tokenizer = texts = None
    if run_utils.available(args.base_model, "--base-model", dry_run):
        with run_utils.flag_errors("--base-model", args.base_model, "cannot load a tokenizer and model config"):
            tokenizer, config = load_tokenizer(args.base_model), config_without_dropout(args.base_model)
        run_utils.check_base_model(args, tokenizer, config)
        rlhf_data.truncate_token_id(tokenizer, task)
    else:
        vocabulary = "--rewards.trained-model's vocabulary, " if args.rewards.function is None else ""
        run_utils.NOT_CHECKED.append(f"what needs --base-model's tokenizer: --task.truncate-token, the lengths against "
                                     f"the models' positions, {vocabulary}that the query texts yield queries")  # fmt: skip
    if run_utils.available(task.query_dataset, "--task.query-dataset", dry_run):
        texts = rlhf_data.QueryTexts.of_task(task)
    if args.rewards.function is None:
        check_reward_model(args.rewards.trained_model, tokenizer, task)
    else:
        check_reward_function(args.rewards.function, "--rewards.function", texts)
    if task.gold_labeler is not None:
        check_reward_function(task.gold_labeler, "--task.gold-labeler", texts)
    if texts is not None and tokenizer is not None:
        check_queries(texts, tokenizer, args)
    return tokenizer, texts


def check_queries(texts, tokenizer, args: Args) -> None:
    """The query texts yield a query, and with --task.gold-labeler, the held-out queries leave texts to train on."""
    held_out = frozenset()
    if args.task.gold_labeler is not None:
        stream = QueryStream(texts, tokenizer, args.task, tokenizer.pad_token_id, EVAL_SEED, chunk=args.eval_queries)
        stream.next_batch(args.eval_queries)  # as held_out_queries draws them
        if stream.epoch or stream.used >= len(texts):  # it read every text: the training stream would find none
            run_utils.fail(f"--eval-queries {args.eval_queries}: the held-out queries take all {len(texts)} texts of "
                           "--task.query-dataset, leaving none to train on; lower --eval-queries")  # fmt: skip
        held_out = held_out_queries(texts, tokenizer, args.task, args.eval_queries)[3]
    QueryStream(texts, tokenizer, args.task, tokenizer.pad_token_id, args.seed, exclude=held_out).next_batch(1)


def check_reward_model(directory: str, tokenizer=None, task: Optional[TaskHParams] = None) -> None:
    """The reward_model/ directory of train_reward_accelerate.py, checked before any model loads: its files by their
    content (reward_model.json, config.json, the weight files' headers, a scalar head of the backbone's width);
    with the base model's tokenizer, that it reads tokens exactly as the policy writes them (the vocabulary's
    fingerprint) and, with the task, has positions for query ⊕ response."""
    flag, path = "--rewards.trained-model", Path(directory)
    if not path.is_dir():
        run_utils.fail(f"{flag} {directory!r}: {'a file, not a directory' if path.exists() else 'no such directory'}")
    if not (path / "reward_model.json").is_file() or not (path / "reward_head.safetensors").is_file():
        inside = f"; {path / 'reward_model'} is one" if (path / "reward_model").is_dir() else ""
        run_utils.fail(f"{flag} {directory!r}: not a reward model directory (no reward_model.json, "
                       f"reward_head.safetensors){inside}")  # fmt: skip
    with run_utils.flag_errors(flag, directory, "cannot read its reward_model.json"):
        info = json.loads((path / "reward_model.json").read_text())
    if not isinstance(info, dict) or not isinstance(info.get("pad_id"), int):
        run_utils.fail(f"{flag} {directory!r}: its reward_model.json has no integer pad_id")
    with run_utils.flag_errors(flag, directory, "cannot read its config.json"):
        config = AutoConfig.from_pretrained(directory)
    run_utils.check_weights_fit(directory, flag, config, causal_lm=False)  # the backbone's
    shapes = run_utils.safetensors_shapes(path / "reward_head.safetensors", flag, directory)
    head = {"scalar_head.weight": [1, config.hidden_size], "scalar_head.bias": [1], "reward_gain": [],
            "reward_bias": []}  # fmt: skip
    if shapes != head:
        run_utils.fail(f"{flag} {directory!r}: reward_head.safetensors holds {shapes}, not a scalar head of the "
                       f"backbone's width {config.hidden_size} ({head})")  # fmt: skip
    if task is not None and info.get("chat_template", False) != task.chat_template:
        run_utils.fail(f"{flag} {directory!r} was trained on queries {'in' if info.get('chat_template') else 'without'} "
                       f"a chat template: {'add' if info.get('chat_template') else 'leave out'} --task.chat-template")  # fmt: skip
    if tokenizer is not None and info.get("tokenizer_fingerprint") != run_utils.tokenizer_fingerprint(tokenizer):
        run_utils.fail(
            f"{flag} {directory!r} was trained with another tokenizer/vocabulary ({info.get('base_model')}) "
            "than --base-model"
        )
    if task is not None:  # it reads the bare query ⊕ response
        run_utils.check_positions(config, flag, directory, {"--task.query-length": task.query_length,
                                                            "--task.response-length": task.response_length})  # fmt: skip


def load_models(args: Args, tokenizer, device) -> tuple[PolicyAndValueWrapper, nn.Module, nn.Module]:
    """The policy (the base model with a value head), the frozen reference policy (the same base model) and the
    frozen reward model (or --rewards.function); the last two on `device` (accelerator.prepare places the policy)."""
    torch.manual_seed(args.seed)  # the value head's init: random only with --no-zero-value-head
    with run_utils.flag_errors("--base-model", args.base_model, "cannot load its weights"):
        policy = PolicyAndValueWrapper(load_pretrained(AutoModelForCausalLM, args.base_model), args.zero_value_head)
        ref_lm = load_pretrained(AutoModelForCausalLM, args.base_model).to(device).eval()
        run_utils.frozen_for_autocast(ref_lm, args)  # bf16: its linear layers stored in bf16, the same numbers
    if args.rewards.function is not None:
        reward_model = RewardFunction(args.rewards.function, tokenizer)
    else:
        with run_utils.flag_errors("--rewards.trained-model", args.rewards.trained_model, "cannot load its weights"):
            reward_model = load_reward_model(args.rewards.trained_model).to(device).eval()
            run_utils.frozen_for_autocast(reward_model.backbone, args)
    if args.gradient_checkpointing:
        run_utils.enable_gradient_checkpointing(policy.lm)
    return policy, ref_lm.requires_grad_(False), reward_model.requires_grad_(False)


def load_reward_model(directory: str) -> RewardModel:
    """The reward model of a reward_model/ directory: backbone, scalar head, gain and bias (also for scoring texts
    outside training: see the README)."""
    info = json.loads(Path(directory, "reward_model.json").read_text())
    with run_utils.quiet_load_report():  # its weights file also holds `score.weight`, which AutoModel does not use
        model = RewardModel(load_pretrained(AutoModel, directory), info["pad_id"])
    missing, unexpected = model.load_state_dict(load_file(Path(directory, "reward_head.safetensors")), strict=False)
    assert not unexpected and all(key.startswith("backbone.") for key in missing), (missing, unexpected)
    return model


class RewardFunction(nn.Module):
    """--rewards.function: a known reward in place of a trained reward model (the paper's direct RL against its mock
    sentiment reward, or a check of each answer): scores of the decoded queries and responses, given also the
    dataset's fields the function asks for (`answer=[...]`, a value per response), as a reward model's (B,) in
    float32."""

    def __init__(self, spec: str, tokenizer):
        super().__init__()
        self.spec, self.tokenizer, self.pad_id = spec, tokenizer, tokenizer.pad_token_id
        self.function = reward_callable(spec, "--rewards.function")

    def forward(self, queries: torch.Tensor, responses: torch.Tensor, **fields) -> torch.Tensor:
        texts = decode(self.tokenizer, queries), decode(self.tokenizer, responses)
        scores = call_with_fields(self.function, *texts, fields)
        return function_scores(f"--rewards.function {self.spec}", scores, len(responses), responses.device)


def function_scores(option: str, scores, n: int, device, dtype=torch.float32) -> torch.Tensor:
    """What a reward function (`option`: its flag and value) returned for n pairs as (n,) scores on `device`, or one
    line naming the flag."""
    try:
        scores = torch.as_tensor(np.asarray(scores, dtype=np.float64), device=device).to(dtype)
    except (TypeError, ValueError) as error:
        run_utils.fail(f"{option}: returned scores that are not numbers ({error})")
    if scores.shape != (n,):
        run_utils.fail(f"{option}: returned {tuple(scores.shape)} scores for {n} responses")
    if not torch.isfinite(scores).all():  # (N48) here, not as non-finite metrics after an update
        run_utils.fail(f"{option}: returned a score that is not a finite number ({scores[~torch.isfinite(scores)][0]})")
    return scores


def reward_callable(spec: str, flag: str):
    """A reward function's callable (--rewards.function, --task.gold-labeler): a simulated labeler's score of the
    responses, or `module:callable` imported."""
    if spec in LABELER_PACKAGES:
        package = LABELER_PACKAGES[spec]
        run_utils.require_package(package, package, f"{flag} {spec}")
        return lambda queries, responses: simulated_labeler_scores(spec, responses)
    return run_utils.import_callable(spec, flag)


def function_fields(function, columns: list[str], option: str) -> tuple[str, ...]:
    """The dataset columns a reward function takes, as TRL's reward functions take them: after (queries, responses),
    each keyword parameter it names (one with a default only where the dataset has it), and every column when it takes
    **kwargs. A function that cannot take two positional arguments: one line naming `option`."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: it gets the two lists
        return ()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
        run_utils.fail(f"{option}: takes {len(positional)} positional argument(s); a reward function takes (queries, "
                       "responses), two lists of str, and the dataset's columns it names as keywords")  # fmt: skip
    named = [p for p in positional[2:] if p.kind is p.POSITIONAL_OR_KEYWORD] + [
        p for p in parameters if p.kind is p.KEYWORD_ONLY
    ]
    required = [p.name for p in named if p.default is p.empty]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return tuple(dict.fromkeys(required + list(columns)))
    return tuple(required + [p.name for p in named if p.default is not p.empty and p.name in columns])


def call_with_fields(function, queries: list[str], responses: list[str], fields: dict[str, list]):
    """function(queries, responses, **the fields it takes of `fields`)."""
    return function(queries, responses, **{name: fields[name] for name in function_fields(function, list(fields), "")})


def check_reward_function(spec: str, flag: str, texts) -> None:
    """A reward function (--rewards.function, --task.gold-labeler), checked before any model loads: it imports, the
    query dataset has the columns it asks for (which the query stream then carries with each text), and it scores two
    probe pairs, the first texts with their fields, as one finite number each."""
    function, option = reward_callable(spec, flag), f"{flag} {spec}"
    names = function_fields(function, [] if texts is None else texts.columns, option)
    if texts is None and names:  # a --dry-run of a Hub dataset: its columns are not known yet
        run_utils.NOT_CHECKED.append(f"the dataset columns {option} asks for, and a probe of it")
        return
    if texts is not None:
        texts.carry(names, option)
    rows = [0, 1] if texts is not None and len(texts) > 1 else [0, 0]  # two pairs: one score each (N49)
    probe = {name: values for name, values in texts.fields(rows).items() if name in names} if names else {}
    queries = [texts[row] for row in rows] if texts is not None else ["A probe query."] * 2  # with their own fields
    responses = ["A probe response.", "Another probe response."]
    function_scores(option, call_with_fields(function, queries, responses, probe), 2, "cpu")


def append_stats(stats: dict, new: dict) -> None:
    """Each of `new`'s metrics appended to its list in `stats` (one value per micro-batch or minibatch)."""
    for key, value in new.items():
        stats.setdefault(key, []).append(value)


def share_moments(returns: torch.Tensor, values: torch.Tensor) -> dict:
    """Mean and (biased) variance of the returns and values of each whitening share of a minibatch, averaged over the
    shares: OAI's per-rank-minibatch `ppo/returns/*` and `ppo/val/{mean,var}` (exact also with gradient accumulation)."""
    stats = {}
    for key, x in (("ppo/returns", returns), ("ppo/val", values)):  # (G, rows, T)
        stats[f"{key}/mean"], stats[f"{key}/var"] = x.mean(), x.var((1, 2), unbiased=False).mean()
    return stats


def record_update(run, update: int, stats: dict, rollout: dict, timer, args: Args, *, kl_coef: float, lr: float,
                  policy: PolicyAndValueWrapper, tokenizer) -> dict:  # fmt: skip
    """The update's metrics row (OAI train_policy.py record_step_stats): the rollout's objective/* (the KL also by
    the k2 and k3 estimators, as metrics only), the PPO epochs' ppo/* averaged over every micro-batch (approxkl's
    largest too, and the first minibatch's largest |ratio - 1|), all averaged over the processes in one collective;
    the time and throughput. The run stops, saying where, if a loss is not finite. Every --print-sample-output-freq
    updates (and the first and last) a table of samples and a progress line; at the last update, the processes'
    parameter spread."""
    accelerator, ppo = run.accelerator, args.ppo
    estimates = kl_estimates(rollout["logprobs"], rollout["ref_logprobs"])  # (B, T) each
    kl = {key: value.sum(1) for key, value in estimates.items()}  # (B,): per response
    non_score_reward, scores = rollout["non_score_reward"].sum(1), rollout["scores"]
    rollout_stats = {
        "objective/kl": kl["k1"].mean(),  # OAI's: the KL the penalty uses
        "objective/kl_k2": kl["k2"].mean(),
        "objective/kl_k3": kl["k3"].mean(),
        "objective/entropy": (-rollout["logprobs"]).sum(1).mean(),
        "objective/non_score_reward": non_score_reward.mean(),
        "objective/scores": scores.mean(),
        "objective/score_total": (scores + non_score_reward).mean(),
    }
    deviations = stats["ppo/policy/ratio_max_deviation"]  # max |ratio - 1| of each micro-batch, in the order they ran
    ppo_stats = {key: torch.stack(items).mean() for key, items in stats.items() if items is not deviations}
    # approxkl of each minibatch (the mean of its micro-batches, then of the processes), for the largest of them: a
    # micro-batch is a process's share of a minibatch, so its own largest would change with the number of processes
    minibatches = torch.stack(stats["ppo/policy/approxkl"]).view(-1, ppo.gradient_accumulation_steps).mean(1)
    each = {f"minibatch/{i}/approxkl": value for i, value in enumerate(minibatches)}
    # the first minibatch's micro-batches run before any optimizer step: every ratio there is exactly 1 when the PPO
    # forward computes what the rollout computed (rollout_logprobs); a new device or --compile shows here if it does not
    first = {"ppo/policy/first_ratio_max_deviation": torch.stack(deviations[: ppo.gradient_accumulation_steps]).max()}
    row = run_utils.reduce_metrics(
        accelerator, {**rollout_stats, **ppo_stats, **each}, {"sync/kl_coef_spread": kl_coef}, first
    )
    row["ppo/policy/approxkl_max"] = max(row.pop(key) for key in each)
    loop = {"PPO epoch": ppo.noptepochs, "minibatch": ppo.nminibatches, "micro-batch": ppo.gradient_accumulation_steps}
    where = run_utils.first_non_finite(torch.stack(stats["ppo/loss/total"]), loop, accelerator.process_index)
    run.stop_if_not_finite(row, update, where)
    episodes = update * ppo.batch_size
    row = {
        "update": update,
        "episode": episodes,
        **row,
        "objective/kl_coef": kl_coef,
        "ppo/lr": lr,
        "ppo/episode": episodes,
    }
    row["ppo/val/var_explained"] = 1 - row["ppo/val/error"] / max(row["ppo/returns/var"], WHITEN_EPSILON)
    if args.task.stop_when_ended:  # the columns sampled: the batch's longest response (<= --task.response-length)
        row["objective/sampled_length"] = rollout["responses"].shape[1]
    row.update(timing_stats(run, policy.lm, timer, rollout["contexts"], update, args))
    if update % args.print_sample_output_freq == 0 or update in (1, args.num_updates):
        table = {
            "query": decode(tokenizer, rollout["queries"][:SAMPLE_ROWS]),
            "response": decode(tokenizer, rollout["responses"][:SAMPLE_ROWS]),
            "score": scores[:SAMPLE_ROWS].tolist(),
            "kl": kl["k1"][:SAMPLE_ROWS].tolist(),
            "total_reward": (scores + non_score_reward)[:SAMPLE_ROWS].tolist(),
        }
        run.samples("samples.jsonl", update, table)  # a table on the console, TensorBoard, wandb; samples.jsonl
        run.print(f"update {update}/{args.num_updates}: score {row['objective/scores']:.3f} kl "
                  f"{row['objective/kl']:.3f} kl_coef {kl_coef:.4f} approxkl {row['ppo/policy/approxkl']:.4f} "
                  f"{row['elapsed/fps']:.0f} tokens/s")  # fmt: skip
    if update == args.num_updates:
        row["sync/param_spread"] = run_utils.parameter_spread(accelerator, policy)  # 0: the processes agree
    return row


def timing_stats(run, lm, timer, contexts, update: int, args: Args) -> dict:
    """elapsed/* (OAI's fps: response tokens per second of this update), the time/* phases, peak memory and, with
    --peak-tflops, MFU (per process: the PPO epochs are 3 forwards' worth each, the rollout ~4 forwards)."""
    ppo, tokens = args.ppo, args.ppo.batch_size * args.task.response_length  # response tokens of an update
    stats = {
        "elapsed/time": run.elapsed(),
        "elapsed/fps": tokens / (time.perf_counter() - timer.start),
        "elapsed/fps_average": update * tokens / run.elapsed(),
        **timer.times,
        "time/peak_memory_gb": run_utils.peak_memory_gb(timer.device),
    }
    if args.peak_tflops:  # this process's tokens: contexts ⊕ responses, and the responses that reach the LM head
        responses = contexts.shape[0] * args.task.response_length
        forward = run_utils.forward_flops(lm, contexts.numel() + responses, responses)
        train = ppo.noptepochs * 3 * forward
        stats["time/mfu_ppo_epochs"] = run_utils.mfu(train, timer.times["time/ppo_epochs"], args.peak_tflops)
        # the rollout: generation, the policy's and the reference's forwards, scoring
        stats["time/mfu_update"] = run_utils.mfu(train + 4 * forward, sum(timer.times.values()), args.peak_tflops)
    return stats


def sampled_to_one_length(lm, chunks: tuple, responses: list, pad_id: int, temperature: float, samples_per_context: int,
                          stop: tuple[int, int]) -> list:  # fmt: skip
    """--task.stop-when-ended: the chunks' responses at one length, the columns the batch's last row to end needs on
    any process (one all-reduce, so that every process trains on the same shapes as one process would): a chunk that
    stopped sooner samples on from where it stopped (its contexts ⊕ responses so far as new contexts), one given whole
    (benchmark/openai/replay.py) is cut after that column."""
    length = max(ended_length(r, stop) for r in responses)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        longest = torch.tensor(length, device=chunks[0].device)
        torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
        length = int(longest)
    equal = []
    for contexts, r in zip(chunks, responses, strict=True):
        if r.shape[1] < length:
            contexts = torch.cat([contexts.repeat_interleave(samples_per_context, 0), r], 1)
            r = torch.cat([r, sample_responses(lm, contexts, pad_id, length - r.shape[1], temperature)], 1)
        equal.append(r[:, :length])
    return equal


def ended_length(responses: torch.Tensor, stop: tuple[int, int]) -> int:
    """The columns (B, T) responses need: up to the last row's first truncate token at index >= truncate_after (as
    truncate_responses cuts them); T when a row has none."""
    index = torch.arange(responses.shape[1], device=responses.device)
    is_end = (responses == stop[0]) & (index >= stop[1])  # (B, T)
    if not len(responses):
        return 0
    if not is_end.any(1).all():
        return responses.shape[1]
    return int(is_end.int().argmax(1).max()) + 1


def held_out_queries(texts, tokenizer, task: TaskHParams, n: int):
    """The gold evaluation's n queries, their fields and contexts: the first of a fixed text order (seed EVAL_SEED);
    every text read for them is kept out of training (the fourth value)."""
    stream = QueryStream(texts, tokenizer, task, tokenizer.pad_token_id, seed=EVAL_SEED, chunk=n)
    queries, fields = stream.next_batch(n)
    order = texts.epoch(0, EVAL_SEED, 0, 1)  # the texts the stream took: the first `used`, or all past one epoch
    read = order if stream.epoch else itertools.islice(order, stream.used)
    return queries, fields, stream.format(queries), frozenset(texts[index] for index in read)


class GoldEvaluation:
    """--task.gold-labeler: the held-out queries (`texts`, those read for them, are kept out of training), sampled
    with the same seed at update 0 (the pretrained policy, the "before" point), every --eval-every updates and at the
    end (every process samples them all, so that the samples are the same on any number of processes, and scores its
    share); the learned reward model's score (eval/rm_score, penalty applied) next to the simulated labeler's
    (eval/gold_score) on the post-processed text, and the KL. Every sample goes to eval_samples.jsonl. Without
    --task.gold-labeler it holds nothing out and does nothing."""

    def __init__(self, args: Args, texts, tokenizer, scale: float):
        self.args, self.tokenizer, self.scale, self.on = args, tokenizer, scale, args.task.gold_labeler is not None
        self.texts, self.initial, self.last = frozenset(), {}, {}
        if self.on:
            self.queries, self.fields, self.contexts, self.texts = held_out_queries(texts, tokenizer, args.task,
                                                                                    args.eval_queries)  # fmt: skip
            self.truncate_token_id = rlhf_data.truncate_token_id(tokenizer, args.task)
            self.labeler = reward_callable(args.task.gold_labeler, "--task.gold-labeler")

    def start(self, run, accelerator, models: tuple, state: Optional[dict]) -> None:
        """The models (policy, reference, reward model) to evaluate; update 0's evaluation, or the resumed run's."""
        self.run, self.accelerator, self.models = run, accelerator, models
        if state is not None and self.on:
            self.initial, self.last = state["initial_eval"], state["last_eval"]
        elif self.on:
            self.initial = self.evaluate(0)
            run.log({"update": 0, "episode": 0, **self.initial}, 0)

    def state(self) -> dict:
        return {"initial_eval": self.initial, "last_eval": self.last} if self.on else {}

    def summary(self) -> None:
        if self.on:
            self.run.print(", ".join(f"{key} {self.initial[key]:.4f} -> {self.last[key]:.4f}" for key in self.initial))

    def evaluate_if_due(self, update: int) -> dict:
        """The evaluation's metrics every --eval-every updates and at the last one; else none."""
        if self.on and (update % self.args.eval_every == 0 or update == self.args.num_updates):
            return self.evaluate(update)
        return {}

    @torch.no_grad()
    def evaluate(self, update: int) -> dict:
        args, task, tokenizer, accelerator = self.args, self.args.task, self.tokenizer, self.accelerator
        policy, ref_lm, reward_model = self.models
        rows, samples = slice(accelerator.process_index, None, accelerator.num_processes), args.eval_samples_per_query
        queries = self.queries[rows].to(accelerator.device).repeat_interleave(samples, 0)  # this process's share
        contexts, pad_id = self.contexts.to(accelerator.device), tokenizer.pad_token_id
        fields = {
            name: [value for value in values[rows] for _ in range(samples)] for name, values in self.fields.items()
        }
        stop = (self.truncate_token_id, task.truncate_after) if task.stop_when_ended else None
        with accelerator.autocast():
            devices = [accelerator.device] if accelerator.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):  # every process draws for every held-out query alike: the
                torch.manual_seed(EVAL_SEED)  # same samples on 1 or N processes; each then scores its share
                responses = generate_responses(policy.lm, contexts, pad_id, task.response_length, task.temperature,
                                               args.local_rollout_forward_batch_size, samples, stop)  # fmt: skip
            responses = responses.view(len(contexts), samples, -1)[rows].flatten(0, 1)  # (its queries x samples, T)
            contexts = contexts[rows]
            query_responses = torch.cat([contexts.repeat_interleave(samples, 0), responses], 1)
            logprobs, ref_logprobs, _ = rollout_logprobs(policy, ref_lm, query_responses, contexts.shape[1], pad_id,
                                                         self.scale, args.micro_batch_size)  # fmt: skip
            postprocessed, scores = score_responses(reward_model, queries, responses, self.truncate_token_id, task,
                                                    args.local_rollout_forward_batch_size, fields)  # fmt: skip
        texts, option = decode(tokenizer, postprocessed), f"--task.gold-labeler {task.gold_labeler}"
        gold = call_with_fields(self.labeler, decode(tokenizer, queries), texts, fields)
        gold = function_scores(option, gold, len(texts), "cpu", torch.float64).tolist()
        query_ids = torch.arange(len(self.queries))[rows].repeat_interleave(samples).tolist()
        kl = (logprobs - ref_logprobs).sum(1).tolist()
        columns = zip(query_ids, decode(tokenizer, queries), texts, gold, scores.tolist(), kl, strict=True)
        table = gather_object(
            [dict(query_index=q, query=t, response=r, gold_score=g, rm_score=s, kl=k) for q, t, r, g, s, k in columns]
        )
        table.sort(key=lambda sample: sample["query_index"])  # the held-out order, on any number of processes
        metrics = {f"eval/{key}": float(np.mean([sample[key] for sample in table]))
                   for key in ("gold_score", "rm_score", "kl")}  # fmt: skip
        self.run.append_jsonl("eval_samples.jsonl", [dict(update=update, **sample) for sample in table])
        self.run.print(f"update {update}: " + ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()))
        self.last = metrics
        return metrics


def save_policy(policy: PolicyAndValueWrapper, directory: Path, base_model: str) -> None:
    """policy/: a Hugging Face causal LM with the base model's own tokenizer (pad = EOS, left padding, so that stock
    batched generate() works: our [PAD] id is one past the embedding matrix) and value_head.safetensors."""
    tokenizer = AutoTokenizer.from_pretrained(base_model, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    policy.lm.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    policy.lm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    save_file(
        {k: v.contiguous() for k, v in policy.value_head.state_dict().items()}, directory / "value_head.safetensors"
    )


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
