#!/usr/bin/env bash
# Build the SGLang venv the SGLang integration tests and `raykv bench --engine sglang`
# drive (default: .venv-sglang). scripts/setup.sh runs it; run it alone to rebuild that
# venv. SGLang 0.5.23 cannot share raykv's main venv: its storage/controller import
# chain needs triton and torchvision, and the only torchvision that imports on CPU here
# is 0.29.1 with torch 2.14.1 (index builds, CUDA-enabled, they run on CPU). So: sglang
# --no-deps plus exactly what its storage layer imports, plus raykv and raykv's runtime
# deps with the same ray version as the main venv (the SGLang side joins the cluster over
# Ray). Idempotent: a venv this script completed and checked (same script, Ray version
# and Python) only gets raykv reinstalled.
# Usage: scripts/sglang-venv.sh [VENV_DIR] [RAY_VERSION]; PYTHON=... picks the interpreter
# (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
VENV=${1:-.venv-sglang}
RAY_VERSION=${2:-$(.venv/bin/python -c 'import ray; print(ray.__version__)' 2>/dev/null || pinned ray)}
# The verified versions (constraints.txt; its torch is .venv's, not this venv's).
SGLANG=$(pinned sglang)
MOONCAKE=$(pinned mooncake-transfer-engine-non-cuda)
PYTHON=${PYTHON:-python3}

# SGLang hashes page keys with a C++ extension it compiles on first use (g++, -lcrypto).
mapfile -t missing < <(missing_packages sglang)
apt_install "${missing[@]}"

# pip's temporary files in .setup-tmp unless TMPDIR is set (scripts/setup.sh's, when it
# runs this script).
setup_tmp
trap drop_setup_tmp EXIT

stamp="$(cat scripts/sglang-venv.sh constraints.txt | sha256sum | cut -c1-16) ray=$RAY_VERSION $("$PYTHON" -V 2>&1)"
if [ "$(cat "$VENV/.raykv-built" 2>/dev/null)" != "$stamp" ]; then
    say "building $VENV (sglang 0.5.23, torch 2.14.1, ray $RAY_VERSION)"
    [ ! -e "$VENV" ] || [ -e "$VENV/pyvenv.cfg" ] || die "$VENV exists and is not a venv"
    rm -rf "$VENV"
    # at least what it takes once built (6.6 GB; more while torch's CUDA wheels install)
    need_space . 6656 "building $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --no-compile --upgrade pip
    "$VENV/bin/python" -m pip install -q --no-compile torch==2.14.1 torchvision==0.29.1 triton
    "$VENV/bin/python" -m pip install -q --no-compile --no-deps "sglang==$SGLANG"
    # What SGLang's storage / controller modules import, at the versions sglang 0.5.23 pins.
    "$VENV/bin/python" -m pip install -q --no-compile numpy orjson psutil pybase64 pillow starlette \
        msgspec pydantic pyzmq tqdm dill transformers==5.19.0 tokenizers==0.23.2 \
        apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf ipython \
        requests aiohttp "python-dateutil<3" \
        "ray==$RAY_VERSION" "mooncake-transfer-engine-non-cuda==$MOONCAKE" click rich matplotlib cryptography \
        "blake3==$(pinned blake3)" \
        ninja
fi
"$VENV/bin/python" -m pip install -q --no-compile --no-deps -e .
if [ "$(cat "$VENV/.raykv-built" 2>/dev/null)" = "$stamp" ]; then
    say "$VENV: already built and checked"
    exit 0
fi
# Import check, and compile SGLang's hash extension now rather than in the first test:
# into the venv, where the tests and `raykv bench --engine sglang` take it from
# (lab/bench/sglang.py, sglang_env), so a test run under another HOME does not build it again. With the venv's
# own ninja, as the tests' SGLang processes use it: another ninja version (the system's,
# or the main venv's on an activated PATH) reads the build as out of date and compiles
# it again.
VENV_ABS="$(cd "$VENV" && pwd)"
PATH="$VENV_ABS/bin:$PATH" TORCH_EXTENSIONS_DIR="$VENV_ABS/torch_extensions" "$VENV/bin/python" -W ignore -c 'import sglang.srt.managers.cache_controller, raykv.integrations.sglang
from sglang.srt.mem_cache.utils import get_storage_hash_str
print("sglang venv ok:", get_storage_hash_str(list(range(32)), None, page_size=16)[0][:12])'
echo "$stamp" > "$VENV/.raykv-built"
