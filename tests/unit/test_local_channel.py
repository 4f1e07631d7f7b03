"""The same-node channel on its own: replies, errors by kind, concurrent callers, the
socket's mode, and a clear retryable error once the server is gone."""

import os
import stat
import threading

import pytest
from raykv.cache_actors.local_channel import ChannelClient, ChannelClosedError, ChannelServer


def bad(_):
    raise ValueError("bad offset 7")


def broken():
    raise KeyError("internal")


def later(reply, value):
    """An async op: answered from another thread, after the I/O thread moved on."""
    threading.Timer(0.05, reply, (value, None)).start()


def refuse(reply, value):
    raise ValueError(f"refused {value}")


@pytest.fixture
def server(tmp_path):
    together = threading.Barrier(4, timeout=5)
    srv = ChannelServer(str(tmp_path / "node.sock"), {
        "echo": lambda *a: a, "bad": bad, "broken": broken,
        "together": lambda: together.wait() is not None},
        async_handlers={"later": later, "refuse": refuse})
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
    """Four calls that return only once all four are in the server at the same time:
    each calling thread has its own connection, served concurrently."""
    client = ChannelClient(server.path)
    out: list[bool] = []
    threads = [threading.Thread(target=lambda: out.append(client.call("together")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert out == [True] * 4
    client.close()


@pytest.mark.parametrize("async_ops", [frozenset({"later", "refuse"}), frozenset()])
def test_async_ops_reply_later_and_many_callers_are_all_answered(server, async_ops):
    """Async ops on connections of their own (served by the I/O thread) or mixed with
    data ops on one connection per thread: every caller gets its own answer."""
    client = ChannelClient(server.path, async_ops=async_ops)
    with pytest.raises(ValueError, match="refused 3"):
        client.call("refuse", 3)
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: client.call("later", i)}))
               for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert out == {i: i for i in range(32)}
    assert client.call("echo", "after") == ("after",)
    client.close()


def test_a_data_op_on_an_async_connection_is_still_served(server):
    """A connection that began with an async op is read by the I/O thread; a data op
    sent on it later runs on a worker, never blocking that thread."""
    client = ChannelClient(server.path)
    assert client.call("later", 1) == 1        # this connection goes to the I/O thread
    assert client.call("echo", 2) == (2,)      # a data op on it
    with pytest.raises(RuntimeError, match="broken failed in the node actor"):
        client.call("broken")
    assert client.call("later", 3) == 3
    client.close()


def test_a_closed_server_is_a_clear_connection_error(server):
    client = ChannelClient(server.path)
    assert client.call("echo", 1) == (1,)
    server.close()
    with pytest.raises(ChannelClosedError):
        client.call("echo", 2)
    with pytest.raises(ChannelClosedError, match="cannot reach the node actor"):
        ChannelClient(server.path)
