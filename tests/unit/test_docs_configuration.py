"""docs/configuration.md documents every key of the config schema, and no key that is not one.

The schema's keys are found by walking the config classes from ``Config`` (a field whose type holds another
config class, alone or in a list, adds that class's keys under its path); the documented ones are the first cells
of the key tables under ``## Top-level keys`` and each ``### `PATH` `` heading (``### `models[].replicas[]` ``).
The CLI's reference is checked against ``--help`` in tests/unit/test_docs.py.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from llmgw.config.fields import is_config_class, yaml_fields
from llmgw.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION = REPO / "docs" / "configuration.md"


# -- configuration keys ------------------------------------------------------------------------------------------


def config_classes_in(hint: object) -> list[tuple[str, type]]:
    """The config classes a field's type holds, each with the suffix its key takes (``[]`` inside a list)."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return config_classes_in(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return [found for arg in typing.get_args(hint) for found in config_classes_in(arg)]
    if origin is list:
        return [(f"[]{suffix}", cls) for suffix, cls in config_classes_in(typing.get_args(hint)[0])]
    if is_config_class(hint):
        return [("", hint)]
    return []


def schema_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every key the schema reads, as a path: ``listen``, ``models[].replicas[].url``, ``state.sentinel.service``."""
    keys: set[str] = set()
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in yaml_fields(cls):
        path = f"{prefix}{field.name}"
        keys.add(path)
        for suffix, inner in config_classes_in(hints[field.name]):
            keys |= schema_keys(inner, f"{path}{suffix}.")
    return keys


SECTION = re.compile(r"#{2,3} `([^`]+)`\s*$")
KEY_ROW = re.compile(r"\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|")


def documented_keys(text: str) -> dict[str, int]:
    """Key path -> line, from the key tables: a row's first cell under ``## Top-level keys`` or ``### `PATH` ``."""
    keys: dict[str, int] = {}
    prefix: str | None = None
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if line.startswith("#"):
            section = SECTION.fullmatch(line)
            prefix = "" if line.strip() == "## Top-level keys" else f"{section[1]}." if section else None
        elif prefix is not None and (row := KEY_ROW.match(line)):
            keys.setdefault(prefix + row[1], number)
    return keys


def test_every_config_key_is_documented_and_every_documented_key_exists():
    schema = schema_keys()
    documented = documented_keys(CONFIGURATION.read_text())
    assert len(schema) > 150, "the walk found too few keys: does it still reach every config class?"
    missing = sorted(schema - documented.keys())
    unknown = sorted(f"line {line}: {key}" for key, line in documented.items() if key not in schema)
    assert missing == [], f"keys of the config schema without a row in docs/configuration.md: {missing}"
    assert unknown == [], f"rows of docs/configuration.md's key tables that are no config key: {unknown}"


def test_the_key_checks_see_a_missing_and_an_invented_key():
    text = ("## Top-level keys\n\n| Key | Type |\n|---|---|\n| `listen` | x |\n| `lisen` | x |\n\n"
            "### `models[].replicas[]`\n\n| Key |\n|---|\n| `url` | x |\n\n## Other\n\n| `not_a_key` | x |\n")
    assert documented_keys(text) == {"listen": 5, "lisen": 6, "models[].replicas[].url": 12}
    assert {"listen", "models[].replicas[].url", "state.sentinel.service", "flow.classes[].max_fill",
            "api_keys[].budgets[].usd"} <= schema_keys()
    assert "source" not in schema_keys()  # set by the loader, not a key of the file
