"""How config classes declare their keys, and how a built object remembers where it came from.

A config class is a frozen, slotted, keyword-only dataclass (``@config_class``)
whose fields are its YAML keys. A field's type says how to read it (see
:mod:`llmgw.config.reader`); ``Annotated`` metadata refines it:
:class:`Parse` reads the scalar with a function (durations, sizes, URLs) and
:class:`Check` adds a constraint. :func:`setting` declares the default and
whether the value is secret (kept out of ``repr`` and of error messages).

Every built object carries a private :class:`Where` (file, key path, line of
the object and of each key written), so code outside the loader can report a
problem in the same ``file:line: key: message`` form with :func:`issue_at`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, dataclass_transform

from .issues import ConfigIssue, join_key


class _Invalid:
    """The value of a key that could not be read (only seen while loading)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INVALID"


INVALID: Any = _Invalid()


def known(*values: object) -> bool:
    """True when none of ``values`` is :data:`INVALID`."""
    return all(value is not INVALID for value in values)


@dataclass(frozen=True, slots=True)
class Parse:
    """``Annotated`` metadata: read the scalar with ``function(value)``, which raises ``ValueError``."""

    function: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Check:
    """``Annotated`` metadata: ``function(value)`` returns an error message, or None when fine."""

    function: Callable[[Any], str | None]


@dataclass(frozen=True, slots=True)
class OrMapping:
    """``Annotated`` metadata: the key may also be written as a mapping, read as config class ``cls`` (the owning
    object's ``_finish`` turns that object into the field's own type, e.g. ``replicas: {min: 0, max: 4}``)."""

    cls: type


def at_least(lowest: int) -> Check:
    return Check(lambda value: None if value >= lowest else f"must be at least {lowest}")


def at_most(highest: int | float, shown: str | None = None) -> Check:
    """No more than ``highest`` (written in messages as ``shown``, e.g. ``"1d"``)."""
    text = shown or f"{highest}"
    return Check(lambda value: None if value <= highest else f"must be at most {text}")


def positive() -> Check:
    return Check(lambda value: None if value > 0 else "must be greater than 0")


def one_of(*choices: str) -> Check:
    listed = ", ".join(choices)
    return Check(lambda value: None if value in choices else f"must be one of: {listed}")


def matches(pattern: str, what: str) -> Check:
    compiled = re.compile(pattern)
    return Check(lambda value: None if compiled.fullmatch(value) else f"must be {what}")


def non_empty(message: str = "must not be empty") -> Check:
    return Check(lambda value: None if len(value) else message)


def at_most_items(highest: int) -> Check:
    return Check(lambda value: None if len(value) <= highest else f"must have at most {highest} entries")


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
            secret: bool = False, internal: bool = False) -> Any:
    """A config key: no default and no factory means the key is required.

    ``secret`` keeps the value out of ``repr`` and error messages; ``internal``
    marks a field set by the loader, not read from the file.
    """
    return field(default=default, default_factory=factory, repr=not secret,
                 metadata={"secret": secret, "internal": internal})


@dataclass(frozen=True, slots=True)
class Where:
    """Where a config object was written: file, key path, its own line and each key's line."""

    file: str = "<built-in>"
    key: str = ""
    line: int = 0
    key_lines: dict[str, int] = field(default_factory=dict)


NOWHERE = Where()


class Located:
    """Base of config classes: answers where the object and each of its keys were written."""

    __slots__ = ()
    _where: Where

    def line_of(self, name: str | None = None) -> int:
        """The line of key ``name`` if it was written, else the line of the object."""
        return self._where.key_lines.get(name, self._where.line) if name else self._where.line

    def key_of(self, name: str | None = None) -> str:
        """The dotted path of key ``name`` (or of the object itself)."""
        return join_key(self._where.key, name) if name else self._where.key

    def was_written(self, name: str) -> bool:
        """Whether key ``name`` appears in the file (rather than taking its default)."""
        return name in self._where.key_lines


def issue_at(obj: Located, name: str | None, message: str) -> ConfigIssue:
    """A :class:`ConfigIssue` about key ``name`` of ``obj``, at the line it was written on."""
    return ConfigIssue(obj._where.file, obj.line_of(name), obj.key_of(name), message)


_Config = TypeVar("_Config", bound=Located)


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(setting,))
def config_class(cls: type[_Config]) -> type[_Config]:
    """Make ``cls`` a config class: a frozen, slotted, keyword-only dataclass with a ``_where``."""
    cls.__annotations__["_where"] = Where
    cls._where = field(default=NOWHERE, repr=False, compare=False, metadata={"internal": True})
    return dataclass(frozen=True, slots=True, kw_only=True)(cls)


def yaml_fields(cls: type) -> Iterable[dataclasses.Field]:
    """The fields of config class ``cls`` that are read from the file."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def is_config_class(tp: object) -> bool:
    return isinstance(tp, type) and issubclass(tp, Located) and dataclasses.is_dataclass(tp)

