"""The paper's defaults over real HTTP: both scripts against a Hugging Face Hub on 127.0.0.1 (tests/local_hub.py)
that serves small copies of the repos they name, with their real ids, file names, configurations and columns
(`gpt2`, `vwxyzjn/lm-human-preferences`, `bookcorpus/bookcorpus` with its Parquet conversion, `webis/tldr-17`,
`abisee/cnn_dailymail`). Nothing local but the flags that make a run tiny: online from an empty cache, then offline
(HF_HUB_OFFLINE=1) from the warm one; the Hub's failures, each one line naming the flag; --upload-model's upload; and
the loopback guard that keeps every test on 127.0.0.1 (tests/loopback/sitecustomize.py)."""

import hashlib
import io
import json
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tests.conftest import run_script, script_environment
from tests.local_hub import LocalHub
from tests.loopback import sitecustomize as loopback

REWARD, POLICY = "train_reward_accelerate.py", "train_policy_accelerate.py"
TOKEN = "hf_local_test_token"  # the one token tests/local_hub.py accepts
OPENAI_PAD = 50259  # OpenAI's label files pad with it
WORDS = "the a cat dog sat on mat happy sad good bad great house river tree bird sun moon ran saw big small".split()
READ_ROUTES = {"GET api/agent-harnesses", "GET api/{type}s/{repo}", "GET api/{type}s/{repo}/revision/{rev}",
               "GET api/{type}s/{repo}/tree/{rev}", "GET api/{type}s/{repo}/tree/{rev}/{path}",
               "HEAD {repo}/resolve/{rev}/{path}", "GET {repo}/resolve/{rev}/{path}",
               "HEAD datasets/{repo}/resolve/{rev}/{path}", "GET datasets/{repo}/resolve/{rev}/{path}"}  # fmt: skip
"""Every route the runs below use: huggingface_hub 2.4, transformers 5.24 and datasets 5.2 send HEAD and GET only."""
UPLOAD_ROUTES = {"GET api/whoami-v2", "POST api/repos/create", "POST api/{type}s/{repo}/preupload/{rev}",
                 "POST api/{type}s/{repo}/commit/{rev}"}  # fmt: skip
REWARD_SIZES = ["--labels.num-train", "16", "--batch-size", "16", "--rollout-batch-size", "16", "--normalize-samples",
                "16", "--eval-batch-size", "16"]  # fmt: skip
POLICY_SIZES = ["--ppo.total-episodes", "16", "--ppo.batch-size", "16", "--ppo.whitening-ranks", "1"]
SUMMARY_SIZES = ["--task.query-length", "48", "--task.response-length", "16", "--task.truncate-after", "8"]
"""Shorter than OpenAI's 500 and 75 tokens: the summarization label files here are made at these lengths."""


# ---------------------------------------------------------------------------------------------------------------------
# the repos, small
def parquet(columns: dict) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


def sentences(n: int, seed: int) -> list[str]:
    """Rows as Hub `bookcorpus` has them: one lower-cased sentence each, a space before the '.'."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + " ." for _ in range(n)]


def label_file(records: int, query_length: int, response_length: int, seed: int) -> bytes:
    """Best-of-4 records in OpenAI's format: token ids, queries padded on the right with OpenAI's pad."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(50257) for _ in range(n)]  # noqa: E731
    return json.dumps([dict(query=tokens(query_length - 3) + [OPENAI_PAD] * 3, best=rng.randrange(4),
                            **{f"sample{i}": tokens(response_length) for i in range(4)})
                       for _ in range(records)]).encode()  # fmt: skip


def gpt2_files(tokenizer_dir: Path, directory: Path) -> dict[str, bytes]:
    """A 1-layer GPT-2 of width 8 (random weights, GPT-2's 50,257-token vocabulary and 1,024 positions) with GPT-2's
    tokenizer files: what `gpt2` holds, small."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8)).save_pretrained(directory)
    files = [*Path(directory).iterdir(), *Path(tokenizer_dir).iterdir()]
    return {path.name: path.read_bytes() for path in files if path.is_file()}


def article_rows(n: int, seed: int) -> dict:
    articles = [f"By . Daily Mail Reporter . {' '.join(sentences(8, seed + i))}" for i in range(n)]
    return {"article": articles, "highlights": ["A highlight ."] * n, "id": [f"{seed:02d}{i:038x}" for i in range(n)]}


def tldr_rows(n: int, seed: int) -> dict:
    posts = [" ".join(sentences(6, seed + i)).capitalize() for i in range(n)]
    return {"author": ["someone"] * n, "body": posts, "normalizedBody": posts, "subreddit": ["AskReddit"] * n,
            "subreddit_id": ["t5_2qh1i"] * n, "id": [f"c{i:06x}" for i in range(n)], "content": posts,
            "summary": ["A summary."] * n}  # fmt: skip


CNNDM_CARD = """---
configs:
- config_name: 1.0.0
  data_files:
  - split: train
    path: 1.0.0/train-*
- config_name: 3.0.0
  data_files:
  - split: train
    path: 3.0.0/train-*
  - split: validation
    path: 3.0.0/validation-*
---
# CNN / DailyMail
"""


def paper_hub(tokenizer_dir: Path, directory: Path) -> LocalHub:
    hub = LocalHub()
    hub.add("model", "gpt2", gpt2_files(tokenizer_dir, directory))
    hub.add("dataset", "vwxyzjn/lm-human-preferences", {
        "sentiment/offline_5k.json": label_file(32, 64, 24, 1), "descriptiveness/offline_5k.json": label_file(32, 64, 24, 2),
        "tldr/online_45k.json": label_file(32, 48, 16, 3), "cnndm/online_45k.json": label_file(32, 48, 16, 4),
    })  # fmt: skip
    books = sentences(1200, seed=0)
    hub.add("dataset", "bookcorpus/bookcorpus", {"bookcorpus.py": b"import datasets  # a loading script\n",
                                                 "README.md": b"# BookCorpus\n"})  # fmt: skip
    hub.add("dataset", "bookcorpus/bookcorpus", {"plain_text/train/0000.parquet": parquet({"text": books[:600]}),
                                                 "plain_text/train/0001.parquet": parquet({"text": books[600:]})},
            revision="refs/convert/parquet")  # fmt: skip
    hub.add(
        "dataset", "webis/tldr-17", {"tldr-17.py": b"import datasets  # a loading script\n", "README.md": b"# tldr\n"}
    )
    hub.add("dataset", "webis/tldr-17", {"default/partial-train/0000.parquet": parquet(tldr_rows(40, 1))},
            revision="refs/convert/parquet")  # fmt: skip
    hub.add("dataset", "abisee/cnn_dailymail", {
        "README.md": CNNDM_CARD.encode(), "1.0.0/train-00000-of-00001.parquet": parquet(article_rows(5, 9)),
        "3.0.0/train-00000-of-00002.parquet": parquet(article_rows(20, 1)),
        "3.0.0/train-00001-of-00002.parquet": parquet(article_rows(20, 2)),
        "3.0.0/validation-00000-of-00001.parquet": parquet(article_rows(5, 3)),
    })  # fmt: skip
    # a dataset with a loading script whose Parquet conversion does not exist (yet)
    hub.add("dataset", "someone/scripted", {"scripted.py": b"import datasets\n", "README.md": b"# scripted\n"})
    return hub


@pytest.fixture(scope="module")
def hub(gpt2_tokenizer_dir, tmp_path_factory):
    hub = paper_hub(gpt2_tokenizer_dir, tmp_path_factory.mktemp("gpt2")).start()
    yield hub
    hub.stop()


def hub_env(hub: LocalHub, home: Path, offline: bool = False, **extra) -> dict:
    """The scripts' environment against the local Hub: a Hugging Face home of the test's own, no token or other
    cache settings from the caller's environment."""
    unset = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_CACHE", "HF_DATASETS_CACHE",
             "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_XET_CACHE")  # fmt: skip
    return {**dict.fromkeys(unset), "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "1" if offline else "0", **extra}  # fmt: skip


def run(hub: LocalHub, script: str, home: Path, *flags: str, offline: bool = False, **env):
    """A script run against the local Hub; also what it asked of the Hub (method, route, path)."""
    before = len(hub.requests)
    result = run_script(script, *flags, env=hub_env(hub, home, offline, **env))
    return result, hub.requests[before:]


def routes(requests) -> set[str]:
    return {f"{method} {route}" for method, route, _ in requests}


def one_line_error(result) -> str:
    """The one line a run that failed printed last (no traceback)."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------------------------
# the defaults, online and then offline
@pytest.fixture(scope="module")
def sentiment_cache(hub, tmp_path_factory):
    """The README's first command with only size flags added, from an empty cache: it fills the cache with gpt2, the
    sentiment labels and bookcorpus's Parquet conversion (no --task.query-dataset-config)."""
    root = tmp_path_factory.mktemp("sentiment")
    result, requests = run(hub, REWARD, root / "home", *REWARD_SIZES, "--output-dir", str(root / "reward"))
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(root / "home", root / "warm")  # as the first run left it, for the tests that start there
    return root, result, requests


def test_sentiment_defaults_over_http_then_offline_from_the_warm_cache(hub, sentiment_cache):
    root, result, requests = sentiment_cache
    args = json.loads((root / "reward" / "args.json").read_text())
    assert (args["base_model"], args["label_dataset_repo"], args["label_dataset"], args["task"]["query_dataset"],
            args["task"]["query_dataset_config"]) == ("gpt2", "vwxyzjn/lm-human-preferences",
                                                      "sentiment/offline_5k.json", "bookcorpus/bookcorpus", None)  # fmt: skip
    paths = [path for _, _, path in requests]
    assert "/datasets/bookcorpus/bookcorpus/resolve/main/bookcorpus.py" in paths  # asked first: a script on main
    assert "/api/datasets/bookcorpus/bookcorpus/revision/refs%2Fconvert%2Fparquet" in paths  # the ref, one segment
    assert any(path.endswith("/plain_text/train/0001.parquet") for path in paths)
    assert "/datasets/vwxyzjn/lm-human-preferences/resolve/main/sentiment/offline_5k.json" in paths
    sha = hub.repos["model", "gpt2"].sha("main")  # the commit of main, pinned: later files by it, not by "main"
    assert f"/gpt2/resolve/{sha}/model.safetensors" in paths and "/gpt2/resolve/main/model.safetensors" not in paths
    size = sum(len(hub.repos["dataset", "bookcorpus/bookcorpus"].revisions["refs/convert/parquet"][f]) for f in
               ("plain_text/train/0000.parquet", "plain_text/train/0001.parquet"))  # fmt: skip
    announced = f"bookcorpus/bookcorpus: downloading 2 data files (plain_text/train/), {size / 1e3:.1f} kB, into"
    assert announced in result.stdout and "bookcorpus/bookcorpus: 2/2 files" in result.stdout
    assert (root / "reward" / "reward_model" / "model.safetensors").is_file()
    home, reward_model = root / "home", str(root / "reward" / "reward_model")

    result, policy_requests = run(hub, POLICY, home, "--rewards.trained-model", reward_model, *POLICY_SIZES,
                                  "--output-dir", str(root / "policy"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "policy" / "policy" / "model.safetensors").is_file()
    assert "downloading" not in result.stdout  # the warm cache: nothing to download
    used = routes(requests + policy_requests)
    assert used <= READ_ROUTES and "GET api/{type}s/{repo}/tree/{rev}/{path}" in used, used  # nothing unknown

    before = len(hub.requests)
    for script, flags in [(REWARD, [*REWARD_SIZES, "--output-dir", str(root / "reward-offline")]),
                          (POLICY, ["--rewards.trained-model", reward_model, *POLICY_SIZES, "--output-dir",
                                    str(root / "policy-offline")])]:  # fmt: skip
        result, _ = run(hub, script, home, *flags, offline=True)
        assert result.returncode == 0, result.stderr[-3000:]
    assert hub.requests[before:] == []  # offline: not one request
    assert (root / "policy-offline" / "policy" / "model.safetensors").is_file()


def test_cnndm_defaults_over_http_then_offline_from_the_warm_cache(hub, tmp_path):
    """A summarization task: its own label file, a dataset of Parquet files with configurations (3.0.0) read from
    main."""
    home, task = tmp_path / "home", ["--task.name", "cnndm", *SUMMARY_SIZES]
    result, requests = run(hub, REWARD, home, *task, *REWARD_SIZES, "--output-dir", str(tmp_path / "reward"))
    assert result.returncode == 0, result.stderr[-3000:]
    args = json.loads((tmp_path / "reward" / "args.json").read_text())
    assert (args["label_dataset"], args["task"]["query_dataset"], args["task"]["query_dataset_config"],
            args["task"]["query_prefix"]) == ("cnndm/online_45k.json", "abisee/cnn_dailymail", "3.0.0", "Article:\n\n")  # fmt: skip
    assert "abisee/cnn_dailymail: downloading 3 data files (3.0.0/), " in result.stdout  # not 1.0.0's
    downloads = [path for method, _, path in requests if method == "GET" and "/resolve/" in path]
    assert any(path.endswith("3.0.0/validation-00000-of-00001.parquet") for path in downloads)
    assert not any("1.0.0" in path or "refs%2Fconvert" in path for path in downloads)
    reward_model = str(tmp_path / "reward" / "reward_model")
    result, policy_requests = run(hub, POLICY, home, *task, "--rewards.trained-model", reward_model, *POLICY_SIZES,
                                  "--output-dir", str(tmp_path / "policy"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert routes(requests + policy_requests) <= READ_ROUTES

    before = len(hub.requests)
    result, _ = run(hub, REWARD, home, *task, *REWARD_SIZES, "--output-dir", str(tmp_path / "r2"), offline=True)
    assert result.returncode == 0, result.stderr[-3000:]
    result, _ = run(hub, POLICY, home, *task, "--rewards.trained-model", reward_model, *POLICY_SIZES,
                    "--output-dir", str(tmp_path / "p2"), offline=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert hub.requests[before:] == [] and (tmp_path / "p2" / "policy" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def second_run(hub, sentiment_cache, tmp_path_factory):
    """A second run in a copy of the first one's cache, with bookcorpus's configuration named and --upload-model
    (one run for two tests: the configuration changes what is read, the upload what happens after the save)."""
    root, _, _ = sentiment_cache
    directory = tmp_path_factory.mktemp("second")
    shutil.copytree(root / "warm", directory / "home")
    result, requests = run(hub, REWARD, directory / "home", *REWARD_SIZES, "--task.query-dataset-config", "plain_text",
                           "--output-dir", str(directory / "reward"), "--upload-model", "--hf-repo-id",
                           "tester/sentiment-reward", HF_TOKEN=TOKEN)  # fmt: skip
    return directory, result, requests


def test_a_warm_cache_reads_a_named_configuration_of_a_dataset_with_a_loading_script(second_run):
    """bookcorpus loaded once without a configuration, then with `plain_text`: `datasets` answers the refused script
    with the dataset it cached ("Couldn't find cache ... for config 'plain_text'") unless the script is asked about
    first (rlhf_data.ships_loading_script)."""
    _, result, requests = second_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bookcorpus/bookcorpus ships a loading script: reading the Hub's Parquet conversion" in result.stdout
    assert "downloading" not in result.stdout  # the same Parquet files, from the cache
    assert any(path.startswith("/api/datasets/bookcorpus/bookcorpus/tree/") for _, _, path in requests)


# ---------------------------------------------------------------------------------------------------------------------
# the Hub's failures: one line naming the flag
@pytest.mark.parametrize("flags, env, expected", [
    (["--base-model", "nobody/no-such-model"], {},
     "error: --base-model 'nobody/no-such-model': cannot load a tokenizer and model config (nobody/no-such-model is "
     "not a local folder and is not a valid model identifier"),
    (["--label-dataset", "sentiment/no_such_file.json"], {},
     "error: --label-dataset 'sentiment/no_such_file.json': not in the Hub dataset 'vwxyzjn/lm-human-preferences' (404 "
     "Client Error. Entry Not Found for url: "),
    (["--task.name", "cnndm", *SUMMARY_SIZES, "--task.query-dataset-config", "9.9.9"], {},
     "error: --task.query-dataset 'abisee/cnn_dailymail' (--task.query-dataset-config '9.9.9'): cannot load it "
     "(ValueError: BuilderConfig '9.9.9' not found. Available: ['1.0.0', '3.0.0'])"),
    (["--task.query-dataset", "someone/scripted"], {},
     "error: --task.query-dataset 'someone/scripted' (--task.query-dataset-config None): cannot load it "
     "(DatasetNotFoundError: Revision 'refs/convert/parquet' doesn't exist for dataset 'someone/scripted' on the Hub.)"),
    ([], {"HF_TOKEN": "hf_not_a_token_the_hub_knows"},
     "error: --base-model 'gpt2': cannot load a tokenizer and model config (There was a specific connection error when "
     "trying to load gpt2: Client error '401 Unauthorized' for url "),
], ids=["missing-repo", "missing-file", "missing-configuration", "missing-revision", "401"])  # fmt: skip
def test_a_hub_failure_is_one_line_naming_the_flag(hub, tmp_path, flags, env, expected):
    result, _ = run(hub, REWARD, tmp_path / "home", *REWARD_SIZES, *flags, "--output-dir", str(tmp_path / "run"), **env)
    line = one_line_error(result)
    assert line.startswith(expected), line
    if env:
        assert line.endswith("the Hub refused the token (HF_TOKEN, or the one `hf auth login` saved))"), line


def test_the_hub_gone_mid_download_is_one_line_and_nothing_half_downloaded_is_read_as_whole(hub, tmp_path):
    """The Hub stops after half of gpt2's weights: the run ends in one line naming --base-model and the lost
    connection, after the client's retries (5, a second apart); huggingface_hub downloads into a temporary file of
    its own and deletes it on failure, so the cache holds no part of the weights for a later run, online or
    offline, to take for the whole file; the next run, with the Hub back, downloads all of it."""
    weights = hub.repos["model", "gpt2"].revisions["main"]["model.safetensors"]
    hub.gone_after("model.safetensors", len(weights) // 2)
    home, flags = tmp_path / "home", [*REWARD_SIZES, "--output-dir", str(tmp_path / "run")]
    try:
        result, _ = run(hub, REWARD, home, *flags)
    finally:
        hub.cut.clear()
        hub.start()  # back, on the same port
    line = one_line_error(result)
    assert line.startswith("error: --base-model 'gpt2': cannot load its weights ("), line
    assert line.endswith("(no answer from the Hub: ConnectError: [Errno 111] Connection refused))"), line
    assert "peer closed connection without sending complete message body" in result.stderr  # cut, then gone
    repo = home / "hub" / "models--gpt2"
    weight_blob = repo / "blobs" / hashlib.sha256(weights).hexdigest()
    assert not list(repo.glob("snapshots/*/model.safetensors")) and not weight_blob.exists()
    assert not [path for path in repo.rglob("*") if path.is_file() and path.stat().st_size == len(weights) // 2]

    resumed = len(hub.resumed)
    result, requests = run(hub, REWARD, home, *flags, "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    (snapshot,) = repo.glob("snapshots/*/model.safetensors")
    assert snapshot.read_bytes() == weights and hub.resumed[resumed:] == []  # the whole file, from its first byte


# ---------------------------------------------------------------------------------------------------------------------
# --upload-model
def test_upload_model_pushes_the_reward_model_to_the_hub(hub, second_run):
    """huggingface_hub's upload: whoami, create the repo, ask how to send each file (all "regular" here: inline,
    base64), commit. What arrives is the saved directory, byte for byte."""
    directory, result, requests = second_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert UPLOAD_ROUTES <= routes(requests)
    uploaded = hub.repos["model", "tester/sentiment-reward"].revisions["main"]
    saved = {path.name: path.read_bytes() for path in (directory / "reward" / "reward_model").iterdir()}
    assert uploaded == saved and "model.safetensors" in saved


# ---------------------------------------------------------------------------------------------------------------------
# the loopback guard
def test_the_loopback_guard_stops_and_reports_any_other_address(guard_the_loopback):
    """In this process and in a script the tests start: a DNS lookup or a connection anywhere but 127.0.0.1 raises,
    and is recorded for guard_the_loopback (tests/conftest.py), which fails the test after it ends; `datasets` asks
    neither its parquet-export server nor its download counter."""
    with pytest.raises(OSError, match="loopback guard"):
        socket.getaddrinfo("huggingface.co", 443)
    with pytest.raises(OSError, match="loopback guard"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)  # TEST-NET-1: nothing there anyway
    probe = ("import socket, datasets.config as c\n"
             "print(c.USE_PARQUET_EXPORT, c.HF_UPDATE_DOWNLOAD_COUNTS)\n"
             "socket.create_connection(('198.51.100.1', 80), timeout=1)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=script_environment())
    assert result.returncode == 1 and result.stdout.split() == ["False", "False"], result.stderr
    assert "loopback guard: blocked a connection to '198.51.100.1'" in result.stderr
    tried = guard_the_loopback.tried()
    assert [line.split(" from ")[0] for line in tried] == [
        "a DNS lookup of 'huggingface.co'", "a connection to '192.0.2.1'", "a connection to '198.51.100.1'",
    ]  # fmt: skip
    guard_the_loopback.reset()  # seen: this test is not to fail for them
    assert loopback.is_loopback("127.0.0.1") and loopback.is_loopback("localhost") and loopback.is_loopback("::1")


def test_the_tests_processes_collect_garbage_less_often_and_still_write_what_they_leave_open(tmp_path):
    """fewer_collections (tests/loopback/sitecustomize.py), in a script the tests start: the collector's threshold
    10,000, and a file the script never closed still written at exit (freed by reference counting, as before)."""
    probe = ("import gc\n"
             f"log = open({str(tmp_path / 'left-open.txt')!r}, 'w')\n"
             "log.write('written at exit')\n"
             "print(gc.get_threshold())\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=script_environment())
    assert result.returncode == 0 and result.stdout.strip() == "(10000, 10, 10)", result.stderr
    assert (tmp_path / "left-open.txt").read_text() == "written at exit"


def test_the_guard_admits_only_the_private_hosts_of_a_tests_own_namespaces(tmp_path, monkeypatch):
    """$LOOPBACK_GUARD_HOSTS (the hosts file of the namespaces tests/test_slurm_two_nodes.py builds): its names and
    private addresses count as local; a public address in it, and any name or address not in it, do not."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.77.0.2 node1\n8.8.8.8 outside  # public: never admitted\n")
    assert not loopback.is_loopback("node1")
    monkeypatch.setenv(loopback.HOSTS_VARIABLE, str(hosts))
    assert loopback.is_loopback("node1") and loopback.is_loopback("10.77.0.2") and loopback.is_loopback("NODE1")
    assert not loopback.is_loopback("outside") and not loopback.is_loopback("8.8.8.8")
    assert not loopback.is_loopback("node2") and not loopback.is_loopback("10.77.0.3")
