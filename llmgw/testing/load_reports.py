"""A gateway's load sharing (llmgw/cluster/load.py) without Redis, for the tests of its reports: one replica ``r1``
of model ``m`` (and the other models named), and a link that keeps what would be written to the ``load`` stream."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..cluster import records
from ..cluster.load import LoadSharing
from ..cluster.metrics import ClusterMetrics
from ..router.model import TierModel
from ..router.replica import Replica
from ..router.replicas import STATIC, ReplicaSet


def load_sharing(secret: bytes | None = None, origin: str = "gw-a", models: tuple[str, ...] = ("m",)) -> LoadSharing:
    """A load sharing of ``origin`` signing with ``secret`` (None: none), its load_ttl 2 s, over ``models``."""
    replicas = ReplicaSet()
    for model in models:
        replicas.declare_model(STATIC, TierModel(model))
    replicas.add(Replica(name="r1", model=models[0], url="http://127.0.0.1:9000"))
    settings: Any = SimpleNamespace(load_ttl=2.0, load_interval=0.05)  # the StateConfig keys it reads
    link: Any = None  # nothing is read from Redis; report_of() puts a CapturedLink in to send
    return LoadSharing(link, records.Keys("c"), settings, replicas, ClusterMetrics(None, "gateway", "c", origin),
                       origin, records.Signer(secret), 10_000)


class CapturedLink:
    """A Redis link that keeps what is written to the load stream."""

    def __init__(self) -> None:
        self.sent: list[dict[bytes, bytes]] = []

    async def add_to_stream(self, operation: str, key: str, fields: dict[bytes, bytes], length: int) -> None:
        self.sent.append(fields)


async def report_of(sharing: LoadSharing) -> dict[str, Any]:
    """The fields of the report ``sharing`` sends now (its load, held requests and figures), as a reader gets them."""
    link = CapturedLink()
    sharing.link = link  # type: ignore[assignment]
    await sharing._send(sharing.own_load(), sharing.own_queued(), sharing.own_figures())
    return {name.decode(): value for name, value in link.sent[0].items()}
