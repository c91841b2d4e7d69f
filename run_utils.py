"""Run tooling for train_reward_accelerate.py and train_policy_accelerate.py: everything a run needs that is not the
RLHF algorithm, written once (CleanRL's split: its scripts import `cleanrl_utils`).

Here, in sections: the tooling flags both scripts inherit (`RunArgs`); one-line errors and input checks, the Hugging
Face Hub; the output directory and atomic writes; the launch (processes, DeepSpeed, gradient checkpointing); one run
(checkpoints and exact resume, SIGTERM / Ctrl-C, metrics to metrics.jsonl, TensorBoard, wandb, console and progress);
devices, timing / MFU; and the estimated peak memory checked against a GPU's before a run (the estimate itself is
memory_estimate.py, the formulas of docs/memory.md). The data the scripts read (query texts, label files) is
rlhf_data.py's. Every tensor operation of the algorithm is in the script that runs it: nothing here defines a
model, calls `backward()` or `generate()`, or imports the scripts or rlhf_data (tests/test_run_utils.py checks all
three).
"""

import atexit
import ctypes
import fcntl
import importlib
import itertools
import json
import math
import netrc
import os
import re
import shutil
import signal
import socket
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, NoReturn, Optional
from urllib.parse import urlparse

import accelerate.utils.other
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, gather_object
from rich.console import Console
from rich.progress import track
from rich.table import Table
from rich.text import Text
from safetensors import SafetensorError, safe_open

import memory_estimate

CHECKPOINT_FORMAT = 2  # 2: accelerate's save_state layout (1, before it: model.pt / optimizer.pt / processes.pt)
RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")  # copied into each checkpoint
GLIBC_M_TRIM_THRESHOLD, GLIBC_M_MMAP_THRESHOLD = -1, -3  # mallopt() parameter numbers from glibc's malloc.h
console = Console()  # one console for progress bars, tables and lines, so that printed lines never tear a bar


@dataclass
class RunArgs:
    exp_name: str = "run"
    """experiment name, the first part of the run name (each script sets its own)"""
    seed: int = 1
    """global seed (each script says what it seeds)"""
    track: bool = False
    """log to Weights & Biases (needs `wandb login` or WANDB_API_KEY; WANDB_MODE=offline needs neither)"""
    wandb_project_name: str = "lm-human-preferences"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user)"""
    tensorboard: bool = True
    """write TensorBoard event files into --output-dir (`tensorboard --logdir runs` shows every run)"""
    output_dir: Optional[str] = None
    """where args.json, metrics.jsonl, the logs and the trained model go; runs/<run_name> when not given"""
    overwrite: bool = False
    """start again in an output directory that holds a previous run of this script (its logs and checkpoints go, once
    every input is checked)"""
    resume: bool = False
    """continue the run in --output-dir from its newest checkpoint (from scratch if it has none; returns at once if it
    finished); every flag that changes the math must be as before"""
    checkpoint_every: int = 0
    """write a checkpoint (model, optimizer, RNG states, data position, logs) every this many steps into
    --output-dir/checkpoints (0: only when stopped by SIGTERM or Ctrl-C, and removed once the resumed run finishes)"""
    checkpoint_keep: int = 2
    """keep the newest this many checkpoints"""
    dry_run: bool = False
    """check every flag and every input the run will read, print the derived sizes and exit before loading a model (a
    Hub input is not fetched: it, and what needs it, are listed as not checked)"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: the trunk's forwards under bf16 autocast with fp32 master weights and optimizer state; the LM head's
    logits, the value and reward heads, log-softmax, losses, rewards and advantages stay fp32, as OpenAI's (a GPU
    speed option for Ampere and newer: slower on GPUs and CPUs without bf16 units; refused under DeepSpeed, whose
    engine would hold the weights themselves in bf16)"""
    allow_tf32: bool = False
    """TF32 matmuls on Ampere and newer GPUs (~1e-3 relative error per matmul, several times fp32's speed: what an
    fp32 run on a GPU wants) for the trunk and every gradient; the LM, value and reward heads' forward products stay
    fp32, as OpenAI's; no effect on CPU"""
    gradient_checkpointing: bool = False
    """recompute the trained model's activations in the backward pass instead of keeping them (memory knob for large
    models: one more forward per backward; same math to float rounding)"""
    peak_tflops: Optional[float] = None
    """the device's peak TFLOP/s (per process); with it, MFU (model FLOPs per second / peak) is logged as time/mfu_*
    (benchmark/speed/throughput.py measures a peak with a matmul benchmark)"""
    gpu_memory_gb: Optional[float] = None
    """the GPU memory per process (GB, 2^30 bytes) that --dry-run checks its estimated peak against (docs/memory.md);
    default: the visible GPU's, when there is one"""
    upload_model: bool = False
    """push the trained model directory to the Hugging Face Hub as --hf-repo-id (access is checked before training)"""
    hf_repo_id: Optional[str] = None
    """Hub repo for --upload-model; the run name when not given"""
    world_size: tyro.conf.Suppress[Optional[int]] = None
    micro_batch_size: tyro.conf.Suppress[Optional[int]] = None
    run_name: tyro.conf.Suppress[Optional[str]] = None


# ---------------------------------------------------------------------------------------------------------------------
# errors and input checks
def fail(message: str) -> NoReturn:
    """Stop with a one-line error (no traceback) and a non-zero exit code."""
    raise SystemExit(f"error: {message}")


def first_line(error: BaseException) -> str:
    """An error's first line, and what caused it when that was the network or the Hub: a loader that could not
    reach the Hub says so only in its error's causes (transformers: "Can't load the model for 'gpt2'..."). A Hub
    error's first line is a status ("401 Client Error.") or a header ("... when trying to load gpt2:"), so the
    next one comes with it, and a token the Hub refused is named as such."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    causes = [error]
    while len(causes) < 10 and (causes[-1].__cause__ or causes[-1].__context__) is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    line = lines[0]
    if any(kind.__name__ == "HfHubHTTPError" for cause in causes for kind in type(cause).__mro__):
        if len(lines) > 1 and (line.endswith(":") or re.fullmatch(r"\d{3} \w+ Error\.", line)):
            line = f"{line} {lines[1]}"
        if any("Invalid credentials in Authorization header" in str(cause) for cause in causes):
            line += ": the Hub refused the token (HF_TOKEN, or the one `hf auth login` saved)"
    network = (ConnectionError, TimeoutError)
    names = ("ConnectError", "ConnectTimeout", "ReadTimeout", "ReadError", "RemoteProtocolError")
    lost = next((cause for cause in causes[1:] if isinstance(cause, network) or type(cause).__name__ in names), None)
    if lost is not None:
        line += f" (no answer from the Hub: {type(lost).__name__}: {(str(lost).strip().splitlines() or [''])[0]})"
    return line


@contextmanager
def flag_errors(flag: str, value, what: str):
    """A loader's error (file missing, unreadable, not what it should be) as one line naming the flag and value."""
    try:
        yield
    except (OSError, ValueError, KeyError, ImportError, SafetensorError) as error:  # SafetensorError: a broken file
        fail(f"{flag} {value!r}: {what} ({first_line(error)})")


def exact_div(total: int, parts: int, flags: str) -> int:
    """A global size split into per-process / per-micro-batch sizes (OAI utils.exact_div), or a one-line error."""
    if total <= 0:
        fail(f"{flags.split(' ')[0]} must be positive, got {total}")
    if total % parts != 0:
        fail(f"{flags}: {total} is not divisible into {parts} equal parts; change the flags so that it is")
    return total // parts


# The range of each numeric flag, as (what the error says it must be, the test): the scripts' tables name every int
# and float field of their Args (tests/test_bad_input.py checks that none is missing); a float must also be finite.
COUNT = ("positive", lambda value: value >= 1)  # sizes, counts, lengths, frequencies (integers)
POSITIVE = ("positive", lambda value: value > 0)  # rates, temperatures, clip ranges, Adam's epsilon, targets
NON_NEGATIVE = (">= 0", lambda value: value >= 0)  # coefficients (0: the term is off), optional counts
UNIT_INTERVAL = ("in [0, 1]", lambda value: 0 <= value <= 1)  # discount and GAE lambda
FINITE = ("a finite number", lambda value: True)  # a score that may be any number
SEED = ("in [0, 2**32)", lambda value: 0 <= value < 2**32)  # numpy's seeds: RandomState's range, no negative seed
RUN_RANGES = {"seed": SEED, "checkpoint_every": NON_NEGATIVE, "checkpoint_keep": COUNT, "peak_tflops": POSITIVE,
              "gpu_memory_gb": POSITIVE}  # fmt: skip
"""The tooling flags' ranges (RunArgs)."""
TEMPERATURE = ("at least 1e-4 (a smaller one takes logits / temperature beyond float32)", lambda value: value >= 1e-4)
TASK_RANGES = {"task.passage_rows": COUNT, "task.query_length": COUNT, "task.response_length": COUNT,
               "task.truncate_after": NON_NEGATIVE, "task.temperature": TEMPERATURE}  # fmt: skip
"""The ranges of the task flags both scripts have (logits / temperature: a temperature must be > 0, and not so small
that the quotient overflows: 1e-40 made every sampled probability NaN)."""


def field_value(args, name: str):
    """The value of a field path such as "ppo.lr"."""
    for part in name.split("."):
        args = getattr(args, part)
    return args


def check_ranges(args, ranges: dict[str, tuple]) -> None:
    """Every flag of `ranges` (field path -> a range above) within its range, or one line naming it and the range
    (None: not set, fine)."""
    for name, (expected, holds) in ranges.items():
        value = field_value(args, name)
        if value is None:
            continue
        finite = isinstance(value, int) or math.isfinite(value)  # an int beyond a float's range is finite (N03)
        big = isinstance(value, int) and not -(2**63) <= value < 2**63  # no tensor, index or float division takes it
        shown = f"a {len(str(abs(value)))}-digit number" if isinstance(value, int) and abs(value) >= 10**30 else value
        if not (finite and holds(value)):
            fail(f"--{name.replace('_', '-')} must be {expected}, got {shown}")
        if big:
            fail(f"--{name.replace('_', '-')} must be {expected} and below 2**63, got {shown}")


def require_package(module: str, package: str, option: str) -> None:
    """An optional dependency, checked when the option that needs it is given (not at import)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        fail(f"{option} needs the {package} package: pip install {package}")


def replace_fields(config, values: dict):
    """A copy of the dataclass `config` with each field path of `values` ("ppo.lr" -> 2e-6) replaced; a path that is
    no field raises (dataclasses.replace)."""
    for path, value in values.items():
        name, _, rest = path.partition(".")
        config = replace(config, **{name: replace_fields(getattr(config, name), {rest: value}) if rest else value})
    return config


CHAT_TEMPLATE_DEFAULTS = {"task.passage_rows": 1, "task.start_text": "", "task.end_text": "", "task.truncate_token": "",
                          "task.truncate_after": 0, "task.stop_when_ended": True}  # fmt: skip
"""The task flags' defaults with --task.chat-template: a text is one whole prompt (one row, not cut at a start or end
text), a response ends at the template's end-of-turn token wherever it comes, and sampling stops once all have."""


def task_cli(task_defaults, args: Optional[list[str]] = None, **cli_options):
    """tyro.cli over `task_defaults(name)`, a script's Args at the defaults of the `--task.name` on the command line
    (read first), and CHAT_TEMPLATE_DEFAULTS on top with --task.chat-template: `--task.name tldr --help` shows tldr's
    defaults, and a flag given wins over them, even one equal to the books tasks' value."""
    args = sys.argv[1:] if args is None else list(args)
    name, chat = None, False
    for i, flag in enumerate(args):
        if flag == "--task.name" and i + 1 < len(args):
            name = args[i + 1]
        elif flag.startswith("--task.name="):
            name = flag.removeprefix("--task.name=")
        elif flag in ("--task.chat-template", "--task.no-chat-template"):
            chat = flag == "--task.chat-template"
    default = replace_fields(task_defaults(name), CHAT_TEMPLATE_DEFAULTS if chat else {})
    return tyro.cli(type(default), default=default, args=args, **cli_options)


def check_chat_task(task) -> None:
    """--task.chat-template with the task flags it replaces: the template holds each text whole, and its end-of-turn
    token ends a response (CHAT_TEMPLATE_DEFAULTS make them '')."""
    if task.chat_template:
        for flag, value, why in (("--task.start-text", task.start_text, "the template holds each text whole"),
                                 ("--task.end-text", task.end_text, "the template holds each text whole"),
                                 ("--task.truncate-token", task.truncate_token,
                                  "the template's end-of-turn token ends a response")):  # fmt: skip
            if value:
                fail(f"{flag} {value!r} with --task.chat-template: {why}; leave {flag} out")


def check_run_args(args, ranges: dict[str, tuple]) -> None:
    """Derived values and checks of the tooling flags, and the range of every numeric flag: the tooling's, the task's
    and the script's own `ranges` (each script's validate_args calls it first)."""
    NOT_CHECKED.clear()
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ and "WORLD_SIZE" not in os.environ and "MASTER_ADDR" in os.environ:
        fail(LAUNCHED_ALONE)  # (also checked at the launch: check_launch) so that a --dry-run says it too (N11b)
    if args.world_size < 1:
        fail(f"WORLD_SIZE={args.world_size}: a run needs at least one process")
    check_ranges(args, {**RUN_RANGES, **TASK_RANGES, **ranges})
    if args.resume and args.overwrite:
        fail("--resume continues the run in --output-dir and --overwrite starts it again: pass one of them")
    if args.resume and args.output_dir is None:
        fail("--resume needs the --output-dir of the run to continue")
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)


def hub_offline() -> bool:
    from huggingface_hub import constants  # the library's own reading of HF_HUB_OFFLINE (not a module-level import:
    # the GPU check path imports only what a bare node has)

    return constants.HF_HUB_OFFLINE


def hub_is_reachable(timeout: float = 3.0) -> bool:
    """A TCP connect to the Hub endpoint; the libraries themselves retry for ~25 s per file when offline."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def check_source(value: str, flag: str, fetch: bool = True) -> None:
    """Fail fast on a flag value that is neither a local path nor a Hub name (checked once at start-up; the loaders
    later turn any other error into one line too), or, if it is to be fetched, on a Hub that cannot be reached."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(value):
        return
    try:
        validate_repo_id(value)
    except HFValidationError:
        fail(f"{flag} {value!r}: no such file or directory")
    owner = value.split("/")[0]
    if "/" in value and os.path.isdir(owner):  # (A8) "models/smollm2" with a local models/: a mistyped path
        fail(f"{flag} {value!r}: no such directory in {owner}/ (a local directory of that name is here; a Hub id "
             f"{value!r} would be a repo of the user {owner!r})")  # fmt: skip
    if flag in ("--base-model", "--rewards.trained-model") and hub_offline():  # (N36) offline: it must be cached
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, "config.json"), str):
            fail(f"{flag} {value!r}: not in the Hugging Face cache and HF_HUB_OFFLINE=1; pass a local directory, or "
                 "download it once with the Hub reachable")  # fmt: skip
    if fetch and not hub_offline() and not hub_is_reachable():
        fail(
            f"{flag} {value!r} is not a local path and the Hugging Face Hub is unreachable: pass a local path to {flag}"
        )


NOT_CHECKED: list[str] = []  # what a --dry-run could not check: Hub inputs and what needs them (check_run_args resets)


def available(value: str, flag: str, dry_run: bool, local: Optional[bool] = None) -> bool:
    """Whether an input can be read now: a local path always, a Hub name after a reachability check (fail fast) — but
    a --dry-run fetches nothing from the Hub: the input and what depends on it are listed as not checked."""
    if os.path.exists(value) if local is None else local:
        return True
    check_source(value, flag, fetch=not dry_run)
    if dry_run:
        NOT_CHECKED.append(f"{flag} {value} (on the Hub)")
    return not dry_run


def check_base_model(args, tokenizer, config) -> None:
    """--base-model, once its tokenizer and config are read: a causal LM, its weight files whole (a local directory:
    their headers, not the tensors), and positions for the longest sequence it reads, prefix ⊕ query ⊕ suffix ⊕
    response (the scripts' other models read less: the bare query ⊕ response)."""
    require_causal_lm(config, args.base_model, "--base-model")
    if os.path.isdir(args.base_model):
        check_weights_fit(args.base_model, "--base-model", config)
    task = args.task
    prefix, suffix = (len(tokenizer.encode(text, add_special_tokens=False)) for text in (task.query_prefix,
                                                                                         task.query_suffix))  # fmt: skip
    check_positions(config, "--base-model", args.base_model, {"--task.query-prefix": prefix, "--task.query-length":
                    task.query_length, "--task.query-suffix": suffix, "--task.response-length": task.response_length})  # fmt: skip


def check_positions(config, flag: str, value: str, lengths: dict[str, int]) -> None:
    """A model's positions (n_positions, max_position_embeddings) hold the tokens it reads, the sum of `lengths` (the
    flag behind each part -> its tokens): GPT-2's learned position embeddings end there (an IndexError beyond)."""
    positions, total = getattr(config, "max_position_embeddings", None), sum(lengths.values())
    if isinstance(positions, int) and total > positions:
        parts = " + ".join(f"{name} ({tokens} tokens)" for name, tokens in lengths.items() if tokens)
        fail(f"{parts} = {total} tokens, more than the {positions} positions of {flag} {value!r}: lower "
             "--task.query-length or --task.response-length")  # fmt: skip


def print_dry_run(args, keys: tuple[str, ...]) -> None:
    """The one line a successful --dry-run prints: the derived sizes, the estimated peak GPU memory per process, and
    which Hub inputs it did not fetch; on stderr, one more line when the estimate is above the GPU's memory."""
    memory, warning = memory_check(args, args.world_size, launched_zero_stage(), gpu_memory_gb(args))
    if memory is None:
        NOT_CHECKED.append(f"the memory estimate (--base-model {args.base_model}: no config here, nor in the cache)")
    report = {"dry_run": "ok", **{key: getattr(args, key) for key in keys}, "estimated_peak_memory_gb": memory}
    print(json.dumps({**report, **({"not_checked": NOT_CHECKED} if NOT_CHECKED else {})}))
    if warning:
        print(warning, file=sys.stderr)


def check_services(args) -> None:
    """--tensorboard needs its package, --track and --upload-model credentials: checked before anything is written."""
    if args.tensorboard:
        require_package("tensorboard", "tensorboard", "--tensorboard (on by default; --no-tensorboard turns it off)")
    if args.track and os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
        try:
            import wandb  # noqa: F401
        except ImportError:
            fail("--track needs the wandb package: pip install wandb")
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
        netrc_path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
        try:
            in_netrc = os.path.isfile(netrc_path) and netrc.netrc(netrc_path).authenticators(host) is not None
        except (netrc.NetrcParseError, OSError):
            in_netrc = False
        if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or in_netrc):
            fail("--track: no wandb credentials; run `wandb login` (or set WANDB_API_KEY, or WANDB_MODE=offline)")
    if args.upload_model:
        if hub_offline() or not hub_is_reachable():
            fail("--upload-model: the Hugging Face Hub is unreachable (or HF_HUB_OFFLINE=1)")
        from huggingface_hub import HfApi

        with flag_errors("--upload-model", args.hf_repo_id or args.run_name, "no Hub access; run `hf auth login`"):
            HfApi().whoami()


def hub_file(repo: str, filename: str, flag: str) -> str:
    """A local file, or a file of a Hub dataset repo (downloaded once into the Hugging Face cache), or of a local
    directory laid out like one."""
    if os.path.isfile(filename):
        return filename
    if os.path.isdir(repo):
        if not os.path.isfile(os.path.join(repo, filename)):
            fail(f"{flag} {filename!r}: no such file, nor in the local directory {repo!r}")
        return os.path.join(repo, filename)
    if os.path.isabs(filename) or filename.startswith("."):
        fail(f"{flag} {filename!r}: no such file")
    if not hub_offline() and not hub_is_reachable():
        fail(f"{flag} {filename!r} is not a local file and the Hugging Face Hub (dataset {repo!r}) is unreachable: "
             f"pass a local file to {flag}")  # fmt: skip
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return hf_hub_download(repo, filename, repo_type="dataset")
    except LocalEntryNotFoundError:
        fail(f"{flag} {filename!r}: not in the Hugging Face cache and HF_HUB_OFFLINE=1; pass a local file to {flag}")
    except (OSError, ValueError) as error:
        fail(f"{flag} {filename!r}: not in the Hub dataset {repo!r} ({first_line(error)}); pass a local file to {flag}")


@contextmanager
def quiet_load_report():
    """transformers' loading report (a warning listing unused or missing weights) off while in the block."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def require_causal_lm(config, value: str, flag: str) -> None:
    """Fail before any weights load unless the model was saved as a causal LM (its config's `architectures`, e.g.
    GPT2LMHeadModel or LlamaForCausalLM; an encoder such as BertModel would load with a random LM head)."""
    architectures = config.architectures or []
    if architectures and not any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures):
        fail(f"{flag} {value!r} is not a causal LM (saved as {', '.join(architectures)})")


def weights_file_problem(path: Path) -> Optional[str]:
    """Why a weights or state file cannot be read, from its header or directory alone, not its tensors (None: it
    can): a .safetensors file's header and size (safetensors' own check: a file cut short fails it), a torch.save
    file's zip directory (at its end: a file cut short has none). A pre-zip torch.save file is not checked."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt"):
                return None
        if path.suffix in (".bin", ".pt", ".pth", ".pkl"):
            with open(path, "rb") as file:
                if file.read(2) != b"PK":  # zip's magic; a pre-zip torch.save file starts with a pickle
                    return None
            with zipfile.ZipFile(path):
                return None
    except (OSError, SafetensorError, zipfile.BadZipFile) as error:
        return f"damaged: {first_line(error)}"
    return None


def check_model_files(directory: str, flag: str) -> list[Path]:
    """The weight files a Hugging Face model directory loads from (the safetensors ones when there are, as
    transformers prefers them; every shard of an index), there and whole, before any model loads; returns them."""
    path = Path(directory)
    for name in ("model.safetensors", "pytorch_model.bin"):
        index, files = path / f"{name}.index.json", [path / name] if (path / name).is_file() else []
        if index.is_file():
            with flag_errors(flag, directory, f"cannot load its weights ({index.name})"):
                files += [path / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if files:
            break
    else:
        fail(f"{flag} {directory!r}: cannot load its weights (no model.safetensors or pytorch_model.bin in it)")
    for file in files:
        problem = weights_file_problem(file) if file.is_file() else "missing"
        if problem:
            fail(f"{flag} {directory!r}: cannot load its weights ({file.name} {problem})")
    return files


def stored_shapes(files: list[Path], flag: str, value: str) -> dict[str, list[int]]:
    """Every tensor's name and shape in a model's weight files: a .safetensors file's header, a torch.save file's
    tensors memory-mapped onto the meta device (no tensor is read)."""
    shapes = {}
    for path in files:
        if path.suffix == ".safetensors":
            shapes.update(safetensors_shapes(path, flag, value))
        else:
            with flag_errors(flag, value, f"cannot read {path.name}"):
                state = torch.load(path, map_location="meta", mmap=True, weights_only=True)
            shapes.update({name: list(tensor.shape) for name, tensor in state.items() if hasattr(tensor, "shape")})
    return shapes


def check_weights_fit(directory: str, flag: str, config, causal_lm: bool = True) -> None:
    """The weights of a local model directory against the model its config builds (on the meta device: nothing is
    allocated), by their names and shapes, before any model loads: a tensor of another shape (transformers would
    refuse it after the other models loaded) or a parameter the files lack (transformers would start it at random,
    quietly here, where its load report is hidden) is one line naming the flag. Tied parameters count once; a
    checkpoint of the base model or of the LM may drop or hold the base model's prefix (`transformer.`, `model.`)."""
    from transformers import AutoModel, AutoModelForCausalLM

    stored = stored_shapes(check_model_files(directory, flag), flag, directory)
    with torch.device("meta"), quiet_load_report():
        model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config)
    prefix = f"{model.base_model_prefix}."
    stored = {name.removeprefix(prefix): shape for name, shape in stored.items()}
    groups: dict[int, list[str]] = {}  # one parameter (tied ones together) -> its names
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    shapes = dict(model.named_parameters(remove_duplicate=False))
    missing = [names[0].removeprefix(prefix) for names in groups.values()
               if not any(name.removeprefix(prefix) in stored for name in names)]  # fmt: skip
    for name, parameter in shapes.items():
        found = stored.get(name.removeprefix(prefix))
        if found is not None and list(parameter.shape) != list(found):
            fail(f"{flag} {directory!r}: its weights do not fit its config.json: {name.removeprefix(prefix)} is "
                 f"{list(found)} in the weights, {list(parameter.shape)} in the model the config builds")  # fmt: skip
    if missing:
        fail(f"{flag} {directory!r}: {len(missing)} of the {len(groups)} weights its config.json builds are not in its "
             f"weight files (e.g. {missing[0]}): loaded, they would start at random")  # fmt: skip


def safetensors_shapes(path: Path, flag: str, value: str) -> dict[str, list[int]]:
    """The tensors' shapes in a .safetensors file's header (no tensor is read), or one line naming the flag."""
    with flag_errors(flag, value, f"cannot read {path.name}"):
        with safe_open(path, framework="pt") as file:
            return {name: file.get_slice(name).get_shape() for name in file.keys()}


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the token → id map: the reward model and the policy must read tokens the same way."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def import_callable(spec: str, flag: str):
    """`module:callable` (the module importable from the working directory or PYTHONPATH), or a one-line error naming
    `flag`."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        fail(f"{flag} {spec!r}: expected module:callable (e.g. my_rewards:score)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m`: a module next to where the command runs
    try:
        function = getattr(importlib.import_module(module_name), name)
    except Exception as error:  # ImportError, AttributeError, a SyntaxError in it, whatever its import raises (N46)
        fail(f"{flag} {spec!r}: cannot import it ({type(error).__name__}: {first_line(error)})")
    if not callable(function):
        fail(f"{flag} {spec!r}: not callable")
    return function


# ---------------------------------------------------------------------------------------------------------------------
# the output directory, atomic writes
def write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def save_directory_atomic(path: Path, write) -> None:
    """write(tmp_dir) then rename: a crash never leaves a half-written directory under the final name, and a write
    that fails (an error, Ctrl-C) removes its temporary directory."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        write(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if path.exists():
        previous = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, previous)
        os.replace(temporary, path)
        shutil.rmtree(previous)
    else:
        os.replace(temporary, path)


LOCK_FILE = ".run.lock"
"""In --output-dir: held (flock) by the process that runs there (process 0 of a multi-process run), for the run's life;
it names that process (PID, host, start). The kernel releases a flock when its process ends, however it ends."""


def lock_holder(directory: Path) -> Optional[str]:
    """Who holds `directory`'s run lock now, in words ("PID 123 on host h, since ..."), or None when no live process
    holds it. Takes and at once releases a shared lock: a probe for --dry-run and the input checks, never a claim."""
    path = Path(directory) / LOCK_FILE
    try:
        with open(path) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return describe_lock(file.read())
            except OSError:  # a file system without flock: the PID, when it is this host's
                return lock_by_pid(file.read())
            fcntl.flock(file, fcntl.LOCK_UN)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return None


def describe_lock(content: str) -> str:
    try:
        holder = json.loads(content)
        return f"PID {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def lock_by_pid(content: str) -> Optional[str]:
    """Without flock: the holder the file names, if it is a live process of this host (or of another host, whose
    processes this one cannot see: assumed alive)."""
    try:
        holder = json.loads(content)
        if holder["host"] == socket.gethostname():
            os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return None
    except (ValueError, KeyError, TypeError, PermissionError):
        pass
    return describe_lock(content) if content.strip() else None


class RunLock:
    """The run's claim on its --output-dir (LOCK_FILE), taken before the run writes anything there and kept until the
    process ends: a second run on the same directory stops at once, naming this one. A lock that a killed process (kill
    -9, a lost node) left in the file, with no live holder, is said to be stale and taken over; a live one never is."""

    def __init__(self, directory: Path, flag: str):
        self.path, self.file = Path(directory) / LOCK_FILE, None
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = describe_lock(file.read())
            file.close()
            fail(f"{flag} is in use by another run ({holder}): wait for it to end, or use another {flag}")
        except OSError:  # no flock on this file system: the PID in the file decides
            file.seek(0)
            holder = lock_by_pid(file.read())
            if holder is not None:
                file.close()
                fail(f"{flag} is in use by another run ({holder}; this file system has no flock: remove "
                     f"{self.path} if that run is gone)")  # fmt: skip
        file.seek(0)
        left = file.read().strip()
        if left:
            console.print(f"{flag}: a stale run lock ({describe_lock(left)}, which no longer runs: killed or its node "
                          "lost) taken over", markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S")}))  # fmt: skip
        file.flush()
        self.file = file
        atexit.register(self.release)

    def release(self) -> None:
        """Empty the file and let go (at the end of the run, or at exit however it exits but a kill)."""
        if self.file is not None and not self.file.closed:
            self.file.seek(0)
            self.file.truncate()
            self.file.flush()
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


RUN_KINDS = {"policy": ("ppo", "a policy run (train_policy_accelerate.py)"),
             "reward_model": ("labels", "a reward-model run (train_reward_accelerate.py)")}  # fmt: skip
"""Each script's result directory -> a top-level key that only its args.json has, and what its run is called."""


def check_output_dir(args, result: str, may_change: set[str], own_lock: bool = False) -> Path:
    """--output-dir as the run will find it, checked without touching it (a --dry-run checks it too, and the run
    again when it starts): it holds no run of another script or a quick start (refused even with --overwrite); a
    previous run of this script is touched only with --resume (its flags as before, when it did any work) or
    --overwrite (no input inside what that removes); it can be written to."""
    path, shown = Path(args.output_dir), repr(args.output_dir)
    if not own_lock and os.environ.get("RANK", "0") == "0" and (holder := lock_holder(path)) is not None:
        fail(f"--output-dir {shown} is in use by another run ({holder}): wait for it to end, or use another "
             "--output-dir")  # fmt: skip
    saved = {}
    if (path / "args.json").is_file():
        try:
            saved = json.loads((path / "args.json").read_text())
        except (OSError, ValueError):
            pass  # nothing to tell it by; --resume reports it (check_resume_args)
    others = [kind for marker, (key, kind) in RUN_KINDS.items()
              if marker != result and ((path / marker).exists() or (isinstance(saved, dict) and key in saved))]  # fmt: skip
    others += ["a quick start (quickstart.py)"] if (path / "quickstart_args.json").exists() else []
    others += ["a model (config.json)"] if (path / "config.json").exists() and not (path / "args.json").exists() else []
    if others:
        fail(f"--output-dir {shown} holds {others[0]}: a run never writes into another's directory, not even with "
             "--overwrite; use another --output-dir")  # fmt: skip
    finished = (path / result).exists()
    metrics = path / "metrics.jsonl"  # empty: a start that failed before any work (its inputs), nothing to keep
    logged = metrics.is_file() and metrics.stat().st_size > 0
    worked = finished or logged or any(path.glob("checkpoints/step-*")) or any(path.glob("*.partial"))
    if worked and not (args.overwrite or args.resume):
        fail(f"--output-dir {shown} already holds {'a finished' if finished else 'an unfinished'} run; pass --resume "
             "to continue it, --overwrite to start again, or another --output-dir")  # fmt: skip
    if worked and args.resume:
        check_resume_args(path, args, RESUME_MAY_CHANGE | may_change, finished)
    if worked and args.resume:  # the checkpoint's number of processes, before any model loads (N76)
        newest = sound_checkpoint(sorted(path.glob("checkpoints/step-*")),
                                  (lambda line: print(line, file=sys.stderr)) if args.dry_run else (lambda line: None))  # fmt: skip
        written = json.loads((newest / "state.json").read_text()).get("world_size") if newest is not None else None
        if written is not None and written != args.world_size:
            fail(f"--resume: {newest} was written by {written} processes, this run has {args.world_size}; resume "
                 "with the same number")  # fmt: skip
    if args.overwrite:
        check_inputs_outside(args, [path / name for name in (*RUN_LOGS, "checkpoints", result)])
    existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "a file" if not existing.is_dir() else "not writable"
        fail(f"--output-dir {shown} is not writable ({existing} is {what})")
    return path


def prepare_output_dir(args, result: str, may_change: set[str], main: bool = True) -> tuple[Path, Optional[RunLock]]:
    """Create the output directory once check_output_dir passes, check it is writable now, not after hours of
    training, and (process 0) take its run lock before anything else in it is touched; then check it again, now that
    no other run can change it."""
    path = check_output_dir(args, result, may_change)
    lock = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        if main:
            lock = RunLock(path, f"--output-dir {args.output_dir!r}")
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        fail(f"--output-dir {args.output_dir!r} is not writable ({error.strerror})")
    return check_output_dir(args, result, may_change, own_lock=True) if main else path, lock


def removed_container(value: str, removed: list[Path]) -> Optional[Path]:
    """The path of `removed` that holds (or is) the local path `value`, if any (quickstart.py uses it too)."""
    path = Path(value).resolve()
    return next((gone.resolve() for gone in removed if path == gone.resolve() or gone.resolve() in path.parents), None)


def check_inputs_outside(args, removed: list[Path]) -> None:
    """No flag names a local input inside what --overwrite removes (the logs, the checkpoints, and at the end the
    result directory, replaced by the new one): refused before anything is removed."""
    for key, value in flat_dict(asdict(args)).items():
        if key == "output_dir" or not isinstance(value, str) or not value or not Path(value).exists():
            continue
        if (gone := removed_container(value, removed)) is not None:
            fail(f"--{key.replace('_', '-')} {value} is inside {gone}, which --overwrite replaces: move it first or "
                 "use another --output-dir")  # fmt: skip


def flat_dict(config: dict, prefix: str = "") -> dict:
    items = [
        flat_dict(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(prefix + k, v)] for k, v in config.items()
    ]
    return dict(item for group in items for item in group)


def check_resume_args(output_dir: Path, args, may_change: set[str], finished: bool = False) -> None:
    """--resume continues the same run: every flag that changes the math must equal the first attempt's (a path by
    the file it names, not by its spelling: `runs/x/` is `runs/x`)."""
    saved_path = output_dir / "args.json"
    if not saved_path.is_file():
        return  # the first attempt died before writing anything: resuming starts from scratch
    try:
        saved = flat_dict(json.loads(saved_path.read_text()))
    except (OSError, ValueError, AttributeError) as error:
        fail(f"--resume: {saved_path} is not a run's args.json ({first_line(error)}); start again with --overwrite")
    current = flat_dict(json.loads(json.dumps(asdict(args))))
    derived = derived_fields(type(args))  # sizes computed from the flags: the flags that differ are named (N45)
    changed = sorted(key for key in current if key not in may_change | derived
                     and not same_value(saved.get(key), current[key]))  # fmt: skip
    if changed:
        again = "; the run finished: --overwrite trains it again with the new flags" if finished else ""
        fail(f"--resume: {', '.join('--' + key.replace('_', '-') for key in changed)} differ from {saved_path}{again}")


def derived_fields(config_class) -> set[str]:
    """The fields hidden from --help (tyro.conf.Suppress: world_size, local sizes, num_updates): no flag sets them."""
    import typing

    hints = typing.get_type_hints(config_class, include_extras=True)
    return {name for name, hint in hints.items() if "Suppress" in repr(hint)}


def same_value(saved, current) -> bool:
    """A flag's value as the first attempt saved it and as given now: equal, or paths of the same file."""
    if saved == current or not (isinstance(saved, str) and isinstance(current, str) and saved and current):
        return saved == current
    if os.path.normpath(saved) == os.path.normpath(current):
        return True
    return os.path.exists(saved) and os.path.exists(current) and os.path.samefile(saved, current)


RESUME_MAY_CHANGE = {
    "output_dir",  # the run's own directory, wherever it is now (a moved run resumes)
    "resume",
    "overwrite",
    "run_name",
    "checkpoint_every",
    "checkpoint_keep",
    "track",
    "tensorboard",
    "dry_run",
    "wandb_project_name",
    "wandb_entity",
    "upload_model",
    "hf_repo_id",
    "world_size",
    "gpu_memory_gb",
}  # fmt: skip (the tooling flags that a resumed run may change; each script adds its per-process sizes)


# ---------------------------------------------------------------------------------------------------------------------
# the launch: processes and engine
DEEPSPEED_BROKEN = {"0.19.8": "cannot start a model with 0-dim parameters (the reward model's gain and bias)"}
ZERO3_REFUSED = ("DeepSpeed ZeRO-3 partitions every weight, and the scripts read weights whole (the LM head's in each "
                 "sampling step, the unwrapped policy in the rollout): use ZeRO-2 (benchmark/launch/deepspeed_zero2.yaml)"
                 " or no DeepSpeed")  # fmt: skip


LAUNCH_FIX = ("add --multi_gpu to `accelerate launch` (implied only with several GPUs per machine) or a --config_file "
              "that sets distributed_type; without GPUs, ACCELERATE_USE_CPU=true")  # fmt: skip
LAUNCHED_ALONE = (f"`accelerate launch` was given several machines or processes (MASTER_ADDR is set) but started this "
                  f"process alone: {LAUNCH_FIX} (for one process, run the script with python)")  # fmt: skip


def torch_extensions_root() -> Path:
    """Where torch builds the C++ extensions DeepSpeed compiles on first use (TORCH_EXTENSIONS_DIR, else torch's
    default under the user's cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def open_by_a_process(path: Path) -> bool:
    """Whether any process of this machine has `path` open (Linux's /proc/PID/fd); True where that cannot be read."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    target = str(path.resolve())
    for fds in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fds.iterdir()):
                return True
        except OSError:  # a process that ended, or one of another user's
            continue
    return False


def check_build_locks(root: Optional[Path] = None) -> None:
    """An interrupted first build of a DeepSpeed extension (cpu_adam on a CPU...) leaves its `lock` file in torch's
    extension folder (torch.utils.file_baton: the builder holds it open until it removes it), and every later launch
    waits on it forever. A lock that no process here holds open, still there a moment later, stops the run with one
    line that names it (it is left in place: another machine sharing the folder could be building)."""
    root = root or torch_extensions_root()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:  # an absent folder globs nothing
        if open_by_a_process(lock):
            continue
        time.sleep(0.5)  # a builder between closing and removing it
        if lock.exists() and not open_by_a_process(lock):
            fail(f"a DeepSpeed build lock that no process holds: {lock} (an interrupted build left it, and this launch "
                 f"would wait on it forever): remove it (rm {lock}) unless another machine builds in that folder now")  # fmt: skip


def check_launch(accelerator, args) -> None:
    """The processes form the run they were launched as, and a DeepSpeed engine keeps OpenAI's math: fp32 weights, no
    gradient clipping (an absent or "auto" value is DeepSpeed's 1.0). DeepSpeed is also given the micro-batch size,
    which accelerate otherwise reads from a prepared dataloader (the scripts prepare none), and ZeRO-2 buckets of
    memory_estimate.ZERO_BUCKET_VALUES where its config sets none. ZeRO-3 is refused."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        fail(f"launched as {launched} processes (WORLD_SIZE) but each runs in a group of "
             f"{accelerator.num_processes}: {LAUNCH_FIX}")  # fmt: skip
    # accelerate's one-process launcher sets a rendezvous address only for --num_machines / --num_processes > 1
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ and "WORLD_SIZE" not in os.environ and "MASTER_ADDR" in os.environ:
        fail(LAUNCHED_ALONE)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()  # accelerate's TorchDynamoPlugin reads it
    if backend != "NO":
        fail(f"the accelerate config sets dynamo_backend {backend}: accelerate would compile the whole prepared model, "
             "sampling included; set it to NO (the policy script's --compile compiles its training forward only)")  # fmt: skip
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and getattr(args, "compile", False):
        fail("--compile under DeepSpeed: torch.compile of DeepSpeed's engine is untested (DeepSpeed compiles through "
             "its own engine.compile()); drop --compile or run without DeepSpeed")  # fmt: skip
    if plugin is None:
        # accelerate's unwrap_model (also inside transformers' save_pretrained) imports DeepSpeed whenever it is
        # installed, to test whether a model is its engine: 1.2 s of every start. This run has none: it answers so
        accelerate.utils.other.is_deepspeed_available = lambda: False
        return
    if plugin.zero_stage == 3:
        fail(ZERO3_REFUSED)
    check_build_locks()  # before DeepSpeed builds (or waits to build) its CPU extensions
    import deepspeed

    if deepspeed.__version__ in DEEPSPEED_BROKEN:
        fail(f"deepspeed {deepspeed.__version__} {DEEPSPEED_BROKEN[deepspeed.__version__]}: "
             "pip install -r requirements-deepspeed.txt (the tested version)")  # fmt: skip
    config = plugin.deepspeed_config
    if accelerator.mixed_precision != "no" or any(config.get(k, {}).get("enabled") is True for k in ("bf16", "fp16")):
        fail("--mixed-precision bf16 under DeepSpeed would train the weights themselves in bf16 (no autocast, no fp32 "
             "master weights): use DeepSpeed in fp32 (mixed_precision: 'no'), or bf16 autocast without DeepSpeed")  # fmt: skip
    clipping = config.get("gradient_clipping", "auto")
    if clipping not in ("auto", 0):
        fail(f"the DeepSpeed config clips gradients at {clipping}; OpenAI clips none: set gradient_clipping to 0")
    config["gradient_clipping"] = 0.0
    config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    zero = config.setdefault("zero_optimization", {})
    for key in ("reduce_bucket_size", "allgather_bucket_size"):  # accelerate's "auto" needs a model with .config
        if zero.get(key, "auto") == "auto":
            zero[key] = memory_estimate.ZERO_BUCKET_VALUES


def checkpoint_problem(directory: Path) -> Optional[str]:
    """Why a checkpoint cannot be resumed from (None: it can): its state.json parsed, every model, optimizer and RNG
    file's header or zip directory read (not the tensors: a file cut short fails it, weights_file_problem)."""
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, ValueError) as error:
        return f"state.json: {first_line(error)}"
    needed = {"step", "world_size", "elapsed", "processes"}
    if not isinstance(state, dict) or state.get("format") == CHECKPOINT_FORMAT and not needed <= state.keys():
        return f"state.json: not a checkpoint's state (it needs {', '.join(sorted(needed))})"
    for path in sorted(directory.rglob("*")):
        if path.is_file() and (problem := weights_file_problem(path)):
            return f"{path.relative_to(directory)} {problem}"
    return None


def sound_checkpoint(checkpoints: list[Path], report) -> Optional[Path]:
    """The newest of `checkpoints` (oldest first) that checkpoint_problem passes, `report`ing each newer one it passes
    over (damaged after it was written, e.g. a disk that filled or a copy cut short); None when there are none, one
    line when none is sound."""
    for checkpoint in reversed(checkpoints):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        report(f"--resume: {checkpoint} is damaged ({problem}); trying the checkpoint before it")
    if checkpoints:
        fail(f"--resume: no checkpoint in {checkpoints[0].parent} can be read (the newest: {checkpoints[-1].name} "
             f"{checkpoint_problem(checkpoints[-1])}); start again with --overwrite")  # fmt: skip
    return None


def frozen_for_autocast(model: torch.nn.Module, args) -> torch.nn.Module:
    """A frozen model (the reference, the reward model's backbone, the reward script's sampler) under
    --mixed-precision bf16: its linear layers stored in bf16 (memory_estimate.bf16_modules), the operands autocast
    gave every one of their products from fp32 before, at half the memory; the same numbers, bit for bit
    (tests/test_mixed_precision.py). Embeddings, norms and the LM head stay fp32."""
    if args.mixed_precision == "bf16":
        for module in memory_estimate.bf16_modules(model):
            module.to(torch.bfloat16)
    return model


def enable_gradient_checkpointing(model) -> None:
    """--gradient-checkpointing: every decoder layer recomputes its activations in the backward pass (transformers
    does it in train mode; the scripts' dropout is 0, so train mode changes nothing else)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24; its default is use_reentrant=False
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# ---------------------------------------------------------------------------------------------------------------------
# one run: its directory, logs, checkpoints and stop signals
class Run:
    """Everything of a run that is not the algorithm, on every process (only process 0 writes files and prints):
    output directory and resume (`resume`, `checkpoint_if_due`), SIGTERM / Ctrl-C, metrics.jsonl + TensorBoard +
    wandb (`log`, `table`), console and progress (`print`, `progress`), the trained model (`save_result`)."""

    def __init__(self, args, accelerator, result: str, may_change: set[str], step_name: str = "step"):
        check_launch(accelerator, args)  # before anything is written
        self.args, self.accelerator, self.result, self.step_name = args, accelerator, result, step_name
        self.main, self.console, self.stop_signal = accelerator.is_main_process, console, None
        for signum in (signal.SIGTERM, signal.SIGINT):  # before the first file is written: a stop keeps it whole
            signal.signal(signum, self.handle_signal)
        # the run's lock on it (process 0, for the run's life), --resume's flags, --overwrite's inputs
        self.output_dir, self.lock = prepare_output_dir(args, result, may_change, self.main)
        accelerator.wait_for_everyone()  # every process has looked at the directory before process 0 writes to it
        self.finished = args.resume and (self.output_dir / result).is_dir()
        self.start_step, self.start_time, self.checkpoint = 0, time.time(), None
        self.file = self.tensorboard = self.wandb = None
        if self.finished:
            self.print(f"--resume: {self.output_dir} holds a finished run ({result}/ exists); nothing to do")
            return
        if args.resume:
            self.checkpoint = sound_checkpoint(self.checkpoints(), self.print)
        if self.main:
            self.start_files()
        accelerator.wait_for_everyone()
        if not sys.stdout.isatty():  # a log file: no "Loading weights" / "Writing model shards" bars in it
            from transformers.utils import logging

            logging.disable_progress_bar()

    # -- files ---------------------------------------------------------------------------------------------------------
    def start_files(self) -> None:
        """The logs as they were at the checkpoint being resumed (rows written after it by the killed process go), or
        none on a fresh start; then args.json, metrics.jsonl, TensorBoard and wandb."""
        checkpoints = self.output_dir / "checkpoints"
        for stale in checkpoints.glob(".step-*"):
            shutil.rmtree(stale)  # temporaries of a process killed while writing a checkpoint
        if self.checkpoint is None:
            shutil.rmtree(checkpoints, ignore_errors=True)
            if not self.args.resume:
                for partial in self.output_dir.glob("*.partial"):
                    shutil.rmtree(partial)  # a fresh start makes its work anew
            for events in self.output_dir.glob("events.out.tfevents.*"):
                events.unlink()
            write_text_atomic(self.output_dir / "args.json", json.dumps(asdict(self.args), indent=2))
        for name in RUN_LOGS:
            if self.checkpoint is not None and (self.checkpoint / name).exists():
                shutil.copyfile(self.checkpoint / name, self.output_dir / name)
            else:
                (self.output_dir / name).unlink(missing_ok=True)
        self.file = open(self.output_dir / "metrics.jsonl", "a")
        resumed_step = (
            0 if self.checkpoint is None else json.loads((self.checkpoint / "state.json").read_text())["step"]
        )
        if self.args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run hides the events the killed attempt wrote after its checkpoint
            self.tensorboard = SummaryWriter(self.output_dir, purge_step=resumed_step + 1 if resumed_step else None)
        if self.args.track:
            import wandb

            id_file = self.output_dir / "wandb_run_id"  # --resume continues the same wandb run
            run_id = id_file.read_text().strip() if self.args.resume and id_file.is_file() else os.urandom(4).hex()
            write_text_atomic(id_file, run_id)
            # dir: wandb's own files go to OUTPUT_DIR/wandb, not into the working directory
            self.wandb = wandb.init(project=self.args.wandb_project_name, entity=self.args.wandb_entity,
                                    name=self.args.run_name, config=asdict(self.args), id=run_id, resume="allow",
                                    dir=self.output_dir)  # fmt: skip
            self.first_new_step = self.wandb.step  # 0, or one past the steps an interrupted attempt already sent

    def append_jsonl(self, name: str, rows: list[dict]) -> None:
        if self.main:
            with open(self.output_dir / name, "a") as file:
                file.writelines(json.dumps(row) + "\n" for row in rows)

    def save_result(self, write) -> Path:
        """The trained model: write(directory) on process 0 into a temporary directory, renamed when complete; then
        pushed to the Hub with --upload-model."""
        path = self.output_dir / self.result
        self.accelerator.wait_for_everyone()
        if self.main:
            save_directory_atomic(path, write)
            self.print(f"saved {path}")
            stops = self.output_dir / "checkpoints"
            if self.args.checkpoint_every == 0 and stops.is_dir():  # written only to stop and resume: done with
                shutil.rmtree(stops)
                self.print(f"removed {stops}: the checkpoint of an earlier stop, not needed by a finished run")
            if self.args.upload_model:
                from huggingface_hub import HfApi

                repo = self.args.hf_repo_id or self.args.run_name
                api = HfApi()
                with flag_errors("--upload-model", repo, "upload failed"):
                    url = api.create_repo(repo, exist_ok=True).repo_id
                    api.upload_folder(repo_id=url, folder_path=path)
                self.print(f"uploaded {path} to the Hub as {url}")
        self.accelerator.wait_for_everyone()
        return path

    # -- logs ----------------------------------------------------------------------------------------------------------
    def print(self, text: str) -> None:
        if self.main:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def log(self, row: dict, step: int) -> None:
        """One row of metrics.jsonl (flushed), the same values to TensorBoard and wandb."""
        if not self.main:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in row.items():
                if "/" in key:
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None and step >= self.first_new_step:  # a resumed run repeats the same rows
            self.wandb.log(row, step=step)

    def samples(self, filename: str, step: int, columns: dict[str, list]) -> None:
        """Sample responses: rows of `filename` (JSON lines with the step), and a table (console, TensorBoard, wandb)."""
        rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        self.append_jsonl(filename, [{self.step_name: step, **row} for row in rows])
        self.table(
            f"{self.step_name} {step}",
            [name.replace("_", " ") for name in columns],
            [list(r.values()) for r in rows],
            step,
        )

    def table(self, title: str, columns: list[str], rows: list[list], step: int, name: str = "samples") -> None:
        """A table on the console, as text in TensorBoard and as a wandb table."""
        if not self.main:
            return
        cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
        table = Table(title=title, show_lines=True)
        for column in columns:
            table.add_column(column)
        for row in cells:
            table.add_row(*map(Text, row))  # Text: a sample's "[/...]" is text, not rich markup
        self.console.print(table)
        if self.tensorboard is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += [
                "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |" for row in cells
            ]
            self.tensorboard.add_text(name, "\n".join(lines), step)
        if self.wandb is not None and step >= self.first_new_step:
            import wandb

            self.wandb.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def progress(self, iterable, description: str, log_every_s: float = 60.0):
        """rich's progress bar on a terminal. rich draws nothing into a file until the loop ends, so when stdout is a
        log (sbatch, nohup, a pipe) print a plain line instead after the first item and then every `log_every_s` s."""
        if not self.main:
            yield from iterable
        elif sys.stdout.isatty():
            yield from track(iterable, description, console=self.console)
        else:
            total, start, last_line = len(iterable), time.perf_counter(), -math.inf
            for done, item in enumerate(iterable, 1):
                yield item
                now = time.perf_counter()
                if done == total or now - last_line >= log_every_s:  # the first item too: last_line starts at -inf
                    last_line, elapsed = now, now - start
                    left = elapsed / done * (total - done)
                    print(f"{description}: {done}/{total} ({done / total:.0%}), {elapsed:.0f} s, ~{left:.0f} s left",
                          flush=True)  # fmt: skip

    def elapsed(self) -> float:
        """Seconds of training so far, over every attempt of a resumed run."""
        return time.time() - self.start_time

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.lock is not None:
            self.lock.release()

    # -- checkpoints and stop signals ----------------------------------------------------------------------------------
    def handle_signal(self, signum, frame) -> None:
        """SIGTERM (Slurm preemption or requeue, `scancel`) or Ctrl-C only set a flag; the training loop stops after
        the step in progress, with a checkpoint (`checkpoint_if_due`). A second Ctrl-C stops at once, without one."""
        if signum == signal.SIGINT and self.stop_signal is not None:
            self.print("Ctrl-C again: stopped at once, without a checkpoint")
            raise SystemExit(128 + signum)
        self.stop_signal = max(self.stop_signal or 0, signum)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.print(f"{what}: stopping after this {self.step_name} with a checkpoint (Ctrl-C again: stop at once)")

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first: a checkpoint is written under a temporary name and renamed when complete,
        so a process killed mid-write leaves only a hidden temporary directory, never a checkpoint that looks complete."""
        return sorted((self.output_dir / "checkpoints").glob("step-*"))

    def resume(self) -> Optional[dict]:
        """Called after accelerator.prepare(): on --resume, load the newest checkpoint's model, optimizer and every
        process's RNG states (accelerate's load_state) and return what else it saved (this process's part under
        "process"); None on a fresh start."""
        if self.checkpoint is None:
            return None
        state = json.loads((self.checkpoint / "state.json").read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            fail(
                f"--resume: {self.checkpoint} was written by an older version of the scripts; start again with --overwrite"
            )
        self.check_same_processes(self.checkpoint, state["world_size"])
        try:  # a model or optimizer of other names or shapes than these flags build: one line, not torch's report
            self.accelerator.load_state(str(self.checkpoint))
        except (RuntimeError, KeyError, ValueError) as error:
            detail = " ".join(str(error).split())  # torch's report: "Error(s) in loading ... Missing key(s) ..."
            fail(f"--resume: {self.checkpoint} does not fit the model these flags build "
                 f"({detail[:200]}{' ...' if len(detail) > 200 else ''}); start again with --overwrite")  # fmt: skip
        state["process"] = state.pop("processes")[self.accelerator.process_index]
        self.start_step, self.start_time = state["step"], time.time() - state["elapsed"]
        self.print(f"resumed from {self.checkpoint} at {self.step_name} {self.start_step + 1}")
        return state

    def stop_requested(self) -> int:
        """The signal (SIGTERM / Ctrl-C) any process got, 0 if none: the same answer on every process."""
        stopping = self.accelerator.reduce(
            torch.tensor(float(self.stop_signal or 0), device=self.accelerator.device), "max"
        )
        return int(stopping.item())

    def checkpoint_if_due(self, step: int, state: dict, process_state: dict) -> None:
        """checkpoints/step-N every --checkpoint-every steps, and after a SIGTERM / Ctrl-C on any process, after which
        the run stops (exit 143 / 130, so a requeued job resumes from it)."""
        signum = self.stop_requested()  # every process stops after the same step
        if signum or (self.args.checkpoint_every and step % self.args.checkpoint_every == 0):
            path = self.save_checkpoint(step, state, process_state)
            if signum:
                self.print(f"stopped by {signal.Signals(signum).name} after {self.step_name} {step}: wrote {path}; "
                           "continue with --resume")  # fmt: skip
                self.close()
                raise SystemExit(128 + signum)

    # -- work before training (simulated labels), kept when a run is stopped there -------------------------------------
    def resumable(self, name: str, steps: range, description: str, keep, restore):
        """The steps of a loop whose work a stop (SIGTERM / Ctrl-C) keeps: a stop between steps keeps `keep()` (this
        process's work so far) and stops the run; the --resume after it hands that to `restore` and goes on from the
        step it stopped at. With a progress bar."""
        saved = self.load_partial(name)
        if saved is not None:
            restore(saved)
        first = saved["next"] if saved is not None else steps.start
        for step in self.progress(range(first, steps.stop, steps.step), description):
            if signum := self.stop_requested():  # stop now, keeping what is made
                self.stop_keeping_partial(name, signum, {**keep(), "next": step})
            yield step

    def stop_keeping_partial(self, name: str, signum: int, process_state: dict) -> NoReturn:
        """Stop (exit 143 / 130) keeping each process's part of the work done so far and its RNG states in
        OUTPUT_DIR/NAME.partial/, which `load_partial` gives back to a --resume."""
        directory, rank = self.output_dir / f"{name}.partial", self.accelerator.process_index
        directory.mkdir(exist_ok=True)
        state = {**process_state, "world_size": self.accelerator.num_processes, "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}  # fmt: skip
        torch.save(state, directory / f".process-{rank}.tmp")
        os.replace(directory / f".process-{rank}.tmp", directory / f"process-{rank}.pt")
        self.accelerator.wait_for_everyone()
        self.print(f"stopped by {signal.Signals(signum).name}: kept the {name} made so far in {directory}; continue "
                   "with --resume")  # fmt: skip
        self.close()
        raise SystemExit(128 + signum)

    def check_same_processes(self, written: Path, world_size: int) -> None:
        """Per-process RNG streams and data positions continue only on as many processes as wrote them."""
        if world_size != self.accelerator.num_processes:
            fail(f"--resume: {written} was written by {world_size} processes, this run has "
                 f"{self.accelerator.num_processes}; resume with the same number")  # fmt: skip

    def load_partial(self, name: str) -> Optional[dict]:
        """On --resume, this process's part of a stopped attempt's work (`stop_keeping_partial`), its RNG states
        restored; None when there is none."""
        path = self.output_dir / f"{name}.partial" / f"process-{self.accelerator.process_index}.pt"
        if not (self.args.resume and path.is_file()):
            return None
        state = torch.load(path, weights_only=False)
        self.check_same_processes(path.parent, state["world_size"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.print(f"resumed the {name} from {path.parent}")
        return state

    def discard_partial(self, name: str) -> None:
        """The work is complete: its partial copy goes."""
        self.accelerator.wait_for_everyone()
        if self.main:
            shutil.rmtree(self.output_dir / f"{name}.partial", ignore_errors=True)

    def save_checkpoint(self, step: int, state: dict, process_state: dict) -> Path:
        """All that continuing exactly after `step` needs: model, optimizer and every process's RNG states (accelerate's
        save_state), `state` (counters, KL controller), every process's `process_state` (query stream position) and
        copies of the logs, in a temporary directory renamed when complete; only the newest --checkpoint-keep stay."""
        processes = gather_object([process_state])  # one per process, in process order
        final = self.output_dir / "checkpoints" / f"step-{step:08d}"
        temporary = final.with_name(f".{final.name}.tmp")
        self.accelerator.save_state(str(temporary), safe_serialization=False)  # every process writes its RNG file
        self.accelerator.wait_for_everyone()
        if self.main:
            for name in RUN_LOGS:
                if (self.output_dir / name).exists():
                    shutil.copyfile(self.output_dir / name, temporary / name)
            info = dict(format=CHECKPOINT_FORMAT, step=step, world_size=self.accelerator.num_processes,
                        elapsed=self.elapsed(), **state, processes=processes)  # fmt: skip
            (temporary / "state.json").write_text(json.dumps(info))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(temporary, final)
            for old in self.checkpoints()[: -self.args.checkpoint_keep]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final

    def stop_if_not_finite(self, row: dict, step: int, where: str = "") -> None:
        """Stop at the first non-finite metric (a NaN/inf loss, reward or KL poisons everything after it)."""
        bad = [key for key, value in row.items() if isinstance(value, float) and not math.isfinite(value)]
        if bad:
            good = self.checkpoints()
            fail(f"non-finite {', '.join(bad)} at {self.step_name} {step}{where}; stopped before saving: no "
                 f"{self.result}/ written, last good checkpoint: {good[-1] if good else 'none'}")  # fmt: skip


def first_non_finite(per_item: torch.Tensor, sizes: dict[str, int], rank: int) -> str:
    """Where the first non-finite row of `per_item` (one row per nested loop iteration, e.g. epoch × minibatch ×
    micro-batch with `sizes` in that order) is: ", first in epoch 0, micro-batch 3 on process 1", or ""."""
    bad = (~torch.isfinite(per_item).reshape(len(per_item), -1).all(1)).nonzero()
    if not len(bad):
        return ""
    index, parts = bad[0].item(), []
    for name, size in reversed(sizes.items()):
        index, position = divmod(index, size)
        parts.insert(0, f"{name} {position}")
    return f", first in {', '.join(parts)} on process {rank}"


def reduce_metrics(accelerator, means: dict[str, torch.Tensor], spreads: Optional[dict] = None,
                   maxima: Optional[dict] = None) -> dict[str, float]:  # fmt: skip
    """Every metric of a step in one collective: `means` averaged over processes, `spreads` as max - min over them
    (0 when the processes agree), `maxima` as their largest."""
    spreads, maxima = spreads or {}, maxima or {}
    local = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=accelerator.device).reshape(())
                         for v in [*means.values(), *spreads.values(), *maxima.values()]])  # fmt: skip
    gathered = accelerator.gather(local[None])  # (processes, metrics)
    mean_values = gathered[:, : len(means)].mean(0).tolist()
    spread = gathered[:, len(means) : len(means) + len(spreads)]
    spread_values = (spread.max(0).values - spread.min(0).values).tolist()
    max_values = gathered[:, len(means) + len(spreads) :].max(0).values.tolist()
    return dict(zip([*means, *spreads, *maxima], mean_values + spread_values + max_values, strict=True))


def parameter_spread(accelerator, model) -> float:
    """max - min over processes of a float64 checksum of all parameters: 0 when every process holds the same model
    (DDP averages gradients, so any other value means the processes drifted apart)."""
    checksum = sum(p.detach().double().sum() + p.detach().double().square().sum() for p in model.parameters())
    checksums = accelerator.gather(checksum.reshape(1))
    return (checksums.max() - checksums.min()).item()


# ---------------------------------------------------------------------------------------------------------------------
# devices, timing, throughput
def ddp_options() -> list:
    """accelerate's DDP settings for the scripts: gradients as views into DDP's all-reduce buckets (no second copy
    of every gradient: 6 GB at gpt2-xl) and no broadcast of buffers before each forward (the models change none)."""
    return [DistributedDataParallelKwargs(gradient_as_bucket_view=True, broadcast_buffers=False)]


def make_accelerator(args, gradient_accumulation_steps: int) -> Accelerator:
    """The run's Accelerator: the script's micro-batches per optimizer step, --mixed-precision, the DDP settings."""
    return Accelerator(gradient_accumulation_steps=gradient_accumulation_steps, mixed_precision=args.mixed_precision,
                       kwargs_handlers=ddp_options())  # fmt: skip


def setup_device(accelerator, args) -> torch.device:
    """The run's device, set up: TF32 matmuls if --allow-tf32; on a GPU, warnings for bf16 without bf16 units and for
    an estimated peak memory above the GPU's; on CPU, glibc keeps freed large blocks for reuse: it hands every freed
    block above its mmap threshold (a (B, T, V) logits tensor is tens of MB) back to the kernel, and the next
    allocation of that size page-faults it in again, zeroed (the math is unchanged; a no-op where glibc is absent)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.allow_tf32
    warn_if_memory_short(args, accelerator)  # the estimate of --dry-run, against this GPU's memory
    if accelerator.device.type == "cuda" and accelerator.mixed_precision == "bf16":
        capability = torch.cuda.get_device_capability(accelerator.device)
        if capability < (8, 0) and accelerator.is_main_process:  # accelerate allows it: torch emulates bf16 there
            name = torch.cuda.get_device_name(accelerator.device)
            print(f"warning: --mixed-precision bf16 on {name} (compute capability {capability[0]}.{capability[1]}), "
                  "which has no bf16 units before Ampere (8.0): emulated, slower than fp32; use --mixed-precision no",
                  file=sys.stderr)  # fmt: skip
    if accelerator.device.type == "cpu":
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return accelerator.device
        libc.mallopt(GLIBC_M_MMAP_THRESHOLD, 2**30)
        libc.mallopt(GLIBC_M_TRIM_THRESHOLD, 2**31 - 1)
    return accelerator.device


class PhaseTimer:
    """Wall time per phase of a step (`time/...` metrics); waits for the GPU so that a phase owns its kernels."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.start = device, {}, time.perf_counter()
        self.last = self.start

    def __call__(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - self.last
        self.last = now


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: GPU memory allocated by torch on CUDA, the process's peak resident size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def trunk_parameters(model) -> int:
    """Parameters a token's forward pass multiplies with (2 FLOPs each, for MFU): all but the embedding lookup and
    the LM head, which is counted apart on the positions that use it."""
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def forward_flops(lm, tokens: int, lm_head_tokens: int) -> float:
    """Model FLOPs of one forward pass: 2 per trunk parameter and token, plus the LM head (2·d·V) where it is used."""
    head = lm.get_output_embeddings().weight
    return 2 * trunk_parameters(lm) * tokens + 2 * head.shape[1] * head.shape[0] * lm_head_tokens


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilization: model FLOPs per second over the device's peak."""
    return flops / seconds / (peak_tflops * 1e12)


# ---------------------------------------------------------------------------------------------------------------------
# the estimated peak memory against the GPU's (the estimate itself: memory_estimate.py, the formulas of docs/memory.md)
EFFICIENT_MICRO_BATCH = 16  # rows below which a GPU's matrix products run far from their peak: the flags that fit are
# first sought with micro-batches of at least this many rows
MEMORY_HEADROOM = 0.9  # of a GPU's memory the estimate may fill: what torch.cuda.max_memory_allocated does not count
# takes the rest: the CUDA context (~0.5 GB), NCCL's buffers (several processes) and the caching allocator's free
# blocks (its rollout and training phases allocate different shapes)


def launched_zero_stage() -> int:
    """The ZeRO stage an `accelerate launch --config_file` with DeepSpeed gave this process (0: none); ZeRO-3 is
    refused, as check_launch refuses it."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return 0
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    if stage == 3:
        fail(ZERO3_REFUSED)
    return stage


def gpu_memory_gb(args, device: Optional[torch.device] = None) -> Optional[float]:
    """--gpu-memory-gb, else the memory of `device` (default: the first visible GPU), None without a GPU."""
    if args.gpu_memory_gb is not None:
        return args.gpu_memory_gb
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / memory_estimate.GB


def memory_check(args, processes: int, zero_stage: int, budget_gb: Optional[float]):
    """(the estimate in GB or None, a one-line warning or None): the warning when the estimate is above
    MEMORY_HEADROOM of `budget_gb`, naming the flags that would make the run fit."""
    memory = memory_estimate.estimate_peak_memory(args, processes, zero_stage)
    if memory is None or budget_gb is None or memory["total"] <= MEMORY_HEADROOM * budget_gb:
        return memory, None
    fit = flags_that_fit(args, processes, zero_stage, MEMORY_HEADROOM * budget_gb * memory_estimate.GB)
    gb = memory_estimate.GB
    advice = f"{fit[0]} would fit (estimated {fit[1] / gb:.1f} GB)" if fit else "no flag of these scripts makes it fit"
    return memory, (f"warning: the estimated peak memory per process, {memory['total']:.1f} GB (docs/memory.md), is "
                    f"above {MEMORY_HEADROOM:.0%} of the GPU's {budget_gb:.1f} GB (--gpu-memory-gb): {advice}")  # fmt: skip


def flags_that_fit(args, processes: int, zero_stage: int, budget: float) -> Optional[tuple[str, float]]:
    """The first of these launches that fits `budget` bytes, with the smallest gradient accumulation (a divisor of
    an optimizer step's rows) and the largest rollout chunks (--local-rollout-forward-batch-size, and the reward
    script's --eval-batch-size, halved) that fit: as it is, with --gradient-checkpointing, with --mixed-precision
    bf16 (not under DeepSpeed, which refuses it), with both, then 8 processes (or twice as many) under ZeRO-2 —
    first with micro-batches of at least EFFICIENT_MICRO_BATCH rows, then of any size; the flags and the estimate,
    or None when none fits."""
    policy = hasattr(args, "ppo")
    field, flag = ("ppo.gradient_accumulation_steps", "--ppo.gradient-accumulation-steps") if policy else (
        "gradient_accumulation_steps", "--gradient-accumulation-steps")  # fmt: skip
    current = args.ppo.gradient_accumulation_steps if policy else args.gradient_accumulation_steps
    more = 8 if processes < 8 else 2 * processes
    zero2 = (
        f"{more} processes under ZeRO-2 in fp32 (accelerate launch --config_file benchmark/launch/deepspeed_zero2.yaml)"
    )
    options = [({}, "", processes, zero_stage),
               ({"gradient_checkpointing": True}, "--gradient-checkpointing", processes, zero_stage),
               ({"mixed_precision": "bf16"}, "--mixed-precision bf16", processes, zero_stage),
               ({"mixed_precision": "bf16", "gradient_checkpointing": True},
                "--mixed-precision bf16 --gradient-checkpointing", processes, zero_stage),
               ({"mixed_precision": "no"}, zero2, more, 2),
               ({"mixed_precision": "no", "gradient_checkpointing": True}, f"{zero2}, --gradient-checkpointing", more, 2)]  # fmt: skip
    base = memory_estimate.model_shape(args.base_model)

    def phases(changes: dict, launch_processes: int, launch_zero: int) -> tuple[float, float, float]:
        changed = replace_fields(args, changes)
        shape = memory_estimate.reward_model_shape(changed, base)
        parts = memory_estimate.peak_memory_parts(changed, base, shape, launch_processes, launch_zero)
        return memory_estimate.peak_memory_phases(parts)

    halvings = lambda n: [n >> i for i in range(n.bit_length())]  # noqa: E731 (n, n / 2, ..., 1)
    for smallest, option in itertools.product((EFFICIENT_MICRO_BATCH, 1), options):
        changes, named, launch_processes, launch_zero = option
        batch = args.ppo.batch_size // args.ppo.nminibatches if policy else args.batch_size  # rows of a step
        if (changes.get("mixed_precision") == "bf16" and launch_zero) or batch % launch_processes:
            continue
        step_rows = batch // launch_processes
        steps = [s for s in range(current, step_rows + 1) if step_rows % s == 0 and step_rows // s >= smallest]
        training = next((s for s in steps if sum(phases({**changes, field: s}, launch_processes, launch_zero)[:2])
                         <= budget), None)  # fmt: skip
        if training is None:
            continue
        chunks = [{"local_rollout_forward_batch_size": c} for c in halvings(args.local_rollout_forward_batch_size)]
        if not policy:  # and the evaluation's batch, split over the processes exactly
            chunks = [{**c, "eval_batch_size": e} for c in chunks for e in halvings(args.eval_batch_size)
                      if e % launch_processes == 0]  # fmt: skip
        rollout = next((c for c in chunks if sum(phases({**changes, field: training, **c}, launch_processes,
                                                        launch_zero)[::2]) <= budget), None)  # fmt: skip
        if rollout is not None:
            static, trained, rolled = phases({**changes, field: training, **rollout}, launch_processes, launch_zero)
            flags = [named, f"{flag} {training}" if training != current else ""]
            flags += [f"--{k.replace('_', '-')} {v}" for k, v in rollout.items() if v not in (None, getattr(args, k))]
            return " ".join(part for part in flags if part), static + max(trained, rolled)
    return None


def warn_if_memory_short(args, accelerator) -> None:
    """At a run's start on a GPU: the dry run's one-line warning (on stderr, from process 0) when the estimated peak
    memory is above the GPU's."""
    if accelerator.device.type != "cuda" or not accelerator.is_main_process:
        return
    plugin = accelerator.state.deepspeed_plugin
    zero_stage = plugin.zero_stage if plugin is not None else 0
    budget = gpu_memory_gb(args, accelerator.device)
    _, warning = memory_check(args, accelerator.num_processes, zero_stage, budget)
    if warning:
        print(warning, file=sys.stderr)
