"""Run inside vLLM's own virtualenv: does vLLM's CLI accept each ``vllm serve`` command line?

Reads a JSON list of argv lists (``["vllm", "serve", MODEL, ...]``) on stdin and
prints a JSON list of ``{"ok": bool, "error": str}``. It builds the parser the
way ``vllm.entrypoints.cli.main`` does, parses, and runs the serve command's
own ``validate``; it never starts a server.
"""

import json
import sys

import vllm.entrypoints.cli.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


def check(argv: list[str]) -> dict:
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    commands = {}
    for command in serve.cmd_init():
        command.subparser_init(subparsers)
        commands[command.name] = command
    try:
        args = parser.parse_args(argv[1:])
        commands[args.subparser].validate(args)
    except SystemExit as exc:
        return {"ok": False, "error": f"argparse exit {exc.code}"}
    except Exception as exc:  # noqa: BLE001 - any rejection is reported, not raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "error": ""}


print(json.dumps([check(argv) for argv in json.load(sys.stdin)]))
