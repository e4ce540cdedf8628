"""``llmgw reload``: make a running ``llmgw serve`` re-read its config file (``POST /admin/reload``).

Prints what the reload changed; a refused reload (an invalid file, one that
has no YAML document or removes every model and deployment, one that empties
``admin_tokens``) changes nothing and exits 1 with the reason. ``--allow-empty``
confirms a reload that removes everything (docs/cluster.md#reload).
"""

from __future__ import annotations

import argparse
import json
import sys

from .control_api import DEFAULT_CONTROL, ControlApiError, add_arguments, request_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw reload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default=DEFAULT_CONTROL,
                        help=f"the control listener of llmgw serve (default {DEFAULT_CONTROL})")
    parser.add_argument("--allow-empty", action="store_true",
                        help="apply a file with no YAML document, or a config that removes every model and "
                             "deployment (refused without it: a file being written looks so)")
    parser.add_argument("--json", action="store_true", help="print the admin API's JSON answer")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")
    add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    url = f"{args.control.rstrip('/')}/admin/reload" + ("?allow_empty=true" if args.allow_empty else "")
    try:
        answer = request_json("POST", url, args, args.timeout)
    except ControlApiError as exc:
        print(f"llmgw reload: not applied (the running config is kept): {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else f"reloaded: {answer['summary']['description']}")
    return 0
