"""The air-gapped GPU node path, on this CPU: benchmark/launch/gpu/prepare.sh builds a bundle (here for this Python)
where PyPI is reachable; then, in a fresh virtual environment that has only a preinstalled PyTorch stack (torch 2.13,
linked from this environment, and the target stack's versions of transformers, accelerate, huggingface_hub,
tokenizers), with the network cut (`unshare -n`) and its site-packages mounted read-only,
benchmark/launch/gpu/check.sh installs what the node lacks from the bundle, with no index, into a directory of its
own, and writes its JSON line. CI runs the tiny model's zero2 configuration (on a CPU: accelerate launch with the ZeRO-2
config, DeepSpeed installed from the bundle; its policy stage trains and evaluates a reward model first, so both
scripts run): one configuration, as the others go through the same install and imports (tests/test_throughput.py
runs throughput.py's stages, tests/test_e2e.py and tests/test_mixed_precision.py the precisions); `RUNS` runs any
other the same way. Also: check.sh's plan, and a configuration past its time limit."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LOOPBACK_DIR, REPO
from tests.fetch import NODE_STACK  # the GPU node's preinstalled stack (tests/fetch.py downloads it before the tests)


def test_every_module_level_import_of_the_check_path_is_in_the_node_stack_or_the_bundle():
    """The scripts, run_utils, rlhf_data, quickstart_assets (its tokenizer builder) and throughput.py import at module
    level only the standard library, the node's stack and the bundle's tyro: the optional packages (datasets among
    them) are imported where used."""
    import ast

    allowed = {"torch", "transformers", "accelerate", "safetensors", "numpy", "rich", "tyro", "run_utils", "rlhf_data",
               "memory_estimate"}  # fmt: skip
    allowed.add("psutil")  # accelerate's dependency
    for name in ("train_reward_accelerate.py", "train_policy_accelerate.py", "run_utils.py", "memory_estimate.py", "rlhf_data.py",
                 "quickstart_assets.py", "benchmark/speed/throughput.py"):  # fmt: skip
        tree = ast.parse((REPO / name).read_text())
        imported = {
            alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {
            node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
        }
        third_party = {
            module for module in imported if module not in sys.stdlib_module_names and module != "__future__"
        }
        assert third_party <= allowed, (name, third_party - allowed)
    requirements = (REPO / "benchmark/launch/gpu/node-requirements.txt").read_text().splitlines()
    bundled = {line.split("==")[0] for line in requirements if line and not line.startswith("#")}
    assert "tyro" in bundled


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, gpt2_tokenizer_dir):
    out = tmp_path_factory.mktemp("bundle")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "PYTHON_VERSION": version, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(REPO / "benchmark/launch/gpu/prepare.sh"), str(out)], capture_output=True,
                            text=True, env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "limit 64 MiB" in result.stdout
    return out


def test_prepare_makes_a_small_bundle_of_wheels_and_the_tokenizer(bundle):
    wheels = sorted(path.name.split("-")[0].lower() for path in (bundle / "wheels").iterdir())
    assert wheels == ["docstring_parser", "typeguard", "typing_extensions", "tyro"]
    deepspeed = {path.name.split("-")[0].lower() for path in (bundle / "deepspeed").iterdir()}
    pinned = (REPO / "benchmark/launch/gpu/node-deepspeed-requirements.txt").read_text().splitlines()
    assert deepspeed == {"deepspeed"} | {line.split("==")[0].replace("-", "_") for line in pinned if "==" in line}
    assert (bundle / "gpt2-tokenizer" / "tokenizer.json").is_file()
    assert sum(path.stat().st_size for path in bundle.rglob("*") if path.is_file()) < 64 * 2**20


def site_packages(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip


def link_torch(node_packages: Path) -> None:
    """The node's torch: this environment's own build of NODE_STACK's version, linked into the node's site-packages
    instead of unpacked there again (~1 GB of files: half the install's time). pip then counts it installed, as on the
    node, and installs the rest of the stack; another version here is left to pip (which would replace, not reuse,
    a linked one)."""
    import torch

    if f"torch=={torch.__version__.split('+')[0]}" not in NODE_STACK:
        return
    source = Path(torch.__file__).parents[1]
    for name in ("torch", "functorch", "torchgen", f"torch-{torch.__version__}.dist-info"):
        if (source / name).exists():
            (node_packages / name).symlink_to(source / name)


def snapshot(directory: Path) -> dict[str, float]:
    """Every file under `directory` and its modification time."""
    return {str(path.relative_to(directory)): path.stat().st_mtime for path in directory.rglob("*")}


def test_check_runs_offline_from_the_bundle_in_a_bare_environment(bundle, tmp_path):
    venv = tmp_path / "node-env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    link_torch(site_packages(python))
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *NODE_STACK],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip (--no-compile: no .pyc for torch, 117 s -> 78 s)
    assert install.returncode == 0, install.stderr[-3000:]
    missing = subprocess.run([str(python), "-c", "import tyro"], capture_output=True, text=True)
    assert missing.returncode != 0  # the node lacks it: the bundle brings it
    node_packages = site_packages(python)
    before = snapshot(node_packages)
    out, site = tmp_path / "gpu_check", tmp_path / "gpu_check" / "site-packages"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "PYTHON"))}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", BUNDLE=str(bundle), RUNS="tiny:zero2", BATCH="8", UPDATES="1",
               LIMIT="300", ACCELERATE_USE_CPU="true", OUT_DIR=str(out), OMP_NUM_THREADS="1",
               PYTHONPATH=str(LOOPBACK_DIR))  # fmt: skip
    # (PYTHONPATH: the tests' process setup, tests/loopback/sitecustomize.py, standard library only: no package of its
    # own in the node's environment. One thread, as every script the suite starts (tests/conftest.py): with two, on
    # cores the other workers keep busy, OpenMP's spinning threads tripled the check's CPU time, measured)
    # no network but the loopback (zero2's launcher meets its process there), the node's site-packages read-only (a
    # mount: root ignores file modes)
    setup = (f'ip link set lo up && mount --bind "{node_packages}" "{node_packages}" && '
             f'mount -o remount,bind,ro "{node_packages}" && ')  # fmt: skip
    check = subprocess.run(["unshare", "--net", "--mount", "bash", "-c",
                            setup + f'exec bash "{REPO / "benchmark/launch/gpu/check.sh"}"'], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=900)  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    (line,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert line["name"] == "tiny zero2" and "failed" not in line, (line, check.stderr[-3000:])
    policy = line["result"]
    assert policy["stage"] == "policy" and policy["seconds_per_update"] > 0 and policy["peak_precision"] == "fp32"
    assert policy["estimated_peak_memory_gb"]["total"] > 0 and policy["peak_memory_gb"] > 0
    assert policy["first_ratio_max_deviation"] == [0.0, 0.0]  # the warm-up's and the measured update's, on CPU
    log = Path(line["log"]).read_text()  # the configuration's log: the reward script's and the policy script's output
    assert "reward model" in log and "PPO" in log, log[-3000:]
    assert "transformers 5.17.0" in check.stderr and "tyro 1.0.17" in check.stderr
    assert snapshot(node_packages) == before  # nothing of the node's own packages replaced or added
    installed = {path.name.split("-")[0].lower() for path in site.glob("*.dist-info")}
    assert {"tyro", "docstring_parser", "typeguard", "deepspeed", "hjson"} <= installed
    assert not installed & {"typing_extensions", "numpy", "torch", "packaging"}  # the node has them: kept
    # the bundle's DeepSpeed (the zero2 run above imported it from there: the version it installed)
    code = "import importlib.metadata as m; print(m.version('deepspeed'))"
    version = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             env={**env, "PYTHONPATH": str(site)}, timeout=120)  # fmt: skip
    assert version.stdout.strip() == "0.19.7", version.stderr[-3000:]


def check_sh(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """check.sh without a bundle, in this environment."""
    environment = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(REPO / "benchmark/launch/gpu/check.sh")], capture_output=True, text=True,
                          env=environment, timeout=300)  # fmt: skip


def test_plan_prints_the_configurations_in_order_and_the_total_within_the_budget(tmp_path):
    """`PLAN=1`: ZeRO-2 first, then the reward stage; each configuration's estimate, the total within BUDGET
    (8 minutes); on one GPU, what its ZeRO-2 configuration checks (one rank: nothing partitioned); nothing run,
    nothing written."""
    result = check_sh(tmp_path, PLAN="1", GPUS="1")
    assert result.returncode == 0, result.stderr
    (zero2,) = [line for line in result.stdout.splitlines() if " zero2 " in line]
    assert "1 GPU: one DeepSpeed rank, nothing partitioned" in zero2
    assert "one DeepSpeed rank" not in check_sh(tmp_path, PLAN="1", GPUS="8").stdout
    rows = re.findall(r"^ +(\d+)\. (\S+) (\S+) +~ *(\d+) s", result.stdout, re.MULTILINE)
    assert [(model, config) for _, model, config, _ in rows][:2] == [("gpt2", "zero2"), ("gpt2", "reward")]
    assert ("gpt2-large", "bf16+tf32+compile") not in [(model, config) for _, model, config, _ in rows]
    total = int(re.search(r"^total ~(\d+) s: within BUDGET 480 s", result.stdout, re.MULTILINE).group(1))
    assert total == pytest.approx(sum(int(seconds) for *_, seconds in rows), abs=len(rows)) and total <= 480
    assert "ESTIMATED" in result.stdout and not (tmp_path / "out").exists()
    assert check_sh(tmp_path, PLAN="1", RUNS="gpt2:nonsense").returncode != 0
    from benchmark.launch.gpu import plan

    configurations = re.findall(
        r"^    \[([\w+]+)\]=", (REPO / "benchmark/launch/gpu/check.sh").read_text(), re.MULTILINE
    )
    assert set(configurations) == set(plan.CONFIGS)  # the plan knows every configuration check.sh has


def test_a_configuration_past_its_limit_is_recorded_and_leaves_nothing_behind(tmp_path):
    """LIMIT 10 s (throughput.py --timeout): a failed line naming the time limit, the configuration's log, and no
    process of it left (check.sh marks each configuration's processes with GPU_CHECK_TAG)."""
    result = check_sh(tmp_path, RUNS="tiny:fp32", BATCH="16", UPDATES="1000", LIMIT="10", ACCELERATE_USE_CPU="true",
                      OMP_NUM_THREADS="1")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert line["name"] == "tiny fp32" and line["failed"] == "time limit (10 s)", line
    assert "--timeout 10 s reached" in Path(line["log"]).read_text(), result.stderr[-3000:]
    assert not [process for process in Path("/proc").glob("[0-9]*") if has_check_tag(process)]


def has_check_tag(process: Path) -> bool:
    try:
        return any(entry.startswith(b"GPU_CHECK_TAG=") for entry in (process / "environ").read_bytes().split(b"\0"))
    except OSError:  # not a process, or gone
        return False
