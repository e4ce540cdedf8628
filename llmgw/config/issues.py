"""Configuration errors: one ``ConfigIssue`` per problem, all of them in one ``ConfigError``.

Also the spelling of key paths (``models[0].replicas[1].url``) so that every
part of the loader names a key the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in a config file: where it is and what is wrong.

    ``line`` is 1-based; 0 means the problem has no line (the file cannot be
    read, or the object was built in code). ``key`` is a dotted path with
    list indexes, empty for the whole document.
    """

    file: str
    line: int
    key: str
    message: str

    def __str__(self) -> str:
        place = f"{self.file}:{self.line}" if self.line else self.file
        return f"{place}: {self.key}: {self.message}" if self.key else f"{place}: {self.message}"


class ConfigError(Exception):
    """A config file is invalid; ``errors`` lists every problem found, in file order.

    ``objects`` are the config objects (models, profiles...) that could still be read, so that a later
    stage (the plugin checks) can report its problems in the same pass.
    """

    def __init__(self, errors: list[ConfigIssue], objects: Iterable[object] = ()):
        self.errors = sorted(dict.fromkeys(errors), key=lambda issue: issue.line)
        self.objects = tuple(objects)
        super().__init__("\n".join(map(str, self.errors)))


def join_key(path: str, key: str) -> str:
    """The path of mapping key ``key`` under ``path``: ``a.b``, or ``a["b.c"]`` for odd keys."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def join_index(path: str, index: int) -> str:
    """The path of list item ``index`` under ``path``: ``a[0]``."""
    return f"{path}[{index}]"
