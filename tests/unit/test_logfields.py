"""Log fields: a value can never be read back as more than one field, in text or in JSON."""

import json
import logging

from hypothesis import given, strategies as st

from llmgw.logfields import fields_extra, logfmt, logfmt_value
from llmgw.logsetup import JsonFormatter


def parse_logfmt(line: str) -> dict[str, str]:
    """Read ``key=value ...`` back as a log reader would: a value is a JSON string or runs to the next space."""
    fields: dict[str, str] = {}
    decoder = json.JSONDecoder()
    position = 0
    while position < len(line):
        equals = line.index("=", position)
        key = line[position:equals]
        position = equals + 1
        if line.startswith('"', position):
            value, position = decoder.raw_decode(line, position)
        else:
            end = line.find(" ", position)
            end = len(line) if end < 0 else end
            value, position = line[position:end], end
        assert key not in fields, f"{key} appears twice in {line!r}"
        fields[key] = value
        position += 1  # the space between fields
    return fields


KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


@given(st.dictionaries(KEYS, st.text(max_size=40), max_size=6))
def test_every_value_reads_back_as_exactly_its_field(fields):
    line = logfmt(fields)
    assert "\n" not in line and "\r" not in line
    assert parse_logfmt(line) == fields


def test_a_forged_field_stays_inside_its_value():
    line = logfmt({"request_id": "FAKE model=secret replica=evil status=200", "model": "tiny"})
    assert line == 'request_id="FAKE model=secret replica=evil status=200" model=tiny'
    assert parse_logfmt(line)["model"] == "tiny"


def test_plain_values_stay_as_they_are_and_none_is_a_dash():
    assert logfmt({"a": "sim-0", "b": 200, "c": 12.5, "d": None}) == "a=sim-0 b=200 c=12.5 d=-"
    assert logfmt_value("") == '""' and logfmt_value("\x85") == '"\\u0085"' and logfmt_value("é") == '"\\u00e9"'


def test_the_json_formatter_writes_fields_as_keys_without_replacing_its_own():
    fields = {"request_id": "r1", "status": 200, "message": "forged", "level": "forged"}
    record = logging.LogRecord("llmgw.access", logging.INFO, __file__, 1, "%s", (logfmt(fields),), None)
    for key, value in fields_extra(fields).items():
        setattr(record, key, value)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["request_id"] == "r1" and entry["status"] == 200
    assert entry["level"] == "info" and entry["message"] == logfmt(fields)
