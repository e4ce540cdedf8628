"""``llmgw.testing``: the child-process runner, the Prometheus reader and the in-process gateway fixture."""

from __future__ import annotations

import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from llmgw.procgroup import group_has_running_members, process_start_time
from llmgw.testing import ChildFailed, free_port, metric_value, samples, series_sum, start_child
from llmgw.testing.sims import start_fake_upstream


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# A parent that starts a grandchild in its own process group, says where it "listens", then waits.
PARENT = python("""
    import signal, subprocess, sys, time
    if "ignore" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("grandchild", grandchild.pid)
    print("parent listening on http://127.0.0.1:9/", flush=True)
    time.sleep(60)
""")


def grandchild_of(child) -> int:
    return int(next(line for line in child.lines if line.startswith("grandchild ")).split()[1])


async def test_a_child_is_ready_on_its_line_and_stopping_it_stops_its_whole_group(nursery):
    child = await start_child(nursery, PARENT, name="parent")
    assert child.url == "http://127.0.0.1:9" and child.lines[-1].startswith("parent listening on ")
    grandchild = grandchild_of(child)
    assert group_has_running_members(child.pid)
    assert await child.stop() == -signal.SIGTERM
    assert child.exited.is_set()
    with trio.fail_after(5):
        while group_has_running_members(child.pid):  # the grandchild got the group's SIGTERM too
            await trio.sleep(0.02)
    assert process_start_time(grandchild) is None  # gone, or a zombie nobody reaped yet


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_when_its_nursery_is_cancelled():
    async with trio.open_nursery() as nursery:
        child = await start_child(nursery, PARENT + ["ignore"], name="stubborn", stop_grace=0.3)
        nursery.cancel_scope.cancel()
    assert child.returncode == -signal.SIGKILL


async def test_a_child_that_exits_before_it_is_ready_fails_with_its_output(nursery):
    with pytest.raises(ChildFailed, match=r"(?s)early exited with code 3 before it was ready:.*no luck"):
        await start_child(nursery, python("print('no luck'); raise SystemExit(3)"), name="early")


async def test_a_child_not_ready_by_its_deadline_fails_and_is_stopped(nursery):
    with pytest.raises(ChildFailed, match=r"(?s)slow was not ready within 0.5 s:.*starting"):
        await start_child(nursery, python("import time; print('starting', flush=True); time.sleep(60)"),
                          name="slow", startup_timeout=0.5, stop_grace=0.2)


async def test_ready_can_be_a_plain_substring_or_a_health_url(nursery):
    said = await start_child(nursery, python("print('all set'); import time; time.sleep(60)"), name="said",
                             ready="all set")
    assert said.announced_url is None and said.lines == ["all set"]
    port = free_port()
    argv = [sys.executable, "-m", "llmgw.testing.fake_upstream", "--port", str(port), "--name", "h"]
    healthy = await start_child(nursery, argv, name="healthy", ready=None,
                                health_url=f"http://127.0.0.1:{port}/health")
    assert healthy.returncode is None and healthy.announced_url is None


async def test_output_can_go_to_a_file_that_the_ready_line_is_read_from(nursery, tmp_path):
    log = tmp_path / "child.log"
    child = await start_child(nursery, python("print('one'); print('listening on http://127.0.0.1:7', flush=True);"
                                              "import time; time.sleep(60)"), name="logged", output_file=log)
    assert child.url == "http://127.0.0.1:7" and child.lines == []
    assert child.output() == "one\nlistening on http://127.0.0.1:7"


async def test_a_child_that_ends_after_it_was_ready_sets_its_exit_code(nursery):
    child = await start_child(nursery, python("print('listening on http://x:1'); print('bye')"), name="brief")
    assert await child.wait_exit() == 0 and child.lines == ["listening on http://x:1", "bye"]


METRICS = """# HELP llmgw_requests_total Requests.
# TYPE llmgw_requests_total counter
llmgw_requests_total{model="tiny",code="200"} 3.0
llmgw_requests_total{model="tiny",code="404"} 2.0
llmgw_requests_total{model="big",code="200"} 5.0
llmgw_requests_created{model="tiny",code="200"} 1.7e9
llmgw_requests_total_extra 9.0
llmgw_up 1.0
"""


def test_metric_value_matches_the_name_exactly_and_every_label_fragment():
    assert metric_value(METRICS, "llmgw_requests_total", 'code="404"') == 2.0
    assert metric_value(METRICS, "llmgw_requests_total", 'model="big",code="200"') == 5.0
    assert metric_value(METRICS, "llmgw_requests_total") == 3.0  # the first sample
    assert metric_value(METRICS, "llmgw_up") == 1.0
    assert metric_value(METRICS, "llmgw_requests") == 0.0  # a prefix is not a name
    assert metric_value(METRICS, "llmgw_requests_total", 'code="500"', default=None) is None
    assert series_sum(METRICS, "llmgw_requests_total") == 10.0
    assert series_sum(METRICS, "llmgw_requests_total", 'code="200"') == 8.0
    assert samples(METRICS)['llmgw_requests_total{model="tiny",code="404"}'] == 2.0 and len(samples(METRICS)) == 6


async def test_the_in_process_gateway_serves_requests_in_the_tests_own_nursery(nursery, gateway_in_process):
    upstream = await start_fake_upstream(nursery, "a", chunks=3)
    gw = await gateway_in_process(f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n"
                                  "        name: a\n")
    assert gw.url.startswith("http://127.0.0.1:") and gw.control_url.startswith("http://127.0.0.1:")
    response = await gw.chat("hi", max_tokens=2)
    assert response.status_code == 200 and response.headers["x-llmgw-replica"] == "a"
    assert response.headers["x-served-by"] == "a"
    assert await gw.metric("llmgw_requests_total", 'model="tiny",code="200"') == 1
    assert [r["name"] for r in (await gw.admin("/admin/replicas")).json()] == ["a"]
    assert "tiny" in gw.gateway.router.models  # the gateway's own objects, in this process


def test_no_test_module_imports_from_another_test_module_or_a_conftest():
    tests = Path(__file__).resolve().parents[1]
    modules = {path.stem for path in tests.rglob("*.py")}
    test_modules = {name for name in modules if name.startswith("test_")} | {"conftest"}
    offenders = [f"{path.relative_to(tests)}: {line.strip()}" for path in tests.rglob("*.py")
                 for line in path.read_text().splitlines()
                 if (match := re.match(r"\s*(?:from|import)\s+([\w.]+)", line))
                 and match.group(1).split(".")[-1] in test_modules]
    assert not offenders, "fixtures belong in conftest.py files:\n" + "\n".join(offenders)
