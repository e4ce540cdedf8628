"""/admin/usage's query: parameters read within bounds or refused naming the parameter; rows grouped and summed."""

from __future__ import annotations

import csv
import io

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.tenancy.usage import FIELDS, UsageRow, zero
from llmgw.tenancy.usage_query import (
    MAX_HOURS,
    PARAMETERS,
    QueryError,
    UsageQuery,
    parse_query,
    query_json,
    summarize,
    to_csv,
)

NOW = 1_796_000_400 + 1800.0  # half past a UTC hour
HOUR = 1_796_000_400


def counts(**values: int) -> list[int]:
    row = zero()
    for name, value in values.items():
        row[FIELDS.index(name)] = value
    return row


def test_defaults_are_the_last_day_grouped_by_key_and_model():
    query = parse_query({}, now=NOW)
    assert query.until == HOUR + 3600
    assert query.since == HOUR + 3600 - 24 * 3600
    assert query.group_by == ("key", "model")
    assert query.format == "json"


MIDNIGHT = HOUR - 3600  # 2026-11-30T00:00Z


@pytest.mark.parametrize("text, expected", [
    ("1796000400", HOUR),
    ("1796001000", HOUR),  # rounded down to its hour
    ("2026-11-30", MIDNIGHT),  # a date: UTC midnight
    ("2026-11-30T00:30Z", MIDNIGHT),
    ("2026-11-30T01:30+01:00", MIDNIGHT),
    ("2h", MIDNIGHT - 3600),  # a duration ago: NOW is 01:30, two hours before is 23:30 the day before
])
def test_since_is_epoch_seconds_iso_8601_or_a_duration_ago(text, expected):
    assert parse_query({"since": text, "until": str(HOUR + 48 * 3600)}, now=NOW).since == expected


def test_until_is_rounded_up_to_an_hour():
    assert parse_query({"since": str(HOUR - 3600), "until": str(HOUR + 1)}, now=NOW).until == HOUR + 3600
    assert parse_query({"since": str(HOUR - 3600), "until": str(HOUR)}, now=NOW).until == HOUR


@pytest.mark.parametrize("params, param", [
    ({"since": "yesterday"}, "since"),
    ({"until": "soon"}, "until"),
    ({"since": str(HOUR + 7200), "until": str(HOUR)}, "since"),
    ({"since": "0"}, "since"),  # longer than MAX_HOURS
    ({"group_by": "key,user"}, "group_by"),
    ({"group_by": "key,key"}, "group_by"),
    ({"format": "xml"}, "format"),
    ({"team": "t" * 300}, "team"),
    ({"limit": "3"}, "limit"),
    ({"since": "9" * 12}, "since"),
])
def test_a_wrong_parameter_is_refused_naming_it(params, param):
    with pytest.raises(QueryError) as caught:
        parse_query(params, now=NOW)
    assert caught.value.param == param


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*PARAMETERS, "other"]), st.text(max_size=40)))
def test_any_parameters_parse_or_are_refused_with_a_query_error(params):
    try:
        query = parse_query(params, now=NOW)
    except QueryError as exc:
        assert exc.param in params
        return
    assert query.since < query.until
    assert (query.until - query.since) // 3600 <= MAX_HOURS
    assert query.since % 3600 == 0 and query.until % 3600 == 0
    assert set(query.group_by) <= {"key", "team", "model", "class", "hour"}


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=2000))
def test_any_moment_text_parses_or_is_refused(text):
    try:
        parse_query({"since": text, "until": str(HOUR)}, now=NOW)
    except QueryError as exc:
        assert exc.param in ("since", "until")


ROWS = [
    (UsageRow("k-1", "alice", "search", "tiny", HOUR), counts(requests=2, input_tokens=100, output_tokens=10,
                                                              nano_usd=500)),
    (UsageRow("k-1", "alice", "search", "big", HOUR), counts(requests=1, input_tokens=10, output_tokens=1,
                                                             nano_usd=5000)),
    (UsageRow("k-1", "alice", "search", "tiny", HOUR - 3600), counts(requests=1, input_tokens=1, output_tokens=1)),
    (UsageRow("k-2", "bob", "", "tiny", HOUR), counts(requests=4, input_tokens=1000, output_tokens=100,
                                                      refused_rate=3)),
]


def query(**options) -> UsageQuery:
    return UsageQuery(since=HOUR - 3600, until=HOUR + 3600, **options)


def test_rows_are_grouped_and_summed_the_largest_spender_first():
    answer = summarize(ROWS, query(group_by=("team",)))
    assert [(item["team"], item["requests"], item["nano_usd"]) for item in answer] == [("search", 4, 5500),
                                                                                      ("", 4, 0)]
    assert answer[0]["usd"] == pytest.approx(5.5e-6)


def test_filters_match_a_key_by_id_or_name_a_team_a_model_and_the_range():
    assert {i["model"] for i in summarize(ROWS, query(key="alice", group_by=("model",)))} == {"tiny", "big"}
    assert summarize(ROWS, query(key="k-2", group_by=("key",)))[0]["key_name"] == "bob"
    assert summarize(ROWS, query(team="", group_by=("key",)))[0]["key_id"] == "k-2"
    by_hour = summarize(ROWS, UsageQuery(since=HOUR, until=HOUR + 3600, model="tiny", group_by=("hour",)))
    assert [(i["hour"], i["requests"]) for i in by_hour] == [("2026-11-30T01:00:00Z", 6)]


def test_json_carries_the_total_and_csv_one_line_per_group():
    q = query(group_by=("key",))
    items = summarize(ROWS, q)
    answer = query_json(items, q)
    assert answer["total"]["requests"] == 8 and answer["total"]["refused_rate"] == 3
    lines = list(csv.reader(io.StringIO(to_csv(items, q.group_by))))
    assert lines[0] == ["key_id", "key_name", *FIELDS, "usd"]
    assert [line[0] for line in lines[1:]] == ["k-1", "k-2"]
    assert lines[1][-1] == "0.000005500"


def test_csv_cells_that_a_spreadsheet_would_run_as_formulas_are_quoted():
    rows = [(UsageRow("k-3", "=HYPERLINK(1)", "", "tiny", HOUR), counts(requests=1))]
    q = query(group_by=("key",))
    assert "'=HYPERLINK(1)" in to_csv(summarize(rows, q), q.group_by)


def test_the_cli_asks_what_its_flags_say_and_prints_a_table_with_a_total():
    from llmgw.commands.usage import build_parser, query_string, usage_table

    args = build_parser().parse_args(["--team", "", "--since", "24h", "--group-by", "team"])
    assert query_string(args) == "team=&since=24h&group_by=team"
    q = query(group_by=("team",))
    lines = usage_table(query_json(summarize(ROWS, q), q))
    assert lines[0] == "usage from 2026-11-30T00:00:00Z to 2026-11-30T02:00:00Z"
    assert lines[1].split()[:3] == ["team", "requests", "input"]
    assert lines[2].split()[:2] == ["search", "4"] and lines[3].split()[:3] == ["(no", "team)", "4"]
    assert lines[-1].split()[:2] == ["total", "8"]


def test_sheds_of_one_class_are_told_apart_from_the_answers_of_another():
    """Team search's batch class shed 300 times while its interactive class was served: grouped by team and
    class, filtered by class (\"\" for requests that did not go through the queue), and in the CLI's table."""
    rows = [*ROWS,
            (UsageRow("k-1", "alice", "search", "tiny", HOUR, "batch"), counts(refused_rate=300)),
            (UsageRow("k-1", "alice", "search", "tiny", HOUR, "interactive"), counts(requests=20, answers_2xx=20))]
    q = query(group_by=("team", "class"))
    answer = {(i["team"], i["class"]): (i["requests"], i["refused_rate"]) for i in summarize(rows, q)}
    assert answer == {("search", "batch"): (0, 300), ("search", "interactive"): (20, 0), ("search", ""): (4, 0),
                      ("", ""): (4, 3)}
    assert parse_query({"class": "batch", "group_by": "team,class"}, now=NOW).priority == "batch"
    batch = summarize(rows, query(priority="batch", group_by=("key",)))
    assert [(i["key_name"], i["refused_rate"]) for i in batch] == [("alice", 300)]
    assert sum(i["requests"] for i in summarize(rows, query(priority="", group_by=("key",)))) == 8
    with pytest.raises(QueryError) as wrong:
        parse_query({"class": "x" * 300}, now=NOW)
    assert wrong.value.param == "class"

    from llmgw.commands.usage import build_parser, query_string, usage_table
    args = build_parser().parse_args(["--class", "batch", "--group-by", "team,class"])
    assert query_string(args) == "class=batch&group_by=team%2Cclass"
    lines = usage_table(query_json(summarize(rows, q), q))
    assert lines[1].split()[:3] == ["team", "class", "requests"]
    assert ["search", "batch", "0"] in [line.split()[:3] for line in lines]
    assert ["search", "(no", "class)", "4"] in [line.split()[:4] for line in lines]
