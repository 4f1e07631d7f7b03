"""Reading a process's listening TCP sockets from /proc and telling which reach further
than allowed (``cache_actors.listeners``): the check raykv runs on Mooncake's servers at
start. Parsing is checked on rows in the kernel's format; ``listeners`` on sockets this
test process opens (no traffic is sent anywhere)."""

import os
import socket

from raykv.cache_actors.listeners import (
    Listener,
    addresses_of,
    exposed,
    listeners,
    parse_tcp_table,
)

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  " \
         "timeout inode\n"


def row(local: str, state: str, inode: int) -> str:
    return (f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
            f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n")


def test_parse_reads_listening_rows_of_the_given_inodes():
    text = HEADER + row("0100007F:1F90", "0A", 11) + row("00000000:0050", "0A", 12) \
        + row("0100007F:1F91", "01", 13) + row("020200C0:01BB", "0A", 14)
    assert parse_tcp_table(text) == [Listener("127.0.0.1", 8080), Listener("0.0.0.0", 80),
                                     Listener("192.0.2.2", 443)]
    assert parse_tcp_table(text, {12, 13}) == [Listener("0.0.0.0", 80)]  # 13: established


def test_parse_reads_ipv6_rows_and_maps_ipv4_mapped_addresses():
    wildcard = "0" * 32
    loopback6 = "00000000000000000000000001000000"
    mapped = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1
    text = HEADER + row(f"{wildcard}:3A98", "0A", 1) + row(f"{loopback6}:3A99", "0A", 2) \
        + row(f"{mapped}:3A9A", "0A", 3)
    assert parse_tcp_table(text) == [Listener("::", 15000), Listener("::1", 15001),
                                     Listener("127.0.0.1", 15002)]


def test_exposed_flags_wildcards_and_other_addresses():
    found = [Listener("127.0.0.1", 1), Listener("0.0.0.0", 2), Listener("::", 3),
             Listener("10.0.0.5", 4), Listener("10.0.0.6", 5)]
    assert exposed(found, {"127.0.0.1"}) == found[1:]
    assert exposed(found, {"127.0.0.1", "10.0.0.5"}) == [found[1], found[2], found[4]]
    assert str(Listener("::", 3)) == "[::]:3" and str(found[1]) == "0.0.0.0:2"
    assert addresses_of("127.0.0.1") == {"127.0.0.1"}
    assert "127.0.0.1" in addresses_of("localhost")


def test_listeners_of_this_process_are_found_by_their_sockets():
    narrow, wide = socket.socket(), socket.socket()
    try:
        narrow.bind(("127.0.0.1", 0))
        wide.bind(("0.0.0.0", 0))
        narrow.listen()
        wide.listen()
        found = listeners(os.getpid())
        ours = {Listener("127.0.0.1", narrow.getsockname()[1]),
                Listener("0.0.0.0", wide.getsockname()[1])}
        assert ours <= set(found)
        assert exposed(ours, {"127.0.0.1"}) == [Listener("0.0.0.0", wide.getsockname()[1])]
    finally:
        narrow.close()
        wide.close()
