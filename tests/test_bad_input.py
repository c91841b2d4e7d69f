"""Bad input, caught early: each case must end with a one-line error that names the flag or file, a non-zero exit,
no traceback, and nothing written into the output directory.

Every check here runs before the scripts create their Accelerator or load a model, so most cases call the script's
`main` in this process (parsing the flags with the script's own tyro parser), which saves a Python + torch start per
case; `test_unwritable_output_directory` runs both scripts as a user would, in a subprocess, and checks what the
user sees on stderr."""

import importlib
import json
import shutil
import subprocess
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import pytest

import run_utils
from tests.conftest import run_script

REWARD = "train_reward_accelerate.py"
POLICY = "train_policy_accelerate.py"
FAST = 60  # seconds: everything here fails before training starts (the tiny model loads in ~1 s)


def run_in_process(script: str, *flags: str) -> subprocess.CompletedProcess:
    """`script`'s main on `flags` in this process, reported like `run_script`: a `raise SystemExit(message)` is what
    Python would print on stderr with exit status 1; any other exception is a traceback with status 1."""
    module = importlib.import_module(script.removesuffix(".py"))
    returncode, stderr = 0, ""
    try:
        module.main(run_utils.task_cli(module.task_defaults, flags))  # the script's last line
    except SystemExit as stop:
        returncode, stderr = (1, f"{stop.code}\n") if isinstance(stop.code, str) else (stop.code or 0, "")
    except Exception:
        returncode, stderr = 1, traceback.format_exc()
    return subprocess.CompletedProcess([script, *flags], returncode, "", stderr)


def check_one_line_error(result, *words: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    for word in words:
        assert word in last, (word, last)
    return last


def label_record(query_length=64, response_length=24, **changes) -> dict:
    record = {"query": [464] * query_length, **{f"sample{i}": [262] * response_length for i in range(4)}, "best": 0}
    return {**record, **changes}


@pytest.fixture
def reward_base(tiny_assets, tmp_path):
    def flags(labels_path, *extra):
        return ["--base-model", str(tiny_assets["model"]), "--label-dataset", str(labels_path),
                "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"),
                "--labels.num-train", "16", "--batch-size", "8", *extra]  # fmt: skip

    return flags


LABEL_FILES = {
    "truncated JSON": lambda path: path.write_text(json.dumps([label_record()] * 40)[:-50]),
    "not a list": lambda path: path.write_text(json.dumps({"query": [1]})),
    "wrong schema (no best)": lambda path: path.write_text(
        json.dumps([{k: v for k, v in label_record().items() if k != "best"}] * 40)
    ),
    "wrong length": lambda path: path.write_text(json.dumps([label_record(query_length=10)] * 40)),
    "ids out of vocabulary": lambda path: path.write_text(json.dumps([label_record(sample2=[70000] * 24)] * 40)),
    "too few records": lambda path: path.write_text(json.dumps([label_record()] * 5)),
    # N20: JSON true is a bool, which Python counts as an int: it trained as label 1
    "best true": lambda path: path.write_text(json.dumps([label_record()] * 3 + [label_record(best=True)] * 37)),
    # N21: an int beyond int64 turned the token array to objects, and the record was reported as 0, the id as "?"
    "token id 10**20": lambda path: path.write_text(
        json.dumps([label_record()] * 5 + [label_record(sample2=[262] * 3 + [10**20] + [262] * 20)] * 35)
    ),
}
LABEL_FILE_WORDS = {"best true": "record 3: 'best' must be an integer in 0..3, got true",
                    "token id 10**20": "record 5: 'sample2' has token id 100000000000000000000, outside any vocabulary"}  # fmt: skip


@pytest.mark.parametrize("case", LABEL_FILES, ids=list(LABEL_FILES))
def test_bad_label_files(reward_base, tmp_path, case):
    labels = tmp_path / "labels.json"
    LABEL_FILES[case](labels)
    start = time.time()
    result = run_in_process(REWARD, *reward_base(labels))
    check_one_line_error(result, "--label-dataset", str(labels), *([LABEL_FILE_WORDS[case]] if case in LABEL_FILE_WORDS
                                                                    else []))  # fmt: skip
    assert time.time() - start < FAST and not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [REWARD, POLICY])
@pytest.mark.parametrize("content", ["", "\n\n", "a b\n"], ids=["empty", "blank lines", "too short"])
def test_query_datasets_that_yield_no_query(tiny_assets, tmp_path, script, content):
    queries = tmp_path / "queries.txt"
    queries.write_text(content)
    common = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(queries),
              "--task.start-text", "zebra", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    flags = [*common, *script_inputs(script, tiny_assets, tmp_path)]
    start = time.time()
    result = run_in_process(script, *flags)
    check_one_line_error(result, "--task.query-dataset")
    assert time.time() - start < FAST


def make_fake_reward_model(tiny_assets, tmp_path, fingerprint=None):
    """A reward_model/ directory as the early checks read it: its files whole, the tiny model's backbone (its LM
    weights: the checks read the headers only), a zero head of its width."""
    import torch
    from safetensors.torch import save_file

    import train_policy_accelerate as P

    directory = tmp_path / "rm"
    directory.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(tiny_assets["model"] / name, directory / name)
    tokenizer = P.load_tokenizer(str(tiny_assets["model"]))
    info = {"base_model": "tiny", "pad_id": tokenizer.pad_token_id,
            "tokenizer_fingerprint": fingerprint or run_utils.tokenizer_fingerprint(tokenizer)}  # fmt: skip
    (directory / "reward_model.json").write_text(json.dumps(info))
    width = json.loads((directory / "config.json").read_text())["n_embd"]
    head = {"scalar_head.weight": torch.zeros(1, width), "scalar_head.bias": torch.zeros(1),
            "reward_gain": torch.tensor(1.0), "reward_bias": torch.tensor(0.0)}  # fmt: skip
    save_file(head, directory / "reward_head.safetensors")
    return directory


def script_inputs(script: str, tiny_assets, tmp_path) -> list[str]:
    """What each script reads besides the base model and queries: labels, or a reward model."""
    if script == REWARD:
        return ["--label-dataset", str(tiny_assets["small_labels"]), "--labels.num-train", "16", "--batch-size", "8"]
    return ["--rewards.trained-model", str(make_fake_reward_model(tiny_assets, tmp_path))]


def test_reward_model_trained_with_another_tokenizer(tiny_assets, tmp_path):
    reward_model = make_fake_reward_model(tiny_assets, tmp_path, fingerprint="another-vocabulary")
    result = run_in_process(POLICY, "--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(reward_model),
                        "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"))  # fmt: skip
    check_one_line_error(result, "--rewards.trained-model", "another tokenizer")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_base_model_directory_that_does_not_exist(tiny_assets, tmp_path, script):
    missing = tmp_path / "no-such-model"
    extra = ["--rewards.trained-model", str(tmp_path)] if script == POLICY else []
    result = run_in_process(script, "--base-model", str(missing), "--output-dir", str(tmp_path / "out"), *extra)
    check_one_line_error(result, "--base-model", str(missing))


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_base_model_that_is_not_a_causal_lm(tiny_assets, tmp_path, script):
    from transformers import BertConfig, BertModel

    not_causal = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(not_causal)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        source = tiny_assets["model"] / name
        if source.exists():
            (not_causal / name).write_bytes(source.read_bytes())
    flags = ["--base-model", str(not_causal), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(tmp_path / "out")]  # fmt: skip
    flags += script_inputs(script, tiny_assets, tmp_path)
    result = run_in_process(script, *flags)
    check_one_line_error(result, "--base-model", "causal")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_base_model_whose_weights_do_not_load(tiny_assets, tmp_path, script):
    """Its tokenizer and config read (checked before anything is written), its weights file broken: one line naming
    the flag where the models load, not a traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_assets["model"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    flags = ["--base-model", str(broken), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(tmp_path / "out"), *script_inputs(script, tiny_assets, tmp_path)]  # fmt: skip
    check_one_line_error(run_in_process(script, *flags), "--base-model", "cannot load its weights")


def test_quickstarts_held_out_split_names_a_base_model_without_a_tokenizer(tiny_assets, tmp_path):
    import quickstart
    import train_policy_accelerate as P

    args = run_utils.task_cli(P.task_defaults, ["--rewards.trained-model", "x", "--base-model", str(tmp_path),
                                                "--task.query-dataset", str(tiny_assets["corpus"])])  # fmt: skip
    with pytest.raises(SystemExit) as failure:
        quickstart.held_out_texts(args)
    assert str(failure.value).startswith(f"error: --base-model '{tmp_path}': cannot load a tokenizer")


@pytest.mark.parametrize(
    "script, flags, words",
    [
        (POLICY, ["--ppo.batch-size", "30", "--ppo.nminibatches", "4"], ["--ppo.batch-size", "--ppo.nminibatches"]),
        (POLICY, ["--task.response-length", "8", "--task.truncate-after", "8"], ["--task.truncate-after"]),
        (REWARD, ["--batch-size", "12", "--gradient-accumulation-steps", "5"], ["--batch-size"]),
        (REWARD, ["--task.response-length", "8", "--task.truncate-after", "9"], ["--task.truncate-after"]),
        (POLICY, ["--checkpoint-every", "-1"], ["--checkpoint-every"]),
        (POLICY, ["--resume", "--overwrite"], ["--resume", "--overwrite"]),
    ],
    ids=["policy-batch", "policy-truncate-after", "reward-batch", "reward-truncate-after", "checkpoint", "resume"],
)
def test_inconsistent_flags(tmp_path, script, flags, words):
    start = time.time()
    result = run_in_process(script, "--rewards.trained-model" if script == POLICY else "--exp-name",
                        str(tmp_path) if script == POLICY else "x", "--output-dir", str(tmp_path / "out"), *flags)  # fmt: skip
    check_one_line_error(result, *words)
    assert time.time() - start < FAST and not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, marker", [(REWARD, "reward_model"), (POLICY, "policy")])
def test_output_directory_with_a_finished_run(tiny_assets, tmp_path, script, marker):
    (tmp_path / "out" / marker).mkdir(parents=True)
    (tmp_path / "out" / marker / "keep.txt").write_text("mine")
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(tmp_path / "out")]  # fmt: skip
    flags += script_inputs(script, tiny_assets, tmp_path)
    result = run_in_process(script, *flags)
    check_one_line_error(result, "--output-dir", "finished run", "--overwrite")
    assert (tmp_path / "out" / marker / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("script, inside", [(REWARD, "checkpoints/step-00000002"), (POLICY, "policy")])
def test_overwrite_refuses_an_input_inside_what_it_replaces(tiny_assets, tmp_path, script, inside):
    """`--overwrite --base-model OUT/policy` would replace the model it was asked to start from: refused, kept."""
    base_model = tmp_path / "out" / inside
    shutil.copytree(tiny_assets["model"], base_model)
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    flags = ["--base-model", str(base_model), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(tmp_path / "out"), "--overwrite"]  # fmt: skip
    result = run_in_process(script, *flags, *script_inputs(script, tiny_assets, tmp_path))
    check_one_line_error(result, "--base-model", "--overwrite")
    assert (base_model / "config.json").is_file() and (
        tmp_path / "out" / "metrics.jsonl"
    ).read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_unwritable_output_directory(tiny_assets, tmp_path, script):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(blocker / "out")]  # fmt: skip
    flags += script_inputs(script, tiny_assets, tmp_path)
    start = time.time()
    result = run_script(script, *flags)
    check_one_line_error(result, "--output-dir", "not writable")
    assert time.time() - start < FAST


# ---------------------------------------------------------------------------------------------------------------------
# The six causes of the bad-inputs review (../shared/notes/bad-inputs-review.md): each test fails on the code before
# it. 1. lost work: nothing is removed before every input is checked, and no script touches another script's run


def finished_policy_run(directory, args_json: dict) -> dict:
    """A finished policy run's files (what --overwrite would replace), their content returned to compare after."""
    (directory / "policy").mkdir(parents=True)
    files = {"args.json": json.dumps(args_json), "metrics.jsonl": '{"update": 1}\n', "samples.jsonl": "{}\n",
             "policy/config.json": "{}"}  # fmt: skip
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def test_overwrite_removes_nothing_when_the_reward_model_is_broken(tiny_assets, tmp_path):
    """G7: --overwrite of a finished run with a reward model whose config.json is cut short: one line, before the old
    run's logs go (they went first, and its policy/ stayed beside the new args.json)."""
    reward_model = make_fake_reward_model(tiny_assets, tmp_path)
    (reward_model / "config.json").write_text('{"model_type": "gpt2", ')
    files = finished_policy_run(tmp_path / "out", {"ppo": {}})
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(reward_model),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--overwrite",
             "--ppo.total-episodes", "16", "--ppo.batch-size", "16", "--ppo.whitening-ranks", "1"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--rewards.trained-model", "config.json")
    assert {name: (tmp_path / "out" / name).read_text() for name in files} == files


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_script_never_writes_into_the_other_scripts_run(tiny_assets, tmp_path, overwrite):
    """G8: a policy run pointed at a finished reward run's directory was told it holds "an unfinished run", and with
    --overwrite replaced the reward run's args.json and logs."""
    run = tmp_path / "reward-run"
    (run / "reward_model").mkdir(parents=True)
    files = {"args.json": json.dumps({"labels": {}}), "metrics.jsonl": '{"step": 1}\n', "samples.jsonl": "{}\n"}
    for name, text in files.items():
        (run / name).write_text(text)
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(make_fake_reward_model(
             tiny_assets, tmp_path)), "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(run),
             "--ppo.total-episodes", "16", "--ppo.batch-size", "16", "--ppo.whitening-ranks", "1",
             *(["--overwrite"] if overwrite else [])]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--output-dir", "holds a reward-model run")
    assert {name: (run / name).read_text() for name in files} == files
    policy_run = tmp_path / "policy-run"
    finished_policy_run(policy_run, {"ppo": {}})
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(policy_run), "--overwrite", *script_inputs(REWARD, tiny_assets, tmp_path)]  # fmt: skip
    check_one_line_error(run_in_process(REWARD, *flags), "--output-dir", "holds a policy run")
    assert (policy_run / "metrics.jsonl").read_text() == '{"update": 1}\n'


def test_quickstart_overwrite_checks_the_inputs_before_removing_anything(tmp_path, capsys):
    """I4: `quickstart.py --overwrite --base-model MISSING` deleted the finished quick start, then failed."""
    import quickstart

    (tmp_path / "policy").mkdir()
    for name in ("summary.json", "quickstart_args.json", "policy/metrics.jsonl"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(SystemExit) as failure:
        quickstart.main(["--output-dir", str(tmp_path), "--overwrite", "--base-model", str(tmp_path / "nope")])
    assert str(failure.value) == f"quickstart: --base-model {tmp_path / 'nope'}: no such file or directory"
    assert all((tmp_path / name).read_text() == "{}" for name in ("summary.json", "policy/metrics.jsonl"))


def finished_quickstart(directory: Path) -> dict[str, str]:
    """A finished quick start's files (as prepare_output_dir tells one), each holding its own name."""
    (directory / "policy").mkdir(parents=True)
    names = ("summary.json", "quickstart_args.json", "policy/metrics.jsonl", "learning_curves.png")
    for name in names:
        (directory / name).write_text(name)
    return {name: name for name in names}


def test_quickstart_overwrite_waits_for_the_inputs_an_unprepared_cache_hides(tiny_chat_assets, tmp_path, capsys):
    """N52: with a --cache-dir that lacked an asset, every input check was skipped and --overwrite removed the
    finished quick start before a --reward-function typo failed in the policy phase. Now the assets are prepared first
    (here the arithmetic sums, made locally), then every input is checked, and only then does --overwrite act."""
    import quickstart

    files = finished_quickstart(tmp_path / "qs")
    with pytest.raises(SystemExit) as failure:
        quickstart.main(["--task", "arithmetic", "--output-dir", str(tmp_path / "qs"), "--overwrite", "--base-model",
                         str(tiny_chat_assets["model"]), "--cache-dir", str(tmp_path / "cache"),
                         "--reward-function", "nosuchmod:score"])  # fmt: skip
    assert str(failure.value).startswith("quickstart: --reward-function 'nosuchmod:score': cannot import it")
    assert {name: (tmp_path / "qs" / name).read_text() for name in files} == files  # nothing removed
    assert (tmp_path / "cache" / quickstart.ARITHMETIC_FILE).is_file()  # the asset it prepared first


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--policy-args", "--output-dir elsewhere"],
            "--policy-args '--output-dir elsewhere': --output-dir is the quick start's own",
        ),
        (["--reward-args=--dry-run"], "--reward-args '--dry-run': --dry-run is the quick start's own"),
        (["--policy-args=--resume"], "--resume is the quick start's own"),
        (
            ["--policy-args=--base_model=x"],
            "--base-model is the quick start's own (give quickstart.py --base-model)",
        ),
        (
            ["--reward-args", "--task.query-dataset x.txt"],
            "--task.query-dataset is the quick start's own (give quickstart.py --corpus)",
        ),
        (["--cache-dir", "FILE"], "--cache-dir FILE: a file, not a directory"),
    ],
    ids=["policy-output-dir", "reward-dry-run", "resume", "base-model", "corpus", "cache-dir-a-file"],
)
def test_quickstart_refuses_flags_that_would_change_its_own_plumbing(tmp_path, capsys, flags, words):
    """N61, N62: --reward-args=--dry-run made the reward phase a no-op (the policy phase then blamed the reward
    model); --policy-args "--output-dir X" trained into X and the report died with a traceback. N60: a --cache-dir
    that is a file, a traceback. Each is one line now, before anything runs."""
    import quickstart

    (tmp_path / "FILE").write_text("")
    flags = [flag.replace("FILE", str(tmp_path / "FILE")) for flag in flags]
    with pytest.raises(SystemExit):
        quickstart.main(["--output-dir", str(tmp_path / "qs"), "--dry-run", *flags])
    error = capsys.readouterr().err.strip()
    assert (
        "\n" not in error
        and error.startswith("quickstart: ")
        and words.replace("FILE", str(tmp_path / "FILE")) in error
    )
    assert not (tmp_path / "qs").exists()


def test_quickstart_says_a_damaged_record_of_its_flags_is_damaged(tmp_path):
    """N53: an unfinished quick start whose quickstart_args.json was cut short: a JSONDecodeError traceback."""
    import quickstart

    (tmp_path / "qs" / "reward").mkdir(parents=True)
    (tmp_path / "qs" / "quickstart_args.json").write_text('{"seed": 1, "lab')
    with pytest.raises(SystemExit) as failure:
        quickstart.prepare_output_dir(tmp_path / "qs", quickstart.parse_args(quickstart.build_parser(), []), {})
    assert str(failure.value).startswith(f"quickstart: {tmp_path / 'qs' / 'quickstart_args.json'} is damaged")
    assert "--overwrite starts it again" in str(failure.value)


# 2. a dry run checks every local input whatever --base-model is, and says what it could not check


@pytest.mark.parametrize(
    "script, flags, words",
    [
        (POLICY, ["--rewards.trained-model", "/nonexistent"], ["--rewards.trained-model", "no such directory"]),
        (POLICY, ["--rewards.function", "nosuchmod:score"], ["--rewards.function", "cannot import it"]),
        (POLICY, ["--rewards.function", "sentiment", "--task.query-dataset", "QUERIES"], ["line 2 has no field"]),
        (REWARD, ["--label-dataset", "LABELS", "--task.query-dataset", "QUERIES"], ["--label-dataset", "JSON"]),
    ],
    ids=["reward-model", "reward-function", "query-file", "label-file"],
)
def test_a_dry_run_with_a_hub_base_model_checks_the_local_inputs(tmp_path, script, flags, words, monkeypatch):
    """A1-A4: a dry run with a Hub name for --base-model returned before it looked at the reward model,
    --rewards.function, the query file or the label file. (Online, as a user's machine is: offline, an uncached Hub
    model is refused at once, test_an_uncached_hub_model_under_hf_hub_offline_fails_the_dry_run.)"""
    monkeypatch.setattr(run_utils, "hub_offline", lambda: False)  # the dry run fetches nothing either way
    (tmp_path / "queries.jsonl").write_text('{"text": "A fine day."}\n{"txt": "x"}\n')
    (tmp_path / "labels.json").write_text(json.dumps([label_record()] * 4)[:-30])
    paths = {"QUERIES": str(tmp_path / "queries.jsonl"), "LABELS": str(tmp_path / "labels.json")}
    flags = [paths.get(flag, flag) for flag in flags]
    result = run_in_process(script, "--base-model", "gpt2", "--output-dir", str(tmp_path / "out"), "--dry-run", *flags)
    check_one_line_error(result, *words)


def test_a_dry_run_names_what_needs_the_hub_base_models_tokenizer(tiny_assets, tmp_path, capsys, monkeypatch):
    """A5: a reward model of another tokenizer can't be told without --base-model's tokenizer: the dry run says so."""
    import train_policy_accelerate as P

    monkeypatch.setattr(run_utils, "hub_offline", lambda: False)  # online, as a user's machine is

    flags = ["--base-model", "gpt2", "--rewards.trained-model", str(make_fake_reward_model(tiny_assets, tmp_path)),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    P.main(run_utils.task_cli(P.task_defaults, flags))
    (unchecked,) = [line for line in json.loads(capsys.readouterr().out.splitlines()[-1])["not_checked"]
                    if "tokenizer" in line]  # fmt: skip
    assert "--rewards.trained-model's vocabulary" in unchecked and "yield queries" in unchecked


@pytest.mark.parametrize("script, marker", [(REWARD, "reward_model"), (POLICY, "policy")])
def test_a_dry_run_looks_at_the_output_directory(tiny_assets, tmp_path, script, marker):
    """G2: a dry run passed an --output-dir that the run then refused."""
    (tmp_path / "out" / marker).mkdir(parents=True)
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--output-dir", str(tmp_path / "out"), "--dry-run", *script_inputs(script, tiny_assets, tmp_path)]  # fmt: skip
    check_one_line_error(run_in_process(script, *flags), "--output-dir", "finished run")


# 3. every numeric flag has its range checked, one line naming the flag and the range


def numeric_fields(config, prefix: str = "") -> list[str]:
    """The int and float flags of an Args dataclass, recursively (the hidden derived sizes left out)."""
    import dataclasses
    import typing

    names = []
    for field in dataclasses.fields(config):
        value, hints = getattr(config, field.name), typing.get_type_hints(type(config), include_extras=True)
        if dataclasses.is_dataclass(value):
            names += numeric_fields(value, f"{prefix}{field.name}.")
        elif "Suppress" not in str(hints[field.name]) and any(
            kind in (int, float) for kind in (hints[field.name], *typing.get_args(hints[field.name]))
        ):
            names.append(prefix + field.name)
    return names


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_every_numeric_flag_has_a_range(script):
    module = importlib.import_module(script.removesuffix(".py"))
    table = getattr(module, "POLICY_FLAG_RANGES" if script == POLICY else "REWARD_FLAG_RANGES")
    ranges = {**run_utils.RUN_RANGES, **run_utils.TASK_RANGES, **table}
    names = numeric_fields(module.Args())
    assert "ppo.nminibatches" in names or "labels.labeler_beta" in names
    assert sorted(set(names) - set(ranges)) == [] and sorted(set(ranges) - set(names)) == []


RANGE_CASES = [
    (
        POLICY,
        ["--task.temperature", "0"],
        "--task.temperature must be at least 1e-4 (a smaller one takes logits / temperature beyond float32), got 0.0",
    ),  # F5
    (
        REWARD,
        ["--task.temperature", "-0.7"],
        "--task.temperature must be at least 1e-4 (a smaller one takes logits / temperature beyond float32), got -0.7",
    ),  # F6
    (
        POLICY,
        ["--task.temperature", "1e-40"],
        "--task.temperature must be at least 1e-4 (a smaller one takes logits / temperature beyond float32), got 1e-40",
    ),  # N05: every sampled probability was NaN, the flag never named
    (
        POLICY,
        ["--ppo.total-episodes", "-" + "1" * 400],
        "--ppo.total-episodes must be positive, got a 400-digit number",
    ),  # N03
    (POLICY, ["--rewards.kl-coef", "-0.5"], "--rewards.kl-coef must be >= 0, got -0.5"),  # F9
    (POLICY, ["--ppo.gradient-accumulation-steps", "0"], "--ppo.gradient-accumulation-steps must be positive, got 0"),
    (REWARD, ["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps must be positive, got 0"),  # F10
    (POLICY, ["--ppo.nminibatches", "0"], "--ppo.nminibatches must be positive, got 0"),  # F11
    (POLICY, ["--ppo.nminibatches", "-1"], "--ppo.nminibatches must be positive, got -1"),  # F12
    (REWARD, ["--gradient-accumulation-steps", "-2"], "--gradient-accumulation-steps must be positive, got -2"),  # F13
    (POLICY, ["--ppo.total-episodes", "8"], "--ppo.total-episodes 8 is less than one update of --ppo.batch-size 16"),
    (POLICY, ["--ppo.gamma", "1.5"], "--ppo.gamma must be in [0, 1], got 1.5"),
    (POLICY, ["--ppo.lam", "-0.1"], "--ppo.lam must be in [0, 1], got -0.1"),
    (POLICY, ["--ppo.cliprange", "0"], "--ppo.cliprange must be positive, got 0.0"),
    (POLICY, ["--ppo.eps", "nan"], "--ppo.eps must be positive, got nan"),
    (POLICY, ["--rewards.adaptive-kl.target", "inf"], "--rewards.adaptive-kl.target must be positive, got inf"),
    (POLICY, ["--task.penalty-reward-value", "-inf"], "--task.penalty-reward-value must be a finite number, got -inf"),
    (REWARD, ["--labels.labeler-beta", "-1"], "--labels.labeler-beta must be >= 0, got -1.0"),
    (REWARD, ["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    (REWARD, ["--eval-batch-size", "0"], "--eval-batch-size must be positive, got 0"),
]


@pytest.mark.parametrize("script, flags, message", RANGE_CASES, ids=[" ".join(c[1]) for c in RANGE_CASES])
def test_numeric_flags_out_of_range_are_one_line_naming_the_flag_and_range(script, flags, message, monkeypatch):
    """F5-F16: temperatures <= 0, a negative KL coefficient, 0 or negative minibatches or accumulation steps (a
    ZeroDivisionError, the wrong flag named, a traceback after minutes), fewer episodes than a batch."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["--rewards.function", "sentiment", "--ppo.batch-size", "16"] if script == POLICY else []
    with pytest.raises(SystemExit) as failure:
        module.validate_args(run_utils.task_cli(module.task_defaults, [*base, *flags]))
    assert str(failure.value) == f"error: {message}"


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_a_query_and_response_longer_than_the_models_positions(tiny_assets, tmp_path, script):
    """F20: 250 + 12 tokens on a model of 256 positions passed the dry run, then an IndexError in the first rollout."""
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
             "--task.query-length", "250", "--task.response-length", "12", "--task.truncate-after", "6",
             "--output-dir", str(tmp_path / "out"), "--dry-run", *script_inputs(script, tiny_assets, tmp_path)]  # fmt: skip
    if script == REWARD:
        flags += ["--labels.source", "sentiment"]
    last = check_one_line_error(run_in_process(script, *flags), "--task.query-length (250 tokens)", "256 positions")
    assert "--base-model" in last


# 4. files checked by their content where a bad one would fail later


def damaged_reward_model(tiny_assets, tmp_path, damage: str):
    reward_model = make_fake_reward_model(tiny_assets, tmp_path)
    name, content = {"reward_model.json": ("reward_model.json", b"not json{"),
                     "config.json": ("config.json", b'{"model_type": "gpt2", "n_embd": '),
                     "model.safetensors": ("model.safetensors", None),
                     "reward_head.safetensors": ("reward_head.safetensors", None)}[damage]  # fmt: skip
    data = (reward_model / name).read_bytes()
    (reward_model / name).write_bytes(content if content is not None else data[: len(data) - 100])
    return reward_model


@pytest.mark.parametrize("damage", ["reward_model.json", "config.json", "model.safetensors", "reward_head.safetensors"])
def test_a_damaged_reward_model_fails_the_dry_run(tiny_assets, tmp_path, damage):
    """B6-B9: a reward_model.json that is not JSON (a traceback), a broken config.json or weights file (passed the dry
    run, failed after the policy and the reference had loaded)."""
    reward_model = damaged_reward_model(tiny_assets, tmp_path, damage)
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(reward_model),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--rewards.trained-model", damage)


@pytest.mark.parametrize("damage", ["state.json", "pytorch_model.bin", "a model of other tensors"])
def test_resume_with_a_damaged_checkpoint_is_one_line(tiny_assets, tmp_path, damage):
    """G11, G12: a checkpoint cut short gave a JSONDecodeError or an OSError traceback (the older checkpoint it falls
    back to: tests/test_resume.py); a whole checkpoint of another model, torch's load report as a traceback."""
    import torch

    import train_policy_accelerate as P

    output_dir = tmp_path / "out"
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(make_fake_reward_model(
             tiny_assets, tmp_path)), "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir",
             str(output_dir), "--ppo.total-episodes", "32", "--ppo.batch-size", "16", "--ppo.whitening-ranks", "1"]  # fmt: skip
    args = P.validate_args(run_utils.task_cli(P.task_defaults, flags))
    checkpoint = output_dir / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    (output_dir / "args.json").write_text(json.dumps(asdict(args)))
    (output_dir / "metrics.jsonl").write_text('{"update": 1}\n')
    state = {"format": run_utils.CHECKPOINT_FORMAT, "step": 1, "world_size": 1, "elapsed": 1.0, "kl_coef": 0.15,
             "processes": [{}]}  # fmt: skip
    (checkpoint / "state.json").write_text(json.dumps(state)[: 40 if damage == "state.json" else None])
    torch.save({"x": torch.zeros(100)}, checkpoint / "pytorch_model.bin")
    (checkpoint / "metrics.jsonl").write_text('{"update": 1}\n')  # a checkpoint's copy of the logs
    if damage == "pytorch_model.bin":
        (checkpoint / damage).write_bytes((checkpoint / damage).read_bytes()[:500])
    words = ("does not fit the model these flags build",) if damage == "a model of other tensors" else (damage,)
    last = check_one_line_error(run_in_process(POLICY, *flags, "--resume"), "--resume", *words)
    assert "--overwrite" in last and (output_dir / "metrics.jsonl").read_text() == '{"update": 1}\n'


# 5. resume by path: a trailing slash, a moved run directory (a moved run resumed end to end: tests/test_resume.py)


def test_resume_compares_paths_by_the_file_they_name(tiny_assets, tmp_path):
    """G13: `--output-dir runs/x/` or a moved run directory was refused ("--output-dir differ from args.json")."""
    import train_policy_accelerate as P

    first = tmp_path / "first"
    first.mkdir()
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment",
             "--task.query-dataset", str(tiny_assets["corpus"])]  # fmt: skip
    args = P.validate_args(run_utils.task_cli(P.task_defaults, [*flags, "--output-dir", str(first)]))
    (first / "args.json").write_text(json.dumps(asdict(args)))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    may_change = run_utils.RESUME_MAY_CHANGE | P.RESUME_MAY_CHANGE
    for directory, corpus in ((f"{first}/", tiny_assets["corpus"]), (str(moved), f"{tiny_assets['corpus'].parent}/./"
                                                                    f"{tiny_assets['corpus'].name}")):  # fmt: skip
        again = run_utils.task_cli(P.task_defaults, [*flags, "--output-dir", directory, "--task.query-dataset",
                                                     str(corpus), "--resume"])  # fmt: skip
        run_utils.check_resume_args(Path(directory), P.validate_args(again), may_change)  # no error
    other = run_utils.task_cli(P.task_defaults, [*flags, "--output-dir", str(moved), "--task.query-dataset",
                                                 str(tmp_path / "other.txt"), "--resume"])  # fmt: skip
    with pytest.raises(SystemExit, match="--task.query-dataset differ"):
        run_utils.check_resume_args(moved, P.validate_args(other), may_change)


# 6. the readers: the right record named, texts that are not text refused, a reward callable's scores, --eval-queries


def test_a_float_token_id_is_reported_in_its_record(reward_base, tmp_path):
    """D9: a float in record 4 was reported as record 0's first (valid) token, np.float64(1348.0)."""
    records = [label_record() for _ in range(40)]
    records[4]["sample2"][3] = 1.5
    (tmp_path / "labels.json").write_text(json.dumps(records))
    last = check_one_line_error(run_in_process(REWARD, *reward_base(tmp_path / "labels.json"), "--dry-run"))
    assert last.endswith("record 4: 'sample2' has token id 1.5, not an integer"), last


@pytest.mark.parametrize(
    "script, text, shown", [(REWARD, "null", "null"), (POLICY, "1", "1"), (POLICY, '["a"]', '["a"]')]
)
def test_query_texts_that_are_not_text_are_refused_naming_the_record(tiny_assets, tmp_path, script, text, shown):
    """E3: null or numeric query texts became the strings "None", "1", ... and trained."""
    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"text": "A fine day. And more."}\n\n{"text": ' + text + "}\n")
    flags = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(queries), "--output-dir",
             str(tmp_path / "out"), "--dry-run", *script_inputs(script, tiny_assets, tmp_path)]  # fmt: skip
    last = check_one_line_error(run_in_process(script, *flags), "--task.query-dataset", str(queries))
    assert last.endswith(f"line 3: 'text' is {shown}, not a text"), last


@pytest.mark.parametrize(
    "content, where",
    [('{"text": "a"}\n' * 5 + "not json\n", "(line 6: Expecting value"), ("[" + '{"text": "a"},\n' * 3, "line 4")],
    ids=["json-lines", "json-list"],
)
def test_bad_json_in_a_query_file_names_its_line(tmp_path, content, where):
    """E8: bad JSON on line 6 of a .jsonl was reported at line 1."""
    import rlhf_data

    path = tmp_path / ("queries.jsonl" if content[0] == "{" else "queries.json")
    path.write_text(content)
    with pytest.raises(SystemExit) as failure:
        rlhf_data.QueryTexts(str(path), None, "text")
    assert where in str(failure.value) and "\n" not in str(failure.value), failure.value


def test_passage_rows_beyond_the_file_and_an_empty_directory_name_the_cause(tmp_path):
    """E12: --task.passage-rows 100 on 20 rows blamed the file alone; E9: an empty directory went to `datasets`."""
    import rlhf_data

    (tmp_path / "rows.txt").write_text("A sentence.\n" * 20)
    with pytest.raises(SystemExit, match=r"has 20 rows, fewer than one text of --task.passage-rows 100$"):
        rlhf_data.QueryTexts(str(tmp_path / "rows.txt"), None, "text", rows_per_text=100)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"^error: --task.query-dataset '.*empty': an empty directory$"):
        rlhf_data.QueryTexts(str(tmp_path / "empty"), None, "text")


def test_a_reward_function_returning_words_is_one_line_naming_the_flag(tiny_assets, tmp_path, monkeypatch):
    """C3: a callable returning strings gave a ValueError traceback in the first update; now its probe call at the
    dry run says so, and so would any later call."""
    import torch

    import train_policy_accelerate as P

    (tmp_path / "badrew.py").write_text("def words(queries, responses):\n    return ['good'] * len(responses)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "badrew:words", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--rewards.function badrew:words: returned scores that are "
                         "not numbers")  # fmt: skip
    function = P.RewardFunction("badrew:words", P.load_tokenizer(str(tiny_assets["model"])))
    with pytest.raises(SystemExit) as failure:
        function(torch.tensor([[15496], [995]]), torch.tensor([[13], [11]]))
    assert str(failure.value).startswith("error: --rewards.function badrew:words: returned scores that are not numbers")


def test_more_held_out_queries_than_the_corpus_yields_names_eval_queries_before_any_model_loads(tiny_assets, tmp_path):
    """E13: --eval-queries 64 on a 20-text corpus passed the dry run, then blamed --task.query-dataset after the models
    loaded and the update-0 evaluation ran."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(line + "\n" for line in tiny_assets["corpus"].read_text().splitlines()[:20]))
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
             str(corpus), "--task.passage-rows", "1", "--task.gold-labeler", "sentiment", "--eval-queries", "64",
             "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    last = check_one_line_error(run_in_process(POLICY, *flags), "--eval-queries 64", "20 texts")
    assert "lower --eval-queries" in last


# ---------------------------------------------------------------------------------------------------------------------
# chat templates and the dataset's fields (tests/test_chat.py has their pieces by hand)


def chat_cases(assets: dict, tiny: dict) -> dict:
    """(script, flags, words of the one-line error) for each bad chat or fields input."""
    chat = ["--base-model", str(tiny["model"]), "--task.chat-template", "--task.query-dataset", str(tiny["questions"]),
            "--task.query-length", "40", "--task.response-length", "16", "--dry-run"]  # fmt: skip
    policy = [*chat, "--rewards.function", "tests.chat_rewards:word_count"]
    plain = ["--base-model", str(assets["model"]), "--task.query-dataset", str(assets["corpus"]), "--dry-run"]
    return {
        "a base model without a chat template": (POLICY, [*plain, "--task.chat-template", "--rewards.function",
                                                          "sentiment"], ["--task.chat-template", "no chat template"]),
        "a base model without a chat template (reward)": (REWARD, [*plain, "--task.chat-template", "--labels.source",
                                                                   "sentiment"], ["no chat template"]),
        "a start text with the chat template": (POLICY, [*policy, "--task.start-text", "."],
                                                ["--task.start-text '.' with --task.chat-template", "whole"]),
        "a truncate token with the chat template (reward)": (REWARD, [*chat, "--labels.source", "sentiment",
                                                                      "--task.truncate-token", "."],
                                                             ["--task.truncate-token '.'", "end-of-turn token"]),
        "every prompt longer than the query length": (POLICY, [*policy, "--task.query-length", "8"],
                                                      ["no text yields a query"]),
        "a column the reward function needs and a text file lacks": (
            POLICY, [*plain, "--rewards.function", "tests.chat_rewards:word_count"],
            ["--rewards.function tests.chat_rewards:word_count asks for the columns 'prompt', 'word'", "lacks"]),
        "a column the gold labeler needs and a text file lacks": (
            POLICY, [*plain, "--rewards.function", "sentiment", "--task.gold-labeler", "tests.chat_rewards:word_count",
                     "--task.passage-rows", "1"], ["--task.gold-labeler tests.chat_rewards:word_count asks for"]),
        "a reward function of one argument": (POLICY, [*policy[:-1], "tests.chat_rewards:responses_only"],
                                              ["tests.chat_rewards:responses_only: takes 1 positional argument(s)"]),
        "a gold labeler that is no module:callable": (POLICY, [*policy, "--task.gold-labeler", "nonsense"],
                                                      ["--task.gold-labeler 'nonsense': expected module:callable"]),
    }  # fmt: skip


CHAT_CASES = list(chat_cases({"model": "", "corpus": ""}, {"model": "", "questions": ""}))


@pytest.mark.parametrize("case", CHAT_CASES)
def test_bad_chat_and_field_inputs_are_one_line_before_any_model_loads(tiny_assets, tiny_chat_assets, tmp_path, case):
    script, flags, words = chat_cases(tiny_assets, tiny_chat_assets)[case]
    check_one_line_error(run_in_process(script, *flags, "--output-dir", str(tmp_path / "out")), *words)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# weights that do not fit the model their config builds (N16, N17, N74)


def refit_weights(directory: Path, change) -> None:
    """Rewrite a model directory's model.safetensors as change(its tensors) returns them."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    save_file(change(tensors), directory / "model.safetensors")


WEIGHT_CASES = {
    "no tensor of the backbone": lambda tensors: {"foo": torch_zeros(1)},
    "a tensor of another shape": lambda tensors: {**tensors, "transformer.h.0.mlp.c_fc.weight": torch_zeros(64, 8)},
    "one layer missing": lambda tensors: {k: v for k, v in tensors.items() if not k.startswith("transformer.h.1.")},
}


def torch_zeros(*shape):
    import torch

    return torch.zeros(*shape)


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_reward_model_weights_that_do_not_fit_its_config_are_refused_before_any_model_loads(tiny_assets, tmp_path,
                                                                                             case):  # fmt: skip
    """N17: a reward model whose weights file holds no tensor of its backbone loaded at random (0 of 272 tensors),
    silently, and the policy trained against it; N74: weights of another shape, a traceback after the policy and the
    reference had loaded. Now one line from the dry run on, naming what does not fit."""
    reward_model = make_fake_reward_model(tiny_assets, tmp_path)
    refit_weights(reward_model, WEIGHT_CASES[case])
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.trained-model", str(reward_model),
             "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out")]  # fmt: skip
    for extra in (["--dry-run"], []):
        last = check_one_line_error(run_in_process(POLICY, *flags, *extra), "--rewards.trained-model")
        words = "do not fit its config.json" if case == "a tensor of another shape" else "would start at random"
        assert words in last, last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_a_base_model_whose_weights_do_not_fit_its_config_is_refused_before_any_model_loads(tiny_assets, tmp_path,
                                                                                            script):  # fmt: skip
    """N16: a base model directory with another model's weights (another width) passed the dry run, then failed with a
    50-line traceback once the run had started."""
    base = tmp_path / "base"
    shutil.copytree(tiny_assets["model"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "n_embd": 128}))
    flags = ["--base-model", str(base), "--task.query-dataset", str(tiny_assets["corpus"]), "--output-dir",
             str(tmp_path / "out"), *script_inputs(script, tiny_assets, tmp_path)]  # fmt: skip
    if script == POLICY:  # a reward model of the base model's own width, so that the base model is what fails
        flags[flags.index("--rewards.trained-model") :] = ["--rewards.function", "sentiment"]
    for extra in (["--dry-run"], []):
        check_one_line_error(
            run_in_process(script, *flags, *extra),
            "--base-model",
            "do not fit its config.json",
            "wte.weight is [404, 64] in the weights, [404, 128] in the model",
        )
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# the second review's other cases (../notes: bad-inputs-review-2.md's numbers), each refused in one line now


def write_module(directory: Path, name: str, source: str, monkeypatch) -> str:
    (directory / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(directory))
    return f"{name}:score"


@pytest.mark.parametrize(
    "source, words",
    [
        ("def score(queries, responses)\n    return [0.0]\n", "cannot import it (SyntaxError: "),  # N46
        ("raise RuntimeError('no GPU here')\n", "cannot import it (RuntimeError: no GPU here)"),
        (
            "def score(queries, responses):\n    return [float('nan')] * len(responses)\n",
            "returned a score that is not a finite number (nan)",
        ),  # N48: the probe took NaN; a late stop
        ("def score(queries, responses):\n    return [1.0]\n", "returned (1,) scores for 2 responses"),  # N49
    ],
    ids=["syntax error", "raises on import", "NaN", "one score"],
)
def test_a_reward_module_that_cannot_score_is_one_line_at_the_dry_run(tiny_assets, tmp_path, monkeypatch, source,
                                                                      words):  # fmt: skip
    spec = write_module(tmp_path, f"rewards_{abs(hash(source))}", source, monkeypatch)
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", spec, "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), f"--rewards.function {spec}" if "import" not in words
                         else f"--rewards.function {spec!r}", words)  # fmt: skip


def test_one_normalization_sample_is_refused_naming_both_flags(reward_base, tmp_path):
    """N10: the reward's mean and std from one sample: after the models loaded, the model was blamed."""
    flags = reward_base(tiny_label_file(tmp_path), "--rollout-batch-size", "1", "--normalize-samples", "1", "--dry-run")
    check_one_line_error(run_in_process(REWARD, *flags), "--normalize-samples 1 with --rollout-batch-size 1",
                         "no std")  # fmt: skip


def tiny_label_file(tmp_path: Path, records: list | None = None) -> Path:
    path = tmp_path / "labels.json"
    path.write_text(json.dumps(records or [label_record()] * 40))
    return path


def test_a_directory_as_label_file_is_one_line_not_a_hub_input(reward_base, tmp_path):
    """N24: the dry run listed a local directory as a Hub input and exited 0."""
    (tmp_path / "labels").mkdir()
    check_one_line_error(run_in_process(REWARD, *reward_base(tmp_path / "labels", "--dry-run")),
                         f"--label-dataset '{tmp_path / 'labels'}': a directory, not a label file")  # fmt: skip


def test_held_out_labels_that_repeat_training_labels_are_said(reward_base, tmp_path, capsys):
    """N19: held-out records that copy training records were accepted silently: test/accuracy would measure training
    records. Said now (the file is the user's: not refused)."""
    samples = {f"sample{j}": [20 + j] * 24 for j in range(4)}  # ids of the tiny vocabulary (404 tokens)
    records = [label_record(query=[10 + i] + [11] * 63, **samples) for i in range(16)]
    result = run_in_process(REWARD, *reward_base(tiny_label_file(tmp_path, records + records[:8] * 2), "--dry-run"))
    assert result.returncode == 0, result.stderr
    said = " ".join(capsys.readouterr().out.split())  # each of the 16 held-out records, not the 8 distinct ones
    assert "16 held-out records (past --labels.num-train) repeat training records" in said


def test_query_files_a_bom_and_a_csv(tmp_path):
    """N26: a .txt's byte-order mark stayed in its first text; N31: a .csv was read as lines, its header a query."""
    import rlhf_data

    (tmp_path / "q.txt").write_text("\ufeffThe first text.\nThe second.\n", encoding="utf-8")
    assert rlhf_data.QueryTexts(str(tmp_path / "q.txt"), None, "text")[0] == "The first text."
    (tmp_path / "q.csv").write_text('text,label\n"A review.",1\n')
    with pytest.raises(SystemExit, match=r"^error: --task.query-dataset '.*q.csv': a local file is a .txt"):
        rlhf_data.QueryTexts(str(tmp_path / "q.csv"), None, "text")


def test_a_model_directory_as_output_dir_is_refused(tiny_assets, tmp_path):
    """N34: a policy run was written into the reward model's directory (nothing lost, but a model directory then held
    a run)."""
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tiny_assets["model"]), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "holds a model (config.json)", "use another --output-dir")


def finished_policy_checkpoint(tiny_assets, tmp_path, world_size: int) -> tuple[Path, list[str]]:
    """An output directory as a run left it after update 1, written by `world_size` processes, and its flags."""
    import torch

    import train_policy_accelerate as P

    output_dir = tmp_path / "out"
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(output_dir), "--ppo.total-episodes", "32",
             "--ppo.batch-size", "16", "--ppo.whitening-ranks", "2"]  # fmt: skip
    args = P.validate_args(run_utils.task_cli(P.task_defaults, flags))
    checkpoint = output_dir / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    (output_dir / "args.json").write_text(json.dumps(asdict(args)))
    (output_dir / "metrics.jsonl").write_text('{"update": 1}\n')
    state = {"format": run_utils.CHECKPOINT_FORMAT, "step": 1, "world_size": world_size, "elapsed": 1.0,
             "kl_coef": 0.15, "processes": [{}] * world_size}  # fmt: skip
    (checkpoint / "state.json").write_text(json.dumps(state))
    torch.save({"x": torch.zeros(1)}, checkpoint / "pytorch_model.bin")
    return output_dir, flags


def test_resume_on_another_number_of_processes_is_refused_at_the_dry_run(tiny_assets, tmp_path, monkeypatch):
    """N76: a 1-process checkpoint resumed on 2 processes passed the dry run and was refused after the models loaded."""
    output_dir, flags = finished_policy_checkpoint(tiny_assets, tmp_path, world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    last = check_one_line_error(run_in_process(POLICY, *flags, "--resume", "--dry-run"), "--resume",
                                "written by 1 processes, this run has 2")  # fmt: skip
    assert "resume with the same number" in last


def test_resume_names_the_flags_that_differ_not_the_sizes_derived_from_them(tiny_assets, tmp_path):
    """N45: --resume with another --ppo.total-episodes also named --num-updates, which is no flag."""
    output_dir, flags = finished_policy_checkpoint(tiny_assets, tmp_path, world_size=1)
    flags[flags.index("--ppo.total-episodes") + 1] = "64"
    last = check_one_line_error(run_in_process(POLICY, *flags, "--resume", "--dry-run"), "--ppo.total-episodes differ")
    assert "num-updates" not in last


def test_accelerate_launch_of_several_processes_that_started_one_fails_the_dry_run(tiny_assets, tmp_path, monkeypatch):
    """N11b: `accelerate launch --num_processes 2` without --multi_gpu ran the dry run as 1 process, then the run was
    refused (with accelerate's traceback)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "started this process alone", "--multi_gpu")


def test_no_query_names_the_flags_that_cut_the_texts(tiny_assets, tmp_path):
    """N06: `--task.query-length 1` with the books tasks' start and end text blamed the query file alone."""
    flags = ["--base-model", str(tiny_assets["model"]), "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--task.query-length", "1", "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "no text yields a query", "--task.query-length 1",
                         "--task.start-text '.'", "--task.end-text '.'")  # fmt: skip


def test_quickstart_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    """N55: the error named the quick start's internal `.input-check` path inside the file."""
    import quickstart

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        quickstart.main(["--output-dir", str(tmp_path / "file"), "--dry-run"])
    assert capsys.readouterr().err.strip().startswith(f"quickstart: --output-dir {tmp_path / 'file'}: a file, not a")


# ---------------------------------------------------------------------------------------------------------------------
# the checks themselves cannot crash: extreme values in every numeric flag, malformed files in every reader

EXTREME_FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 5e-324, -5e-324, 1e308, -1e308, 10**400]
EXTREME_INTS = [0, -1, 2**63, -(2**63) - 1, 10**400, -(10**400)]


def numeric_fields_and_types(args, prefix: str = "") -> list[tuple[str, type]]:
    """Every int and float field of a script's Args (nested ones too), not bools, as (dotted path, type)."""
    import dataclasses
    import typing

    fields = []
    hints = typing.get_type_hints(type(args))
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if dataclasses.is_dataclass(value):
            fields += numeric_fields_and_types(value, f"{prefix}{field.name}.")
        elif field.name not in run_utils.derived_fields(type(args)):
            kind = typing.get_args(hints[field.name]) or (hints[field.name],)
            for base in (int, float):
                if base in kind:
                    fields.append((prefix + field.name, base))
    return fields


@pytest.mark.parametrize("script", [REWARD, POLICY])
def test_extreme_numbers_in_every_numeric_flag_are_checked_or_accepted_never_a_traceback(script, monkeypatch):
    """Each numeric flag given NaN, infinities, zeros, subnormals and integers beyond any machine type (set on the
    parsed flags, as a config or a shell variable could give them): validate_args accepts the value or refuses it in
    one line naming the flag; no exception of its own (N03 was an OverflowError)."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["--rewards.function", "sentiment"] if script == POLICY else []
    defaults = run_utils.task_cli(module.task_defaults, base)
    fields = numeric_fields_and_types(defaults)
    assert len(fields) > 20 and ("task.temperature", float) in fields
    refused = 0
    for name, kind in fields:
        for value in EXTREME_INTS if kind is int else EXTREME_FLOATS:
            args = run_utils.replace_fields(run_utils.task_cli(module.task_defaults, base), {name: value})
            try:
                module.validate_args(args)
            except SystemExit as stop:
                message = str(stop.code)
                assert message.startswith("error: ") and "\n" not in message, (name, value, message)
                refused += 1
            except Exception as error:  # the check itself broke
                raise AssertionError(f"--{name} {value!r}: {type(error).__name__}: {error}") from error
    assert refused > len(fields)  # most extremes are refused, each in one line


MALFORMED = [b"", b"\x00\xff\xfe binary", b"[" * 2000, b'{"text": ' + b"9" * 5000 + b"}", b'[{"text": 1e999}]',
             b'{"text": "\\ud800"}\n', b'[{"text": "a"}, 3]', b'{"text": ["nested", {"deep": []}]}\n', b"\xef\xbb\xbf",
             b'{"text": "fine"}\n{"text": "fine"\n', b"null", b'"just a string"', b"1e400", b'{"text": null}\n']  # fmt: skip


@pytest.mark.parametrize("suffix", [".txt", ".json", ".jsonl"])
def test_malformed_query_files_are_read_or_refused_in_one_line(tmp_path, suffix):
    """Random bytes, deep nesting, huge numbers, lone surrogates, wrong types: QueryTexts reads the file or refuses it
    in one line naming it, whatever the content (the seeded random cuts of a good file too)."""
    import random

    import rlhf_data

    good = "".join(json.dumps({"text": f"Text number {i}.", "answer": i}) + "\n" for i in range(20)).encode()
    rng = random.Random(0)
    contents = MALFORMED + [good[: rng.randrange(len(good))] for _ in range(10)] + [rng.randbytes(64) for _ in range(5)]
    for content in contents:
        path = tmp_path / f"queries{suffix}"
        path.write_bytes(content)
        try:
            texts = rlhf_data.QueryTexts(str(path), None, "text")
            [texts[i] for i in range(len(texts))]
        except SystemExit as stop:
            message = str(stop.code)
            assert message.startswith("error: --task.query-dataset") and "\n" not in message, (content[:40], message)
        except Exception as error:
            raise AssertionError(f"{content[:40]!r}: {type(error).__name__}: {error}") from error


def test_malformed_label_files_are_read_or_refused_in_one_line(tmp_path):
    """The label reader on the same malformed contents and on records with every field of a wrong type."""
    import rlhf_data

    lengths = {"query": 4, **{f"sample{i}": 2 for i in range(4)}}
    good = {"query": [1, 2, 3, 4], **{f"sample{i}": [5, 6] for i in range(4)}, "best": 0}
    wrong = [None, True, 1.5, "1", [], {}, -1, 10**30, [None] * 4, [1e999] * 4, [True] * 4, [[1]] * 4]
    records = [{**good, key: value} for key in good for value in wrong]
    contents = MALFORMED + [json.dumps([record] * 3).encode() for record in records]
    for content in contents:
        path = tmp_path / "labels.json"
        path.write_bytes(content)
        try:
            rlhf_data.read_label_records(str(path), lengths, 100, (50259,), 4)
        except SystemExit as stop:
            message = str(stop.code)
            assert message.startswith("error: --label-dataset") and "\n" not in message, (content[:60], message)
        except Exception as error:
            raise AssertionError(f"{content[:60]!r}: {type(error).__name__}: {error}") from error


def test_an_uncached_hub_model_under_hf_hub_offline_fails_the_dry_run(tiny_assets, tmp_path):
    """N36: HF_HUB_OFFLINE=1 with a Hub base model the cache lacks: the dry run listed it as not checked and exited 0,
    then the run failed. (The tests run with HF_HUB_OFFLINE=1 and an empty cache for `gpt2`-like ids.)"""
    flags = ["--base-model", "someone/no-such-model", "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--base-model 'someone/no-such-model': not in the Hugging "
                         "Face cache and HF_HUB_OFFLINE=1")  # fmt: skip


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tiny_assets, tmp_path, monkeypatch):
    """A8: `--base-model models/smollm2` with a local models/ and no smollm2 in it: the dry run called it a Hub input."""
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    flags = ["--base-model", "models/smollm2", "--rewards.function", "sentiment", "--task.query-dataset",
             str(tiny_assets["corpus"]), "--output-dir", str(tmp_path / "out"), "--dry-run"]  # fmt: skip
    check_one_line_error(run_in_process(POLICY, *flags), "--base-model 'models/smollm2': no such directory in models/")
