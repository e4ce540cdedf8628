"""The multipart ``model`` field finder: real forms (as httpx encodes them), hostile bytes, bounded work."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from llmgw.http.multipart import FormError, boundary_of, form_field


def encoded(data: dict, files: dict) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/v1/audio/transcriptions", data=data, files=files)
    return request.read(), request.headers["content-type"]


@given(model=st.text(min_size=1, max_size=100).filter(lambda s: "\r" not in s and "\n" not in s),
       audio=st.binary(max_size=2000), before=st.integers(0, 3))
@settings(max_examples=200, deadline=None)
def test_the_model_field_of_any_form_httpx_writes(model, audio, before):
    data = {f"field{i}": f"value{i}" for i in range(before)}
    data["model"] = model
    body, content_type = encoded(data, {"file": ("a.wav", audio, "audio/wav")})
    assert form_field(body, content_type, "model") == model


def test_a_form_without_the_field_and_bad_forms():
    body, content_type = encoded({"language": "en"}, {"file": ("a.wav", b"RIFF", "audio/wav")})
    assert form_field(body, content_type, "model") is None
    with pytest.raises(FormError):
        boundary_of("application/json")
    with pytest.raises(FormError):
        boundary_of("multipart/form-data")
    assert boundary_of('multipart/form-data; boundary="a b"') == "a b"
    with pytest.raises(FormError, match="longer than"):
        form_field(*encoded({"model": "m" * 2000}, {"file": ("a", b"x")}), "model")
    many = {f"f{i}": "v" for i in range(100)}
    many["model"] = "m"
    with pytest.raises(FormError, match="more than 64 parts"):
        form_field(*encoded(many, {"file": ("a", b"x")}), "model")


@given(body=st.binary(max_size=500), boundary=st.text(st.characters(min_codepoint=33, max_codepoint=126,
                                                                      exclude_characters='";'), min_size=1,
                                                      max_size=10))
@settings(max_examples=500, deadline=None)
def test_any_bytes_give_a_value_none_or_a_form_error(body, boundary):
    content_type = f"multipart/form-data; boundary={boundary}"
    try:
        value = form_field(body, content_type, "model")
    except FormError:
        return
    assert value is None or isinstance(value, str)
