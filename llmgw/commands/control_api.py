"""The CLI side of the control API: GET (or POST) a JSON document from ``llmgw serve``'s control listener.

Commands that use ``/admin/*`` (``llmgw status``, ``llmgw plan --control``, ``llmgw reload``)
take the admin token from ``--admin-token`` or, better (a flag shows in
``ps``), the ``LLMGW_ADMIN_TOKEN`` environment variable, and trust an
``https://`` control listener through the system store or ``--control-ca``.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

from ..tls import TlsClientOptions, client_context, describe_tls_error

ADMIN_TOKEN_ENV = "LLMGW_ADMIN_TOKEN"
DEFAULT_CONTROL = "http://127.0.0.1:8001"


class ControlApiError(Exception):
    """The control API could not be read: unreachable, refused, or not JSON (the message says which)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-token", metavar="TOKEN",
                        help=f"an admin token of the control API (default: ${ADMIN_TOKEN_ENV}, which unlike a flag "
                             "does not show in the process list)")
    parser.add_argument("--control-ca", metavar="FILE",
                        help="PEM CA file that signs an https:// control listener's certificate (default: the "
                             "system trust store)")


def get_json(url: str, args: argparse.Namespace, timeout: float) -> Any:
    """``GET url`` with the token and trust of ``args``; :class:`ControlApiError` with a one-line reason."""
    return request_json("GET", url, args, timeout)


def request_json(method: str, url: str, args: argparse.Namespace, timeout: float, body: Any = None) -> Any:
    """``method url`` as :func:`get_json`, with ``body`` as JSON (None: a POST has an empty body)."""
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = b"" if method == "POST" else None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    request = urllib.request.Request(url, headers=headers, method=method, data=data)
    try:
        context = client_context(TlsClientOptions(ca_file=args.control_ca)) if url.startswith("https:") else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            hint = ("the admin token was refused" if token else
                    f"the control API needs an admin token: pass --admin-token or set {ADMIN_TOKEN_ENV}")
            raise ControlApiError(f"{method} {url}: 401 Unauthorized: {hint}") from None
        raise ControlApiError(f"{method} {url}: {exc.code} {_error_message(exc)}") from None
    except (ssl.SSLError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        detail = describe_tls_error(reason) if isinstance(reason, ssl.SSLError) else str(reason)
        raise ControlApiError(f"{method} {url}: {detail}") from None
    except (OSError, ValueError) as exc:
        raise ControlApiError(f"{method} {url}: {exc}") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(exc)["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason or ""
