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
}


@pytest.mark.parametrize("case", LABEL_FILES, ids=list(LABEL_FILES))
def test_bad_label_files(reward_base, tmp_path, case):
    labels = tmp_path / "labels.json"
    LABEL_FILES[case](labels)
    start = time.time()
    result = run_in_process(REWARD, *reward_base(labels))
    check_one_line_error(result, "--label-dataset", str(labels))
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
    """A reward_model/ directory whose metadata is all that the early checks read."""
    import run_utils
    import train_policy_accelerate as P

    directory = tmp_path / "rm"
    directory.mkdir(exist_ok=True)
    tokenizer = P.load_tokenizer(str(tiny_assets["model"]))
    info = {"base_model": "tiny", "pad_id": tokenizer.pad_token_id,
            "tokenizer_fingerprint": fingerprint or run_utils.tokenizer_fingerprint(tokenizer)}  # fmt: skip
    (directory / "reward_model.json").write_text(json.dumps(info))
    (directory / "reward_head.safetensors").write_bytes(b"")  # the early checks look only for it
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
