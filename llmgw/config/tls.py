"""TLS keys of the config file: trust options for ``https://`` replicas, and a listener's certificate.

``upstream_tls`` (top level) is the default for every ``https://`` replica of
``models``; a replica's own ``tls_ca_file``, ``tls_cert_file``,
``tls_key_file`` and ``tls_verify`` override it key by key
(:func:`replica_tls_options`). ``data_tls`` gives the data-plane listener a
certificate. Files must exist when the config is checked, and the context
each replica or listener would use is built then, so a key that does not
match its certificate or a CA file that is not PEM is a ``file:line: key``
error, not a failure at the first request.
"""

from __future__ import annotations

import os
import ssl
from typing import TYPE_CHECKING, Annotated

from ..tls import TlsClientOptions, client_context, describe_tls_error, server_context
from .fields import Check, Located, config_class, issue_at, known, setting

if TYPE_CHECKING:
    from .reader import Draft


def _readable_file(path: str) -> str | None:
    if not path.strip():
        return "must not be empty"
    if not os.path.isfile(path):
        return f"no such file: {path} (relative paths start in the directory llmgw runs in)"
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied"
    return None


TlsFile = Annotated[str, Check(_readable_file)]  # a PEM file that exists and can be read


def _problem_with(build) -> str | None:
    """Why ``build()`` cannot make an SSL context from the files, or None."""
    try:
        build()
    except ssl.SSLError as exc:
        if exc.reason is None and "PEM lib" in str(exc):  # OpenSSL's only word for "no usable cert and key"
            return "cannot be used for TLS: no PEM certificate with its private key could be read from it"
        return f"cannot be used for TLS: {describe_tls_error(exc)}"
    except OSError as exc:
        return f"cannot be used for TLS: {exc.strerror or exc}"
    return None


@config_class
class UpstreamTls(Located):
    """How llmgw checks ``https://`` replicas by default: a CA file (else the system store), a client certificate."""

    ca_file: TlsFile | None = setting(None)  # PEM CA bundle that signs the replicas' certificates
    cert_file: TlsFile | None = setting(None)  # client certificate chain for mutual TLS
    key_file: TlsFile | None = setting(None)  # its private key (default: in cert_file)
    verify: bool = setting(True)  # false: no certificate or host name check (logged as a warning)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("cert_file", "key_file") and draft["key_file"] and not draft["cert_file"]:
            draft.problem("key_file", "needs cert_file: the key belongs to a client certificate")


@config_class
class ListenerTls(Located):
    """A listener's certificate chain and private key: it then serves HTTPS only."""

    cert_file: TlsFile = setting()  # PEM certificate chain, the server's own certificate first
    key_file: TlsFile | None = setting(None)  # its private key (default: in cert_file)

    def context(self) -> ssl.SSLContext:
        return server_context(self.cert_file, self.key_file)

    @classmethod
    def _finish(cls, draft: Draft) -> None:
        if draft.known("cert_file", "key_file"):
            problem = _problem_with(lambda: server_context(draft["cert_file"], draft["key_file"]))
            if problem:
                draft.problem("cert_file", problem)


REPLICA_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_verify")


def replica_tls_options(replica, defaults: UpstreamTls) -> TlsClientOptions:
    """The trust options of one ``models[].replicas[]`` entry: its own ``tls_*`` keys over ``upstream_tls``."""
    own_cert = replica.tls_cert_file is not None
    return TlsClientOptions(
        ca_file=replica.tls_ca_file if replica.tls_ca_file is not None else defaults.ca_file,
        cert_file=replica.tls_cert_file if own_cert else defaults.cert_file,
        key_file=replica.tls_key_file if own_cert else defaults.key_file,
        verify=replica.tls_verify if replica.tls_verify is not None else defaults.verify,
    )


def check_replica_tls(draft: Draft) -> None:
    """Rules for one replica's ``tls_*`` keys (run from its ``_finish``)."""
    if not draft.known("url", *REPLICA_TLS_KEYS):
        return
    written = [name for name in REPLICA_TLS_KEYS if draft[name] is not None]
    if written and not draft["url"].startswith("https://"):
        draft.problem(written[0], "only applies to an https:// url")
    if draft["tls_key_file"] and not draft["tls_cert_file"]:
        draft.problem("tls_key_file", "needs tls_cert_file: the key belongs to a client certificate")


def check_upstream_tls(draft: Draft) -> None:
    """Build the TLS context every ``https://`` replica will use, reporting files that do not make one."""
    from .schema import ExternalReplica, ModelConfig  # the schema imports this module

    if not draft.known("models", "upstream_tls"):
        return
    defaults = draft["upstream_tls"]
    if not known(defaults.ca_file, defaults.cert_file, defaults.key_file, defaults.verify):
        return  # a file of upstream_tls is reported already
    checked: dict[TlsClientOptions, str | None] = {}
    for model in draft["models"]:
        if not isinstance(model, ModelConfig) or not known(model.replicas):
            continue
        for replica in model.replicas:
            if not isinstance(replica, ExternalReplica) or not known(replica.url, *(getattr(replica, name) for name in
                                                                           REPLICA_TLS_KEYS)):
                continue
            if not replica.url.startswith("https://"):
                continue
            options = replica_tls_options(replica, defaults)
            if options not in checked:
                checked[options] = _problem_with(lambda: client_context(options))
            problem = checked[options]
            if problem:
                own = [name for name in REPLICA_TLS_KEYS[:3] if getattr(replica, name) is not None]
                target, key = (replica, own[0]) if own else (defaults, "ca_file")
                draft.add(issue_at(target, key, problem))
