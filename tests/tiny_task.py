"""A tiny language task that runs anywhere in seconds: the tests' inputs and the side-by-side with OpenAI's code.

A corpus of short sentences over a 23-word vocabulary (sentiment words among them, and '.'), and a 2-layer GPT-2 that
has learned that corpus a little: it writes its words and ends sentences with '.', so truncation after '.' and a
sentiment labeler both have something to work with. The tests' model reads GPT-2's tokenizer cut down to the task
(write_tiny_tokenizer: ~400 tokens, the corpus's pieces and ids 0-255 as GPT-2 has them); the side-by-side's keeps
GPT-2's real 50,257-token vocabulary, which OpenAI's code encodes with.

The model is a pure function of its arguments on any CPU: initialized from numpy's seeded legacy generator, trained
in float64 on one thread, and every weight put on a grid of 2^-16 after every step (GRID). CPUs differ in the last
bits of float64 sums (matmul kernels of other widths and vendors: measured on an AVX2 EPYC and an AVX-512 Xeon), and
training amplifies such bits step after step until float32 sees them; on the grid, a step's ~1e-18 difference changes
a weight only if it lands within 1e-18 of a grid midpoint (odds ~1e-13 per weight and step), so every CPU lands on
the same weights. This is what lets a CI machine rebuild the exact weights that OpenAI's code saw on another machine
(benchmark/openai/side_by_side_reference/). Adam's steps (~lr: 65 grid units at 1e-3) are what the grid keeps. Cheap on
CPU: the embedding rows of tokens outside the corpus are 0, so their logits are exactly 0 and the full-vocabulary
softmax needs only the corpus's ~40 logits plus a constant (V - 40) * exp(0).
"""

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

WORDS = "the a cat dog sat on mat happy sad good bad great terrible house river tree bird sun moon ran saw big small".split()
TINY_GPT2 = dict(n_layer=2, n_head=4, n_embd=64, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
"""The tiny model's shape (256 positions; the vocabulary is its tokenizer's), without dropout (the training scripts
remove it too)."""
EOS_ID, PERIOD_ID = 50256, 13  # GPT-2's <|endoftext|> and '.' (the side by side's warm starts)
GRID = 2.0**-16
"""Every weight of the tiny model is a multiple of this after every training step (module docstring)."""


def synthetic_sentences(n: int, seed: int) -> list[str]:
    """Lines of 2-4 short sentences made of the 23-word vocabulary: easy for a tiny LM to pick up, including '.'."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(2, 4))]
        lines.append(". ".join(sentences).capitalize() + ".")
    return lines


def write_tiny_tokenizer(gpt2_tokenizer_dir: Path, directory: Path) -> Path:
    """GPT-2's tokenizer cut down to the tiny task, saved in `directory`: GPT-2's 256 byte tokens (ids 0-255 as in
    GPT-2: '.' is 13, '\\n' 198), the tokens GPT-2 makes of the task's words (alone, after a space, capitalized), each
    with the merge that makes it and, recursively, that merge's parts, and <|endoftext|> last (EOS).

    Each of GPT-2's 50,000 merges makes a token of its own, and BPE applies the lowest-ranked merge it can: with a
    subset of the merges that holds every merge a word's pieces were made by, the word is cut into the same pieces.
    So the task's texts get GPT-2's very tokens (in other ids), and any other text still encodes, in smaller pieces.
    ~400 tokens in place of 50,257: the LM head, its softmax and their backward were ~3/4 of a tiny run's compute."""
    full = json.loads((Path(gpt2_tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = full["model"]["vocab"], full["model"]["merges"]
    made_by = {left + right: (left, right) for left, right in merges}
    assert len(made_by) == len(merges) == len(vocab) - 257, "not GPT-2's BPE table"
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    token_of = {index: token for token, index in vocab.items()}
    kept = {token_of[index] for index in range(256)}
    texts = [form for word in WORDS for form in (word, " " + word, word.capitalize(), " " + word.capitalize())]
    pending = [token_of[index] for text in texts for index in tokenizer.encode(text)]
    while pending:
        token = pending.pop()
        if token not in kept:
            kept.add(token)
            pending.extend(made_by[token])
    ordered = sorted(kept, key=vocab.__getitem__)  # GPT-2's order: the byte tokens keep their ids
    (special,) = full["added_tokens"]
    full["model"]["vocab"] = {token: index for index, token in enumerate([*ordered, special["content"]])}
    full["model"]["merges"] = [[left, right] for left, right in merges if left + right in kept]
    special["id"] = len(ordered)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(full, ensure_ascii=False), encoding="utf-8")
    shutil.copyfile(Path(gpt2_tokenizer_dir) / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


CHAT_END = "<|end|>"
"""The tiny chat template's end-of-turn token: a special token of its own, not EOS (as Llama 3's <|eot_id|>)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 'Q:' if message['role'] == 'user' else 'A:' }} {{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
"""A tiny chat template: `Q: question<|end|>A:` opens the assistant's turn, which ends with <|end|>."""


def write_tiny_chat_tokenizer(tiny_tokenizer_dir: Path, directory: Path) -> Path:
    """The tiny task's tokenizer with a chat template (CHAT_TEMPLATE) and its end-of-turn token added (id 404)."""
    from transformers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_tokens([AddedToken(CHAT_END, special=True)])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return Path(directory)


def chat_conversations(n: int, seed: int) -> list[str]:
    """n conversations in CHAT_TEMPLATE, a line of the tiny task as the question and its first sentence as the
    answer: a tiny model trained on them answers in a few words and ends its turn."""
    lines = synthetic_sentences(n, seed)
    return [f"Q: {line}{CHAT_END}A: {line.split('.')[0]}.{CHAT_END}" for line in lines]


def write_tiny_gpt2(
    directory: Path,
    tokenizer_dir: Path,
    corpus: list[str],
    steps: int,
    seed: int = 0,
    lr: float = 1e-2,
    batch: int = 16,
    saved_dropout: float = 0.0,
) -> Path:
    """A 2-layer GPT-2 (TINY_GPT2) briefly trained on `corpus` (Adam, `batch` windows of 48 tokens a step),
    saved with its tokenizer; the same bytes on every machine (module docstring). Trained without dropout; its saved
    config has `saved_dropout` as every dropout probability (GPT-2's own is 0.1, which the training scripts zero)."""
    rng = np.random.RandomState(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, immune to a busy machine, one summation order
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    model = GPT2LMHeadModel(GPT2Config(**TINY_GPT2, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos))
    model = model.double()
    with torch.no_grad():  # GPT-2's initialization, drawn by numpy: weights N(0, 0.02), layer norms 1, biases 0
        for name, param in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
            elif param.dim() == 2:
                param.copy_(torch.from_numpy(rng.normal(0.0, 0.02, tuple(param.shape))))
            else:
                param.zero_()
    ids = torch.tensor(tokenizer(" ".join(corpus))["input_ids"])
    vocabulary, local_ids = torch.unique(ids, return_inverse=True)
    embedding = model.transformer.wte.weight  # tied to the LM head
    # only the corpus's rows are trained (the others stay 0): as their own parameter, so that backward and Adam touch
    # ~40 rows, not 50,257 (the same numbers: every other row's gradient is 0, and Adam leaves a 0 row at 0)
    rows_trained = nn.Parameter(embedding.detach()[vocabulary].clone())
    log_others = torch.tensor(math.log(len(embedding) - len(vocabulary)), dtype=torch.float64)
    windows = local_ids[: len(ids) // 48 * 48].view(-1, 48)
    others = [param for param in model.parameters() if param is not embedding]
    optimizer = torch.optim.Adam([rows_trained, *others], lr=lr, foreach=False)
    on_grid(rows_trained, *others)
    for _ in range(steps):
        rows = windows[torch.from_numpy(rng.randint(len(windows), size=batch))]
        hidden = model.transformer(inputs_embeds=F.embedding(rows, rows_trained)).last_hidden_state[:, :-1]
        logits = hidden @ rows_trained.T  # (batch, 47, |corpus vocabulary|)
        log_normalizer = torch.logaddexp(logits.logsumexp(-1), log_others)  # + the zero logits
        target_logits = logits.gather(-1, rows[:, 1:, None]).squeeze(-1)
        loss = (log_normalizer - target_logits).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        on_grid(rows_trained, *others)
    with torch.no_grad():
        embedding.zero_()
        embedding[vocabulary] = rows_trained
    torch.set_num_threads(threads)
    model.config.update(dict(resid_pdrop=saved_dropout, embd_pdrop=saved_dropout, attn_pdrop=saved_dropout))
    model.float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@torch.no_grad()
def write_warm_policy(base_dir: Path, directory: Path, scale: float, value_scale: float, eos_scale: float,
                      seed: int) -> Path:  # fmt: skip
    """A policy that starts away from its reference: the base model with every transformer block's matrix moved by
    N(0, scale) noise, EOS's embedding row eos_scale times '.''s, and a value head drawn N(0, value_scale), all from
    numpy's seeded generator and on the GRID, so that it too is the same bytes on every machine (float32 sums of
    multiples of 2^-16 below 2^8 are exact). Written as train_policy_accelerate.py writes a policy: a causal LM
    directory and value_head.safetensors."""
    from safetensors.torch import save_file

    rng = np.random.RandomState(seed)
    lm = GPT2LMHeadModel.from_pretrained(base_dir, dtype=torch.float32)
    for name, param in lm.named_parameters():
        if name.startswith("transformer.h.") and param.dim() == 2:  # attention and MLP matrices; not the embeddings
            noise = torch.from_numpy(np.round(rng.normal(0.0, scale, tuple(param.shape)) / GRID) * GRID)
            param.copy_((param.double() + noise).float())
    # EOS (50256) never occurs in the corpus, so the base model's row for it is 0; here it is the '.' row's, scaled:
    # the policy then writes EOS mid-response now and then, as GPT-2 does, and must not stop there or treat it as pad
    embedding = lm.get_input_embeddings().weight  # tied to the LM head
    embedding[EOS_ID] = torch.round(embedding[PERIOD_ID].double() * eos_scale / GRID).float() * GRID
    weight = np.round(rng.normal(0.0, value_scale, (1, lm.config.n_embd)) / GRID) * GRID
    head = {"weight": torch.from_numpy(weight).float(), "bias": torch.tensor([0.25])}
    lm.save_pretrained(directory)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(directory)
    save_file(head, Path(directory) / "value_head.safetensors")
    return Path(directory)


@torch.no_grad()
def on_grid(*params: torch.Tensor) -> None:
    """Round each weight to the nearest multiple of GRID (exact in float64: a power of two, and |weight| << 2^36);
    + 0.0 turns the -0.0 of a tiny negative weight into 0.0 (the same number, other bytes)."""
    for param in params:
        param.copy_(torch.round(param / GRID) * GRID + 0.0)
