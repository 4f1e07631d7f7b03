"""Ray's auth mode and token, settled once before ``start_local`` starts Ray."""

from __future__ import annotations

import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from raykv.cache_actors import ray_auth_mode
from raykv.clusters import ray_auth


@pytest.fixture
def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A machine without a token and without a chosen mode, as this process's Ray sees
    it; afterwards this process's environment and Ray's cached view of it are as before
    (a later test in this worker may start Ray)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in (ray_auth_mode.MODE_VAR, ray_auth_mode.TOKEN_VAR,
                ray_auth_mode.TOKEN_PATH_VAR):
        monkeypatch.delenv(var, raising=False)
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray's cached view too (an earlier test may have joined)
    AuthenticationTokenLoader.instance().reset_cache()
    yield tmp_path / ".ray" / "auth_token"
    monkeypatch.undo()
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def test_settle_chooses_token_mode_and_makes_a_private_token(fresh_home: Path) -> None:
    import os

    assert ray_auth.settle() == "token"
    assert os.environ[ray_auth_mode.MODE_VAR] == "token"
    token = fresh_home.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(fresh_home.stat().st_mode) == 0o600
    assert ray_auth.settle() == "token" and fresh_home.read_text() == token  # kept


def test_a_mode_the_environment_names_is_kept(fresh_home: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ray_auth_mode.MODE_VAR, "disabled")
    assert ray_auth.settle() == "disabled"
    assert not fresh_home.exists()


def test_racing_writers_agree_on_one_token(fresh_home: Path) -> None:
    """Eight starters at once on a machine without a token: exactly one token is
    written, and it is the one every starter reads afterwards."""
    start = threading.Barrier(8)
    won: list[str] = []

    def starter(i: int) -> None:
        start.wait()
        if ray_auth.create_once(fresh_home, f"{i:064x}"):
            won.append(f"{i:064x}")

    threads = [threading.Thread(target=starter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and fresh_home.read_text() == won[0]
    assert not [p for p in fresh_home.parent.iterdir() if p != fresh_home]  # no leftovers


def test_control_rays_own_writer_replaces_a_token_others_already_read(
        fresh_home: Path) -> None:
    """What two starters that both found no token do with Ray's own writer: the second
    replaces the token the first (and every process it started) already read."""
    from ray._private.authentication.authentication_token_setup import (
        generate_and_save_token,
    )

    generate_and_save_token()
    first = fresh_home.read_text()
    generate_and_save_token()
    assert fresh_home.read_text() != first
    assert not ray_auth.create_once(fresh_home, "0" * 64)  # ours never replaces one


def _ray_mode() -> str:
    """The auth mode this process's Ray runs in (its cached config)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def test_join_mode_turns_token_mode_on_in_rays_cached_config(fresh_home: Path) -> None:
    """A process that imported Ray (an engine) and joins with a token at hand: Ray's own
    cached config runs in token mode afterwards, not only the environment."""
    import os

    import ray  # noqa: F401  (read the mode, as an engine's import does)

    assert _ray_mode() == "disabled" and ray_auth_mode.join_mode() is None  # no token
    assert ray_auth_mode.MODE_VAR not in os.environ
    ray_auth.create_once(fresh_home, "ab" * 32)
    assert ray_auth_mode.join_mode() == "token"
    assert os.environ[ray_auth_mode.MODE_VAR] == "token" and _ray_mode() == "token"


def test_join_mode_keeps_a_mode_given_or_named(fresh_home: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ray_auth.create_once(fresh_home, "ab" * 32)
    monkeypatch.setenv(ray_auth_mode.MODE_VAR, "disabled")
    assert ray_auth_mode.join_mode() == "disabled" and _ray_mode() == "disabled"
    assert ray_auth_mode.join_mode("token") == "token" and _ray_mode() == "token"


def test_control_the_environment_alone_leaves_rays_cached_mode(fresh_home: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """What ``join_ray`` did: ``RAY_AUTH_MODE=token`` set after Ray read its config; Ray
    still runs without a token (a token cluster refuses the join)."""
    import ray  # noqa: F401

    assert _ray_mode() == "disabled"
    monkeypatch.setenv(ray_auth_mode.MODE_VAR, "token")
    assert _ray_mode() == "disabled"
