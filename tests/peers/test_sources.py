"""Fetching the engines' test files: a fetch that fails is a test failure with the way
to fix it (never a skip), and a file with the wrong checksum is refused."""

from __future__ import annotations

import pytest

from tests.peers import sources


def test_unreachable_index_fails_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens
    monkeypatch.delenv("RAYKV_PEER_VLLM_SDIST", raising=False)
    with pytest.raises(sources.PeerSourceError, match="RAYKV_PEER_VLLM_SDIST"):
        sources.vllm_sdist()
    assert not list((tmp_path / "raykv-peers").iterdir())  # no partial file left


def test_wrong_checksum_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / sources.VLLM_SDIST
    fake.write_bytes(b"not vLLM")
    monkeypatch.setenv("RAYKV_PEER_VLLM_SDIST", str(fake))
    with pytest.raises(sources.PeerSourceError, match="SHA-256"):
        sources.vllm_sdist()
    # control: the file's own checksum passes the same check
    monkeypatch.setattr(sources, "VLLM_SDIST_SHA256", sources._sha256(fake))
    assert sources.vllm_sdist() == fake
