"""Entry points: read a file or a string, parse the YAML, read the model, raise every issue at once."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any, TypeVar

from .issues import ConfigError, ConfigIssue
from .reader import Reader
from .schema import Config
from .yamlpos import parse_yaml

T = TypeVar("T")
MAX_FILE_BYTES = 1 << 20  # a real configuration is a few KiB; this bounds what parsing may cost


def load_config(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Config:
    """The :class:`Config` in file ``path``; :class:`ConfigError` listing every problem otherwise.

    ``env`` (default ``os.environ``) supplies ``${NAME}`` references.
    """
    return parse_config(read_config_text(path), os.fspath(path), env=env)


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of file ``path``, read once (a reload parses exactly these bytes: it never opens the file again);
    :class:`ConfigError` when it cannot be read, is too large, is not UTF-8, or changed while it was read (a
    writer in the middle of it: replace the file by a rename instead)."""
    filename = os.fspath(path)
    try:
        with open(filename, "rb") as file:
            before = os.fstat(file.fileno())
            data = file.read(MAX_FILE_BYTES + 1)
            after = os.fstat(file.fileno())
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError([ConfigIssue(filename, 0, "", f"the file is larger than {MAX_FILE_BYTES} bytes")])
        torn = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or len(data) != after.st_size
        if torn and stat.S_ISREG(after.st_mode):  # a pipe (config check <(...)) has no size to compare
            raise ConfigError([ConfigIssue(filename, 0, "", "the file changed while it was read (being written?): "
                                           "write a temporary file and rename it over this one")])
        return data.decode("utf-8")
    except OSError as exc:
        raise ConfigError([ConfigIssue(filename, 0, "", f"cannot read the file: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue(filename, 0, "", f"the file is not UTF-8 text ({exc.reason})")]) from None


def is_blank(text: str) -> bool:
    """Whether ``text`` holds no YAML document: nothing but blank lines and comments (an empty file, or one being
    written). It parses as a config with every default: no models, no deployments, no tokens."""
    return all(not line.strip(" \t") or line.lstrip(" \t").startswith("#") for line in text.splitlines())


def parse_config(text: str, filename: str = "<string>", *, env: Mapping[str, str] | None = None) -> Config:
    """The :class:`Config` in YAML ``text``, with errors attributed to ``filename``."""
    root, issues = parse_yaml(text, filename)
    if issues and root is None:
        raise ConfigError(issues)
    reader = Reader(filename, os.environ if env is None else env)
    config = reader.read_document(Config, root)
    issues += reader.issues
    if issues:
        raise ConfigError(issues, reader.built)
    return config


def read_json_object(cls: type[T], value: dict[str, Any], what: str) -> T:
    """The config class ``cls`` (e.g. an admin API's request) read from a parsed JSON object, with every rule of
    the file's reader; :class:`ConfigError` naming each wrong key (as ``what:LINE: key``, the line of the object
    written one key per line). No ``${NAME}`` is taken from the environment: a request never reads it."""
    root, issues = parse_yaml(json.dumps(value, indent=1, ensure_ascii=True), what)
    if root is None:
        raise ConfigError(issues)
    reader = Reader(what, {})
    built = reader.read_document(cls, root)
    issues += reader.issues
    if issues:
        raise ConfigError(issues, reader.built)
    return built
