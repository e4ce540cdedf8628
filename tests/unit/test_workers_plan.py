"""What the ``--workers`` supervisor decides: the flags, each worker's command line, the private Redis's place,
and the config a worker runs with."""

from __future__ import annotations

import argparse
import sys

import pytest

from llmgw.commands.serve import build_parser
from llmgw.config import HostPort, parse_config
from llmgw.usererrors import UserError
from llmgw.workers.plan import (
    SECRET_ENV,
    SECRET_NAME,
    Plan,
    check_roles,
    default_state_dir,
    private_secret,
    redis_socket,
    worker_count,
)
from llmgw.workers.worker import with_private_state


def plan(**changes) -> Plan:
    options = dict(count=3, config_path="/etc/llmgw.yaml", listen=HostPort("0.0.0.0", 8000),
                   control_listen=HostPort("10.0.0.1", 8001), role="control", redis_url="unix:///s/redis.sock")
    return Plan(**{**options, **changes})


def test_workers_counts_from_one():
    assert worker_count("4") == 4 and worker_count("1") == 1
    for wrong in ("0", "-2", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            worker_count(wrong)


def test_worker_zero_controls_on_the_configured_address_and_the_others_follow_on_loopback():
    zero, one = plan().argv(0), plan().argv(1)
    assert zero[:4] == [sys.executable, "-m", "llmgw", "serve"]
    for argv in (zero, one):
        assert argv[argv.index("--config") + 1] == "/etc/llmgw.yaml"
        assert argv[argv.index("--listen") + 1] == "0.0.0.0:8000"  # one port for all
        assert argv[argv.index("--worker-state") + 1] == "unix:///s/redis.sock"
        assert "--workers" not in argv
    assert zero[zero.index("--role") + 1] == "control" and zero[zero.index("--worker") + 1] == "0"
    assert zero[zero.index("--control-listen") + 1] == "10.0.0.1:8001"
    assert one[one.index("--role") + 1] == "gateway" and one[one.index("--worker") + 1] == "1"
    assert one[one.index("--control-listen") + 1] == "127.0.0.1:0"


def test_the_other_flags_pass_through_and_a_configured_redis_adds_no_state_flag():
    argv = plan(redis_url=None, control_listen=None, stop_engines=True, log_level="debug", log_format="json",
                role="gateway").argv(0)
    assert "--worker-state" not in argv and "--control-listen" not in argv  # the config's control address
    assert argv[argv.index("--role") + 1] == "gateway"  # --role gateway --workers: all follow
    assert "--stop-engines" in argv and argv[argv.index("--log-level") + 1] == "debug"
    assert argv[argv.index("--log-format") + 1] == "json"
    assert plan(listen=HostPort("::1", 9000)).argv(2)[plan().argv(2).index("--listen") + 1] == "[::1]:9000"


def test_the_serve_parser_takes_the_workers_flags_and_hides_the_internal_ones(capsys):
    args = build_parser().parse_args(["--workers", "2", "--state-dir", "/x", "--worker", "1",
                                      "--worker-state", "unix:///x/redis.sock"])
    assert (args.workers, str(args.state_dir), args.worker, args.worker_state) == (2, "/x", 1, "unix:///x/redis.sock")
    assert build_parser().parse_args([]).workers == 1
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--workers", "0"])
    assert exited.value.code == 2 and "--workers: must be at least 1" in capsys.readouterr().err
    text = build_parser().format_help()
    assert "--workers N" in text and "--state-dir" in text
    assert "--worker-state" not in text and "--worker " not in text and "INDEX" not in text


def test_the_private_redis_lives_in_a_state_dir_per_port_with_a_socket_path_the_kernel_takes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir(8000) == tmp_path / "llmgw" / "workers" / "8000"
    assert redis_socket(tmp_path) == tmp_path / "redis.sock"
    with pytest.raises(UserError, match="over the 107 .*shorter folder"):
        redis_socket(tmp_path / ("d" * 100))


def test_a_worker_runs_on_the_private_redis_whatever_the_file_says_of_state():
    config = parse_config("state:\n  load_interval: 100ms\n  load_ttl: 1s\nlog_level: warning\n", filename="x.yaml")
    changed = with_private_state(config, "unix:///run/llmgw/redis.sock")
    assert not config.state.shared and changed.state.shared
    assert (changed.state.url, changed.state.cluster) == ("unix:///run/llmgw/redis.sock", "workers")
    assert changed.state.load_interval == 0.1 and changed.log_level == "warning"  # the rest as the file says
    assert changed.state.secret_env == SECRET_ENV  # signed with the supervisor's secret, from the environment
    with pytest.raises(ValueError):
        with_private_state(config, "http://not-redis")


def test_following_a_cluster_elsewhere_needs_its_redis():
    check_roles("control", shared=False)
    check_roles("gateway", shared=True)
    with pytest.raises(UserError, match="state.backend: redis"):
        check_roles("gateway", shared=False)


def test_the_private_clusters_secret_is_kept_in_the_state_dir_readable_by_its_owner_only(tmp_path):
    secret = private_secret(tmp_path)
    path = tmp_path / SECRET_NAME
    assert len(secret) == 64 and path.read_text() == secret and path.stat().st_mode & 0o777 == 0o600
    assert private_secret(tmp_path) == secret  # a restart keeps it
    path.chmod(0o644)  # others could read it: no longer a secret, a new one replaces it
    renewed = private_secret(tmp_path)
    assert renewed != secret and path.stat().st_mode & 0o777 == 0o600
    assert all(secret not in arg and renewed not in arg
               for arg in Plan(2, "/x.yaml", HostPort("127.0.0.1", 8000), None, "control", "unix:///r.sock").argv(1))
