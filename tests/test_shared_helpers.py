"""The two scripts stay drift-free and free of dead configuration (STYLE 4, 6, 8).

Each script is a single file; the helpers both need are copied verbatim into one block. These tests fail when a
same-named top-level definition drifts apart, when the shared block differs by a byte, when a flag is never read,
or when `--help` stops rendering.
"""

import ast
import dataclasses
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO

import train_policy_accelerate
import train_reward_accelerate

SCRIPTS = {"reward": REPO / "train_reward_accelerate.py", "policy": REPO / "train_policy_accelerate.py"}
MODULES = {"reward": train_reward_accelerate, "policy": train_policy_accelerate}
BLOCK_START, BLOCK_END = "# Shared helpers", "# End of the shared helpers"
SCRIPT_SPECIFIC = {"main", "validate_args"}
"""Defined in both scripts and different by design: each script's own entry point and flag checks."""


def is_config_class(name: str) -> bool:
    """The tyro dataclasses: they differ between the scripts by design (each has its own flags)."""
    return name == "Args" or name.endswith(("HParams", "Params"))


def top_level_definitions(path: Path) -> dict[str, tuple[ast.AST, str]]:
    """name -> (node, its full source lines, decorators and trailing comments included)."""
    lines = path.read_text().splitlines(keepends=True)
    definitions = {}
    for node in ast.parse("".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        first = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        source = "".join(lines[first - 1 : node.end_lineno])
        for name in names:
            definitions[name] = (node, source)
    return definitions


@pytest.fixture(scope="module")
def definitions():
    return {kind: top_level_definitions(path) for kind, path in SCRIPTS.items()}


def test_same_named_top_level_definitions_are_identical(definitions):
    reward, policy = definitions["reward"], definitions["policy"]
    common = sorted(set(reward) & set(policy) - SCRIPT_SPECIFIC)
    shared = [name for name in common if not is_config_class(name)]
    assert {"right_padding_to_left_padding", "padded_forward", "AdamTensorFlowStyle", "RewardModel"} <= set(shared)
    assert {"RANK_SEED_STRIDE", "linear_lr", "whiten", "truncate_responses", "QueryStream"} <= set(shared)
    drifted = [name for name in shared if reward[name][1] != policy[name][1]]
    assert not drifted, f"same-named top-level definitions differ between the scripts: {drifted}"


def config_fields(class_node: ast.ClassDef) -> dict[str, tuple[str, str | None, str | None]]:
    """field -> (annotation, default, docstring) of a dataclass body."""
    fields, body = {}, class_node.body
    for index, statement in enumerate(body):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            following = body[index + 1] if index + 1 < len(body) else None
            docstring = None
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docstring = following.value.value
            default = ast.unparse(statement.value) if statement.value is not None else None
            fields[statement.target.id] = (ast.unparse(statement.annotation), default, docstring)
    return fields


def test_config_fields_in_both_scripts_agree(definitions):
    """TaskHParams (and any other config class in both but Args) may add fields, but a field both have must have
    the same annotation, default and docstring."""
    reward, policy = definitions["reward"], definitions["policy"]
    classes = sorted(n for n in set(reward) & set(policy) if is_config_class(n) and n != "Args")
    assert "TaskHParams" in classes
    for name in classes:
        reward_fields, policy_fields = config_fields(reward[name][0]), config_fields(policy[name][0])
        common = set(reward_fields) & set(policy_fields)
        assert {"query_length", "response_length", "truncate_token", "truncate_after", "temperature"} <= common
        drifted = sorted(f for f in common if reward_fields[f] != policy_fields[f])
        assert not drifted, f"{name} fields differ between the scripts: {drifted}"
        assert all(docstring for _, _, docstring in {**reward_fields, **policy_fields}.values())


def shared_block(path: Path) -> str:
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(BLOCK_START)]
    ends = [i for i, line in enumerate(lines) if line.startswith(BLOCK_END)]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], f"{path.name}: shared block banners"
    return "".join(lines[starts[0] : ends[0] + 1])


def test_shared_block_is_byte_identical():
    reward, policy = (shared_block(path) for path in SCRIPTS.values())
    assert "def right_padding_to_left_padding(" in reward
    assert reward == policy


def test_shared_functions_and_classes_live_in_the_shared_block(definitions):
    for kind, path in SCRIPTS.items():
        block = shared_block(path)
        other = definitions["policy" if kind == "reward" else "reward"]
        outside = [
            name
            for name, (node, source) in definitions[kind].items()
            if name in other
            and name not in SCRIPT_SPECIFIC
            and not is_config_class(name)
            and isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and source not in block
        ]
        assert not outside, f"{path.name}: helpers of both scripts outside the shared block: {outside}"


# ---------------------------------------------------------------------------------------------------------------
# no dead configuration (STYLE 8)


def all_fields(config_class, prefix: str = "") -> list[str]:
    """Dotted names of every field, recursively through nested dataclasses."""
    names = []
    for field in dataclasses.fields(config_class):
        names.append(prefix + field.name)
        nested = field.type if dataclasses.is_dataclass(field.type) else None
        if nested is None and field.default_factory is not dataclasses.MISSING:
            nested = type(field.default_factory())
        if dataclasses.is_dataclass(nested):
            names += all_fields(nested, f"{prefix}{field.name}.")
    return names


def source_outside_dataclasses(path: Path) -> str:
    lines = path.read_text().splitlines()
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            for number in range(node.lineno - 1, node.end_lineno):
                lines[number] = ""
    return "\n".join(lines)


@pytest.mark.parametrize("kind", SCRIPTS)
def test_every_args_field_is_read(kind):
    source = source_outside_dataclasses(SCRIPTS[kind])
    fields = all_fields(MODULES[kind].Args)
    assert "task.query_length" in fields and len(fields) > 30
    unread = [name for name in fields if not re.search(rf"\.{name.rsplit('.', 1)[-1]}\b", source)]
    assert not unread, f"{SCRIPTS[kind].name}: Args fields never read outside the dataclasses: {unread}"


# ---------------------------------------------------------------------------------------------------------------
# --help


@pytest.fixture(scope="module")
def help_outputs():
    """`python SCRIPT --help` for both scripts, run side by side (each takes seconds to import torch)."""
    env = {**os.environ, "COLUMNS": "200"}
    processes = {
        kind: subprocess.Popen(
            [sys.executable, str(path), "--help"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for kind, path in SCRIPTS.items()
    }
    outputs = {}
    for kind, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        outputs[kind] = (process.returncode, stdout.decode(), stderr.decode())
    return outputs


@pytest.mark.parametrize(
    "kind, flags",
    [
        ("reward", ["--labels.num-train", "--task.query-length", "--batch-size", "--no-use-tensorflow-adam"]),
        ("policy", ["--ppo.noptepochs", "--rewards.adaptive-kl.target", "--task.truncate-after", "--ppo.lam"]),
    ],
)
def test_help_renders(help_outputs, kind, flags):
    returncode, stdout, stderr = help_outputs[kind]
    assert returncode == 0, stderr[-2000:]
    for flag in flags:
        assert flag in stdout, flag
    for derived in ("--world-size", "--local-batch-size", "--num-updates", "--run-name"):
        assert derived not in stdout, f"derived value {derived} shown in --help"


def test_tracked_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """--track: a fresh run gets a new wandb id (kept in OUTPUT_DIR/wandb_run_id); --resume reuses it, and rows of
    steps the interrupted attempt already sent are not sent again (the resumed run recomputes the same rows)."""
    inits, logged = [], []

    class FakeRun:
        def __init__(self, step):
            self.step = step

        def log(self, row, step):
            logged.append(step)

    def init(**kwargs):
        inits.append(kwargs)
        return FakeRun(step=5 if len(inits) == 3 else 0)  # the server holds steps 0..4 of the resumed run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    accelerator = types.SimpleNamespace(is_main_process=True)
    for resume in (False, False, True):
        args = train_policy_accelerate.Args(resume=resume, output_dir=str(tmp_path))
        logger = train_policy_accelerate.RunLogger(accelerator, tmp_path, args, track=True)
        logger.log({"x": 1.0}, step=4)
        logger.log({"x": 2.0}, step=5)
        logger.file.close()
    first, fresh, resumed = (kwargs["id"] for kwargs in inits)
    assert first != fresh and resumed == fresh == (tmp_path / "wandb_run_id").read_text()  # --overwrite: a new run
    assert all(kwargs["resume"] == "allow" for kwargs in inits)
    assert logged == [4, 5, 4, 5, 5]  # the resumed logger skips step 4, which wandb already has


def test_progress_in_a_log_file_prints_plain_lines(monkeypatch, capsys):
    """Under sbatch / nohup stdout is a file, where rich draws its bar only at the end: a plain line after the first
    item, then one per `log_every_s` seconds, and one at the end, each with the count, elapsed time and what is left."""
    script = train_reward_accelerate
    clock = iter([0.0, 10.0, 20.0, 70.0, 80.0, 90.0, 100.0])  # start, then once after each of the 6 items
    monkeypatch.setattr(script.time, "perf_counter", lambda: next(clock))
    assert list(script.track_progress(range(6), "simulating labels", enabled=True)) == list(range(6))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "simulating labels: 1/6 (17%), 10 s, ~50 s left",  # 10 s per item so far, 5 items to go
        "simulating labels: 3/6 (50%), 70 s, ~70 s left",  # 60 s after the previous line
        "simulating labels: 6/6 (100%), 100 s, ~0 s left",
    ]
    assert list(script.track_progress(range(3), "training reward model", enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().out == ""  # other processes print nothing
