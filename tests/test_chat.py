"""Chat models and the dataset's fields in rewards (--task.chat-template, --task.stop-when-ended, a --rewards.function
that names a column): the pieces by hand, then both scripts end to end on the tiny chat model (tests/tiny_task.py's
chat template, whose end-of-turn token is not EOS), on 1 and 2 processes, and through a resume.

The tiny chat runs hand their reward functions the `prompt` field beside the query it belongs to
(tests/chat_rewards.py): a field that travelled with another query is logged, and the tests assert the log empty.
"""

import json
import signal
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

import rlhf_data
import run_utils
import train_policy_accelerate as P
from tests.conftest import one_line_error, read_jsonl, run_script, script_command, script_environment
from tests.test_resume import assert_same_run, run_and_interrupt
from tests.tiny_task import CHAT_END

POLICY, REWARD = "train_policy_accelerate.py", "train_reward_accelerate.py"
EOS_ID, END_ID = 403, 404  # the tiny tokenizer's <|endoftext|>, and the chat template's <|end|> added after it
TEMPLATES = {
    "ChatML (SmolLM2, Qwen)": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "Llama 3": (
        "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "Gemma": (
        "{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + "
        "m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<start_of_turn>model\n' }}{% endif %}",
        ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
}  # fmt: skip
"""Chat templates of the shapes that common chat models use (written here for the test, not the models' own files),
the special tokens they need, and the end-of-turn text each puts after an answer."""


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_chat_assets):
    return P.load_tokenizer(str(tiny_chat_assets["model"]))


def chat_task(*flags: str) -> P.TaskHParams:
    """The policy's task flags as the command line gives them (task_cli applies --task.chat-template's defaults)."""
    return run_utils.task_cli(P.task_defaults, ["--rewards.function", "sentiment", *flags]).task


def query_texts(tmp_path: Path, rows: list[dict]) -> rlhf_data.QueryTexts:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rlhf_data.QueryTexts(str(tmp_path / "rows.jsonl"), None, "text")


# ---------------------------------------------------------------------------------------------------------------------
# the chat template


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_end_of_turn_token_is_what_the_template_writes_after_an_answer(tiny_tokenizer_dir, name):
    template, specials, end = TEMPLATES[name]
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.chat_template = template
    assert rlhf_data.end_of_turn_text(tokenizer) == end
    task = chat_task("--task.chat-template")
    assert rlhf_data.truncate_token_id(tokenizer, task) == tokenizer.convert_tokens_to_ids(end)


def test_a_chat_response_ends_at_the_end_of_turn_token_not_at_eos(chat_tokenizer):
    """The tiny template's <|end|> is a token of its own (as Llama 3's <|eot_id|>): EOS in a response is a word like
    any other, <|end|> ends it."""
    task = chat_task("--task.chat-template")
    end = rlhf_data.truncate_token_id(chat_tokenizer, task)
    assert end == END_ID == chat_tokenizer.convert_tokens_to_ids(CHAT_END) and end != chat_tokenizer.eos_token_id
    responses = torch.tensor([[5, EOS_ID, 6, END_ID, 7, 8], [END_ID, 9, 9, 9, 9, 9], [5, 6, EOS_ID, 7, 8, 9]])
    postprocessed, has_cut = P.truncate_responses(responses, end, task.truncate_after, chat_tokenizer.pad_token_id)
    pad = chat_tokenizer.pad_token_id
    assert postprocessed.tolist() == [[5, EOS_ID, 6, END_ID, pad, pad], [END_ID] + [pad] * 5, [5, 6, EOS_ID, 7, 8, 9]]
    assert has_cut.tolist() == [True, True, False]  # the last never ended: it scores --task.penalty-reward-value


def test_chat_template_flag_sets_its_defaults_and_a_flag_given_wins():
    plain, chat = chat_task(), chat_task("--task.chat-template")
    assert (plain.passage_rows, plain.start_text, plain.truncate_token, plain.truncate_after) == (8, ".", ".", 16)
    assert not plain.stop_when_ended and not plain.chat_template
    assert (chat.passage_rows, chat.start_text, chat.end_text, chat.truncate_token) == (1, "", "", "")
    assert chat.truncate_after == 0 and chat.stop_when_ended and chat.chat_template
    given = chat_task("--task.chat-template", "--task.truncate-after", "3", "--task.no-stop-when-ended")
    assert given.truncate_after == 3 and not given.stop_when_ended
    assert not chat_task("--task.chat-template", "--task.no-chat-template").chat_template


@pytest.mark.parametrize("flag", ["--task.start-text", "--task.end-text", "--task.truncate-token"])
def test_a_task_flag_the_chat_template_replaces_is_one_line(flag):
    args = run_utils.task_cli(P.task_defaults, ["--rewards.function", "sentiment", "--task.chat-template", flag, "."])
    with pytest.raises(SystemExit) as failure:
        P.validate_args(args)
    assert flag in one_line_error(failure) and "--task.chat-template" in str(failure.value.code)


def test_chat_queries_are_the_whole_prompt_in_the_template_and_a_longer_one_is_skipped(chat_tokenizer, tmp_path):
    """--task.query-length counts the templated prompt, prefix and suffix inside the user's turn; a prompt that does
    not fit is skipped whole (cut, it would lose the opened assistant's turn), and the policy and the reward model
    read the same tokens."""
    short, long = "the cat sat.", "the big dog ran on the mat and the sun saw the moon and the bird sat on a tree."
    texts = query_texts(tmp_path, [{"text": short}, {"text": long}, {"text": short}])
    task = chat_task("--task.chat-template", "--task.query-length", "14", "--task.query-prefix", "Say: ")
    stream = P.QueryStream(texts, chat_tokenizer, task, chat_tokenizer.pad_token_id, seed=0)
    queries, fields = stream.next_batch(3)
    prompt = chat_tokenizer.encode(f"Q: Say: {short}{CHAT_END}A:", add_special_tokens=False)
    pad = chat_tokenizer.pad_token_id
    assert queries.tolist() == [[pad] * (14 - len(prompt)) + prompt] * 3 and fields == {}
    assert torch.equal(stream.format(queries), queries)  # the policy reads what the reward model reads
    assert len(chat_tokenizer.encode(f"Q: Say: {long}{CHAT_END}A:")) > 14  # skipped, not cut
    only_long = P.QueryStream(query_texts(tmp_path, [{"text": long}]), chat_tokenizer, task, pad, seed=0)
    with pytest.raises(SystemExit) as failure:
        only_long.next_batch(1)
    assert "no text yields a query" in one_line_error(failure)


def test_an_end_of_turn_text_of_several_tokens_is_one_line(tiny_tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}[done]{% endfor %}"
    with pytest.raises(SystemExit) as failure:
        rlhf_data.truncate_token_id(tokenizer, chat_task("--task.chat-template"))
    assert "'[done]' is 5 tokens, not 1" in one_line_error(failure)  # '[', 'd', 'one' ... in the tiny vocabulary


# ---------------------------------------------------------------------------------------------------------------------
# sampling that stops once every row has ended


@pytest.fixture(scope="module")
def chat_lm(tiny_chat_assets):
    return P.load_pretrained(AutoModelForCausalLM, str(tiny_chat_assets["model"])).eval()


def chat_contexts(tokenizer, tmp_path, n: int) -> torch.Tensor:
    texts = rlhf_data.QueryTexts(str(tmp_path / "questions.jsonl"), None, "text")
    task = chat_task("--task.chat-template", "--task.query-length", "40")
    return P.QueryStream(texts, tokenizer, task, tokenizer.pad_token_id, seed=0).next_batch(n)[0]


@pytest.mark.parametrize("truncate_after", [0, 3])
def test_sampling_stops_once_every_row_has_ended_and_draws_what_full_sampling_draws(
    chat_lm, chat_tokenizer, tiny_chat_assets, tmp_path, truncate_after
):
    """The same draws as fixed-length sampling up to the stop, every row with its end of turn at an index >=
    truncate_after by then, and the last one to end ending in the last column: what the full-length responses become
    once truncated, to the last column."""
    (tmp_path / "questions.jsonl").write_bytes(tiny_chat_assets["questions"].read_bytes())
    contexts, pad = chat_contexts(chat_tokenizer, tmp_path, 12), chat_tokenizer.pad_token_id
    torch.manual_seed(5)
    full = P.sample_responses(chat_lm, contexts, pad, 24, 0.7)
    torch.manual_seed(5)
    stopped = P.sample_responses(chat_lm, contexts, pad, 24, 0.7, stop=(END_ID, truncate_after))
    length = stopped.shape[1]
    assert length < 24 and torch.equal(stopped, full[:, :length])
    index = torch.arange(length)
    is_end = (stopped == END_ID) & (index >= truncate_after)
    assert is_end.any(1).all() and not is_end[:, :-1].any(1).all()  # all ended, and not one column sooner
    truncated = P.truncate_responses(full, END_ID, truncate_after, pad)[0]
    assert (truncated[:, length:] == pad).all()  # the columns left out held nothing a truncated response keeps
    assert torch.equal(truncated[:, :length], P.truncate_responses(stopped, END_ID, truncate_after, pad)[0])


def test_a_truncate_token_before_truncate_after_does_not_end_a_row(chat_lm, chat_tokenizer, tiny_chat_assets, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """With --task.truncate-after 2, a row that writes its end of turn at index 0 has not ended (truncate_responses
    would not cut it there): sampling goes on until every row writes it at an index >= 2. The draws are scripted: every
    row draws the end of turn at steps 0 and 3, another token at steps 1 and 2."""
    (tmp_path / "questions.jsonl").write_bytes(tiny_chat_assets["questions"].read_bytes())
    contexts, pad = chat_contexts(chat_tokenizer, tmp_path, 4), chat_tokenizer.pad_token_id
    script = iter([END_ID, 7, 7, END_ID, 7, 7])
    monkeypatch.setattr(P, "draw_tokens", lambda probs: torch.full((len(probs), 1), next(script)))
    responses = P.sample_responses(chat_lm, contexts, pad, 6, 0.7, stop=(END_ID, 2))
    assert responses.tolist() == [[END_ID, 7, 7, END_ID]] * 4
    assert P.truncate_responses(responses, END_ID, 2, pad)[1].all()  # each ended, at index 3


def test_every_chunk_of_a_rollout_gets_the_length_of_its_longest_response(chat_lm, chat_tokenizer, tiny_chat_assets,
                                                                           tmp_path):  # fmt: skip
    """Chunks of 2 rows stop at their own ends; those that ended sooner sample on to the batch's length, so the
    rollout is one (B, T') tensor whose every row has ended by its last column, the last of them in it."""
    (tmp_path / "questions.jsonl").write_bytes(tiny_chat_assets["questions"].read_bytes())
    contexts, pad = chat_contexts(chat_tokenizer, tmp_path, 8), chat_tokenizer.pad_token_id
    torch.manual_seed(3)
    responses = P.generate_responses(chat_lm, contexts, pad, 24, 0.7, chunk=2, stop=(END_ID, 0))
    assert responses.shape[0] == 8 and responses.shape[1] < 24
    assert P.ended_length(responses, (END_ID, 0)) == responses.shape[1]
    for rows in responses.split(2):  # a chunk that ended sooner went on: its rows hold real tokens to the end
        assert (rows != pad).all()
    torch.manual_seed(3)
    fixed = P.generate_responses(chat_lm, contexts, pad, 24, 0.7, chunk=2)
    assert fixed.shape == (8, 24)


def test_a_rollout_given_whole_is_cut_after_the_column_its_last_row_ends_in():
    """benchmark/openai/replay.py hands full-length responses: they are cut where sampling would have stopped."""
    given = torch.tensor([[1, END_ID, 1, 1, 1], [1, 1, 1, END_ID, 1], [END_ID, 1, 1, 1, 1]])
    cut = P.sampled_to_one_length(None, (torch.zeros(3, 2),), [given], 0, 0.7, 1, (END_ID, 0))
    assert [r.tolist() for r in cut] == [given[:, :4].tolist()]
    assert P.ended_length(given, (END_ID, 1)) == 5  # row 3's end comes before index 1: it never ends
    assert P.ended_length(given[:0], (END_ID, 0)) == 0


# ---------------------------------------------------------------------------------------------------------------------
# the dataset's fields


def test_fields_travel_with_their_queries_through_the_shuffle_processes_and_a_resume(chat_tokenizer, tmp_path):
    """Each batch's fields are its queries' own rows, whatever order an epoch shuffles the texts into, on each process
    of two (which together read every text once an epoch), across the end of an epoch, and after a stream's state was
    saved mid-buffer and loaded into a new stream (a --resume)."""
    words = "the a cat dog sat on mat happy sad good bad great house river tree bird sun moon ran saw big small".split()
    rows = [{"text": f"{words[i % 22]} {words[(3 * i) % 22]} {i}.", "number": i, "extra": [i, -i]} for i in range(30)]
    texts = query_texts(tmp_path, rows)
    assert texts.columns == ["number", "extra"]
    texts.carry(("number", "extra"), "--rewards.function f")
    task = chat_task("--task.chat-template", "--task.query-length", "20")
    pad = chat_tokenizer.pad_token_id
    streams = [P.QueryStream(texts, chat_tokenizer, task, pad, seed=4, rank=r, world_size=2, chunk=4) for r in (0, 1)]
    seen = []
    for stream in streams:
        for n in (5, 6, 9):  # 20 rows of the 15 a process reads an epoch: into its second epoch
            queries, fields = stream.next_batch(n)
            decoded = P.decode(chat_tokenizer, queries)
            assert [int(text.split()[-1].rstrip(".A:")) for text in decoded] == fields["number"]
            assert fields["extra"] == [[i, -i] for i in fields["number"]]
            seen.append(fields["number"])
    first_epochs = seen[0] + seen[1] + seen[2][:4] + seen[3] + seen[4] + seen[5][:4]
    assert sorted(first_epochs) == list(range(30))  # each text once an epoch, on one process of the two
    state = json.loads(json.dumps(streams[0].state()))  # as a checkpoint's state.json holds it
    expected = streams[0].next_batch(7)
    resumed = P.QueryStream(texts, chat_tokenizer, task, pad, seed=4, rank=0, world_size=2, chunk=4)
    resumed.load_state(state)
    again = resumed.next_batch(7)
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1]


def test_fields_of_a_hub_dataset_are_read_for_the_batch_rows(chat_tokenizer, tmp_path, monkeypatch):
    """A Hub dataset (a local directory laid out like one: Parquet files) hands on its other columns too."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    texts = [f"the cat {i}." for i in range(12)]
    pq.write_table(pa.table({"text": texts, "answer": list(range(12)), "note": ["x"] * 12}),
                   tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")  # fmt: skip
    hub = rlhf_data.QueryTexts(str(tmp_path / "hub"), None, "text")
    assert hub.columns == ["answer", "note"] and hub.fields([3, 1]) == {}
    hub.carry(("answer",), "--rewards.function f")
    assert hub.fields([3, 1, 10]) == {"answer": [3, 1, 10]}
    stream = P.QueryStream(hub, chat_tokenizer, chat_task("--task.chat-template", "--task.query-length", "20"),
                           chat_tokenizer.pad_token_id, seed=2)  # fmt: skip
    queries, fields = stream.next_batch(5)
    assert [int(text.split()[-1].rstrip(".A:")) for text in P.decode(chat_tokenizer, queries)] == fields["answer"]


def test_a_reward_function_takes_the_columns_its_signature_names():
    def positional(queries, responses, answer, note="n"):
        return queries

    def keywords(queries, responses, *, answer, unused=None):
        return queries

    def everything(queries, responses, **fields):
        return queries

    columns = ["answer", "note", "other"]
    assert P.function_fields(positional, columns, "f") == ("answer", "note")
    assert P.function_fields(keywords, columns, "f") == ("answer",)  # `unused` is no column: its default stays
    assert P.function_fields(everything, columns, "f") == ("answer", "note", "other")
    assert P.function_fields(lambda queries, responses: 0, columns, "f") == ()  # the paper's functions, unchanged
    with pytest.raises(SystemExit) as failure:
        P.function_fields(lambda texts: 0, columns, "--rewards.function m:f")
    assert "--rewards.function m:f: takes 1 positional argument(s)" in one_line_error(failure)
    fields = {"answer": [1, 2], "note": ["a", "b"], "other": [0, 0]}
    assert P.call_with_fields(lambda q, r, answer: answer, ["q", "q"], ["r", "r"], fields) == [1, 2]


def test_fields_of_a_passage_of_several_rows_are_one_line(tmp_path):
    query_texts(tmp_path, [{"text": "a.", "answer": 1}] * 4)
    texts = rlhf_data.QueryTexts(str(tmp_path / "rows.jsonl"), None, "text", rows_per_text=2)
    with pytest.raises(SystemExit) as failure:
        texts.carry(("answer",), "--rewards.function m:f")
    assert "--task.passage-rows 2" in one_line_error(failure)


# ---------------------------------------------------------------------------------------------------------------------
# both scripts end to end on the tiny chat model


def chat_policy_flags(assets, output_dir, *extra) -> list[str]:
    return ["--base-model", str(assets["model"]), "--task.chat-template", "--task.query-dataset",
            str(assets["questions"]), "--task.query-length", "40", "--task.response-length", "16",
            "--rewards.function", "tests.chat_rewards:word_count", "--task.gold-labeler",
            "tests.chat_rewards:ends_quickly", "--eval-queries", "8", "--eval-samples-per-query", "2", "--eval-every",
            "2", "--ppo.batch-size", "16", "--ppo.total-episodes", "64", "--ppo.whitening-ranks", "2",
            "--ppo.lr", "1e-3", "--local-rollout-forward-batch-size", "4", "--output-dir", str(output_dir), *extra]  # fmt: skip


def alignment_log(tmp_path: Path) -> tuple[Path, dict]:
    log = tmp_path / "alignment.log"
    return log, {"CHAT_ALIGNMENT_LOG": str(log)}


@pytest.fixture(scope="module")
def chat_runs(tiny_chat_assets, tmp_path_factory) -> dict[int, Path]:
    """The tiny chat policy run on 1 and on 2 processes, with the same flags, and each run's alignment log."""
    runs = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"chat-{nproc}")
        log, env = alignment_log(root)
        result = run_script(POLICY, *chat_policy_flags(tiny_chat_assets, root / "run"), nproc=nproc, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[nproc] = root
    return runs


@pytest.mark.parametrize("nproc", [1, 2])
def test_chat_policy_with_fields_trains_end_to_end(chat_runs, nproc):
    """PPO on the tiny chat model: the rollout in chunks of 4 that stop at their ends, every reward and gold-labeler
    call handed its queries' own fields (on 2 processes, each process's rows, also in the gold evaluation), responses
    that end at <|end|>, a policy saved with the chat template."""
    run, log = chat_runs[nproc] / "run", chat_runs[nproc] / "alignment.log"
    assert not log.exists(), log.read_text()
    assert json.loads((run / "args.json").read_text())["world_size"] == nproc  # as many processes ran as launched
    rows = read_jsonl(run / "metrics.jsonl")
    assert [row["update"] for row in rows] == [0, 1, 2, 3, 4] and "eval/gold_score" in rows[0]
    samples = read_jsonl(run / "eval_samples.jsonl")
    assert {row["update"] for row in samples} == {0, 2, 4} and len(samples) == 3 * 16
    assert all(row["gold_score"] in (0.0, 1.0) and row["query"].startswith("Q: ") for row in samples)
    assert all(0 < row["objective/sampled_length"] <= 16 for row in rows[1:])
    assert any(row["objective/sampled_length"] < 16 for row in rows[1:])  # sampling stopped sooner at least once
    assert AutoTokenizer.from_pretrained(run / "policy").chat_template is not None


def test_the_gold_evaluation_samples_the_same_on_1_and_2_processes(chat_runs):
    """Update 0's held-out samples (the pretrained policy) are the same whatever the number of processes: every
    process draws for every held-out query with the evaluation's seed, then scores its share; the rows come back in the
    held-out order. So the "before" gold score of a 1-GPU and an 8-GPU run is one number (issue 66: it was -0.0254 on
    1 process and -0.0351 on 2, each process drawing with its own seed)."""
    one, two = (read_jsonl(chat_runs[n] / "run" / "eval_samples.jsonl") for n in (1, 2))
    before = [[row for row in rows if row["update"] == 0] for rows in (one, two)]
    keys = ("query_index", "query", "response", "gold_score", "rm_score")
    assert [[row[key] for key in keys] for row in before[0]] == [[row[key] for key in keys] for row in before[1]]
    assert [row["kl"] for row in before[0]] == pytest.approx([row["kl"] for row in before[1]], abs=1e-4)
    metrics = [read_jsonl(chat_runs[n] / "run" / "metrics.jsonl")[0] for n in (1, 2)]
    assert metrics[0]["eval/gold_score"] == metrics[1]["eval/gold_score"]
    assert len({row["response"] for row in before[0]}) > 4  # samples that differ from one another: a real check


def test_chat_reward_model_trains_and_the_policy_needs_the_same_template(tiny_chat_assets, tmp_path):
    """The reward script on chat queries (simulated labels of responses cut at <|end|>); the policy reads its
    reward model with --task.chat-template, and without it gets one line."""
    reward = run_script(REWARD, "--base-model", str(tiny_chat_assets["model"]), "--task.chat-template",
                        "--task.query-dataset", str(tiny_chat_assets["questions"]), "--task.query-length", "40",
                        "--task.response-length", "16", "--labels.source", "sentiment", "--labels.num-train", "16",
                        "--labels.simulated-num-test", "8", "--batch-size", "8", "--rollout-batch-size", "8",
                        "--normalize-samples", "8", "--local-rollout-forward-batch-size", "8",
                        "--output-dir", str(tmp_path / "rm"))  # fmt: skip
    assert reward.returncode == 0, reward.stderr[-3000:]
    info = json.loads((tmp_path / "rm" / "reward_model" / "reward_model.json").read_text())
    assert info["chat_template"] is True
    labels = json.loads((tmp_path / "rm" / "labels.json").read_text())
    assert all(len(record[f"sample{i}"]) == 16 for record in labels for i in range(4))  # padded back to the length
    assert any(END_ID in record["sample0"] for record in labels)
    flags = chat_policy_flags(tiny_chat_assets, tmp_path / "policy", "--ppo.total-episodes", "16")
    at = flags.index("--rewards.function")
    flags[at : at + 2] = ["--rewards.trained-model", str(tmp_path / "rm" / "reward_model")]
    policy = run_script(POLICY, *flags)
    assert policy.returncode == 0, policy.stderr[-3000:]
    flags[flags.index("--task.chat-template")] = "--task.no-chat-template"
    plain = run_script(
        POLICY, *flags, "--task.truncate-after", "2", "--output-dir", str(tmp_path / "plain"), "--dry-run"
    )
    assert (
        plain.returncode == 1 and "was trained on queries in a chat template: add --task.chat-template" in plain.stderr
    )


def test_a_chat_run_with_fields_resumes_exactly(tiny_chat_assets, tmp_path):
    """SIGTERM after a checkpoint, then --resume: the same metrics and weights as an uninterrupted run, with every
    field still beside its query (the stream's buffered rows and position come back from the checkpoint)."""
    log, env = alignment_log(tmp_path)
    flags = ["--checkpoint-every", "1", "--ppo.total-episodes", "96"]
    reference = run_script(POLICY, *chat_policy_flags(tiny_chat_assets, tmp_path / "reference", *flags), env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = script_command(POLICY, chat_policy_flags(tiny_chat_assets, tmp_path / "run", *flags))
    status, output = run_and_interrupt(command, tmp_path / "run", signal.SIGTERM, after_rows=3,
                                       env=script_environment(env=env))  # fmt: skip
    assert status == 128 + signal.SIGTERM, output[-3000:]
    resumed = run_script(POLICY, *chat_policy_flags(tiny_chat_assets, tmp_path / "run", *flags, "--resume"), env=env)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert not log.exists(), log.read_text()
    assert_same_run(tmp_path / "run", tmp_path / "reference", "policy/model.safetensors")


def test_the_stopping_benchmark_runs_both_arms_on_the_same_flags(tiny_chat_assets, capsys):
    """benchmark/speed/stop_when_ended.py (docs/chat.md's measurement) on the tiny chat model: the stopping arm samples
    fewer columns than the fixed-length arm's --task.response-length, which samples them all."""
    from benchmark.speed import stop_when_ended

    args = stop_when_ended.Args(base_model=str(tiny_chat_assets["model"]), dataset=str(tiny_chat_assets["questions"]),
                                reward_function="tests.chat_rewards:word_count", response_length=24, query_length=40,
                                batch_size=8, updates=2, repeats=1, threads=1)  # fmt: skip
    results = stop_when_ended.main(args)
    stopping, fixed = results
    assert stopping["stop_when_ended"] and not fixed["stop_when_ended"]
    assert max(stopping["sampled_length"]) < 24 and fixed["sampled_length"] == [24, 24]
    assert all(len(result[phase]) == 2 for result in results for phase in stop_when_ended.PHASES)
    assert "| stops when every response ended | 2 |" in capsys.readouterr().out
