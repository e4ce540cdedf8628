"""The reload guard over random configs: the summary is an exact diff, and a reload is refused exactly when it would
read a blank file, remove every model and deployment (unless confirmed) or empty ``admin_tokens`` or ``api_keys``
(always)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw.config import parse_config
from llmgw.config.loading import is_blank
from llmgw.config.yamlpos import parse_yaml
from llmgw.gateway.reload_guard import refusal, summarize

MODELS = ("alpha", "beta", "gamma", "delta")
PROFILES = ("p-one", "p-two", "p-three")
SECRET = "tok-secret-"
API_KEYS = tuple(f"{SECRET}api-{n}-0123456789" for n in range(3))


@st.composite
def config_texts(draw) -> str:
    """A valid config: some static models (one of two ports: a changed model), some deployments of sim profiles
    (a replica count and a model path that vary: a changed deployment), 0-2 admin tokens, 0-1 join token."""
    lines = ["agents:", "  embedded: true"]
    if draw(st.booleans()):
        lines.append(f"  token: {SECRET}join")
    models = draw(st.lists(st.sampled_from(MODELS), unique=True, max_size=len(MODELS)))
    lines.append("models:" + ("" if models else " []"))
    for name in models:
        port = draw(st.sampled_from((9, 10)))
        lines += [f"  - name: {name}", "    replicas:", f"      - url: http://127.0.0.1:{port}"]
    lines.append("profiles:")
    for name in PROFILES:
        lines += [f"  - name: {name}", "    engine: sim", f"    model_path: {draw(st.sampled_from(('m1', 'm2')))}",
                  f"    served_model_name: {name}-model"]
    deployed = draw(st.lists(st.sampled_from(PROFILES), unique=True, max_size=len(PROFILES)))
    lines.append("deployments:" + ("" if deployed else " []"))
    for name in deployed:
        lines += [f"  - profile: {name}", f"    replicas: {draw(st.integers(0, 2))}"]
    tokens = draw(st.integers(0, 2))
    lines.append("admin_tokens:" + ("" if tokens else " []"))
    lines += [f"  - token: {SECRET}{i}-0123456789" for i in range(tokens)]
    keys = draw(st.lists(st.sampled_from(API_KEYS), unique=True, max_size=len(API_KEYS)))
    lines.append("api_keys:" + ("" if keys else " []"))
    lines += [f"  - key: {key}" for key in keys]
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(config_texts(), config_texts(), st.booleans(), st.booleans())
def test_the_summary_is_the_diff_and_the_refusal_follows_the_rules(old_text, new_text, blank, allow_empty):
    old, new = parse_config(old_text, "old.yaml"), parse_config(new_text, "new.yaml")
    summary = summarize(old, new)
    for changes, before, after in (
            (summary.models, {m.name: m for m in old.models}, {m.name: m for m in new.models}),
            (summary.deployments, {d.profile: (d, old.profile(d.profile)) for d in old.deployments},
             {d.profile: (d, new.profile(d.profile)) for d in new.deployments})):
        assert set(changes.added) == after.keys() - before.keys()
        assert set(changes.removed) == before.keys() - after.keys()
        assert set(changes.changed) == {name for name in before.keys() & after.keys() if before[name] != after[name]}
        assert changes.before == len(before)
    back = summarize(new, old)
    assert (back.models.added, back.models.removed) == (summary.models.removed, summary.models.added)
    assert set(back.deployments.changed) == set(summary.deployments.changed)
    assert summary.admin_tokens == (len(old.admin_tokens), len(new.admin_tokens))
    old_keys, new_keys = {k.key for k in old.api_keys}, {k.key for k in new.api_keys}
    assert summary.api_keys.to_json() == {"added": len(new_keys - old_keys), "removed": len(old_keys - new_keys),
                                          "kept": len(old_keys & new_keys)}
    assert SECRET not in repr(summary.to_json()) and SECRET not in summary.describe()
    assert summarize(old, old).describe().count("-") >= 6 and not summarize(old, old).removed

    refused = refusal(old, new, summary, blank=blank, allow_empty=allow_empty, control_host="127.0.0.1")
    empties = (old.models or old.deployments) and not (new.models or new.deployments)
    if blank and not allow_empty:
        expected = "empty_file"
    elif old.admin_tokens and not new.admin_tokens:
        expected = "removes_admin_tokens"
    elif old.api_keys and not new.api_keys:
        expected = "removes_api_keys"
    elif empties and not allow_empty:
        expected = "removes_everything"
    else:
        expected = None
    assert (refused.code if refused else None) == expected
    if refused is not None:
        assert refused.status == 409 and refused.message and SECRET not in refused.message


COMMENT_LINES = st.one_of(st.just(""), st.text(" ", max_size=3),
                          st.builds(lambda pad, text: f"{pad}#{text}", st.text(" ", max_size=3),
                                    st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20)))


@settings(max_examples=300, deadline=None)
@given(st.lists(COMMENT_LINES, max_size=8), st.sampled_from(("\n", "\r\n")))
def test_a_file_of_blank_lines_and_comments_is_blank_and_holds_no_document(lines, newline):
    text = newline.join(lines)
    assert is_blank(text)
    assert parse_yaml(text, "f.yaml") == (None, [])
    config = parse_config(text, "f.yaml")
    assert (config.models, config.deployments, config.admin_tokens) == ([], [], [])
    assert not is_blank(text + newline + "models: []")


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(st.one_of(COMMENT_LINES, st.text(" \t-:#~.%", max_size=6)))
                 .map("\n".join)))
def test_a_blank_text_never_holds_a_document(text):
    if is_blank(text):
        assert parse_yaml(text, "f.yaml")[0] is None  # nothing to apply: empty, or a YAML error (then 422)


def test_confirming_never_opens_v1():
    old = parse_config(f"api_keys:\n  - key: {API_KEYS[0]}\n  - key: {API_KEYS[1]}\n", "old.yaml")
    new = parse_config("models: []\n", "new.yaml")
    refused = refusal(old, new, summarize(old, new), blank=False, allow_empty=True, control_host="127.0.0.1")
    assert refused is not None and refused.code == "removes_api_keys" and refused.status == 409
    assert "api_keys is empty while the running config has 2" in refused.message and SECRET not in refused.message
    assert summarize(old, new).describe().endswith("API keys: added 0, removed 2, kept 0")


def test_confirming_never_opens_admin():
    old = parse_config(f"admin_tokens:\n  - token: {SECRET}0123456789\n", "old.yaml")
    new = parse_config("models: []\n", "new.yaml")
    refused = refusal(old, new, summarize(old, new), blank=False, allow_empty=True, control_host="0.0.0.0")
    assert refused is not None and refused.code == "removes_admin_tokens"
    opened = parse_config("models: []\n", "new.yaml")
    none = parse_config("models: []\n", "old.yaml")
    exposed = refusal(none, opened, summarize(none, opened), blank=False, allow_empty=True, control_host="0.0.0.0")
    assert exposed is not None and exposed.code == "exposes_admin"

