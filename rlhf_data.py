"""The data the scripts read: query texts as OpenAI's `lm_human_preferences/datasets/` made them (books.py,
tldr.py, cnndm.py: passages of a book corpus, cleaned Reddit posts and news articles), from a local file or a Hub
dataset, and the human label files as OpenAI's `label_types.py` read them (best-of-N records of token ids).

Data preparation only: the tensor operations that turn texts into queries (`query_from_text`, `QueryStream`) are in
the scripts that use them. Both scripts import this module; it imports run_utils for its one-line errors and input
checks, and run_utils does not import it.
"""

import json
import os
import re
import time
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

import numpy as np

from run_utils import check_source, console, fail, first_line, flag_errors, hub_offline, require_package

# ---------------------------------------------------------------------------------------------------------------------
# query texts: a local file or a Hub dataset, cleaned like OpenAI's
BOOKS_TASKS = ("sentiment", "descriptiveness")  # OAI's books tasks: queries from bookcorpus
SUMMARIZATION_TASKS = ("tldr", "cnndm")


def clean_query_text(text: str, task_name: str) -> str:
    """Texts as OAI's queries were made of. Books: Hub `bookcorpus` is tokenized text (lower-cased, a space before
    punctuation, `` and '' for quotes); joined back like running text (OAI's passages were), its sentences end in
    the '.' token that OAI's start and end text look for. Summarization: OAI's clean-up (datasets/tldr.py, cnndm.py).

    Summarization: straight quotes (OAI: ftfy), Unix newlines, at most one empty line in a row, no surrounding whitespace.
    cnndm also cuts at "@highlight" and drops the header before the story: the byline ("By . NAME ." in the Hub's
    `cnn_dailymail`, whose loader joins lines with spaces and ends them with " ."; "By\\nNAME\\n" in .story files),
    the Daily Mail date lines up to the last "PUBLISHED:/UPDATED: 15:36 EST, 25 October 2013" and the CNN dateline
    up to "(CNN) --" (in the first 100 characters, like OAI)."""
    if task_name not in BOOKS_TASKS + SUMMARIZATION_TASKS:  # a new task says here how its texts are cleaned
        raise ValueError(f"clean_query_text: no cleaning for task {task_name!r} (books: {BOOKS_TASKS}, summarization: "
                         f"{SUMMARIZATION_TASKS})")  # fmt: skip
    if task_name in BOOKS_TASKS:
        text = text.replace("`` ", '"').replace(" ''", '"').replace("( ", "(")
        return re.sub(r" (?=[.,!?;:)]|n't\b|'(?:s|re|ve|ll|d|m)\b)", "", text)
    if task_name == "cnndm":
        text = text.split("@highlight")[0]
        text = re.sub(r"^\s*By(?: \. .{0,80}? \. |\s*\n[^\n]*\n)", "", text)
        date = r"(?:PUBLISHED:|UPDATED:|Last updated at)[\s.]*\d{1,2}:\d{2}.*?\b(?:19|20)\d{2}\b[\s.|]*"
        headers = list(re.finditer(date, text[:500]))
        text = text[headers[-1].end() :] if headers else text
        text = re.sub(r"^[\s\S]{0,100}\(CNN\)\s*(?:--)?", "", text)
    text = text.translate(str.maketrans("\u2018\u2019\u201c\u201d", "''\"\"")).replace("\r\n", "\n")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def query_texts(texts: list[str], task, tokenizer) -> list[str]:
    """What the tokenizer makes each text's query of: the text cleaned as its task's (clean_query_text), or with
    --task.chat-template the text as the dataset holds it, between --task.query-prefix and --task.query-suffix, as one
    user turn of the base model's chat template with the generation prompt (the assistant's turn, opened)."""
    if not task.chat_template:
        return [clean_query_text(text, task.name) for text in texts]
    return [chat_prompt(tokenizer, task.query_prefix + text + task.query_suffix) for text in texts]


def truncate_token_id(tokenizer, task) -> int:
    """The id of the token that ends a response: --task.truncate-token ('.' is 13 in GPT-2, '\\n' 198), or with
    --task.chat-template the template's end-of-turn token (SmolLM2's <|im_end|>); it must be one token."""
    flag, text = "--task.truncate-token", task.truncate_token
    if task.chat_template:
        flag, text = "--task.chat-template: the template's end of turn", end_of_turn_text(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        fail(f"{flag} {text!r} is {len(ids)} tokens, not 1")
    return ids[0]


CHAT_MARKER = "RLHFMARKER7"
"""A text no chat template writes: where it lands in a rendered conversation shows what the template puts after an
assistant's answer."""


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as the user's turn of a conversation in the tokenizer's chat template, the assistant's turn opened."""
    flag = "--task.chat-template"
    if not getattr(tokenizer, "chat_template", None):
        fail(f"{flag}: the tokenizer of --base-model {tokenizer.name_or_path!r} has no chat template (its "
             "tokenizer_config.json or chat_template.jinja names none): a base model, not a chat model")  # fmt: skip
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    except Exception as error:  # jinja2's errors, and whatever a template raises
        fail(f"{flag}: the chat template of --base-model {tokenizer.name_or_path!r} fails ({first_line(error)})")


def end_of_turn_text(tokenizer) -> str:
    """The text the chat template puts right after an assistant's answer, up to the first whitespace: the token that
    ends a turn (SmolLM2 and Qwen: <|im_end|>, Llama 3: <|eot_id|>, Gemma: <end_of_turn>)."""
    chat_prompt(tokenizer, "")  # a template, and one that renders
    conversation = [{"role": "user", "content": "U"}, {"role": "assistant", "content": CHAT_MARKER}]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception as error:
        fail(f"--task.chat-template: the chat template of --base-model {tokenizer.name_or_path!r} cannot render an "
             f"answer ({first_line(error)})")  # fmt: skip
    after = re.match(r"\s*(\S*)", rendered.split(CHAT_MARKER, 1)[-1]).group(1) if CHAT_MARKER in rendered else ""
    if not after:
        fail(f"--task.chat-template: the chat template of --base-model {tokenizer.name_or_path!r} ends an answer with "
             "no end-of-turn text: no token would end a response")  # fmt: skip
    return after


def no_query_message(task) -> str:
    """Why a query dataset yields no query: what a text must be for the task's flags."""
    if task.chat_template:
        must = f"fits --task.query-length {task.query_length} in the chat template"
    else:
        rules = [f"starts after --task.start-text {task.start_text!r}"] if task.start_text else []
        rules += [f"ends with --task.end-text {task.end_text!r}"] if task.end_text else []
        must = f"{' and '.join(rules) or 'is not empty'} within --task.query-length {task.query_length}"
    return f"--task.query-dataset {task.query_dataset!r}: no text yields a query (one that {must})"


def join_rows(rows: list[str]) -> str:
    """Consecutive rows (sentences) as one text, empty rows left out."""
    return " ".join(row for row in rows if row)


class QueryTexts:
    """The query texts of --task.query-dataset: text i is rows [i * rows_per_text, (i + 1) * rows_per_text) joined
    (Hub `bookcorpus` has one sentence per row, in book order; OAI's queries were multi-sentence passages), and each
    epoch reads every text once, in a seeded order of all of them, as OAI shuffled its whole passage file.

    A local .txt (one row per line), .jsonl or .json (a list of objects) file is read into memory. A Hub dataset (or
    a local directory laid out like one) costs a one-time download of the whole dataset into the `datasets` cache,
    as memory-mapped Arrow files that texts are read from when needed, never held in memory (bookcorpus: its Parquet
    files, then 4.85 GB of Arrow for 74M rows, by its dataset card). A stream cannot shuffle like OAI: bookcorpus's
    74M sentences are 11,038 books in order (Zhu et al. 2015; ~840 passages each), so a 10,000-passage shuffle buffer
    holds ~12 books and a batch of 512 came from 13-15 books at first, ~52 later (a simulation of that buffer),
    against ~500 for a full shuffle (tests/test_data.py counts books per batch on a small dataset in book order).
    Every process loads it: `datasets` prepares the cache under a file lock, so one process downloads and converts
    it, and the others then read its files."""

    def __init__(self, name: str, config: Optional[str], field: str, rows_per_text: int = 1):
        self.name, self.config, self.field, self.rows_per_text = name, config, field, rows_per_text
        self.records, self.carried = None, ()  # the rows whole (a JSON list, a Hub dataset); the fields to hand on
        if os.path.isdir(name) and not any(os.scandir(name)):
            fail(f"--task.query-dataset {name!r}: an empty directory")
        self.rows = self.read_file() if os.path.isfile(name) else self.read_dataset()
        if len(self.rows) and not len(self):
            fail(f"--task.query-dataset {name!r} has {len(self.rows)} rows, fewer than one text of --task.passage-rows "
                 f"{rows_per_text}")  # fmt: skip

    @classmethod
    def of_task(cls, task) -> "QueryTexts":
        """The texts of a script's --task.query-dataset / -config / -field / --task.passage-rows."""
        return cls(task.query_dataset, task.query_dataset_config, task.query_field, task.passage_rows)

    def __len__(self) -> int:
        return len(self.rows) // self.rows_per_text

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < len(self):
            raise IndexError(index)
        first = int(index) * self.rows_per_text
        return join_rows(self.rows[first : first + self.rows_per_text])

    @property
    def columns(self) -> list[str]:
        """The dataset's columns besides --task.query-field (a .jsonl / .json file: the keys every record has; a .txt
        file has none)."""
        if self.records is None:
            return []
        if isinstance(self.records, list):
            common = set(self.records[0]).intersection(*self.records[1:]) if self.records else set()
            return [key for key in self.records[0] if key in common and key != self.field] if self.records else []
        return [name for name in self.records.column_names if name != self.field]

    def carry(self, names: tuple[str, ...], flag: str) -> None:
        """Hand on these columns with every text (`fields`): what `flag`'s function asks for, checked here in one
        line each: the dataset has them, and a text is one row (a passage of several rows has no one value)."""
        missing = [name for name in names if name not in self.columns]
        if missing:
            fail(f"{flag} asks for the column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}, which "
                 f"--task.query-dataset {self.name!r} lacks (its columns besides --task.query-field {self.field!r}: "
                 f"{self.columns or 'none'})")  # fmt: skip
        if names and self.rows_per_text != 1:
            fail(f"{flag} asks for the columns {list(names)}, but --task.passage-rows {self.rows_per_text} joins "
                 "several rows into one text: set it to 1")  # fmt: skip
        self.carried = tuple(names)

    def fields(self, indices: list[int]) -> dict[str, list]:
        """The carried columns' values of texts `indices`, one list per column ({} when none is carried)."""
        if not self.carried:
            return {}
        if isinstance(self.records, list):
            return {name: [self.records[index][name] for index in indices] for name in self.carried}
        rows = self.records.select_columns(list(self.carried))[list(indices)]  # one read of the Arrow files
        return {name: rows[name] for name in self.carried}

    def read_file(self) -> list[str]:
        path, flag = self.name, "--task.query-dataset"
        if not path.endswith((".txt", ".json", ".jsonl")):  # a .csv read as lines would keep its header and commas
            fail(f"{flag} {path!r}: a local file is a .txt (one text per line), .json or .jsonl file; give a .jsonl "
                 "with a text field, or a directory of a Hub dataset's files")  # fmt: skip
        with flag_errors(flag, path, "cannot read it"):
            content = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is no text (N26)
        if path.endswith((".json", ".jsonl")):
            rows, where = [], []  # the records, and where each is: "line N" of JSON lines, "record N" of a list
            try:
                for number, line in enumerate(content.splitlines(), 1):
                    if line.strip():
                        rows.append(json.loads(line))
                        where.append(f"line {number}")
            except (ValueError, RecursionError) as error:  # bad JSON, a 5000-digit number, nesting beyond the stack
                try:  # a .json file with a list spread over several lines
                    rows, where = json.loads(content), None
                except (ValueError, RecursionError) as whole:  # the error of the form the file starts as
                    problem = f"line {number}: {first_line(error)}"
                    problem = first_line(whole) if content.lstrip().startswith("[") else problem
                    fail(f"{flag} {path!r}: not JSON lines or a JSON list ({problem})")
            if path.endswith(".json") and len(rows) == 1 and isinstance(rows[0], list):  # a list on one line
                rows, where = rows[0], None
            if not isinstance(rows, list):
                fail(f"{flag} {path!r}: not JSON lines or a JSON list (one {type(rows).__name__})")
            for row, at in zip(rows, where or [f"record {index}" for index in range(len(rows))], strict=True):
                if not isinstance(row, dict) or self.field not in row:
                    fail(f"{flag} {path!r}: {at} has no field {self.field!r} (--task.query-field)")
                if not isinstance(row[self.field], str):
                    fail(f"{flag} {path!r}: {at}: {self.field!r} is {json.dumps(row[self.field])}, not a text")
            self.records = rows
            return [row[self.field] for row in rows]
        return content.splitlines()

    def read_dataset(self):
        """The Hub dataset's rows of `field`, a column of the cached Arrow files read when sliced. A repo that still
        ships a loading script (refused by `datasets` >= 4, e.g. bookcorpus/bookcorpus, webis/tldr-17) is read from
        the Hub's automatic Parquet conversion instead (PARQUET_CONVERSION; there, a configuration is a directory).
        The first run downloads the data files (download_data_files says which and how big first) and converts
        them into Arrow files in the datasets cache; later runs, and offline ones (HF_HUB_OFFLINE=1), read those."""
        require_package("datasets", "datasets", f"--task.query-dataset {self.name!r} (a Hub dataset or directory)")
        import datasets

        datasets.disable_progress_bars()
        flag = f"--task.query-dataset {self.name!r} (--task.query-dataset-config {self.config!r})"
        check_source(self.name, "--task.query-dataset")
        try:
            if ships_loading_script(self.name):
                console.print(
                    f"{self.name} ships a loading script: reading the Hub's Parquet conversion of it", soft_wrap=True
                )
                builder = datasets.load_dataset_builder(self.name, revision=PARQUET_CONVERSION, data_dir=self.config)
            else:
                builder = datasets.load_dataset_builder(self.name, self.config)
            if not os.path.isfile(os.path.join(builder.cache_dir, "dataset_info.json")):  # not in the cache yet
                download_data_files(self.name, builder.config.data_files)
            builder.download_and_prepare()  # what datasets.load_dataset does, in three steps
            dataset = builder.as_dataset(split="train")
        except Exception as error:  # datasets, fsspec and httpx raise their own types for a missing repo or network
            fail(f"{flag}: cannot load it ({type(error).__name__}: {first_line(error)})")
        if self.field not in dataset.column_names:
            fail(f"--task.query-field {self.field!r} is not a column of {self.name} (columns: {dataset.column_names})")
        feature = dataset.features[self.field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            fail(f"--task.query-field {self.field!r} of {self.name} holds {feature}, not text")
        self.records = dataset
        return dataset[self.field]

    def epoch(self, epoch: int, seed: int, rank: int, world_size: int, start: int = 0):
        """This process's texts of one epoch, as their indices, in a seeded order that all processes share (process r
        takes every world_size-th), from the `start`-th on."""
        order = np.random.default_rng([seed, epoch]).permutation(len(self))[rank::world_size]
        return (int(i) for i in order[start:])


PARQUET_CONVERSION = "refs/convert/parquet"
"""The git ref of a Hub dataset repo that holds the Hub's automatic conversion of its data to Parquet files."""


def ships_loading_script(name: str) -> bool:
    """Whether the Hub dataset `name` ships a loading script on its main branch (NAME.py, which `datasets` >= 4
    refuses), asked of the Hub before `datasets` is asked for the dataset: once its cache holds the dataset,
    `datasets` answers a refused script with the dataset it cached last, whatever its configuration, so that a
    configuration other than the cached one fails ("Couldn't find cache"). The script is cached with the rest, so
    that an offline run (HF_HUB_OFFLINE=1) knows too; a local directory has none."""
    if os.path.isdir(name):
        return False
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        hf_hub_download(name, f"{name.split('/')[-1]}.py", repo_type="dataset")
    except EntryNotFoundError:  # not on the Hub, or offline: not in the cache
        return False
    return True


def download_data_files(name: str, data_files) -> None:
    """Before a Hub dataset's first use: say which data files `datasets` will read that are not in the Hugging Face
    cache yet and how big they are (the Hub's tree listing), then download them there, where `datasets` finds them,
    a line per file: tqdm's bars show on a terminal only, and a log (sbatch, nohup) would show nothing for minutes.
    Every process of a machine does this (one downloads a file, the others wait on its lock); the first one says so."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.hf_api import RepoFile

    prefix, files = f"hf://datasets/{name}@", []  # (revision, path) of each file not in the cache yet
    for url in [str(url) for split_files in (data_files or {}).values() for url in split_files]:
        revision, _, path = url.removeprefix(prefix).partition("/")
        if url.startswith(prefix):  # not a local file
            cached = try_to_load_from_cache(name, path, revision=unquote(revision), repo_type="dataset")
            files += [] if isinstance(cached, str) else [(unquote(revision), path)]
    if not files or hub_offline():  # local files, or all cached; offline, `datasets` says what the cache lacks
        return
    listing = HfApi().list_repo_tree(name, repo_type="dataset", revision=files[0][0], recursive=True)
    sizes = {entry.path: entry.size for entry in listing if isinstance(entry, RepoFile)}
    total, folders = sum(sizes.get(path, 0) for _, path in files), sorted({os.path.dirname(p) + "/" for _, p in files})
    first = os.environ.get("LOCAL_RANK", "0") == "0"

    def say(text: str) -> None:
        if first:
            console.print(text, markup=False, highlight=False, soft_wrap=True)

    say(
        f"{name}: downloading {len(files)} data files ({', '.join(folders)}), {format_bytes(total)}, into the Hugging "
        "Face cache, once; `datasets` then converts them into Arrow files in its cache"
    )
    start, done = time.perf_counter(), 0
    for index, (revision, path) in enumerate(files, 1):
        hf_hub_download(name, path, repo_type="dataset", revision=revision)
        done += sizes.get(path, 0)
        say(
            f"{name}: {index}/{len(files)} files, {format_bytes(done)} of {format_bytes(total)}, "
            f"{time.perf_counter() - start:.0f} s"
        )


def format_bytes(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


# ---------------------------------------------------------------------------------------------------------------------
# label files
LABEL_ANSWER_KEYS = (("score", "scalar_rating"), ("difference", "scalar_compare"), ("choice", "pairwise"))
"""OAI's label_types.py tells label types by their answer key; best-of-N records answer with `best`."""


def read_label_records(path: str, lengths: dict[str, int], vocab_size: Optional[int], pad_ids: tuple,
                       num_samples: int) -> list:  # fmt: skip
    """Read and check a best-of-N label file (OAI's schema: a JSON list of {query, sample0..sample{N-1}, best}, token
    ids within `vocab_size`, unless None, or `pad_ids`); every problem is one line naming the file and the record."""
    flag = "--label-dataset"
    try:
        records = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as error:  # unreadable, not UTF-8 or JSON, too deep or too long
        fail(f"{flag} {path}: not a readable JSON file ({first_line(error)})")
    if not isinstance(records, list):
        fail(f"{flag} {path}: expected a JSON list of label records, got {type(records).__name__}")
    expected = f"best-of-{num_samples} records need query, {', '.join(k for k in lengths if k != 'query')}, best"
    for index, record in enumerate(records):
        where = f"{flag} {path}: record {index}"
        if not isinstance(record, dict):
            fail(f"{where} is not an object")
        indices = [int(key[6:]) for key in record if key.startswith("sample") and key[6:].isdigit()]
        kind = next((kind for key, kind in LABEL_ANSWER_KEYS if key in record and "best" not in record),
                    f"best_of_{max(indices, default=num_samples - 1) + 1}")  # fmt: skip
        if kind != f"best_of_{num_samples}":
            fail(f"{where}: label type {kind} not supported (keys: {', '.join(sorted(record))}); {expected}")
        for key, length in lengths.items():
            if key not in record:
                fail(f"{where} has no {key!r} ({expected})")
            if not isinstance(record[key], list) or len(record[key]) != length:
                fail(
                    f"{where}: {key!r} must be a list of {length} token ids (--task.query-length/--task.response-length)"
                )
        if type(record.get("best")) is not int or not 0 <= record["best"] < num_samples:  # JSON true is no pick (N20)
            fail(f"{where}: 'best' must be an integer in 0..{num_samples - 1}, got {json.dumps(record.get('best'))}")
    found = ((i, key, t) for i, record in enumerate(records) for key in lengths for t in record[key])
    for index, key, token in found:  # a float, bool, string or null; or an int no token id can be (N21)
        if type(token) is not int:
            fail(f"{flag} {path}: record {index}: {key!r} has token id {json.dumps(token)}, not an integer")
        if not -(2**63) <= token < 2**63:
            fail(f"{flag} {path}: record {index}: {key!r} has token id {token}, outside any vocabulary")
    tokens = np.asarray([[t for key in lengths for t in record[key]] for record in records] or [[0]])
    keys = [key for key, length in lengths.items() for _ in range(length)]  # the record key of each column
    if vocab_size is None:
        return records
    bad = ~(((tokens >= 0) & (tokens < vocab_size)) | np.isin(tokens, pad_ids))
    if bad.any():
        index = int(bad.any(1).argmax())
        column = int(bad[index].argmax())
        fail(f"{flag} {path}: record {index}: {keys[column]!r} has token id {tokens[index][column]} outside the "
             f"vocabulary of {vocab_size} tokens")  # fmt: skip
    return records
