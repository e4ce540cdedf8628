"""The status page, ``GET /ui`` on the control port: one self-contained HTML file (``status.html`` beside this
module, read once), answered with a Content-Security-Policy that allows only its own inline script and style.

The page holds no data: it asks for the admin token (or reads it once from the URL's ``#token=`` fragment, which
browsers never send), keeps it in ``sessionStorage`` and sends it as ``Authorization: Bearer`` with its
``fetch()`` calls to the ``/admin/*`` JSON endpoints, which check it as for any client (docs/security.md).
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

PAGE_FILE = "status.html"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.S)


@dataclass(frozen=True)
class StatusPage:
    body: bytes
    headers: dict[str, str]


def content_security_policy(html: str) -> str:
    """Only the page's own inline ``<script>`` and ``<style>`` (by their SHA-256), and fetches to its origin."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, text in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        hashes[tag].append(f"'sha256-{digest}'")
    return (f"default-src 'none'; script-src {' '.join(hashes['script'])}; style-src {' '.join(hashes['style'])}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@cache
def status_page() -> StatusPage:
    """The page and its headers, read from the package once."""
    html = resources.files(__package__).joinpath(PAGE_FILE).read_text(encoding="utf-8")
    return StatusPage(html.encode(), {
        "Content-Security-Policy": content_security_policy(html),
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
    })
