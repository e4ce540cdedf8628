"""Each gateway's figures per model in its load report (``f``, signed in ``g``): arrivals, first tokens within the
TTFT SLO, output in flight, trusted drain rates. Decoded bounded, read by a reader of the version before as if
absent, absent from a report of that version without harm (None: it says nothing), never forged onto a report an
honest gateway signed, and small."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.cluster import records
from llmgw.cluster.load import NO_FIGURES, LoadSharing
from llmgw.cluster.records import ModelFigures, RecordError
from llmgw.gateway.load_figures import PeerDrainsOf
from llmgw.testing.load_reports import load_sharing, report_of

LIMITS = records.LoadLimits(frozenset({"r1"}), 2.0, 10_000)
FIGURES = ModelFigures(entered=120, ttft_within=40, ttft_seen=50, output_inflight=2048, drains=((0, 1500), (2, 90)))


def test_figures_round_trip_clamped_to_known_models_and_their_bounds():
    raw = records.encode_load_figures({"m": FIGURES, "ghost": FIGURES})
    assert records.decode_load_figures({"f": raw}, {"m"}) == {"m": FIGURES}
    forged = records.pack([["m", 1 << 60, 1 << 30, 7, -5, [[-1, 1 << 40]]]])
    assert records.decode_load_figures({"f": forged}, {"m"}) == {
        "m": ModelFigures(records.MAX_FIGURES_COUNTER, 7, 7, 0, ((0, records.MAX_FIGURES_RATE),))}
    assert records.decode_load_figures({}, {"m"}) is None  # a report of the version before: nothing said
    for malformed in (records.pack([["m", 1, 2, 3, 4]]), records.pack([["m", 1, 2, 3, "4", []]]),
                      records.pack([["m", 1, 2, 3, 4, [[0, 1.5]]]]),
                      records.pack([["m", 1, 2, 3, 4, [[0, 1]] * (records.MAX_FIGURES_BANDS + 1)]]), b"\xc1"):
        with pytest.raises(RecordError):
            records.decode_load_figures({"f": malformed}, {"m"})


def test_many_models_stay_within_the_bytes_a_reader_takes_and_one_model_is_a_few_dozen_bytes():
    many = {("x" * 1000) + str(i): ModelFigures(entered=i + 1) for i in range(5000)}
    raw = records.encode_load_figures(many)
    assert len(raw) <= records.MAX_FIGURES_BYTES
    assert records.decode_load_figures({"f": raw}, {("x" * 1000) + "4999"}) == {
        ("x" * 1000) + "4999": ModelFigures(entered=5000)}  # the most arrivals kept first
    assert len(records.encode_load_figures({"llama-3.1-8b": FIGURES})) <= 40


def test_a_reader_of_the_version_before_reads_a_report_with_figures():
    fields = {"o": b"gw-1", "x": b"2000", "l": records.pack([["r1", 3, 900, 600, 2, 120]]),
              "f": records.encode_load_figures({"m": FIGURES}), "g": b"sig"}
    assert records.decode_load_report(fields, LIMITS) == ("gw-1", 2.0, {"r1": (3, 900, 600, 2, 120)})


packable = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=10)
                        | st.binary(max_size=10), lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@settings(max_examples=300)
@given(f=st.one_of(st.binary(max_size=60), packable.map(records.pack),
                   st.lists(st.tuples(st.sampled_from(["m", "x"]), *[st.integers(-(1 << 63), (1 << 64) - 1)] * 4,
                                      st.lists(st.tuples(st.integers(-(1 << 63), (1 << 64) - 1),
                                                         st.integers(-(1 << 63), (1 << 64) - 1)), max_size=3)),
                            max_size=3).map(lambda items: records.pack([[*i[:5], [list(b) for b in i[5]]]
                                                                        for i in items]))))
def test_any_figures_field_decodes_bounded_or_is_a_record_error(f):
    try:
        figures = records.decode_load_figures({"f": f}, {"m"})
    except RecordError:
        return
    assert figures is not None and set(figures) <= {"m"}
    for found in figures.values():
        assert 0 <= found.entered <= records.MAX_FIGURES_COUNTER
        assert 0 <= found.ttft_within <= found.ttft_seen <= records.MAX_FIGURES_FIRST_TOKENS
        assert 0 <= found.output_inflight <= records.MAX_REPLICA_FIGURE
        assert len(found.drains) <= records.MAX_FIGURES_BANDS
        assert all(0 <= rank <= records.MAX_FIGURES_RANK and 0 <= rate <= records.MAX_FIGURES_RATE
                   for rank, rate in found.drains)


def make_sharing(secret: bytes | None = None, origin: str = "gw-a") -> LoadSharing:
    return load_sharing(secret, origin, ("m", "n"))


async def sent_by(sharing: LoadSharing, figures: dict[str, ModelFigures] | None,
                  queued: dict[str, int] | None = None) -> dict[str, bytes]:
    if figures is not None:
        sharing.report_figures(lambda: figures)
    sharing.count_queued(lambda: queued or {}, 10_000)
    return await report_of(sharing)


@pytest.mark.parametrize("secret", [None, b"k" * 32])
async def test_a_peers_figures_reach_this_gateway_by_origin_and_its_drains_its_flow_queue(secret):
    sender, old, reader = make_sharing(secret, "gw-b"), make_sharing(secret, "gw-old"), make_sharing(secret)
    reader.take_reports([await sent_by(sender, {"m": FIGURES}, {"m": 9}), await sent_by(old, None)])
    # gw-old (the version before: no f) says nothing; gw-b said nothing of n, which is none.
    assert reader.peer_figures("m") == {"gw-b": FIGURES}
    assert reader.peer_figures("n") == {"gw-b": NO_FIGURES}
    drains = PeerDrainsOf(reader)
    assert drains.rates("m", 0) == [1500] and drains.rates("m", 2) == [90] and drains.rates("m", 1) == []
    assert drains.held("m") == [9]
    assert reader.peer_output("m") is None  # gw-old's output is not known: the room keeps its own mean
    del reader.peers["gw-old"]
    assert reader.peer_output("m") == 2048 and reader.peer_output("n") == 0
    reader.peers.clear()
    assert reader.peer_figures("m") == {}  # a peer expired: its figures with it


async def test_figures_forged_onto_a_signed_report_are_refused():
    sender, reader = make_sharing(b"k" * 32, "gw-b"), make_sharing(b"k" * 32)
    fields = await sent_by(sender, None)
    fields["f"] = records.encode_load_figures({"m": ModelFigures(drains=((0, 1),))})
    reader.take_reports([fields])
    assert reader.peer_figures("m") == {} and "gw-b" not in reader.peers
    assert reader.metrics.bad_records.labels("load")._value.get() == 1
    honest = await sent_by(sender, {"m": FIGURES})
    honest["g"] = b"\x00" * 32
    reader.take_reports([honest])
    assert reader.peer_figures("m") == {}
