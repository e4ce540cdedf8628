"""``llmgw usage``: usage per key, team, model, priority class and hour from a running gateway's
``GET /admin/usage``, as a table or CSV.

Filters and grouping are the API's (docs/tenants.md, "Watching usage"): ``--key``, ``--team``, ``--model``,
``--class``, ``--since``, ``--until``, ``--group-by``; ``--csv`` prints CSV (for a spreadsheet), ``--json`` the
API's answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from typing import Any

from ..tenancy.usage_query import to_csv
from .control_api import DEFAULT_CONTROL, ControlApiError, add_arguments, get_json
from .status import table

NO_TEAM = "(no team)"  # the team column of keys of no team
NO_CLASS = "(no class)"  # the class column of requests that did not go through the gateway's queue
_NONE_SHOWN = {"team": NO_TEAM, "class": NO_CLASS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw usage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default=DEFAULT_CONTROL,
                        help=f"the control listener of llmgw serve (default {DEFAULT_CONTROL})")
    parser.add_argument("--key", help="one key: its id (cfg-NAME, k-...) or its name")
    parser.add_argument("--team", help="one team ('' for keys of no team)")
    parser.add_argument("--model", help="one model")
    parser.add_argument("--class", dest="priority",
                        help="one priority class ('' for requests that did not go through the gateway's queue)")
    parser.add_argument("--since", help="from: epoch seconds, an ISO 8601 date or time (UTC), or a duration ago "
                                        "such as 24h (default: 24h)")
    parser.add_argument("--until", help="to (exclusive), as --since (default: the end of this hour)")
    parser.add_argument("--group-by", default="key,model",
                        help="a comma-separated list of key, team, model, class, hour (default key,model)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    output.add_argument("--json", action="store_true", help="print the admin API's JSON")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")
    add_arguments(parser)
    return parser


def query_string(args: argparse.Namespace) -> str:
    params = {"key": args.key, "team": args.team, "model": args.model, "class": args.priority, "since": args.since,
              "until": args.until, "group_by": args.group_by}
    return urllib.parse.urlencode({name: value for name, value in params.items() if value is not None})


def usage_table(answer: dict[str, Any]) -> list[str]:
    """The groups as a table: who, requests, tokens, money, answers by class and refusals."""
    group_by = [str(part) for part in answer.get("group_by") or []]
    who = [column for part in group_by for column in (["key_id", "key_name"] if part == "key" else [part])]
    headers = [*who, "requests", "input", "cached", "output", "usd", "2xx", "4xx", "5xx", "429 rate", "429 quota",
               "403"]
    fields = ["requests", "input_tokens", "cached_tokens", "output_tokens", "usd", "answers_2xx", "answers_4xx",
              "answers_5xx", "refused_rate", "refused_quota", "refused_model"]
    rows: list[list[Any]] = []
    total = {**dict.fromkeys(who, ""), **(answer.get("total") or {})}
    for item in [*(answer.get("data") or []), total]:
        row = [_NONE_SHOWN[column] if column in _NONE_SHOWN and item.get(column) == "" and item is not total
               else item.get(column) for column in who] + [item.get(field, 0) for field in fields]
        row[len(who) + 4] = f"{float(row[len(who) + 4] or 0):.6f}"
        rows.append(row)
    rows[-1][0] = "total"
    lines = table(headers, rows)
    return [f"usage from {answer.get('since')} to {answer.get('until')}", *lines]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.control.rstrip("/") + "/admin/usage?" + query_string(args)
    try:
        answer = get_json(url, args, args.timeout)
    except ControlApiError as exc:
        print(f"llmgw usage: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.csv:
        sys.stdout.write(to_csv(answer.get("data") or [], tuple(answer.get("group_by") or ())))
    else:
        print("\n".join(usage_table(answer)))
    return 0
