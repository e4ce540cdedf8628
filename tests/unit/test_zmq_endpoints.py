"""Static replicas' KV-event endpoints in the config: ``tcp://HOST:PORT`` or an absolute ``ipc://`` path."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from llmgw.config import ConfigError, parse_config
from llmgw.config.addresses import IPC_PATH_MAX, parse_zmq_endpoint


def replica(events: str, replay: str) -> str:
    return (f"models:\n  - name: a\n    routing: kv_index\n    replicas:\n      - url: http://h:1\n"
            f"        kv_events: '{events}'\n        kv_replay: '{replay}'\n")


def test_an_ipc_socket_in_a_private_folder_is_accepted_as_is():
    config = parse_config(replica("ipc:///run/llmgw/e0.ev", "ipc:///run/llmgw/e0.rp"), filename="llmgw.yaml")
    (static,) = config.models[0].replicas
    assert (static.kv_events, static.kv_replay) == ("ipc:///run/llmgw/e0.ev", "ipc:///run/llmgw/e0.rp")
    assert parse_zmq_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


@pytest.mark.parametrize("endpoint, why", [
    ("ipc://relative/e.ev", "must be absolute"),
    ("ipc:///" + "p" * IPC_PATH_MAX, f"at most {IPC_PATH_MAX} bytes"),
    ("ipc:///run/e\n.ev", "control character"),
    ("tcp://*:5557", "cannot be '*'"),
    ("inproc://e", "expected a ZMQ endpoint"),
])
def test_endpoints_llmgw_cannot_connect_to_are_refused(endpoint, why):
    with pytest.raises(ValueError, match=why):
        parse_zmq_endpoint(endpoint)
    with pytest.raises(ConfigError, match="kv_events"):
        parse_config(replica(endpoint.replace("\n", "\\n"), "tcp://h:2").replace("'", '"'), filename="llmgw.yaml")


@given(st.one_of(st.text(max_size=130), st.text(max_size=130).map(lambda t: "ipc://" + t),
                 st.text(max_size=40).map(lambda t: "tcp://" + t)))
def test_any_text_is_an_endpoint_or_a_value_error(text):
    try:
        endpoint = parse_zmq_endpoint(text)
    except ValueError:
        return
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        assert path.startswith("/") and path.isprintable() and len(path.encode("utf-8", "surrogatepass")) <= 107
    else:
        assert endpoint.startswith("tcp://") and not endpoint.endswith(":0")
