"""The pure plan of an emulated multi-host cluster (``lab.host_plan``): addresses
stay inside raykv's private subnet, names fit Linux's 15 characters, a subnet in use
here is never taken, and the commands shape both ends of a link."""

import ipaddress

import pytest
from raykv_lab.host_plan import (
    SUBNETS,
    HostPlan,
    choose_index,
    format_rate,
    index_of,
    parse_rate,
)


def test_rates_parse_as_tc_writes_them():
    assert parse_rate("10gbit") == 10 * 10**9
    assert parse_rate("100Mbit") == 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert format_rate(parse_rate("25gbit")) == "25gbit"
    assert format_rate(2_500_000_000) == "2500mbit"
    for bad in ("10", "fast", "10gb", "-1gbit", "500kbit", "1000gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_addresses_stay_in_the_private_subnet_and_names_fit():
    plan = HostPlan(255, 32, parse_rate("1gbit"))
    addresses = [plan.address(h) for h in range(32)]
    assert len(set(addresses)) == 32
    assert all(ipaddress.ip_address(a) in plan.subnet for a in addresses)
    assert plan.subnet.subnet_of(SUBNETS)
    assert plan.address(0) == "10.213.255.1" and plan.netns(0) is None
    assert plan.netns(31) == "rkvh255-31"
    assert all(len(n) <= 15 for n in (plan.bridge, *plan.veth(31)))
    assert plan.exec_prefix(0) == [] and plan.exec_prefix(2)[:3] == ["ip", "netns", "exec"]
    with pytest.raises(ValueError):
        plan.address(32)
    with pytest.raises(ValueError):
        plan.veth(0)
    with pytest.raises(ValueError):
        HostPlan(0, 33)


def test_every_command_names_only_this_clusters_devices_and_addresses():
    plan = HostPlan(7, 3, parse_rate("10gbit"))
    ours = {plan.bridge, *plan.veth(1), *plan.veth(2), plan.netns(1), plan.netns(2), "lo"}
    for cmd in plan.setup_commands():
        assert cmd[0] in ("ip", "tc")
        for word in cmd:
            if word.startswith("10."):
                assert ipaddress.ip_interface(word).network == plan.subnet
            if word.startswith("rkvh"):
                assert word in ours
    shaped = [c for c in plan.setup_commands() if "tbf" in c]
    assert len(shaped) == 4  # both ends of both links
    assert all("10gbit" in c for c in shaped)


def test_unshaped_links_and_link_state():
    plan = HostPlan(0, 2)
    assert not any("tbf" in c for c in plan.setup_commands())
    unshape = plan.unshape_commands(1)
    assert [c[c.index("dev") + 1] for c in unshape] == list(plan.veth(1))
    assert all(c[c.index("qdisc") + 1] == "del" for c in unshape)
    assert unshape[1][:4] == ["ip", "netns", "exec", plan.netns(1)]
    down = plan.link_commands(1, up=False)
    assert [c[-1] for c in down] == ["down", "down"]
    assert {c[-2] for c in down} == set(plan.veth(1))


def test_a_subnet_or_bridge_in_use_is_never_chosen():
    assert choose_index([], ["192.0.2.0/24", "0.0.0.0/0"]) == 0
    assert choose_index(["rkvh0", "eth0"], []) == 1
    assert choose_index([], ["10.213.0.0/23"]) == 2
    with pytest.raises(RuntimeError):
        choose_index([], ["10.0.0.0/8"])


def test_names_of_ours_are_recognised():
    assert index_of("rkvh3") == 3
    assert index_of("rkvh3-12") == 3
    assert index_of("rkvh3-12r") == 3
    assert index_of("eth0") is None
    assert index_of("rkvhx") is None
