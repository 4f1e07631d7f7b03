"""The same-node channel on its own: replies, errors by kind, concurrent callers, the
socket's mode, and a clear retryable error once the server is gone."""

import os
import stat
import threading

import pytest

from cache_actors.local_channel import ChannelClient, ChannelClosedError, ChannelServer


def bad(_):
    raise ValueError("bad offset 7")


def broken():
    raise KeyError("internal")


@pytest.fixture
def server(tmp_path):
    srv = ChannelServer(str(tmp_path / "node.sock"), {
        "echo": lambda *a: a, "bad": bad, "broken": broken,
        "thread": threading.get_ident})
    yield srv
    srv.close()


def test_replies_and_errors(server):
    client = ChannelClient(server.path)
    assert client.call("echo", 1, ["k"], {"x": 2}) == (1, ["k"], {"x": 2})
    with pytest.raises(ValueError, match="bad offset 7"):
        client.call("bad", 0)
    with pytest.raises(RuntimeError, match="broken failed in the node actor: KeyError"):
        client.call("broken")
    assert client.call("echo", "still serving") == ("still serving",)
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    client.close()


def test_each_thread_has_its_own_connection(server):
    client = ChannelClient(server.path)
    names: list[int] = []
    threads = [threading.Thread(target=lambda: names.append(client.call("thread")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(set(names)) == 4  # four server threads, one per connection
    client.close()


def test_a_closed_server_is_a_clear_connection_error(server):
    client = ChannelClient(server.path)
    assert client.call("echo", 1) == (1,)
    server.close()
    with pytest.raises(ChannelClosedError):
        client.call("echo", 2)
    with pytest.raises(ChannelClosedError, match="cannot reach the node actor"):
        ChannelClient(server.path)
