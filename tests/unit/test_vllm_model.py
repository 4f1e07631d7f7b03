"""``make_llama`` makes a model once per machine and copies it after (no vLLM needed:
the build step is replaced by one that writes a marker and counts its calls)."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
from raykv_lab.engines import vllm_model
from raykv_lab.engines.vllm_model import LlamaDims, make_llama


def counting_build(calls: list[str]):
    def build(out: str, dims: LlamaDims, seed: int, want: dict) -> None:
        calls.append(out)
        Path(out, "weights.bin").write_bytes(bytes([seed]) * 64)
        Path(out, "raykv_dims.json").write_text(json.dumps(want))

    return build


def test_a_model_is_made_once_then_copied(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[str] = []
    monkeypatch.setattr(vllm_model, "_build", counting_build(calls))
    a = make_llama(str(tmp_path / "a"))
    b = make_llama(str(tmp_path / "b"))
    assert len(calls) == 1
    assert not filecmp.dircmp(a, b).diff_files and Path(b, "weights.bin").exists()
    # another seed or other dims: a model of its own
    make_llama(str(tmp_path / "c"), seed=1)
    make_llama(str(tmp_path / "d"), LlamaDims.of(128, 2))
    assert len(calls) == 3
    assert Path(tmp_path, "c", "weights.bin").read_bytes() == bytes([1]) * 64
    # nothing half-made is left in the cache
    assert not [p for p in Path(vllm_model.cache_root()).iterdir() if p.name.startswith(".")]


def test_a_failed_build_leaves_no_model_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def failing(out: str, dims: LlamaDims, seed: int, want: dict) -> None:
        Path(out, "weights.bin").write_bytes(b"half")
        raise RuntimeError("tokenizer failed")

    monkeypatch.setattr(vllm_model, "_build", failing)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        make_llama(str(tmp_path / "a"))
    assert list(Path(vllm_model.cache_root()).iterdir()) == []
    calls: list[str] = []
    monkeypatch.setattr(vllm_model, "_build", counting_build(calls))
    make_llama(str(tmp_path / "a"))
    assert len(calls) == 1
