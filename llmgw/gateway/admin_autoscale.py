"""``GET /admin/autoscale``: the leader's autoscaled deployments (bounds, counts, signals, recent decisions).

The leader answers from its control plane's autoscaler (:meth:`llmgw.autoscale.actuator.Autoscaler.describe`);
a process that does not lead answers ``leading: false`` with the leader's control URL it knows, where the
answer is (``llmgw status`` follows it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import jsonify

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .app import Gateway


def autoscale_json(gateway: "Gateway") -> dict[str, Any]:
    control = gateway.control
    if control is None:
        holder = (gateway.shared.leader_holder if gateway.shared is not None else None) or {}
        return {"leading": False, "leader": holder.get("control_url") or None, "deployments": {}}
    if control.scale is None:
        return {"leading": True, "deployments": {}}
    return {"leading": True, **control.scale.describe(control)}


def register_autoscale_routes(app: "QuartTrio", gateway: "Gateway") -> None:
    @app.get("/admin/autoscale")
    async def autoscale():
        """Per autoscaled deployment: min, max, desired, ready, starting, draining, its signals and decisions."""
        return jsonify(autoscale_json(gateway))
