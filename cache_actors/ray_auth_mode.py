"""Ray's token authentication as one process sees it: the mode (``RAY_AUTH_MODE``), where
its token is, and Ray's cached view of both.

Ray reads the mode and the token once and caches them (its ``RayConfig`` when ``ray`` is
imported, its token loader at first use). A process that sets ``RAY_AUTH_MODE`` after
that, as an engine does (vLLM and SGLang import Ray long before raykv joins), still runs
in the mode Ray read: its ``ray.init`` then fails against a cluster that ``ray start``
made with a token (``InvalidAuthToken``, after Ray's connect retries). ``use_mode`` sets
the mode and refreshes both caches, so the next ``ray.init`` of this process, and every
process it starts, uses it; ``join_mode`` is the mode of a process that joins a running
cluster (an engine's, a ``raykv`` command's).
"""

from __future__ import annotations

import os
from pathlib import Path

MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"


def token_path() -> Path:
    """Where Ray reads its token from: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    named = os.environ.get(TOKEN_PATH_VAR)
    return Path(named) if named else Path.home() / ".ray" / "auth_token"


def token_available() -> bool:
    """Whether a Ray auth token is at hand: ``RAY_AUTH_TOKEN``, or a file at
    ``token_path()``."""
    return bool(os.environ.get(TOKEN_VAR)) or token_path().is_file()


def use_mode(mode: str) -> None:
    """Run this process's Ray in auth mode ``mode`` (``token``, ``disabled``) from now on:
    ``RAY_AUTH_MODE`` set (processes started later inherit it) and Ray's cached config
    and token read again. Call before ``ray.init``; a connected Ray keeps its mode."""
    os.environ[MODE_VAR] = mode
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def join_mode(auth_mode: str | None = None) -> str | None:
    """Settle the auth mode of this process before it joins a running Ray cluster
    (``ray.init(address=...)``) and return it (None: left to Ray, which then runs
    without a token): ``auth_mode`` when given; else ``RAY_AUTH_MODE`` when set; else
    ``token`` when a token is at hand (``token_available``). Ray's own ``ray.init``
    turns token mode on only for ``auto``; with an explicit address a process without
    it is refused by a cluster ``ray start`` made with a token (``InvalidAuthToken``),
    while a cluster without authentication accepts a process that sends one. The mode
    chosen is set with ``use_mode`` (Ray's cached config refreshed)."""
    mode = auth_mode or os.environ.get(MODE_VAR) or ("token" if token_available() else None)
    if mode:
        use_mode(mode)
    return mode
