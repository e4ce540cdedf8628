"""The requests each gateway holds per model, in its load report (``q``, signed in ``t``): decoded bounded, read
by a reader of the version before as if absent, absent from a report of that version without harm, and never
forged onto a report an honest gateway signed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.cluster import records
from llmgw.cluster.load import LoadSharing
from llmgw.cluster.records import RecordError
from llmgw.testing.load_reports import CapturedLink, load_sharing, report_of

LIMITS = records.LoadLimits(frozenset({"r1"}), 2.0, 10_000)


def test_held_requests_round_trip_clamped_to_known_models_and_to_what_a_gateway_holds():
    raw = records.encode_load_queued({"m": 12, "n": 0, "ghost": 3, "big": 1 << 50})
    assert records.decode_load_queued({"q": raw}, {"m", "big", "n"}, 10_000) == {"m": 12, "big": 10_000}
    assert records.decode_load_queued({}, {"m"}, 10_000) == {}  # a report of the version before
    with pytest.raises(RecordError):
        records.decode_load_queued({"q": records.pack([["m", "12"]])}, {"m"}, 10_000)
    with pytest.raises(RecordError):
        records.decode_load_queued({"q": b"\xc1"}, {"m"}, 10_000)


def test_many_models_held_stay_within_the_bytes_a_reader_takes():
    raw = records.encode_load_queued({("x" * 1000) + str(i): i + 1 for i in range(5000)})
    assert len(raw) <= records.MAX_QUEUED_BYTES
    held = records.decode_load_queued({"q": raw}, {("x" * 1000) + "4999"}, 10_000)
    assert held == {("x" * 1000) + "4999": 5000}  # the most held kept first


def test_a_reader_of_the_version_before_reads_a_report_with_held_requests():
    fields = {"o": b"gw-1", "x": b"2000", "l": records.pack([["r1", 3, 900, 600, 2, 120]]),
              "q": records.encode_load_queued({"m": 4}), "t": b"sig", "future": b"anything"}
    assert records.decode_load_report(fields, LIMITS) == ("gw-1", 2.0, {"r1": (3, 900, 600, 2, 120)})


packable = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=10)
                        | st.binary(max_size=10), lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@settings(max_examples=300)
@given(q=st.one_of(st.binary(max_size=60), packable.map(records.pack)))
def test_any_held_requests_field_decodes_bounded_or_is_a_record_error(q):
    try:
        held = records.decode_load_queued({"q": q}, {"m", ""}, 100)
    except RecordError:
        return
    assert set(held) <= {"m", ""} and all(0 <= n <= 100 for n in held.values())


async def sent_by(sharing: LoadSharing, queued: dict[str, int]) -> dict[str, bytes]:
    sharing.count_queued(lambda: queued, 10_000)
    return await report_of(sharing)


@pytest.mark.parametrize("secret", [None, b"k" * 32])
async def test_a_peers_held_requests_reach_this_gateway_and_wake_it(secret):
    sender, reader = load_sharing(secret, "gw-b"), load_sharing(secret)
    woken = []
    reader.watch(lambda: woken.append(1))
    reader.count_queued(lambda: {}, 50)
    reader.take_reports([await sent_by(sender, {"m": 7, "gone": 1})])
    assert reader.peer_queued("m") == [7] and woken
    reader.take_reports([await sent_by(sender, {"m": 70})])
    assert reader.peer_queued("m") == [50]  # at most what an honest gateway holds
    reader.take_reports([await sent_by(sender, {})])
    assert reader.peer_queued("m") == []  # its newest report holds none


async def test_held_requests_forged_onto_a_signed_report_are_refused():
    sender, reader = load_sharing(b"k" * 32, "gw-b"), load_sharing(b"k" * 32)
    fields = await sent_by(sender, {})
    fields["q"] = records.encode_load_queued({"m": 10_000})
    reader.take_reports([fields])
    assert reader.peer_queued("m") == [] and "gw-b" not in reader.peers
    assert reader.metrics.bad_records.labels("load")._value.get() == 1
    honest = await sent_by(sender, {"m": 3})
    honest["t"] = b"\x00" * 32
    reader.take_reports([honest])
    assert reader.peer_queued("m") == []


async def test_a_failing_count_of_held_requests_or_of_figures_still_lets_the_load_report_go(caplog):
    sharing = load_sharing()
    sharing.replicas.get("r1").local_inflight = 2

    def broken() -> dict:
        raise RuntimeError("the queue's count broke")

    link = CapturedLink()
    sharing.link = link
    sharing.count_queued(broken, 10_000)
    sharing.report_figures(broken)  # the figures per model (f, tests/unit/test_load_figures.py) likewise
    for _ in range(2):
        await sharing._send(sharing.own_load(), sharing.own_queued(), sharing.own_figures())
    assert len(link.sent) == 2 and b"q" not in link.sent[0] and b"f" not in link.sent[0]
    assert records.decode_load_report({k.decode(): v for k, v in link.sent[0].items()}, LIMITS)[2]["r1"][0] == 2
    assert sum("could not be counted" in r.message for r in caplog.records) == 2  # once for each source
