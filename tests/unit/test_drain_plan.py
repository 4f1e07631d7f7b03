"""What a drain may move: the room below the store's high watermark (before and after the
leaving segment goes), the hottest objects that fit, the store's usage as its master
reports it."""

from __future__ import annotations

import http.server
import threading

import pytest
from raykv.clusters.store_usage import StoreUsage, parse_store_usage, read_store_usage
from raykv.controllers.drain_plan import fitting, room, sole_on

MASTER_TEXT = """# HELP master_allocated_bytes Total allocated bytes
# TYPE master_allocated_bytes gauge
master_allocated_bytes 300
master_total_capacity_bytes 1000
segment_allocated_bytes{segment="10.0.0.1:123"} 200
segment_total_capacity_bytes{segment="10.0.0.1:123"} 500
segment_allocated_bytes{segment="10.0.0.2:456"} 100
segment_total_capacity_bytes{segment="10.0.0.2:456"} 500
master_value_size_bytes_bucket{le="4096.000000"} 1
"""


def test_room_is_the_tighter_of_before_and_after_the_segment_goes():
    # before: 950 - 300 = 650; after: 0.95 * 500 - (300 - 200) = 375
    assert room(1000, 300, 500, 200, 0.95) == 375
    # a leaving segment that holds nothing: after = 475 - 300 = 175 < before = 650
    assert room(1000, 300, 500, 0, 0.95) == 175
    # already past the watermark: no room, never a negative one
    assert room(1000, 980, 500, 480, 0.95) == 0
    # CONTROL: the bound before alone would let 650 bytes move, which pushes the store
    # past its watermark once the segment is gone (100 + 650 > 475)
    assert 0.95 * 1000 - 300 == 650 > room(1000, 300, 500, 200, 0.95)


@pytest.mark.parametrize("args", [(-1, 0, 0, 0), (10, 0, 11, 0), (10, 5, 10, 6),
                                  (10, 0, 0, 0, 0.0), (10, 0, 0, 0, 1.5), (10.0, 0, 0, 0)])
def test_room_refuses_sizes_that_cannot_be(args):
    with pytest.raises(ValueError):
        room(*args)


def test_fitting_takes_the_hottest_that_fit_and_drops_the_rest_never_making_room():
    ordered = [("hot", 60), ("big", 50), ("warm", 30), ("cold", 20)]
    choice = fitting(ordered, 100)
    assert choice.take == [("hot", 60), ("warm", 30)]  # big does not fit after hot
    assert choice.dropped == [("big", 50), ("cold", 20)]
    assert fitting(ordered, None).take == ordered and fitting(ordered, None).dropped == []
    assert fitting(ordered, 0).take == []
    with pytest.raises(ValueError):
        fitting(ordered, -1)
    with pytest.raises(ValueError):
        fitting([("x", -5)], 10)


def test_only_objects_on_the_leaving_segment_alone_are_candidates():
    keys = ["a", "b", "c", "d"]
    located = [("s1",), ("s1", "s2"), ("s2",), ()]
    assert sole_on(keys, located, "s1") == ["a"]


def test_the_masters_metrics_give_the_usage_and_the_room_of_a_segment():
    usage = parse_store_usage(MASTER_TEXT)
    assert usage == StoreUsage(1000, 300, {"10.0.0.1:123": (200, 500),
                                           "10.0.0.2:456": (100, 500)})
    assert usage.room_without("10.0.0.1:123", 0.95) == room(1000, 300, 500, 200, 0.95)
    assert usage.room_without("unknown:1", 0.95) == 650  # nothing leaves
    assert parse_store_usage("garbage\nmaster_allocated_bytes 3\n") is None


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the server's name)
        body = MASTER_TEXT.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_read_store_usage_over_http_and_none_when_unreadable():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert read_store_usage(url, 5.0).capacity == 1000
    finally:
        server.shutdown()
        server.server_close()
    assert read_store_usage(url, 0.5) is None  # nobody listens any more
    assert read_store_usage("not a url", 0.5) is None
