"""The public plugin API: ``llmgw.plugin`` has every name it promises, built-in plugins take those names from it,
and the tier base class needs only ``pick``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmgw.plugin as api
from llmgw.router.replica import Replica

PLUGINS = Path(api.__file__).parent / "plugins"


def test_every_exported_name_exists():
    assert all(getattr(api, name, None) is not None for name in api.__all__)


def test_built_in_plugins_take_public_names_from_the_public_api():
    public = set(api.__all__)
    found = []
    for path in sorted(PLUGINS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module not in ("plugin", "llmgw.plugin") \
                    and (node.level or (node.module or "").startswith("llmgw")):
                found += [f"{path.name}: {alias.name} from {node.module}" for alias in node.names
                          if alias.name in public]
    assert found == []


def test_a_replica_is_a_replica_view():
    assert isinstance(Replica(name="a", model="m", url="http://127.0.0.1:1"), api.Replica)


async def test_a_tier_needs_only_pick_and_inherits_no_op_hooks():
    class Minimal(api.RoutingTier):
        async def pick(self, request, candidates):
            return api.Decision(candidates[0])

    tier = Minimal()
    replica = Replica(name="a", model="m", url="http://127.0.0.1:1")
    request = api.RouteRequest("m", "/v1/completions", {"model": "m", "prompt": "x"})
    decision = await tier.pick(request, [replica])
    tier.routed(request, decision)
    tier.first_token(request, decision, 0.1)
    tier.attempt_failed(request, decision, "connect")
    tier.finished(request, decision, None)
    assert tier.explain(request, [replica]) is None
    assert Minimal.check_options({"anything": 1}) == []
    assert tier.wants_usage is False and tier.engine_metrics_interval is None

    class NoPick(api.RoutingTier):
        pass

    with pytest.raises(TypeError):
        NoPick()
