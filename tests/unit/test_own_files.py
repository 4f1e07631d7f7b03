"""What a restarting node actor reads from ``/dev/shm`` never stalls or steers it: a FIFO
or a link planted under a pool record's name or the standalone ``mooncake_client``
record's is skipped at once (a blocking open of a FIFO used to hang the actor's
constructor; the client record used to be read through links and from any owner), and
records are replaced atomically, never written through what lies at their path.
(tests/integration/test_restart_metadata.py: a real actor restarted over planted files.)
"""

import contextlib
import glob
import json
import os
import threading

import pytest
from raykv.cache_actors.node.client_supervisor import (
    ClientRecord,
    read_record,
    record_path,
    stop_recorded,
)
from raykv.cache_actors.node.own_files import read_own_file, write_own_file
from raykv.cache_actors.node.pool_records import PoolRecords

DEADLINE_S = 10.0  # generous: a non-blocking open returns in microseconds


@pytest.fixture
def prefix(shm_prefix):
    return shm_prefix


def release(fifo: str) -> None:
    """Give a reader blocked on ``fifo`` its end of file (a writer that opens and closes)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def finishes(fn, fifo: str):
    """``fn()``'s result if it returns within ``DEADLINE_S``; fails the test otherwise
    (and then unblocks it through ``fifo``)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    blocked = thread.is_alive()
    while thread.is_alive():
        release(fifo)
        thread.join(0.1)
    assert not blocked, f"blocked on the FIFO {fifo}"
    return out.get("v")


def test_a_planted_fifo_record_is_skipped_without_blocking(prefix):
    records = PoolRecords(prefix, "embedded")
    fifo = records.path("x")
    os.mkfifo(fifo, 0o600)
    assert finishes(lambda: list(records.trusted()), fifo) == []
    assert os.path.exists(fifo)  # not a regular file: left where it is, never read


def test_a_planted_fifo_or_link_as_client_record_is_ignored_at_once(prefix, tmp_path):
    path = record_path(prefix)
    os.mkfifo(path, 0o600)
    assert finishes(lambda: read_record(path), path) is None
    os.unlink(path)
    target = tmp_path / "record"
    target.write_text(json.dumps({"pid": os.getpid(), "port": 1234, "start_ticks": 1}))
    os.symlink(target, path)
    assert read_record(path) is None  # a link is never followed
    # stop_recorded removes what it cannot trust and signals nothing
    assert finishes(lambda: stop_recorded(prefix), path) == []
    assert not os.path.lexists(path)


@pytest.mark.parametrize("text", [
    "", "{", "[]", '{"pid": 1, "port": 2}', '{"pid": "1", "port": 2, "start_ticks": 3}',
    '{"pid": 1, "port": 70000, "start_ticks": 3}', '{"pid": -1, "port": 2, "start_ticks": 3}',
    '{"pid": true, "port": 2, "start_ticks": 3}',
    '{"pid": 1, "port": 2, "start_ticks": 3, "cmd": "x"}', "x" * 5000,
])
def test_a_client_record_that_is_not_exactly_a_record_is_ignored(prefix, text):
    path = record_path(prefix)
    write_own_file(path, text.encode())
    assert read_record(path) is None


def test_a_client_record_others_may_write_is_ignored(prefix):
    path = record_path(prefix)
    write_own_file(path, json.dumps({"pid": 1, "port": 2, "start_ticks": 3}).encode())
    assert read_record(path) == ClientRecord(1, 2, 3)
    os.chmod(path, 0o622)
    assert read_record(path) is None
    if os.getuid() == 0:  # another user's record (only root can make one here)
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
        assert read_record(path) is None


def test_read_own_file_refuses_what_is_not_this_uids_small_regular_file(prefix):
    path = f"/dev/shm/{prefix}f"
    write_own_file(path, b"abc")
    assert read_own_file(path, "f", 3) == b"abc"
    with pytest.raises(ValueError, match="larger than 2 bytes"):
        read_own_file(path, "f", 2)
    os.chmod(path, 0o602)
    with pytest.raises(ValueError, match="writable by group or others"):
        read_own_file(path, "f", 3)
    with pytest.raises(FileNotFoundError):
        read_own_file(path + "-gone", "f", 3)


def test_writes_replace_a_planted_link_or_fifo_never_write_through_it(prefix, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    link = f"/dev/shm/{prefix}link"
    os.symlink(target, link)
    write_own_file(link, b"new")
    assert target.read_bytes() == b"keep"
    assert read_own_file(link, "record", 16) == b"new"
    fifo = f"/dev/shm/{prefix}fifo"
    os.mkfifo(fifo, 0o600)
    finishes(lambda: write_own_file(fifo, b"new"), fifo)  # an open for writing would block
    assert read_own_file(fifo, "record", 16) == b"new"
    assert oct(os.stat(fifo).st_mode & 0o777) == "0o600"
    assert not glob.glob(f"/dev/shm/{glob.escape(prefix)}*.tmp")
