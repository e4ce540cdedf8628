"""The overload decisions gateways share for each other's /admin/explain (llmgw/gateway/explain_shared.py): bounded
while Redis is away, signed over the request id, and a record read from Redis never believed, nor raising,
unless a gateway of the cluster signed it for that id."""

from __future__ import annotations

import json

import trio
from hypothesis import given, strategies as st
from prometheus_client import CollectorRegistry

from llmgw.cluster.records import Keys, Signer
from llmgw.flow.model import DEFAULT_CLASSES, FlowRequest, Shed
from llmgw.gateway.explain_shared import MAX_PENDING, SharedOutcomes
from llmgw.gateway.flow_gate import FlowOutcome


def shared(secret: bytes | None = b"cluster secret") -> SharedOutcomes:
    return SharedOutcomes(None, Keys("c"), Signer(secret), "gw-1", CollectorRegistry())  # type: ignore[arg-type]


def outcome(request_id: str = "r-1") -> FlowOutcome:
    request = FlowRequest("m", "team", DEFAULT_CLASSES[0], 120, 0.0)
    return FlowOutcome(request_id, request, Shed("unservable", 3, 0.0, "too much ahead", 7, 900, "interactive"),
                       1_800_000_000.0)


def stored(s: SharedOutcomes, request_id: str) -> bytes:
    """What the writer sets at ``request_id``'s key: its record, signed."""
    s.note(outcome(request_id))
    written_id, record = s._pending.pop()
    return s._signed(written_id, record)


def test_a_signed_record_is_read_back_with_the_gateway_that_wrote_it():
    s = shared()
    found = s._verified("r-1", stored(s, "r-1"))
    assert found == {**outcome().to_json(), "gateway": "gw-1"}
    assert s.key("r-1") == "llmgw:c:flow:explain:r-1"


def test_a_record_moved_to_another_id_or_made_up_or_signed_with_another_secret_is_refused():
    s = shared()
    assert s._verified("r-2", stored(s, "r-1")) is None  # the true record of r-1, moved to r-2
    made_up = json.dumps({"r": json.dumps({**outcome("r-3").to_json(), "reason": "overflow"}), "s": "00" * 32})
    assert s._verified("r-3", made_up.encode()) is None
    other = shared(b"another secret")
    assert s._verified("r-4", stored(other, "r-4")) is None
    assert shared(None)._verified("r-5", stored(shared(None), "r-5")) is not None  # no secret: nothing checked


@given(st.binary(max_size=600) | st.text(max_size=300).map(str.encode))
def test_whatever_redis_holds_is_refused_or_a_record_never_an_exception(raw):
    s = shared()
    assert s._verified("r-1", raw) is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                max_size=4), max_leaves=12))
def test_any_json_in_redis_is_refused_without_the_secret(value):
    s = shared()
    assert s._verified("r-1", json.dumps(value).encode()) is None
    assert s._verified("r-1", json.dumps({"r": json.dumps(value), "s": "ab" * 32}).encode()) is None


def test_while_redis_is_away_what_waits_to_be_written_stays_bounded():
    s = shared()
    for i in range(MAX_PENDING + 10):
        s.note(outcome(f"r-{i}"))
    assert len(s._pending) == MAX_PENDING and s._pending[0][0] == "r-10"
    assert s.written.labels("dropped")._value.get() == 10


async def test_notes_are_written_in_batches_off_the_requests_path(autojump_clock):
    class Link:
        def __init__(self):
            self.calls: list[int] = []

        async def call(self, operation, command, timeout=None):
            class Client:
                async def eval(self, script, keys, args):
                    return len(keys)
            self.calls.append(await command(Client()))

    link = Link()
    s = SharedOutcomes(link, Keys("c"), Signer(b"k"), "gw-1", CollectorRegistry())  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(s.run)
        for i in range(300):
            s.note(outcome(f"r-{i}"))  # no await: a request never waits on Redis
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert link.calls == [256, 44] and s.written.labels("written")._value.get() == 300
