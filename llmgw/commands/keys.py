"""``llmgw keys`` and ``llmgw teams``: API keys and teams of a running gateway, over its control API.

``llmgw keys create NAME [--team T] [--model M]... [--rpm N] [--tpm N] [--concurrency N] [--budget
PERIOD:usd=X,tokens=N]...`` prints the new key once (the gateway keeps only its SHA-256); ``list``, ``update
ID|NAME`` (only what is given changes; ``none`` clears a limit) and ``revoke ID|NAME``. ``llmgw teams
create|list|update|delete`` likewise. Keys and teams reach every gateway of the cluster within a second
(docs/tenants.md#creating-and-revoking-keys).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from typing import Any

from .control_api import DEFAULT_CONTROL, ControlApiError, add_arguments, request_json
from .status import table

LIMITS = ("rpm", "tpm", "concurrency")


def limit_value(text: str) -> int | None:
    """A limit's value on the command line: a count, or ``none`` (unlimited)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or 'none'") from None


def budget_value(text: str) -> dict[str, Any]:
    """``PERIOD:usd=X,tokens=N`` -> ``{"period": PERIOD, "usd": X, "tokens": N}`` (the gateway checks the values)."""
    period, _, amounts = text.partition(":")
    budget: dict[str, Any] = {"period": period}
    for part in filter(None, amounts.split(",")):
        name, _, value = part.partition("=")
        try:
            budget[name] = {"usd": float, "tokens": int}[name](value)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(f"{part!r}: expected usd=DOLLARS or tokens=COUNT") from None
    return budget


def build_parser(kind: str = "keys") -> argparse.ArgumentParser:
    noun = "key" if kind == "keys" else "team"
    remove = "revoke" if noun == "key" else "delete"
    parser = argparse.ArgumentParser(prog=f"llmgw {kind}", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["create", "list", "update", remove],
                        help=f"create a {noun}; list every {noun} (the config's too); update one made by the admin "
                             f"API (only what is given changes); {remove} one" + (
                                 " (refused from the next request on every gateway)" if noun == "key" else
                                 " (one without keys)"))
    parser.add_argument("ref", nargs="?", help=f"create: the new {noun}'s name; update, {remove}: " + (
        "the key's id or name" if noun == "key" else "the team's name"))
    parser.add_argument("--control", default=DEFAULT_CONTROL,
                        help=f"the control listener of llmgw serve (default {DEFAULT_CONTROL})")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer (default 10)")
    parser.add_argument("--json", action="store_true", help="print the admin API's JSON answer")
    add_arguments(parser)
    if noun == "key":
        parser.add_argument("--team", help="its team ('none': no team)")
        parser.add_argument("--name", dest="new_name", help="update: a new name")
    parser.add_argument("--model", action="append", dest="models", metavar="MODEL",
                        help="a model it may use (repeat; default: every model)")
    parser.add_argument("--all-models", action="store_true", help="every model may be used")
    parser.add_argument("--priority", help="its priority class ('none': " + ("its team's)" if noun == "key" else
                                                                            "none)"))
    parser.add_argument("--priority-header", choices=("allow", "deny"), help="allow: its requests may raise their "
                        "class with the priority header (lowering it is always allowed)")
    for limit in LIMITS:
        parser.add_argument(f"--{limit}", type=limit_value, default=argparse.SUPPRESS,
                            help=f"{limit} limit ('none': unlimited)")
    parser.add_argument("--budget", action="append", type=budget_value, dest="budgets", metavar="PERIOD:AMOUNTS",
                        help="a budget, e.g. month:usd=250 or day:tokens=5000000,usd=10 (repeat; on update they "
                             "replace the budgets)")
    parser.add_argument("--no-budgets", action="store_true", help="no budgets")
    return parser


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The body of a create or update: only what the command line gives."""
    body: dict[str, Any] = {}
    if args.action == "create":
        body["name"] = args.ref
    if getattr(args, "new_name", None):
        body["name"] = args.new_name
    if getattr(args, "team", None) is not None:
        body["team"] = None if args.team.lower() == "none" else args.team
    if args.all_models:
        body["models"] = None
    elif args.models:
        body["models"] = args.models
    if args.priority is not None:
        body["priority"] = None if args.priority.lower() == "none" else args.priority
    if args.priority_header is not None:
        body["priority_header"] = args.priority_header == "allow"
    limits = {limit: getattr(args, limit) for limit in LIMITS if hasattr(args, limit)}
    if limits:
        body["limits"] = limits
    if args.no_budgets:
        body["budgets"] = []
    elif args.budgets:
        body["budgets"] = args.budgets
    return body


def _limits_text(item: dict[str, Any]) -> str:
    limits = [f"{name}={value}" for name, value in item["limits"].items() if value is not None]
    for budget in item["budgets"]:
        amounts = [f"${budget['usd']:g}" if budget["usd"] is not None else "",
                   f"{budget['tokens']} tokens" if budget["tokens"] is not None else ""]
        limits.append(f"{budget['period']}:" + "+".join(filter(None, amounts)))
    return " ".join(limits) or "-"


def _priority_text(item: dict[str, Any]) -> str:
    """Its class, and '+header' when its requests may raise it with the priority header."""
    return (item["priority"] or "-") + ("+header" if item.get("priority_header") else "")


def rows(kind: str, items: list[dict[str, Any]]) -> list[str]:
    if kind == "keys":
        return table(["ID", "NAME", "TEAM", "MODELS", "PRIORITY", "LIMITS", "SOURCE"], [
            [k["id"], k["name"], k["team"] or "-", ",".join(k["models"]) if k["models"] is not None else "*",
             _priority_text(k), _limits_text(k), k["source"]] for k in items])
    return table(["NAME", "MODELS", "PRIORITY", "LIMITS", "SOURCE"], [
        [t["name"], ",".join(t["models"]) if t["models"] is not None else "*", _priority_text(t),
         _limits_text(t), t["source"]] for t in items])


def run(kind: str, argv: list[str]) -> int:
    parser = build_parser(kind)
    args = parser.parse_args(argv)
    if args.action != "list" and not args.ref:
        parser.error(f"{args.action} needs the {kind[:-1]}'s " + (
            "name" if args.action == "create" or kind == "teams" else "id or name"))
    base = f"{args.control.rstrip('/')}/admin/{kind}"
    ref = urllib.parse.quote(args.ref or "", safe="")
    method, url, body = {"create": ("POST", base, None), "list": ("GET", base, None),
                         "update": ("PATCH", f"{base}/{ref}", None), "revoke": ("DELETE", f"{base}/{ref}", None),
                         "delete": ("DELETE", f"{base}/{ref}", None)}[args.action]
    if args.action in ("create", "update"):
        body = settings_of(args)
    try:
        answer = request_json(method, url, args, args.timeout, body)
    except ControlApiError as exc:
        print(f"llmgw {kind} {args.action}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.action == "list":
        print("\n".join(rows(kind, answer[kind])))
    elif args.action == "create" and kind == "keys":
        print(f"created key {answer['id']} ({answer['name']}); it is shown only this once:\n{answer['key']}")
    else:
        done = {"create": "created", "update": "updated", "revoke": "revoked", "delete": "deleted"}[args.action]
        print(f"{done} {kind[:-1]} {answer.get('id') or answer['name']}")
        if args.action in ("create", "update"):
            print("\n".join(rows(kind, [answer])))
    return 0


def main(argv: list[str]) -> int:
    return run("keys", argv)

