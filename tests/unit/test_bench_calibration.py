"""The routing benchmark's calibration: decisions read from /admin/decisions rings, and their summary."""

from __future__ import annotations

from llmgw.bench.calibration import DecisionCollector, calibration, calibration_table, decision_row


def decision(i: int, outcome: str = "hit", estimated: float = 0.1, actual_ms: float = 120.0, **cost) -> dict:
    return {"at": 1000.0 + i, "request_id": f"r{i}", "replica": "sim-0", "outcome": outcome, "status": 200,
            "ttft_ms": actual_ms, "detail": {"cost": {"estimated_ttft_s": estimated, **cost}}}


def test_each_decision_is_kept_once_in_order_and_a_ring_that_turned_over_is_counted():
    collector = DecisionCollector([])
    collector.keep([decision(i) for i in reversed(range(3))], capacity=3)  # newest first
    collector.keep([decision(i) for i in reversed(range(1, 5))], capacity=4)  # 1 and 2 read before
    assert [row[2] for row in collector.decisions] == [0.12] * 5 and collector.lost == 0
    collector.keep([decision(i) for i in reversed(range(10, 14))], capacity=4)  # 5 to 9 fell out unread
    assert len(collector.decisions) == 9 and collector.lost == 1


def test_decisions_without_an_estimate_or_a_first_token_are_left_out():
    assert decision_row(decision(1, actual_ms=None)) is None  # type: ignore[arg-type]
    assert decision_row({**decision(1), "detail": {"matched_chars": 3}}) is None  # round_robin, rule scores
    assert decision_row({**decision(1), "status": 502}) is None
    row = decision(1, "cost_override", 0.2, 300.0, expected_gain_s=0.05, gain_uncertainty_s=0.02, uncertainty_s=0.01)
    row["detail"]["estimates"] = {"sim-0": 0.2, "sim-1": 0.3}
    assert decision_row(row) == ["cost_override", 0.2, 0.3, 0.01, 0.02, 0.05, {"sim-0": 0.2, "sim-1": 0.3}, "sim-0"]


def test_calibration_by_outcome_with_the_overrides_gain_beside_its_uncertainty():
    rows = [["hit", 0.1, 0.1 * k, None, None, None, None, "a"] for k in (0.5, 1.0, 1.0, 2.0)]
    rows += [["cost_override", 0.2, 0.4, 0.1, 0.03, 0.05, {}, "b"],
             ["cost_override", 0.2, 0.2, 0.1, 0.01, 0.03, {}, "b"]]
    summary = calibration(rows)
    assert list(summary) == ["cost_override", "hit", "all"]
    hit = summary["hit"]
    assert hit["decisions"] == 4 and hit["ratio_p50"] == 1.0 and hit["ratio_p90"] == 2.0
    assert abs(hit["mean_error_ms"] - 12.5) < 1e-9 and abs(hit["mean_abs_error_ms"] - 37.5) < 1e-9
    assert hit["mean_expected_gain_ms"] is None and hit["mean_estimate_uncertainty_ms"] is None  # before the gate
    over = summary["cost_override"]
    assert abs(over["mean_expected_gain_ms"] - 40) < 1e-9 and abs(over["mean_uncertainty_ms"] - 20) < 1e-9
    assert abs(over["mean_estimate_uncertainty_ms"] - 100) < 1e-9 and over["within_uncertainty"] == 0.5
    assert summary["all"]["decisions"] == 6
    workload = {"arms": {"kv_index": {"label": "kv_index", "calibration": {"8": summary}},
                         "vllm-router-cache_aware": {"label": "vllm-router cache_aware"}}}
    table = calibration_table(workload, ["8"])
    # ratios 2.0 and 1.0: the nearest-rank median of two is the upper one
    assert "| kv_index | 8 | cost_override | 2 | 2.00 | 2.00 | +100.0 | 100.0 | 100.0 | 0.50 | 40.0 | 20.0 |" in table
    assert calibration_table({"arms": {"x": {"label": "x"}}}, ["8"]) == []
