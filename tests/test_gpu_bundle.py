"""The air-gapped GPU node path, on this CPU: benchmark/gpu/prepare.sh builds a bundle (here for this Python) where
PyPI is reachable; then, in a fresh virtual environment that has only a preinstalled PyTorch stack (torch 2.13 and
the target stack's versions of transformers, accelerate, huggingface_hub, tokenizers), with the network cut
(`unshare -n`), benchmark/gpu/check.sh installs the bundle with no index and writes its JSON line. CI runs the fp32
configuration on the tiny model; `CONFIGS` (all three by default) runs the rest the same way."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

NODE_STACK = ["torch==2.13.0", "transformers==5.17.0", "accelerate==1.15.0", "huggingface_hub==1.33.0",
              "tokenizers==0.23.*", "safetensors", "numpy", "rich", "tensorboard", "tqdm"]  # fmt: skip
"""The GPU node's preinstalled stack (torch 2.13 for this machine's CPU wheel instead of the node's 2.11): no tyro,
no datasets, wandb or simulated labelers."""


def test_every_module_level_import_of_the_check_path_is_in_the_node_stack_or_the_bundle():
    """The scripts, run_utils, rlhf_data, quickstart_assets (its tokenizer builder) and throughput.py import at module
    level only the standard library, the node's stack and the bundle's tyro: the optional packages (datasets among
    them) are imported where used."""
    import ast

    allowed = {"torch", "transformers", "accelerate", "safetensors", "numpy", "rich", "tyro", "run_utils", "rlhf_data"}
    for name in ("train_reward_accelerate.py", "train_policy_accelerate.py", "run_utils.py", "rlhf_data.py",
                 "quickstart_assets.py", "benchmark/throughput.py"):  # fmt: skip
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
    bundled = {line.split("==")[0] for line in (REPO / "benchmark/gpu/node-requirements.txt").read_text().splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    assert "tyro" in bundled


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, gpt2_tokenizer_dir):
    out = tmp_path_factory.mktemp("bundle")
    env = {**os.environ, "PYTHON_VERSION": f"{sys.version_info.major}.{sys.version_info.minor}"}
    result = subprocess.run(["bash", str(REPO / "benchmark/gpu/prepare.sh"), str(out)], capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "limit 64 MiB" in result.stdout
    return out


def test_prepare_makes_a_small_bundle_of_wheels_and_the_tokenizer(bundle):
    wheels = sorted(path.name.split("-")[0].lower() for path in (bundle / "wheels").iterdir())
    assert wheels == ["docstring_parser", "typeguard", "typing_extensions", "tyro"]
    deepspeed = {path.name.split("-")[0].lower() for path in (bundle / "deepspeed").iterdir()}
    pinned = (REPO / "benchmark/gpu/node-deepspeed-requirements.txt").read_text().splitlines()
    assert deepspeed == {"deepspeed"} | {line.split("==")[0].replace("-", "_") for line in pinned if "==" in line}
    assert (bundle / "gpt2-tokenizer" / "tokenizer.json").is_file()
    assert sum(path.stat().st_size for path in bundle.rglob("*") if path.is_file()) < 64 * 2**20


def test_check_runs_offline_from_the_bundle_in_a_bare_environment(bundle, tmp_path):
    venv = tmp_path / "node-env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *NODE_STACK],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip (--no-compile: no .pyc for torch, 117 s -> 78 s)
    assert install.returncode == 0, install.stderr[-3000:]
    missing = subprocess.run([str(python), "-c", "import tyro"], capture_output=True, text=True)
    assert missing.returncode != 0  # the node lacks it: the bundle brings it
    results = tmp_path / "results.jsonl"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "PYTHON"))}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", BUNDLE=str(bundle), MODELS="tiny", BATCH="16", CONFIGS="fp32",
               UPDATES="1", LIMIT="300", ACCELERATE_USE_CPU="true", RESULTS=str(results), OMP_NUM_THREADS="2")  # fmt: skip
    check = subprocess.run(["unshare", "--net", "bash", str(REPO / "benchmark/gpu/check.sh")], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    (line,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert line["name"] == "tiny fp32" and "failed" not in line, (line, check.stderr[-3000:])
    assert line["result"]["stage"] == "policy" and line["result"]["seconds_per_update"] > 0
    assert "transformers 5.17.0" in check.stderr and "tyro 1.0.17" in check.stderr
    # the zero2 configuration's DeepSpeed installs from the bundle with no index and no network
    install = subprocess.run(["unshare", "--net", str(python), "-m", "pip", "install", "--quiet", "--no-index",
                              "--find-links", str(bundle / "deepspeed"), "-r", str(REPO / "requirements-deepspeed.txt")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    version = subprocess.run([str(python), "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                             text=True, env={**env, "DS_ACCELERATOR": "cpu"}, timeout=120)  # fmt: skip
    assert version.stdout.strip().splitlines()[-1] == "0.19.7", version.stderr[-3000:]
