"""The two scripts stay drift-free and free of dead configuration.

Each script holds its whole pipeline; what both need of it is copied verbatim into one block, and the run tooling
lives once in run_utils.py. These tests fail when a same-named top-level definition drifts apart, when the shared
block differs by a byte or holds something one script does not use, when a flag is never read, when a blog detail is
not tagged exactly once, or when `--help` stops rendering.
"""

import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train_policy_accelerate
import train_reward_accelerate
from tests.conftest import REPO, tracked_files

SCRIPTS = {"reward": REPO / "train_reward_accelerate.py", "policy": REPO / "train_policy_accelerate.py"}
MODULES = {"reward": train_reward_accelerate, "policy": train_policy_accelerate}
BLOCKS = (("# The pipeline both scripts share", "# End of the shared pipeline."),
          ("# Speed substitutions", "# End of the speed substitutions."))  # fmt: skip
"""The two shared blocks' banners: the pipeline (above main) and the speed substitutions it calls (below main)."""
SCRIPT_SPECIFIC = {"main", "validate_args", "read_inputs", "RESUME_MAY_CHANGE", "DRY_RUN_SIZES", "TLDR_OVERRIDES",
                   "TASK_OVERRIDES", "task_defaults"}  # fmt: skip
"""Defined in both scripts and different by design: entry point, flag and input checks, per-process sizes, the sizes
a dry run prints, each script's own Args at a task's defaults."""


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
    assert {"RANK_SEED_STRIDE", "linear_lr", "truncate_responses", "QueryStream"} <= set(shared)
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
    """Both shared blocks of a script, banners included, one after the other."""
    lines, blocks = path.read_text().splitlines(keepends=True), []
    for start, end in BLOCKS:
        starts = [i - 1 for i, line in enumerate(lines) if line.startswith(start)]  # from the banner's rule
        ends = [i + 1 for i, line in enumerate(lines) if line.startswith(end)]
        assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], f"{path.name}: {start!r} banners"
        blocks.append("".join(lines[starts[0] : ends[0] + 1]))
    return "".join(blocks)


def test_shared_block_is_byte_identical():
    reward, policy = (shared_block(path) for path in SCRIPTS.values())
    assert "def right_padding_to_left_padding(" in reward and "def draw_tokens(" in reward
    assert reward == policy


def test_the_paper_comes_before_main_and_the_machine_after():
    """The algorithm is read from the first line to the end of main: the speed substitutions (the reward model's
    best-of-n forward among them), the numerics and compatibility helpers, the simulated labelers and the tooling
    (input checks, loading, the metrics' helpers, records, saving) sit below it."""
    below = {"validate_args", "read_inputs", "task_defaults", "head_product", "draw_tokens", "fused_gelu",
             "cache_argument", "fp32_products", "simulated_labeler_scores", "BestOfNRewardModel", "save_policy",
             "save_reward_model", "load_models", "record_update", "record_step", "append_stats", "share_moments"}  # fmt: skip
    for path in SCRIPTS.values():
        body = ast.parse(path.read_text()).body
        main_index = next(i for i, node in enumerate(body) if getattr(node, "name", None) == "main")
        above = {node.name for node in body[:main_index] if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert not above & below, (path.name, above & below)
        assert isinstance(body[-1], ast.If) and "__main__" in ast.unparse(body[-1].test)  # the entry point is last


def name_uses(tree: ast.Module, name: str) -> int:
    """How often code outside `name`'s own definition reads `name`: a comment, a docstring or a type hint that names
    it is no use (`# see use_plain_sampling` kept the shared copy "used" after its only call was gone)."""
    annotations = [node.annotation for node in ast.walk(tree) if isinstance(node, (ast.arg, ast.AnnAssign))]
    annotations += [node.returns for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    hinted = {id(node) for annotation in annotations if annotation is not None for node in ast.walk(annotation)}
    others = [node for node in tree.body if getattr(node, "name", None) != name]
    return sum(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)
               and id(node) not in hinted for top in others for node in ast.walk(top))  # fmt: skip


def test_the_shared_block_holds_only_what_both_scripts_use(definitions):
    """No dead copies: every function and class of the shared block is used by the script outside its own
    definition (the reward script needs no whiten, the policy no reward-model save)."""
    for path in SCRIPTS.values():
        block_names = [name for name, (node, source) in top_level_definitions(path).items()
                       if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and source in shared_block(path)]  # fmt: skip
        assert len(block_names) > 15
        tree = ast.parse(path.read_text())
        for name in block_names:
            assert name_uses(tree, name) > 0, f"{path.name}: {name} is in the shared block but never used"


def test_a_shared_definition_counts_as_used_only_where_code_calls_it():
    tree = ast.parse("def f(): pass\n\n\ndef g(x: f) -> f:\n    # f\n    return 'f'\n\n\nh = [f]\n")
    assert name_uses(tree, "f") == 1 and name_uses(tree, "g") == 0


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


def field_reads(source: str) -> set[tuple[str, str]]:
    """What code reads of a flags object: (owner, field) for every `...owner.field` attribute load (`args.seed`,
    `self.args.track`, `args.task.query_length` and its alias `task.query_length` all end in owner.field), and
    (owner, "*") for `**vars(...owner)`. An assignment (`args.num_updates = ...`) is no read, nor is a field's name in
    a string: what takes fields by name (`require_positive(args, "ppo.lr")`, `fill_defaults`, `print_dry_run`) checks,
    fills or prints them, and any other string (`group["eps"]`) would make a flag of that name look used."""
    tree = ast.parse(source)
    for node in tree.body:  # the dataclasses themselves declare the fields: no reads
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            node.body = []
    accesses = {
        (ast.unparse(node.value).rsplit(".", 1)[-1], node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
    }
    accesses |= {  # `f(**vars(args.rewards.adaptive_kl))` reads every field of adaptive_kl
        (ast.unparse(node.value.args[0]).rsplit(".", 1)[-1], "*") for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg is None and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "vars"
    }  # fmt: skip
    return accesses


def is_read(name: str, accesses: set[tuple[str, str]]) -> bool:
    owner, _, field = name.rpartition(".")
    owner = owner.rsplit(".", 1)[-1] or "args"
    return (owner, field) in accesses or (owner, "*") in accesses


@pytest.mark.parametrize("kind", SCRIPTS)
def test_every_args_field_is_read(kind):
    readers = [SCRIPTS[kind], REPO / "run_utils.py", REPO / "rlhf_data.py"]  # the script and the modules it imports
    accesses = field_reads("\n".join(path.read_text() for path in readers))
    fields = all_fields(MODULES[kind].Args)
    assert "task.query_length" in fields and "checkpoint_every" in fields and len(fields) > 30
    unread = [name for name in fields if not is_read(name, accesses)]
    assert not unread, f"{SCRIPTS[kind].name}: Args fields never read outside the dataclasses: {unread}"


def test_a_field_counts_as_read_only_where_its_owner_reads_it():
    """The check above cannot be fooled by a name that happens to match: `device.type` is no read of `labels.type`,
    `group["eps"]` or a check by name no read of `eps` or `ppo.lr`, `args.num_updates = ...` no read of num_updates."""
    accesses = field_reads(
        "x = accelerator.device.type\nrequire_positive(args, 'ppo.lr')\nd = group['eps']\nargs.num_updates = 3\n"
        "task = args.task\ny = task.name\nz = args.ppo.noptepochs\nf(**vars(args.rewards.adaptive_kl))"
    )
    assert not is_read("labels.type", accesses) and not is_read("ppo.lr", accesses) and not is_read("eps", accesses)
    assert not is_read("num_updates", accesses) and not is_read("seed", accesses)
    assert is_read("task", accesses) and is_read("task.name", accesses) and is_read("ppo.noptepochs", accesses)
    assert is_read("rewards.adaptive_kl.target", accesses) and not is_read("rewards.kl_coef", accesses)


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
    # only the flags whose default means "not set" (the output dir, the wandb entity, the Hub repo, the peak FLOPS,
    # the GPU memory, the dataset configuration; the policy's gold labeler and --rewards.function): every other default is its value, and the policy's
    # reward model is (required unless --rewards.function)
    assert stdout.count("(default: None)") == {"reward": 6, "policy": 7}[kind]
    assert stdout.count("(required unless --rewards.function)") == {"reward": 0, "policy": 1}[kind]


# ---------------------------------------------------------------------------------------------------------------
# detail tags: each of the blog's details is tagged `# detail: NAME —` exactly once where it is implemented

SHARED_DETAILS = {
    "query ⊕ response input", "pad token", "position ids for padding", "fixed-length responses",
    "learning rate annealing", "different seeds for different processes", "reward from the last token",
    "reward head initialization", "queries that start and end with a period", "dropout disabled",
    "rejection sampling", "TF-style Adam",
}  # fmt: skip
DETAILS = {
    "reward": SHARED_DETAILS | {"reward normalization before and after"},
    "policy": SHARED_DETAILS | {
        "logits scaled by the sampling temperature", "value head initialization", "discount factor 1",
        "batches and minibatches", "per-token KL penalty", "per-minibatch reward and advantage whitening",
        "clipped value function", "adaptive KL",
    },
}  # fmt: skip
"""The blog's 6 general, 3 reward-model and 11 policy details, and its Adam section: 21 names in all."""


@pytest.mark.parametrize("kind", SCRIPTS)
def test_every_detail_is_tagged_exactly_once(kind):
    tags = re.findall(r"# detail: (.+?) —", SCRIPTS[kind].read_text())
    assert sorted(tags) == sorted(DETAILS[kind]), set(tags) ^ DETAILS[kind]
    assert len(DETAILS["reward"] | DETAILS["policy"]) == 21


def test_the_details_page_lists_every_tagged_detail():
    page = (REPO / "docs" / "details.md").read_text()
    for name in DETAILS["reward"] | DETAILS["policy"]:
        assert f"| {name} |" in page, name


READING_PATH_LINK = re.compile(r"\[`(\w+)`\]\((train_\w+\.py)#L(\d+)-L(\d+)\)")
READING_PATH_TEST = re.compile(r"`(test_\w+\.py)(?:::(test_\w+))?`")


def test_the_readmes_reading_path_points_at_the_lines_and_tests_it_names():
    """Each row of the README's "Read it next to the blog": the link's lines are exactly the definition it names, and
    the test it names exists. Fails with the lines to write when a script moves."""
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if READING_PATH_LINK.search(line)]
    assert len(rows) >= 10
    wrong = []
    for row in rows:
        name, script, first, last = READING_PATH_LINK.search(row).groups()
        spans = {node.name: (node.lineno, node.end_lineno) for node in ast.parse((REPO / script).read_text()).body
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef))}  # fmt: skip
        if spans.get(name) != (int(first), int(last)):
            wrong.append(f"{name} in {script}: README says L{first}-L{last}, the file has {spans.get(name)}")
        test_file, test_name = READING_PATH_TEST.search(row).groups()
        assert (REPO / "tests" / test_file).exists(), test_file
        if test_name:
            tests = {getattr(node, "name", "") for node in ast.parse((REPO / "tests" / test_file).read_text()).body}
            assert test_name in tests, f"{test_file}::{test_name}"
    assert not wrong, wrong


def test_no_file_cites_a_document_the_repository_does_not_have():
    files = [p for p in tracked_files() if p.suffix in (".py", ".md", ".sh", ".txt", ".toml", ".slurm", ".yaml")]
    assert len(files) > 20
    spec = re.compile("SP" "EC" r"\b")  # written in two parts, so that this file does not match itself
    citing = [str(p.relative_to(REPO)) for p in files if spec.search(p.read_text(errors="ignore"))]
    assert not citing, citing


def test_repository_checks_read_the_tracked_files_and_nothing_a_setup_put_beside_them():
    """The README's setup puts `.venv/` inside the repository: its packages must not reach the checks above."""
    probe = REPO / ".venv-probe-untracked"
    probe.mkdir(exist_ok=True)
    try:
        (probe / "notes.md").write_text("an untracked file")
        files = tracked_files()
        assert REPO / "README.md" in files and REPO / "tests" / "conftest.py" in files
        assert not any(probe in path.parents for path in files)
    finally:
        shutil.rmtree(probe)


def test_the_two_slurm_files_share_one_worker_under_ci_run(tmp_path):
    """`.ci/run`'s `--dist loadgroup` (here on 2 workers): tests/conftest.py's groups must reach pytest-xdist (its hook
    reads the marks, so ours has to run first), else tests/test_slurm.py and tests/test_slurm_two_nodes.py, which both
    start Slurm's daemons on this machine, run at the same time on two workers."""
    plugin = tmp_path / "record_worker_items.py"
    plugin.write_text(
        "import os, pytest\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_runtestloop(session):\n"
        "    worker = os.environ.get('PYTEST_XDIST_WORKER')\n"
        "    if worker:\n"
        f"        open({str(tmp_path)!r} + '/' + worker, 'w').write('\\n'.join(i.nodeid for i in session.items))\n"
        "        return True  # record only, run nothing\n"
    )
    command = [sys.executable, "-m", "pytest", "-p", plugin.stem, "-n", "2", "--dist", "loadgroup", "-q",
               "--no-loadscope-reorder", "tests/test_slurm.py", "tests/test_slurm_two_nodes.py", "tests/test_data.py"]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}  # not this run's
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    nodeids = [line for worker in ("gw0", "gw1") if (tmp_path / worker).exists()
               for line in (tmp_path / worker).read_text().splitlines()]  # fmt: skip
    groups = {nodeid.split("::")[0]: nodeid.rsplit("@", 1)[-1] for nodeid in nodeids if "@" in nodeid}
    assert len(groups) == 3 and len(nodeids) > 8, nodeids[:5]  # every item carries its group
    assert groups["tests/test_slurm.py"] == groups["tests/test_slurm_two_nodes.py"] == "test_slurm.py"
    assert groups["tests/test_data.py"] == "test_data.py"


def test_contributing_names_tests_that_exist():
    """CONTRIBUTING.md's obligations each name the test that enforces them (`tests/<file>.py::test_name`, then bare
    `test_name`s of the same file): every one must exist, so that the page cannot drift from the suite."""
    named = []
    for line in (REPO / "CONTRIBUTING.md").read_text().splitlines():
        file = None
        for match in re.finditer(r"`(?:tests/(\w+\.py))?(?:::)?(test_\w+)?`", line):
            file = match.group(1) or file
            if match.group(2) and file:
                named.append((file, match.group(2)))
    assert len(named) >= 20
    missing = []
    for file, name in named:
        tests = {getattr(node, "name", "") for node in ast.parse((REPO / "tests" / file).read_text()).body}
        if name not in tests:
            missing.append(f"{file}::{name}")
    assert not missing, missing
