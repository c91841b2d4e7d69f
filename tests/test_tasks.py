"""OpenAI's four tasks (launch.py): `--task.name` sets every per-task default in both scripts (`--help` shows them),
explicit flags win, the summarization texts are cleaned like OpenAI's, the policy reads prefix ⊕ query ⊕ suffix while
the reward model reads the bare query, label files of the summarization shape load, and a tiny tldr run goes end to
end (offline)."""

import dataclasses
import json
import re
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

import rlhf_data
import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import one_line_error, read_jsonl, run_script, synthetic_sentences

PAD = 50257  # GPT-2's [PAD]
OPENAI_PAD = 50259
NEWLINE = 198  # '\n' in GPT-2
TL = 14990  # 'TL' in GPT-2: "\n\nTL;DR:" is [198, 198, 14990, 26, 7707, 25]
TASKS = ("sentiment", "descriptiveness", "tldr", "cnndm")

# OAI's launch.py, written out by hand (not read from the scripts' tables); the Hub datasets by their full ids
BOOKS = dict(query_dataset="bookcorpus/bookcorpus", query_dataset_config=None, query_field="text", passage_rows=8,
             query_length=64, response_length=24, query_prefix="", query_suffix="", start_text=".", end_text=".",
             truncate_token=".", truncate_after=16, temperature=0.7)  # fmt: skip
SUMMARIZATION = dict(passage_rows=1, query_length=500, response_length=75, query_prefix="", query_suffix="\n\nTL;DR:",
                     start_text="", end_text="", truncate_token="\n", truncate_after=55, temperature=0.7)  # fmt: skip
OAI_TASK = {
    "sentiment": BOOKS,
    "descriptiveness": BOOKS,
    "tldr": dict(SUMMARIZATION, query_dataset="webis/tldr-17", query_dataset_config=None, query_field="content"),
    "cnndm": dict(SUMMARIZATION, query_dataset="abisee/cnn_dailymail", query_dataset_config="3.0.0",
                  query_field="article", query_prefix="Article:\n\n", temperature=0.5),
}  # fmt: skip
OAI_REWARD = {  # label file, labels.num_train, batch_size, lr, rollout_batch_size
    "sentiment": ("sentiment/offline_5k.json", 4992, 32, 5e-5, 512),
    "descriptiveness": ("descriptiveness/offline_5k.json", 4992, 32, 5e-5, 512),
    "tldr": ("tldr/online_45k.json", 46000, 16, 2.5e-5, 128),
    "cnndm": ("cnndm/online_45k.json", 46000, 16, 2.5e-5, 128),
}
OAI_PPO = {  # ppo.batch_size, ppo.lr, rewards.kl_coef, rewards.use_adaptive_kl, ppo.whiten_rewards
    "sentiment": (512, 1e-5, 0.15, True, True),
    "descriptiveness": (512, 1e-5, 0.15, True, True),
    "tldr": (32, 2e-6, 0.03, False, False),
    "cnndm": (32, 2e-6, 0.01, False, False),
}


def reward_args(*flags: str) -> R.Args:
    return R.validate_args(run_utils.task_cli(R.task_defaults, flags))  # as the script's last line parses them


def policy_args(*flags: str) -> P.Args:
    return P.validate_args(run_utils.task_cli(P.task_defaults, ["--rewards.trained-model", "x", *flags]))


# ---------------------------------------------------------------------------------------------------------------
# per-task defaults


@pytest.mark.parametrize("task", TASKS)
def test_task_defaults_resolve_as_openai_set_them_in_both_scripts(task, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    reward, policy = reward_args("--task.name", task), policy_args("--task.name", task)
    for args in (reward, policy):
        assert {key: getattr(args.task, key) for key in OAI_TASK[task]} == OAI_TASK[task]
    label_dataset, num_train, batch_size, lr, rollout_batch_size = OAI_REWARD[task]
    assert (reward.label_dataset, reward.labels.num_train, reward.batch_size) == (label_dataset, num_train, batch_size)
    assert (reward.lr, reward.rollout_batch_size) == (lr, rollout_batch_size)
    assert reward.num_updates == num_train // batch_size  # 156 (books) or 2875 (summarization) steps
    batch_size, lr, kl_coef, adaptive, whiten = OAI_PPO[task]
    assert (policy.ppo.batch_size, policy.ppo.lr, policy.ppo.whiten_rewards) == (batch_size, lr, whiten)
    assert (policy.rewards.kl_coef, policy.rewards.use_adaptive_kl) == (kl_coef, adaptive)
    assert policy.ppo.total_episodes == 1_000_000 and policy.num_updates == -(-1_000_000 // batch_size)


def test_the_default_task_is_sentiment_and_the_truncate_tokens_are_single_gpt2_tokens(monkeypatch, tokenizer):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert reward_args().task.name == policy_args().task.name == "sentiment"
    assert tokenizer.encode(".") == [13] and tokenizer.encode("\n") == [NEWLINE]
    assert tokenizer.encode("\n\nTL;DR:") == [NEWLINE, NEWLINE, TL, 26, 7707, 25]


def test_task_defaults_are_what_the_command_line_gives():
    """Tests and programs that build Args for a task get exactly what `--task.name` gives a user."""
    for module in (R, P):
        required = ["--rewards.trained-model", "x"] if module is P else []  # the policy's one required flag

        def given(args, required=required):
            if required:
                args.rewards.trained_model = "x"
            return args

        for task in TASKS:
            expected = given(module.task_defaults(task))
            assert expected == run_utils.task_cli(module.task_defaults, ["--task.name", task, *required])
            assert expected == run_utils.task_cli(module.task_defaults, [f"--task.name={task}", *required])
        assert (
            given(module.task_defaults()) == given(module.Args()) == run_utils.task_cli(module.task_defaults, required)
        )
        with pytest.raises(SystemExit):  # an unknown task is tyro's error, not a silent books run
            run_utils.task_cli(module.task_defaults, ["--task.name", "books"])


def test_an_explicit_flag_equal_to_the_books_default_still_wins(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    policy = policy_args("--task.name", "tldr", "--task.response-length", "24", "--task.truncate-after", "16",
                         "--ppo.batch-size", "512", "--rewards.use-adaptive-kl", "--task.query-dataset",
                         "bookcorpus/bookcorpus")  # fmt: skip
    assert (policy.task.response_length, policy.task.truncate_after, policy.ppo.batch_size) == (24, 16, 512)
    assert (policy.rewards.use_adaptive_kl, policy.task.query_dataset) == (True, "bookcorpus/bookcorpus")
    assert (policy.task.query_length, policy.ppo.lr, policy.rewards.kl_coef) == (500, 2e-6, 0.03)  # the task's
    reward = reward_args("--task.name", "cnndm", "--batch-size", "32", "--lr", "5e-5", "--labels.num-train", "4992",
                         "--task.temperature", "0.7", "--task.query-prefix", "")  # fmt: skip
    assert (reward.batch_size, reward.lr, reward.labels.num_train) == (32, 5e-5, 4992)
    assert (reward.task.temperature, reward.task.query_prefix) == (0.7, "")
    assert (reward.rollout_batch_size, reward.task.response_length) == (128, 75)  # the task's


def test_explicit_flags_override_the_task_defaults(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    policy = policy_args("--task.name", "tldr", "--ppo.batch-size", "64", "--rewards.kl-coef", "0.05",
                         "--rewards.use-adaptive-kl", "--ppo.whiten-rewards", "--task.query-length",
                         "48", "--task.query-suffix", "", "--task.temperature", "1.0", "--task.truncate-token", ".")  # fmt: skip
    assert (policy.ppo.batch_size, policy.rewards.kl_coef, policy.rewards.use_adaptive_kl) == (64, 0.05, True)
    assert (policy.ppo.whiten_rewards, policy.task.query_length, policy.task.query_suffix) == (True, 48, "")
    assert (policy.task.temperature, policy.task.truncate_token) == (1.0, ".")
    assert (policy.ppo.lr, policy.task.response_length, policy.task.truncate_after) == (2e-6, 75, 55)  # the task's
    assert policy.task.query_dataset == "webis/tldr-17"
    reward = reward_args("--task.name", "cnndm", "--batch-size", "32", "--labels.num-train", "640", "--lr", "1e-4",
                         "--task.query-prefix", "", "--task.query-dataset", "articles.jsonl",
                         "--label-dataset", "mine.json")  # fmt: skip
    assert (reward.batch_size, reward.labels.num_train, reward.lr, reward.num_updates) == (32, 640, 1e-4, 20)
    assert (reward.task.query_prefix, reward.task.query_dataset) == ("", "articles.jsonl")
    assert reward.label_dataset == "mine.json"
    assert (reward.rollout_batch_size, reward.task.query_suffix, reward.task.temperature) == (128, "\n\nTL;DR:", 0.5)
    assert reward.task.query_dataset_config == "3.0.0"


def test_summarization_batches_are_checked_against_the_number_of_processes(monkeypatch):
    """PPO batch 32 on 8 processes is 4 episodes each: fine without reward whitening (OAI's summarization setting),
    but whitening it would use too few rows, and 32 episodes don't split over 3 processes."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert policy_args("--task.name", "tldr").local_batch_size == 4
    with pytest.raises(SystemExit) as failure:
        policy_args("--task.name", "tldr", "--ppo.whiten-rewards")
    assert "--ppo.whiten-rewards" in one_line_error(failure)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as failure:
        policy_args("--task.name", "cnndm")
    assert "--ppo.batch-size" in one_line_error(failure)


def help_defaults(module, capsys, *flags: str) -> dict[str, str]:
    """flag -> the default that `SCRIPT *flags --help` shows for it (parsed as the script's last line parses)."""
    with pytest.raises(SystemExit):
        run_utils.task_cli(module.task_defaults, [*flags, "--help"])
    entries, flag = {}, None
    for line in capsys.readouterr().out.splitlines():
        text = line.strip("│ ")
        if text.startswith("--") and len(line.lstrip("│")) - len(line.lstrip("│ ")) < 4:  # a flag, not its help
            flag = text.split()[0].rstrip(",")
            entries[flag] = ""
        elif flag is not None:
            entries[flag] += " " + text
    defaults = {flag: re.findall(r"\(default: ([^()]*)\)", text) for flag, text in entries.items()}
    return {flag: found[-1] for flag, found in defaults.items() if found}


def oai_flags(module, task: str) -> dict[str, object]:
    """flag -> OAI's value for `task` in `module`'s script, from the tables above."""
    values = {f"--task.{key.replace('_', '-')}": value for key, value in OAI_TASK[task].items()}
    if module is R:
        flags = ("--label-dataset", "--labels.num-train", "--batch-size", "--lr", "--rollout-batch-size")
        return values | dict(zip(flags, OAI_REWARD[task], strict=True))
    flags = ("--ppo.batch-size", "--ppo.lr", "--rewards.kl-coef", "--rewards.use-adaptive-kl", "--ppo.whiten-rewards")
    return values | dict(zip(flags, OAI_PPO[task], strict=True))


TASK_FLAGS = {"sentiment": [], "descriptiveness": ["--task.name", "descriptiveness"], "tldr": ["--task.name", "tldr"],
              "cnndm": ["--task.name=cnndm"]}  # fmt: skip


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("module", [R, P], ids=["reward", "policy"])
def test_help_shows_the_tasks_defaults(module, task, capsys):
    """`--help` shows the books tasks' values (24-token responses), `--task.name tldr --help` tldr's (75)."""
    shown = help_defaults(module, capsys, *TASK_FLAGS[task])
    assert shown["--task.name"] == task and shown["--task.response-length"] == str(OAI_TASK[task]["response_length"])
    expected = oai_flags(module, task)
    assert len(expected) == 18
    for flag, value in expected.items():
        if "\n" not in str(value):  # such a string spans help lines; the parse test above checks it
            assert shown[flag] in (str(value), repr(value)), (flag, shown[flag], value)


NONE_BY_DESIGN = {"--wandb-entity", "--output-dir", "--peak-tflops", "--hf-repo-id", "--task.query-dataset-config",
                  "--gpu-memory-gb"}  # fmt: skip
"""The flags whose default is really None (not set), in both scripts; the policy adds two."""


@pytest.mark.parametrize("module", [R, P], ids=["reward", "policy"])
def test_help_shows_none_only_where_none_is_meant(module, capsys):
    shown = help_defaults(module, capsys)
    assert len(shown) > 40 and shown["--seed"] == "1"
    extra = {"--task.gold-labeler", "--rewards.function"} if module is P else set()
    assert {flag for flag, default in shown.items() if default == "None"} == NONE_BY_DESIGN | extra


def test_the_reward_model_flag_is_required_unless_a_reward_function_is_given(capsys, tmp_path):
    """--help says (required unless --rewards.function), not (default: None); with neither flag, or both, the script
    stops with one line naming them, before anything loads."""
    with pytest.raises(SystemExit):
        run_utils.task_cli(P.task_defaults, ["--help"])
    help_text = " ".join(line.strip("│ ") for line in capsys.readouterr().out.splitlines())
    assert re.search(
        r"--rewards\.trained-model \S+ +reward model directory .{0,120}\(required unless --rewards\.function\) +"
        r"--rewards\.function",
        help_text,
    )
    assert "(default: None)" not in help_text.split("--rewards.trained-model")[1].split("--rewards.function")[0]
    for flags in ([], ["--rewards.trained-model", str(tmp_path), "--rewards.function", "sentiment"]):
        args = run_utils.task_cli(P.task_defaults, ["--dry-run", *flags])
        with pytest.raises(SystemExit) as failure:
            P.validate_args(args)
        message = str(failure.value.code)
        assert "\n" not in message and "--rewards.trained-model" in message and "--rewards.function" in message


# ---------------------------------------------------------------------------------------------------------------
# query texts


@pytest.mark.parametrize(
    "article, expected",
    [
        ("LONDON, England (CNN) -- Harry Potter star Daniel Radcliffe turns 18.", "Harry Potter star Daniel Radcliffe turns 18."),
        ("(CNN)Share prices fell on Monday.", "Share prices fell on Monday."),
        ("By . Daily Mail Reporter . PUBLISHED: . 14:11 EST, 25 October 2013 . | . UPDATED: . 15:36 EST, 25 October "
         "2013 . The bishop said \u2018no\u2019 to \u201cthem\u201d.", "The bishop said 'no' to \"them\"."),
        ("By . Rebecca Evans . Last updated at 4:07 PM on 12th March 2012 . A woman was found.", "A woman was found."),
        ("By . Associated Press . The man was arrested.", "The man was arrested."),
        ("By\nDaily Mail Reporter\n\n\n\nUPDATED:\n 15:36 EST, 25 October 2013\n\n\nIt\u2019s a \u201cgreat\u201d day."
         "\r\n\r\n\r\n\r\nSecond paragraph.\n\n@highlight\n\nBishop says no\n\n@highlight\n\nMore",
         "It's a \"great\" day.\n\nSecond paragraph."),
        ("By the time police arrived, he had fled.", "By the time police arrived, he had fled."),  # no byline
        ("A first sentence long enough to push the dateline past the first one hundred characters of the text, "
         "then (CNN) -- more.", "A first sentence long enough to push the dateline past the first one hundred "
         "characters of the text, then (CNN) -- more."),  # only a dateline at the start is one
        ("  Plain story.\n\n\n\nNext.  ", "Plain story.\n\nNext."),
    ],
    ids=["cnn-dateline", "cnn-no-dashes", "dm-published-updated", "dm-last-updated", "byline-only",
         "story-file", "by-in-a-sentence", "late-cnn", "whitespace"],
)  # fmt: skip
def test_cnndm_clean_up_of_crafted_articles(article, expected):
    assert rlhf_data.clean_query_text(article, "cnndm") == expected


def test_tldr_texts_are_normalized_and_tokenized_book_rows_joined_back():
    clean = rlhf_data.clean_query_text
    text = "  I (25F) said \u201chi\u201d.\r\n\r\n\r\nTL;DR he didn\u2019t  "
    assert clean(text, "tldr") == 'I (25F) said "hi".\n\nTL;DR he didn\'t'
    assert clean(text, "sentiment") == clean(text, "descriptiveness") == text  # running text
    row = "usually , he would n't go . `` hello , '' she said ( twice ) . it 's fine !"  # a Hub bookcorpus row
    assert clean(row, "sentiment") == "usually, he wouldn't go. \"hello,\" she said (twice). it's fine!"
    assert clean("(CNN) -- By . X . text", "tldr") == "(CNN) -- By . X . text"  # cnndm only


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer_dir):
    return R.load_tokenizer(str(gpt2_tokenizer_dir))


def test_contexts_put_prefix_and_suffix_around_the_bare_query_and_move_middle_pads_left(tokenizer, tmp_path):
    """cnndm's formatting on queries of 8 tokens: OAI builds prefix ⊕ right-padded query ⊕ suffix (pads in the
    middle); every row of ours is that row left-padded, and the bare queries stay as the reward model's."""
    task = dataclasses.replace(R.task_defaults("cnndm").task, query_length=8)  # "Article:\n\n", "\n\nTL;DR:"
    texts = ["One two three four five six seven eight nine ten.", "Short one.", "Three words here"]
    stream = R.QueryStream(query_texts(tmp_path, texts), tokenizer, task, PAD, seed=0, chunk=3)
    queries = stream.next_batch(3)[0]  # (3, 8)
    contexts = stream.format(queries)
    prefix, suffix = tokenizer.encode("Article:\n\n"), tokenizer.encode("\n\nTL;DR:")
    assert (len(prefix), len(suffix), contexts.shape) == (3, 6, (3, 3 + 8 + 6))
    for query, context in zip(queries.tolist(), contexts.tolist(), strict=True):
        bare = [t for t in query if t != PAD]
        assert query == [PAD] * (8 - len(bare)) + bare  # left-padded bare query
        openai_row = prefix + bare + [PAD] * (8 - len(bare)) + suffix  # OAI's layout: pads between query and suffix
        assert context == [PAD] * (8 - len(bare)) + [t for t in openai_row if t != PAD]
        assert context[-len(suffix) :] == suffix  # the last column is a real token
    assert sorted(R.decode(tokenizer, queries)) == sorted(["One two three four five six seven eight", "Short one.",
                                                           "Three words here"])  # fmt: skip
    assert torch.equal(R.right_padding_to_left_padding(contexts, PAD), contexts)


def test_books_contexts_equal_the_queries(tokenizer, tmp_path):
    task = R.TaskHParams(query_length=6, start_text="", end_text="")  # the books tasks' empty prefix and suffix
    stream = R.QueryStream(query_texts(tmp_path, ["Hello world.", "usually, he would"]), tokenizer, task, PAD, seed=0)
    queries = stream.next_batch(2)[0]
    assert torch.equal(stream.format(queries), queries)


# ---------------------------------------------------------------------------------------------------------------
# the reward model reads the bare query


class RecordingReward(nn.Module):
    """Stands in for the reward model: score 0, remembers every input."""

    pad_id = PAD

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.cat([queries, responses], 1))
        return torch.zeros(len(queries))


def tiny_lm(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16)).eval()


def query_texts(tmp_path, lines: list[str]) -> rlhf_data.QueryTexts:
    (tmp_path / "queries.txt").write_text("\n".join(lines) + "\n")
    return rlhf_data.QueryTexts(str(tmp_path / "queries.txt"), None, "text")


def summarization_stream(tokenizer, query_length: int, tmp_path) -> R.QueryStream:
    task = dataclasses.replace(R.task_defaults("tldr").task, query_length=query_length, query_prefix="Article:\n\n",
                               response_length=4, truncate_after=1)  # fmt: skip
    return R.QueryStream(query_texts(tmp_path, synthetic_sentences(20, seed=0)), tokenizer, task, PAD, seed=0)


def test_policy_rollout_samples_from_the_contexts_and_scores_the_bare_queries(tokenizer, tmp_path):
    stream = summarization_stream(tokenizer, query_length=6, tmp_path=tmp_path)
    queries = stream.next_batch(3)[0]
    queries[1, :2] = PAD  # a shorter query
    contexts = stream.format(queries)  # (3, 3 + 6 + 6)
    args = P.Args(local_rollout_forward_batch_size=2)  # 2 chunks
    args.task = P.TaskHParams(**{k: getattr(stream.task, k) for k in ("response_length", "truncate_after")},
                              temperature=0.7, penalty_reward_value=-1.0)  # fmt: skip
    policy, ref_lm, reward = P.PolicyAndValueWrapper(tiny_lm(0)), tiny_lm(1), RecordingReward()
    torch.manual_seed(0)
    responses = P.generate_responses(policy.lm, contexts, PAD, args.task.response_length, 0.7, 2)
    logprobs, ref_logprobs, _ = P.rollout_logprobs(
        policy, ref_lm, torch.cat([contexts, responses], 1), contexts.shape[1], PAD, 0.7, 2
    )
    postprocessed, _ = P.score_responses(reward, queries, responses, NEWLINE, args.task, 2, {})
    seen = torch.cat(reward.seen)  # 2 chunks
    assert len(reward.seen) == 2 and torch.equal(seen, torch.cat([queries, postprocessed], 1))
    query_responses = torch.cat([contexts, responses], 1)  # what both policies read
    with torch.no_grad():
        logits = P.lm_logits(policy.lm, query_responses, contexts.shape[1], PAD, 0.7)
        ref_logits = P.lm_logits(ref_lm, query_responses, contexts.shape[1], PAD, 0.7)
    torch.testing.assert_close(logprobs, P.logprobs_from_logits(logits, responses))
    torch.testing.assert_close(ref_logprobs, P.logprobs_from_logits(ref_logits, responses))


def test_reward_script_samples_from_the_contexts_and_scores_the_bare_queries(tokenizer, monkeypatch, tmp_path):
    """Normalization (sample_and_score) and simulated labels: generation gets the contexts, the reward model and
    the label records the bare queries (OAI's label files hold queries of query_length tokens, no prefix/suffix)."""
    stream = summarization_stream(tokenizer, query_length=6, tmp_path=tmp_path)
    generated = []

    def fake_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context=1, stop=None):
        generated.append(contexts)
        return torch.full((len(contexts) * samples_per_context, response_length), NEWLINE)

    monkeypatch.setattr(R, "sample_responses", fake_sample)
    labels = R.LabelHParams(source="sentiment", num_train=3, simulated_num_test=1)
    args = R.Args(local_rollout_forward_batch_size=16, labels=labels)  # one chunk each
    args.task, args.world_size = stream.task, 1
    ref_lm, reward = types.SimpleNamespace(device=torch.device("cpu")), RecordingReward()
    queries, responses, _ = R.sample_and_score(ref_lm, reward, stream, 4, args)
    assert queries.shape == (4, 6) and torch.equal(generated[0], stream.format(queries))
    assert torch.equal(reward.seen[0], torch.cat([queries, responses], 1))
    records = R.label_records(ref_lm, stream, tokenizer, NEWLINE, 4, args)
    assert len(records) == 4 and all(len(r["query"]) == 6 for r in records)
    # the samples as the labeler saw them: cut after the first newline at index >= truncate_after (1), OAI's pad after
    samples = [r[f"sample{j}"] for r in records for j in range(4)]
    assert all(sample == [NEWLINE, NEWLINE, OPENAI_PAD, OPENAI_PAD] for sample in samples), samples[:2]
    bare = torch.tensor([r["query"] for r in records])  # right-padded with OAI's pad, like OAI's files
    bare = R.right_padding_to_left_padding(torch.where(bare == OPENAI_PAD, PAD, bare), PAD)
    assert torch.equal(generated[1], stream.format(bare)) and generated[1].shape == (4, 3 + 6 + 6)  # 4 samples each


# ---------------------------------------------------------------------------------------------------------------
# label files


def summarization_record(seed: int, query_length: int = 500, response_length: int = 75) -> dict:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randint(0, 50257, (query_length - 7,), generator=generator).tolist() + [OPENAI_PAD] * 7
    samples = {
        f"sample{i}": torch.randint(0, 50257, (response_length,), generator=generator).tolist() for i in range(4)
    }
    return {"query": query, **samples, "best": seed % 4}


def test_summarization_label_files_load_with_the_tasks_lengths(tmp_path, tokenizer, monkeypatch):
    """OAI's tldr/cnndm online_45k.json are best-of-4 records with 500-token queries (bare) and 75-token samples."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    path = tmp_path / "online_45k.json"
    path.write_text(json.dumps([summarization_record(i) for i in range(6)]))
    args = reward_args("--task.name", "tldr", "--labels.num-train", "4", "--batch-size", "2")
    labels = R.load_labels(str(path), tokenizer, args)
    assert labels["queries"].shape == (6, 500) and labels["samples"].shape == (6, 4, 75)
    assert labels["queries"][:, :7].eq(PAD).all() and not labels["queries"].eq(OPENAI_PAD).any()  # remapped, left
    books = reward_args("--labels.num-train", "4", "--batch-size", "2")  # sentiment: 64-token queries
    with pytest.raises(SystemExit) as failure:
        R.load_labels(str(path), tokenizer, books)
    assert "list of 64 token ids" in one_line_error(failure)


@pytest.mark.parametrize(
    "record, kind",
    [
        ({"query": [1] * 8, "sample0": [2] * 4, "sample1": [3] * 4, "choice": 1}, "pairwise"),
        ({"query": [1] * 8, "sample0": [2] * 4, "sample1": [3] * 4, "difference": 0.5}, "scalar_compare"),
        ({"query": [1] * 8, "sample": [2] * 4, "score": 0.5}, "scalar_rating"),
        ({"query": [1] * 8, "sample0": [2] * 4, "sample1": [3] * 4, "best": 1}, "best_of_2"),
    ],
    ids=["pairwise-choice", "scalar-compare", "scalar-rating", "best-of-2"],
)
def test_unsupported_label_types_are_a_one_line_error(tmp_path, tokenizer, record, kind):
    path = tmp_path / "labels.json"
    path.write_text(json.dumps([record] * 3))
    args = R.Args(
        batch_size=1, labels=R.LabelHParams(num_train=2), task=R.TaskHParams(query_length=8, response_length=4)
    )
    with pytest.raises(SystemExit) as failure:
        R.load_labels(str(path), tokenizer, args)
    message = one_line_error(failure)
    assert f"label type {kind} not supported" in message and "record 0" in message and str(path) in message


# ---------------------------------------------------------------------------------------------------------------
# end to end: tldr on synthetic local data (reward model with simulated labels, then PPO)


def run_tiny_summarization(task: str, dataset: Path, tiny_assets, tmp_path, *reward_extra: str) -> tuple[Path, Path]:
    """The task's reward model on simulated labels, then 2 PPO updates against it; tiny lengths, data and model."""
    task_flags = ["--task.name", task, "--task.query-dataset", str(dataset), "--task.query-length", "48",
                  "--task.response-length", "16", "--task.truncate-after", "8", "--base-model", str(tiny_assets["model"])]  # fmt: skip
    reward_dir, policy_dir = tmp_path / "reward", tmp_path / "policy"
    result = run_script("train_reward_accelerate.py", *task_flags, "--labels.source", "sentiment",
                        "--labels.num-train", "32", "--labels.simulated-num-test", "16", "--rollout-batch-size", "16",
                        "--normalize-samples", "16", "--output-dir", str(reward_dir), *reward_extra)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_script("train_policy_accelerate.py", *task_flags, "--rewards.trained-model",
                        str(reward_dir / "reward_model"), "--ppo.batch-size", "16", "--ppo.total-episodes", "32",
                        "--print-sample-output-freq", "1", "--output-dir", str(policy_dir))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (policy_dir / "policy").is_dir()
    return reward_dir, policy_dir


def test_tiny_tldr_run_end_to_end(tiny_assets, tmp_path):
    """~70 s on 2 cores. Only the lengths, the data and the model are not tldr's (the tiny model never writes the
    truncate token '\n', so every score is the penalty: the run checks plumbing, not learning)."""
    posts = tmp_path / "posts.jsonl"
    lines = synthetic_sentences(200, seed=3)
    posts.write_text("".join(json.dumps({"content": f"{a}\n\n\n{b}", "summary": "x"}) + "\n"
                             for a, b in zip(lines[::2], lines[1::2], strict=True)))  # fmt: skip
    reward_dir, policy_dir = run_tiny_summarization("tldr", posts, tiny_assets, tmp_path, "--no-normalize-before")
    args = json.loads((reward_dir / "args.json").read_text())
    task_args = (args["task"]["query_suffix"], args["task"]["truncate_token"], args["task"]["temperature"])
    assert task_args == ("\n\nTL;DR:", "\n", 0.7)
    assert (args["batch_size"], args["lr"], args["num_updates"]) == (16, 2.5e-5, 2)
    records = json.loads((reward_dir / "labels.json").read_text())
    assert len(records) == 48 and all(len(r["query"]) == 48 and TL not in r["query"] for r in records)  # bare
    rows = read_jsonl(reward_dir / "metrics.jsonl")
    assert any("test/accuracy" in row for row in rows) and any("normalization/after/std" in row for row in rows)

    args = json.loads((policy_dir / "args.json").read_text())
    ppo_args = (args["ppo"]["lr"], args["ppo"]["whiten_rewards"], args["rewards"]["use_adaptive_kl"])
    assert ppo_args == (2e-6, False, False) and args["task"]["query_suffix"] == "\n\nTL;DR:"
    updates = [row for row in read_jsonl(policy_dir / "metrics.jsonl") if "objective/kl_coef" in row]
    assert [row["update"] for row in updates] == [1, 2]
    assert all(row["objective/kl_coef"] == 0.03 for row in updates)  # fixed, tldr's
    samples = read_jsonl(policy_dir / "samples.jsonl")
    assert samples and all("TL;DR" not in sample["query"] for sample in samples)  # the bare query is logged


def test_tiny_cnndm_run_end_to_end(tiny_assets, tmp_path):
    """cnndm on local articles in the Hub's `cnn_dailymail` layout (field `article`, with a byline, a Daily Mail date
    header, a CNN dateline and highlights to clean away): reward model with simulated labels, then PPO with cnndm's
    defaults (prefix "Article:\\n\\n", temperature 0.5, fixed KL 0.01). Lengths, data and model are tiny."""
    articles = tmp_path / "articles.jsonl"
    lines = synthetic_sentences(200, seed=4)
    header = "By . Daily Mail Reporter . PUBLISHED: . 15:36 EST, 25 October 2013 . | . LONDON, England (CNN) -- "
    articles.write_text("".join(json.dumps({"article": f"{header}{a} {b} @highlight The highlight.", "id": str(i)}) + "\n"
                                for i, (a, b) in enumerate(zip(lines[::2], lines[1::2], strict=True))))  # fmt: skip
    reward_dir, policy_dir = run_tiny_summarization("cnndm", articles, tiny_assets, tmp_path)
    args = json.loads((reward_dir / "args.json").read_text())
    task_args = (args["task"]["query_prefix"], args["task"]["query_suffix"], args["task"]["temperature"])
    assert task_args == ("Article:\n\n", "\n\nTL;DR:", 0.5)
    records = json.loads((reward_dir / "labels.json").read_text())
    tokenizer = R.load_tokenizer(str(tiny_assets["model"]))
    queries = [tokenizer.decode([t for t in r["query"] if t < PAD]) for r in records]  # OAI's pad 50259 dropped
    assert len(records) == 48 and all(len(r["query"]) == 48 for r in records)
    for junk in ("Article:", "TL;DR", "(CNN)", "PUBLISHED", "Daily Mail Reporter", "@highlight", "highlight."):
        assert not any(junk in query for query in queries), junk  # bare, cleaned queries for the reward model

    args = json.loads((policy_dir / "args.json").read_text())
    ppo_args = (args["ppo"]["lr"], args["ppo"]["whiten_rewards"], args["rewards"]["use_adaptive_kl"])
    assert ppo_args == (2e-6, False, False) and args["task"]["query_prefix"] == "Article:\n\n"
    updates = [row for row in read_jsonl(policy_dir / "metrics.jsonl") if "objective/kl_coef" in row]
    assert [row["update"] for row in updates] == [1, 2]
    assert all(row["objective/kl_coef"] == 0.01 for row in updates)  # fixed, cnndm's
    samples = read_jsonl(policy_dir / "samples.jsonl")
    assert samples and all("Article:" not in s["query"] and "CNN" not in s["query"] for s in samples)
