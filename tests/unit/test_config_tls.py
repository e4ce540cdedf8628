"""TLS keys of the config file: ``upstream_tls``, ``models[].replicas[].tls_*`` and ``data_tls``.

Files are real PEM files from a test CA (``trustme``); every mistake is a
``file:line: key: message`` error found when the config is checked, not at the
first request.
"""

from __future__ import annotations

import textwrap

import pytest
import trustme

from llmgw.config import ConfigError, parse_config
from llmgw.config.tls import replica_tls_options
from llmgw.tls import TlsClientOptions


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    """Paths of: ca, a server cert+key in one file, a client cert and its key apart, another key, garbage."""
    base = tmp_path_factory.mktemp("pem")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(base / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(base / "server.pem"))
    client = ca.issue_cert("client")
    client.cert_chain_pems[0].write_to_path(str(base / "client.crt"))
    client.private_key_pem.write_to_path(str(base / "client.key"))
    ca.issue_cert("other").private_key_pem.write_to_path(str(base / "other.key"))
    (base / "garbage.pem").write_text("not a certificate\n")
    return {path.stem + path.suffix.replace(".pem", ""): str(path) for path in base.iterdir()}


def load(text: str):
    return parse_config(textwrap.dedent(text), "conf.yaml", env={})


def one_replica(keys: str = "", top: str = "", url: str = "https://127.0.0.1:9001") -> str:
    """A config whose first lines are ``top`` and whose one replica has ``url`` and ``keys`` (one per line)."""
    replica = "".join(f"\n    {line}" for line in keys.splitlines())
    return f"{top}models:\n- name: m\n  replicas:\n  - url: {url}{replica}\n"


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text)
    return [str(issue) for issue in caught.value.errors]


def test_replica_keys_override_upstream_tls_key_by_key(pem):
    config = load(f"""\
        upstream_tls:
          ca_file: {pem['ca']}
          cert_file: {pem['client.crt']}
          key_file: {pem['client.key']}
        models:
          - name: m
            replicas:
              - url: https://127.0.0.1:9001
              - url: https://127.0.0.1:9002
                tls_verify: false
                tls_cert_file: {pem['server']}
    """)
    first, second = config.models[0].replicas
    assert replica_tls_options(first, config.upstream_tls) == TlsClientOptions(
        ca_file=pem["ca"], cert_file=pem["client.crt"], key_file=pem["client.key"], verify=True)
    # its own certificate comes with its own key (here: in the same file), never with the default's key
    assert replica_tls_options(second, config.upstream_tls) == TlsClientOptions(
        ca_file=pem["ca"], cert_file=pem["server"], key_file=None, verify=False)


def test_defaults_verify_against_the_system_store():
    config = load("models:\n  - name: m\n    replicas:\n      - url: https://example.com\n")
    assert replica_tls_options(config.models[0].replicas[0], config.upstream_tls) == TlsClientOptions()
    assert config.data_tls is None


def test_a_missing_file_names_file_line_and_key(tmp_path):
    missing = tmp_path / "nope.pem"
    assert errors(one_replica(f"tls_ca_file: {missing}")) == [
        f"conf.yaml:5: models[0].replicas[0].tls_ca_file: no such file: {missing} (relative paths start in the "
        "directory llmgw runs in)"]


def test_tls_keys_on_a_plain_http_url_are_an_error(pem):
    assert errors(one_replica("tls_verify: false", url="http://127.0.0.1:9001")) == [
        "conf.yaml:5: models[0].replicas[0].tls_verify: only applies to an https:// url"]


def test_a_key_without_a_certificate_is_an_error(pem):
    top = f"upstream_tls:\n  key_file: {pem['client.key']}\n"
    assert errors(one_replica(f"tls_key_file: {pem['client.key']}", top)) == [
        "conf.yaml:2: upstream_tls.key_file: needs cert_file: the key belongs to a client certificate",
        "conf.yaml:7: models[0].replicas[0].tls_key_file: needs tls_cert_file: the key belongs to a client certificate"]


def test_a_key_that_does_not_match_its_certificate_is_found_at_check_time(pem):
    (problem,) = errors(one_replica(f"tls_cert_file: {pem['client.crt']}\ntls_key_file: {pem['other.key']}"))
    assert problem.startswith("conf.yaml:5: models[0].replicas[0].tls_cert_file: cannot be used for TLS: ")
    assert "KEY_VALUES_MISMATCH" in problem.upper()


def test_a_ca_file_that_is_not_pem_is_reported_at_upstream_tls(pem):
    (problem,) = errors(one_replica(top=f"upstream_tls:\n  ca_file: {pem['garbage']}\n"))
    assert problem.startswith("conf.yaml:2: upstream_tls.ca_file: cannot be used for TLS: ")


def test_data_tls(pem):
    config = load(f"data_tls:\n  cert_file: {pem['server']}\n")
    assert config.data_tls.cert_file == pem["server"] and config.data_tls.key_file is None
    config.data_tls.context()  # builds
    (problem,) = errors(f"data_tls:\n  cert_file: {pem['client.crt']}\n")  # no key anywhere
    assert problem == ("conf.yaml:2: data_tls.cert_file: cannot be used for TLS: no PEM certificate with its "
                       "private key could be read from it")
    assert errors("data_tls: {}\n") == ["conf.yaml:1: data_tls.cert_file: missing required key"]


def test_every_mistake_is_reported_once_and_none_breaks_the_check(tmp_path, pem):
    missing = tmp_path / "nope.pem"
    top = f"upstream_tls:\n  ca_file: {missing}\ndata_tls:\n  cert_file: {pem['garbage']}\n"
    found = errors(one_replica(f"tls_key_file: {pem['client.key']}", top))
    assert [problem.split(": ")[1] for problem in found] == [
        "upstream_tls.ca_file", "data_tls.cert_file", "models[0].replicas[0].tls_key_file"]
