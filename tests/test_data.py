"""Query texts and label files as the runs read them: OpenAI's book passages built from a sentence-per-row corpus,
local files, and Hub datasets read from local directories laid out as the Hub serves them (a repo that still ships
a loading script and its Parquet conversion, a repo of Parquet files with configurations, the label-file repo).
Everything offline."""

import itertools
import json
import random

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tyro

import rlhf_data
import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import run_script

PAD, DOT = 50257, 13
WORDS = "the man woman dog walked ran looked into out of a house room garden slowly quietly and then ,".split()


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer_dir):
    return R.load_tokenizer(str(gpt2_tokenizer_dir))


def book_sentences(n: int) -> list[str]:
    """Hub `bookcorpus`-like rows: one lower-cased sentence per row, tokenized (" ,", " ."), 6 to 17 words."""
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 17))) + " ." for _ in range(n)]


def books_task(*flags: str) -> R.TaskHParams:
    return R.validate_args(run_utils.task_cli(R.task_defaults, ["--labels.num-train", "32", *flags])).task


def contains_at(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


def test_books_queries_are_passages_that_start_after_and_end_with_a_period(tokenizer, tmp_path):
    """OpenAI's queries were multi-sentence book passages (language/datasets.py): with the books tasks' defaults, a
    sentence-per-row file gives queries of several sentences that start right after a '.', end with one, and fit
    in 64 tokens."""
    rows = book_sentences(400)
    (tmp_path / "books.txt").write_text("\n".join(rows) + "\n")
    task = books_task("--task.query-dataset", str(tmp_path / "books.txt"))
    assert (task.passage_rows, task.start_text, task.end_text, task.query_length) == (8, ".", ".", 64)
    texts = rlhf_data.QueryTexts(task.query_dataset, None, task.query_field, task.passage_rows)
    assert len(texts) == 50 and texts[0] == " ".join(rows[:8]) and texts[49] == " ".join(rows[392:])
    queries = R.QueryStream(texts, tokenizer, task, PAD, seed=0).next_batch(32)[0]
    corpus = tokenizer.encode(rlhf_data.clean_query_text(" ".join(rows), "sentiment"))  # " ." joined: '.' is 13
    for query in queries.tolist():
        tokens = [t for t in query if t != PAD]
        assert 0 < len(tokens) <= 64 and tokens[-1] == DOT and tokens.count(DOT) >= 2  # several sentences
        starts = contains_at(corpus, tokens)
        assert starts and all(corpus[start - 1] == DOT for start in starts)  # right after a '.' of the book


def test_one_text_per_row_files_read_as_before(tokenizer, tmp_path):
    """--task.passage-rows 1 and no start/end text: each line is one text, as a file of passages needs."""
    (tmp_path / "lines.txt").write_text("A short line\nAnother one here\n")
    flags = ["--task.query-dataset", str(tmp_path / "lines.txt"), "--task.passage-rows", "1", "--task.start-text", "",
             "--task.end-text", ""]  # fmt: skip
    task = books_task(*flags)
    texts = rlhf_data.QueryTexts(task.query_dataset, None, task.query_field, task.passage_rows)
    assert [texts[0], texts[1]] == ["A short line", "Another one here"] and len(texts) == 2
    queries = R.QueryStream(texts, tokenizer, task, PAD, seed=0).next_batch(2)[0]
    assert sorted(R.decode(tokenizer, queries)) == ["A short line", "Another one here"]


def test_query_stream_resumes_exactly_from_its_state(tokenizer, tmp_path):
    (tmp_path / "lines.txt").write_text("\n".join(f"Line number {i} of the file" for i in range(50)) + "\n")
    task = R.TaskHParams(query_length=8, start_text="", end_text="")
    texts = rlhf_data.QueryTexts(str(tmp_path / "lines.txt"), None, "text")
    stream = R.QueryStream(texts, tokenizer, task, PAD, seed=3, chunk=7)
    first, second = stream.next_batch(30)[0], None
    state = json.loads(json.dumps(stream.state()))  # as a checkpoint's state.json holds it
    second = stream.next_batch(30)[0]  # crosses into the next epoch
    resumed = R.QueryStream(texts, tokenizer, task, PAD, seed=3, chunk=7)
    resumed.load_state(state)
    assert not first.equal(second[:30]) and resumed.next_batch(30)[0].equal(second)


# ---------------------------------------------------------------------------------------------------------------
# Hub datasets, from local directories laid out like the Hub's repos


def write_parquet(path, rows: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` writes what it loads into a cache of Arrow files: the test's own, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def test_a_hub_dataset_in_book_order_gives_batches_from_as_many_books_as_a_full_shuffle(tmp_path):
    """OpenAI shuffled its whole passage file; the Hub's bookcorpus has one sentence per row, in book order. A batch
    of 512 passages of 8 rows must come from as many books as a full shuffle of the passages gives: ~291 of these 400
    (a stream through a 10,000-passage shuffle buffer gave ~99 here; on bookcorpus 13-52 instead of ~500)."""
    books, book_rows, passage_rows, batch, batches = 400, 800, 8, 512, 4
    rows = [f"book {book} sentence {row} ." for book in range(books) for row in range(book_rows)]
    for shard in range(4):  # Parquet files under data/, as the Hub serves a dataset
        write_parquet(tmp_path / "books" / "data" / f"train-{shard:05d}-of-00004.parquet",
                      {"text": rows[shard * len(rows) // 4 : (shard + 1) * len(rows) // 4]})  # fmt: skip
    texts = rlhf_data.QueryTexts(str(tmp_path / "books"), None, "text", passage_rows)
    passages = [texts[i] for i in itertools.islice(texts.epoch(0, seed=1, rank=0, world_size=1), batch * batches)]
    starts = [(int(text.split()[1]), int(text.split()[3])) for text in passages]  # (book, sentence) of its first row
    for text, (b, s) in zip(passages, starts, strict=True):  # passage i is rows [8i, 8i + 8), joined
        assert s % passage_rows == 0 and text == " ".join(f"book {b} sentence {s + i} ." for i in range(passage_rows))
    ours = np.mean([len({b for b, _ in starts[i : i + batch]}) for i in range(0, len(starts), batch)])
    per_book = book_rows // passage_rows
    shuffled = np.random.default_rng(0).permutation(books * per_book)[: batch * batches] // per_book  # their books
    full = np.mean([len(set(shuffled[i : i + batch])) for i in range(0, len(shuffled), batch)])
    assert full > 280 and ours >= 0.9 * full, (ours, full)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """`datasets.load_dataset_builder` of a Hub id reads a local directory laid out as that repo (and revision) on
    the Hub: bookcorpus/bookcorpus's main branch ships a loading script, its refs/convert/parquet branch the Parquet
    files (tests/test_hub.py reads the same layouts over HTTP)."""
    books = tmp_path / "main" / "bookcorpus"  # datasets looks for the script named after the repo
    books.mkdir(parents=True)
    (books / "bookcorpus.py").write_text("import datasets  # a loading script, refused by datasets >= 4\n")
    (books / "README.md").write_text("# BookCorpus\n")
    rows = book_sentences(600)
    for shard in range(2):
        write_parquet(tmp_path / "bookcorpus-parquet" / "plain_text" / "train" / f"{shard:04d}.parquet",
                      {"text": rows[300 * shard : 300 * (shard + 1)]})  # fmt: skip
    cnndm = tmp_path / "cnn_dailymail-main"
    write_parquet(cnndm / "3.0.0" / "train-00000-of-00001.parquet", {"article": ["(CNN) -- First story."] * 20,
                                                                     "id": [str(i) for i in range(20)]})  # fmt: skip
    (cnndm / "README.md").write_text("---\nconfigs:\n- config_name: 3.0.0\n  data_files:\n  - split: train\n"
                                     "    path: 3.0.0/train-*\n---\n")  # fmt: skip
    layout = {("bookcorpus/bookcorpus", None): books, ("bookcorpus/bookcorpus", "refs/convert/parquet"):
              tmp_path / "bookcorpus-parquet", ("abisee/cnn_dailymail", None): cnndm}  # fmt: skip
    real, calls = datasets.load_dataset_builder, []

    def load_dataset_builder(path, *args, revision=None, **kwargs):
        calls.append((path, args, revision, kwargs.get("data_dir")))
        return real(str(layout[path, revision]), *args, **kwargs)

    def ships_loading_script(name):  # what the Hub answers: is there NAME.py on main
        return (layout[name, None] / f"{name.split('/')[-1]}.py").is_file()

    monkeypatch.setattr(datasets, "load_dataset_builder", load_dataset_builder)
    monkeypatch.setattr(rlhf_data, "ships_loading_script", ships_loading_script)
    monkeypatch.setattr(rlhf_data, "check_source", lambda value, flag: None)  # the Hub is "reachable"
    return calls, rows


def test_a_hub_dataset_with_a_loading_script_is_read_from_its_parquet_conversion(hub, tokenizer):
    calls, rows = hub
    task = books_task()  # the default: bookcorpus/bookcorpus, passages of 8 rows
    assert task.query_dataset == "bookcorpus/bookcorpus"
    texts = rlhf_data.QueryTexts.of_task(task)
    assert [call[2:] for call in calls] == [("refs/convert/parquet", None)]  # a script on main: the conversion
    assert len(texts) == 75 and texts[74] == " ".join(rows[592:])  # 600 rows, 8 to a passage
    epochs = [list(texts.epoch(0, seed=1, rank=rank, world_size=3)) for rank in range(3)]
    assert sorted(sum(epochs, [])) == list(range(75))  # each text once, in one process's part
    assert list(texts.epoch(0, 1, rank=2, world_size=3, start=5)) == epochs[2][5:]  # resumed: skips what it used
    assert list(texts.epoch(1, 1, rank=2, world_size=3)) != epochs[2]  # a new order each epoch
    streams = [R.QueryStream(texts, tokenizer, task, PAD, seed=1, rank=rank, world_size=2) for rank in (0, 1)]
    batches = [stream.next_batch(20)[0] for stream in streams]
    corpus = tokenizer.encode(rlhf_data.clean_query_text(" ".join(rows), "sentiment"))
    for query in batches[0].tolist() + batches[1].tolist():
        tokens = [t for t in query if t != PAD]
        starts = contains_at(corpus, tokens)  # empty if the query is not text of the corpus: all() alone would pass
        assert tokens[-1] == DOT and starts and all(corpus[start - 1] == DOT for start in starts)
    assert not set(map(tuple, batches[0].tolist())) & set(map(tuple, batches[1].tolist()))  # two disjoint shards
    state = streams[0].state()
    more = streams[0].next_batch(5)[0]
    resumed = R.QueryStream(texts, tokenizer, task, PAD, seed=1, rank=0, world_size=2)
    resumed.load_state(state)
    assert resumed.next_batch(5)[0].equal(more)  # a resumed stream skips exactly what it already read


def test_a_hub_dataset_of_parquet_files_loads_its_configuration(hub, tokenizer):
    calls, _ = hub
    task = books_task("--task.name", "cnndm")
    assert (task.query_dataset, task.query_dataset_config) == ("abisee/cnn_dailymail", "3.0.0")
    texts = rlhf_data.QueryTexts.of_task(task)
    assert calls == [("abisee/cnn_dailymail", ("3.0.0",), None, None)]
    task.query_length = 8
    queries = R.QueryStream(texts, tokenizer, task, PAD, seed=0).next_batch(3)[0]
    assert R.decode(tokenizer, queries) == ["First story."] * 3  # cleaned like OpenAI's cnndm


def test_a_missing_hub_dataset_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(rlhf_data, "check_source", lambda value, flag: None)
    with pytest.raises(SystemExit) as failure:
        rlhf_data.QueryTexts(str(tmp_path / "nowhere" / "at-all"), None, "text")
    message = str(failure.value)
    assert message.startswith("error: --task.query-dataset") and "cannot load it" in message and "\n" not in message


@pytest.mark.parametrize("field, problem", [("title", "is not a column of"), ("label", "holds Value('int64'")])
def test_a_query_field_that_is_not_a_text_column_is_a_one_line_error(tmp_path, field, problem):
    write_parquet(tmp_path / "reviews" / "data" / "train-00000-of-00001.parquet", {"text": ["Fine."], "label": [1]})
    with pytest.raises(SystemExit) as failure:
        rlhf_data.QueryTexts(str(tmp_path / "reviews"), None, field)
    message = str(failure.value)
    assert message.startswith(f"error: --task.query-field {field!r}") and problem in message and "\n" not in message


def test_label_files_come_from_a_directory_laid_out_like_the_hub_repo(tmp_path, tiny_assets):
    """--label-dataset-repo DIR: OpenAI's label files by their names in vwxyzjn/lm-human-preferences."""
    (tmp_path / "repo" / "sentiment").mkdir(parents=True)
    (tmp_path / "repo" / "sentiment" / "offline_5k.json").write_text(tiny_assets["small_labels"].read_text())
    flags = ["--base-model", str(tiny_assets["model"]), "--label-dataset-repo", str(tmp_path / "repo"),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--task.passage-rows", "1",
             "--labels.num-train", "64", "--batch-size", "16", "--dry-run"]  # fmt: skip
    args = R.validate_args(tyro.cli(R.Args, args=flags))
    tokenizer, labels, texts = R.read_inputs(args)
    assert labels["queries"].shape == (128, 64) and texts is not None


def test_the_default_label_file_under_hf_hub_offline_is_a_one_line_error(tiny_assets, tmp_path):
    result = run_script("train_reward_accelerate.py", "--base-model", str(tiny_assets["model"]),
                        "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"),
                        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")})  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --label-dataset 'sentiment/offline_5k.json': not in the Hugging Face cache and HF_HUB_OFFLINE=1; "
        "pass a local file to --label-dataset"
    )


def test_a_dry_run_with_hub_inputs_fetches_nothing_and_says_what_it_did_not_check(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(run_utils, "hub_offline", lambda: False)  # online, as a user's machine is (none is fetched)
    R.main(tyro.cli(R.Args, args=["--dry-run"]))
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dry_run"] == "ok" and report["not_checked"] == [
        "--base-model gpt2 (on the Hub)",
        "what needs --base-model's tokenizer: --task.truncate-token, the lengths against its positions, the label "
        "file's token ids, that the query texts yield queries",
        "--label-dataset sentiment/offline_5k.json (on the Hub)", "--task.query-dataset bookcorpus/bookcorpus (on the Hub)",
    ]  # fmt: skip
    P.main(tyro.cli(P.Args, args=["--dry-run", "--rewards.function", "sentiment"]))
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_checked"] == [
        "--base-model gpt2 (on the Hub)",
        "what needs --base-model's tokenizer: --task.truncate-token, the lengths against the models' positions, that "
        "the query texts yield queries",
        "--task.query-dataset bookcorpus/bookcorpus (on the Hub)",
    ]


def test_query_texts_of_a_task_nobody_said_how_to_clean_are_refused():
    """A new task name must say how its texts are cleaned: bookcorpus's clean-up (quotes, spaces before punctuation)
    would silently rewrite ordinary text."""
    assert rlhf_data.clean_query_text("`` a '' , b", "sentiment") == '"a", b'
    with pytest.raises(ValueError, match="no cleaning for task 'reviews'"):
        rlhf_data.clean_query_text("It's good , really", "reviews")
