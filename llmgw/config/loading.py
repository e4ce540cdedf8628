"""Entry points: read a file or a string, parse the YAML, read the model, raise every issue at once."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .issues import ConfigError, ConfigIssue
from .reader import Reader
from .schema import Config
from .yamlpos import parse_yaml

MAX_FILE_BYTES = 1 << 20  # a real configuration is a few KiB; this bounds what parsing may cost


def load_config(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Config:
    """The :class:`Config` in file ``path``; :class:`ConfigError` listing every problem otherwise.

    ``env`` (default ``os.environ``) supplies ``${NAME}`` references.
    """
    filename = os.fspath(path)
    try:
        with open(filename, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError([ConfigIssue(filename, 0, "", f"the file is larger than {MAX_FILE_BYTES} bytes")])
        text = data.decode("utf-8")
    except OSError as exc:
        raise ConfigError([ConfigIssue(filename, 0, "", f"cannot read the file: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue(filename, 0, "", f"the file is not UTF-8 text ({exc.reason})")]) from None
    return parse_config(text, filename, env=env)


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
