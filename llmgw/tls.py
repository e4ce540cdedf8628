"""TLS contexts built from llmgw's trust options: one place for upstream replicas, the agent link and listeners.

Client side (an ``https://`` replica, a ``wss://`` control plane): certificate
and host name verification on by default against the system trust store, or
a CA file; an optional client certificate and key for mutual TLS; and an
explicit ``verify=False`` that the caller must log loudly. Server side (the
data and control listeners): a certificate chain and key, and optionally a CA
whose certificates clients must present.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsClientOptions:
    """How to trust a server: ``ca_file`` (default: the system store), an mTLS pair, or no verification."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True


def client_context(options: TlsClientOptions | None = None) -> ssl.SSLContext:
    """A context for connecting to a TLS server; ``OSError``/``ssl.SSLError`` when a file cannot be used."""
    options = options or TlsClientOptions()
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if not options.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if options.cert_file:
        context.load_cert_chain(options.cert_file, options.key_file)
    return context


def server_context(cert_file: str, key_file: str | None = None, client_ca_file: str | None = None,
                   alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    """A context for a listener; with ``client_ca_file`` every client must present a certificate it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client must not make the server redo handshakes (CPU)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(cafile=client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def describe_tls_error(exc: BaseException) -> str:
    """A one-line reason for a failed handshake, naming the certificate problem when there is one."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verification failed: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc}"
    return str(exc)
