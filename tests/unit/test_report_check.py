"""The one check of what a node reports (llmgw.control.report_check) and the engine-name rule (llmgw.config.names):
property tests that nothing it accepts can break what is built from it, and that nothing raises."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given, settings, strategies as st

from llmgw import wire
from llmgw.config.names import MAX_NAME, name_problem
from llmgw.control.report_check import MAX_GPUS, MAX_PID, MAX_RANK, ReportCheck, host_problem, is_own_host
from llmgw.router.replica import Replica

NODE = "10.20.30.40"
OWN_PORTS = (8000, 8001)
check = ReportCheck(OWN_PORTS)

hosts = st.one_of(st.just(NODE), st.just("127.0.0.1"), st.just("[::1]"), st.just("h"), st.just("[::1"),
                  st.text(max_size=20))
ports = st.one_of(st.integers(-5, 70000).map(str), st.text(max_size=6), st.just(""))
endpoints = st.one_of(
    st.builds(lambda scheme, host, port, path: f"{scheme}://{host}{':' if port is not None else ''}{port or ''}{path}",
              st.sampled_from(["http", "https", "HTTP", "ftp", ""]), hosts, st.one_of(st.none(), ports),
              st.sampled_from(["", "/", "/v1", "/x?y", "#f"])),
    st.text(max_size=60),
)


@settings(max_examples=500, deadline=None)
@given(endpoints)
def test_an_accepted_endpoint_builds_a_replica_on_the_nodes_address_off_the_gateways_ports(endpoint):
    problem = check.endpoint_problem(endpoint, NODE)
    if problem is None:
        replica = Replica(name="r", model="m", url=endpoint)  # raised "Port out of range" before the check
        assert replica.host == NODE and 1 <= replica.port <= 65535 and not replica.uses_tls
        assert replica.base_path == ""
    else:
        assert isinstance(problem, str) and problem


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:99999", "http://[::1", "http://h:abc", "http://h:0",
                                      "http://10.0.0.1:8000", "http://127.0.0.1:8000", "http://0.0.0.0:8001",
                                      "http://localhost:8000", "http://[::1]:8001", "http://[::ffff:127.0.0.1]:8000"])
def test_the_reported_attacks_are_refused(endpoint):
    assert check.endpoint_problem(endpoint, "127.0.0.1") is not None


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1", "0.0.0.0", "::ffff:127.0.0.1"])
def test_the_gateways_own_ports_are_refused_on_any_address_of_this_machine(address):
    host = f"[{address}]" if ":" in address else address
    for port in OWN_PORTS:
        assert "own listeners" in check.endpoint_problem(f"http://{host}:{port}", address)
    assert check.endpoint_problem(f"http://{host}:9000", address) is None


def test_a_gateway_port_on_another_machine_is_an_ordinary_engine_port():
    assert check.endpoint_problem("http://10.20.30.40:8000", NODE) is None  # not this machine's address
    assert check.endpoint_problem("http://127.0.0.1:9000", "127.0.0.1") is None
    assert check.endpoint_problem("http://[::1]:9000", "::1") is None


def test_an_address_of_this_machine_counts_as_its_own():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet: picks the interface a route would use
        assert is_own_host(probe.getsockname()[0])
    assert is_own_host("127.0.0.2") and is_own_host("::1") and is_own_host("localhost") and is_own_host("0.0.0.0")
    assert not is_own_host("192.0.2.1") and not is_own_host("example.invalid")


names = st.text(alphabet=st.characters(codec="ascii"), max_size=MAX_NAME + 2)


@settings(max_examples=500, deadline=None)
@given(st.one_of(names, st.text(max_size=40), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+-]{0,40}", fullmatch=True)))
def test_an_accepted_name_is_one_engine_argument(name):
    if name_problem(name) is None:
        assert 0 < len(name) <= MAX_NAME and not name.startswith("-")
        assert name.isascii() and name.isprintable() and not any(c.isspace() or c == "=" for c in name)
        assert "=" not in name and "\x00" not in name


@pytest.mark.parametrize("name", ["--served-model-name", "a b", "a=b", "-x", "", "a\nb", "é", "x" * (MAX_NAME + 1)])
def test_names_that_break_a_command_line_are_refused(name):
    assert name_problem(name) is not None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_host_problem_never_raises_and_accepts_only_hosts(host):
    if host_problem(host) is None:
        assert 0 < len(host) <= 253
        try:
            ipaddress.ip_address(host)
        except ValueError:
            assert all(c.isascii() and (c.isalnum() or c in "-_.") for c in host) and not host.startswith(("-", "."))


big = st.integers(-(1 << 70), 1 << 70)
reports = st.builds(
    wire.ShardReport,
    shard_id=st.one_of(st.just("s-g1-r0"), st.text(max_size=10)), replica_id=st.one_of(st.just("s"), st.text()),
    rank=big, node_count=big, state=st.sampled_from(wire.ShardState), reason=st.text(max_size=50), pid=big,
    http_port=big, endpoint=st.one_of(st.just(f"http://{NODE}:9000"), endpoints), fingerprint=st.text(max_size=5),
    generation=big, gpu_indices=st.lists(big, max_size=4), restarts=big, model=st.text(max_size=5),
    started_at=st.one_of(st.floats(allow_nan=True, allow_infinity=True), big),
    log_tail=st.lists(st.text(max_size=5), max_size=3),
)


@settings(max_examples=500, deadline=None)
@given(reports)
def test_an_accepted_report_builds_what_the_control_plane_builds_from_it(report):
    if check.shard_problem(report, NODE) is None:
        assert f"s/g{report.generation}/pid{report.pid}/{report.started_at:.3f}"  # DeployedReplicas' engine id
        assert 0 <= report.pid <= MAX_PID and 0 <= report.rank < MAX_RANK and 0 <= report.http_port <= 65535
        assert all(0 <= index < MAX_GPUS for index in report.gpu_indices) and report.generation >= 0
        if report.endpoint:
            Replica(name=report.replica_id, model=report.model or "m", url=report.endpoint)
        assert name_problem(report.shard_id) is None and name_problem(report.replica_id) is None


@settings(max_examples=200, deadline=None)
@given(st.builds(wire.Register, address=st.text(max_size=30), labels=st.dictionaries(st.text(max_size=3),
                                                                                      st.text(max_size=3))))
def test_register_problem_never_raises(register):
    problem = check.register_problem(register)
    assert problem is None or isinstance(problem, str)
