"""The one generic reader: turns a positioned YAML tree into config objects, collecting every issue.

Reading is driven by the config classes' type hints:

- ``str``: any scalar, taken as written (``name: 7b`` and ``tp_env: 4`` are
  strings where a string is wanted; ``yes`` is not turned into true);
- ``int``, ``float``, ``bool``: the YAML scalar of that type (``float`` also
  takes integers; ``int`` does not take booleans);
- ``X | None``: null gives None;
- ``list[X]``, ``dict[str, X]`` (the key type may carry ``Annotated`` checks),
  ``dict``/``Any`` for free-form values;
- a config class: a mapping whose keys are the class's fields;
- ``Annotated[T, Parse(f), Check(g)...]``: ``f`` reads the scalar, each ``g``
  constrains the result; with ``OrMapping(C)`` a mapping is read as config
  class ``C`` instead (the owner's ``_finish`` turns it into a ``T``).

Strings are interpolated (``${NAME}``, see :mod:`llmgw.config.envsubst`)
before anything else; a scalar that referenced a variable is re-typed from
its new text, so ``tp: ${TP:-2}`` (or ``"${TP:-2}"``) is an integer. A key set to null takes its default. A value
that cannot be read becomes :data:`~llmgw.config.fields.INVALID` and reading
goes on, so one pass reports every problem; a list or mapping holding an
invalid item is invalid as a whole. Each class may define ``_finish(draft)``
to derive defaults and check rules across its keys (see :class:`Draft`).
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Mapping as AbcMapping
from dataclasses import MISSING, Field
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import yaml

from .envsubst import InterpolationError, interpolate
from .fields import INVALID, Check, OrMapping, Parse, Where, is_config_class, known, yaml_fields
from .issues import ConfigIssue, join_index, join_key
from .yamlpos import Mapping, Node, Scalar, Sequence

_SCALAR_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


class Draft:
    """The values read for one object before it is built, for its class's ``_finish`` hook.

    Every field is present: the value from the file, its default, or INVALID.
    """

    def __init__(self, reader: "Reader", values: dict[str, Any], where: Where):
        self._reader = reader
        self.values = values
        self.where = where

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def known(self, *names: str) -> bool:
        """True when every named value was read without error."""
        return known(*(self.values[name] for name in names))

    def set(self, name: str, value: Any) -> None:
        self.values[name] = value

    def was_written(self, name: str) -> bool:
        return name in self.where.key_lines

    def line_of(self, name: str) -> int:
        return self.where.key_lines.get(name, self.where.line)

    def problem(self, name: str, message: str) -> None:
        """Report a problem with key ``name`` of this object."""
        self._reader.issues.append(
            ConfigIssue(self.where.file, self.line_of(name), join_key(self.where.key, name), message)
        )

    def add(self, issue: ConfigIssue) -> None:
        """Report an issue built elsewhere (e.g. with :func:`~llmgw.config.fields.issue_at`)."""
        self._reader.issues.append(issue)


class _Resolved:
    """A scalar after interpolation: its text, its Python value, and whether it may be quoted in errors."""

    __slots__ = ("text", "value", "from_env")

    def __init__(self, text: str, value: Any, from_env: bool):
        self.text, self.value, self.from_env = text, value, from_env


class Reader:
    """Reads one file's tree into config objects; ``issues`` collects every problem."""

    def __init__(self, filename: str, env: AbcMapping[str, str]):
        self.filename = filename
        self.env = env
        self.issues: list[ConfigIssue] = []
        self.built: list[Any] = []  # every config object read, also those inside invalid lists (for later checks)
        self._yaml = yaml.SafeLoader("")  # used only to resolve and construct scalars
        self._scalars: dict[int, _Resolved | Any] = {}

    def report(self, line: int, key: str, message: str) -> None:
        self.issues.append(ConfigIssue(self.filename, line, key, message))

    # -- documents and objects -------------------------------------------------

    def read_document(self, cls: type, root: Node | None) -> Any:
        if root is None:
            root = Mapping(1, {})
        if not isinstance(root, Mapping):
            self.report(root.line, "", "the file must be a mapping of keys (listen, models, ...)")
            return INVALID
        return self.read_object(cls, root, "")

    def read_object(self, cls: type, node: Node, key: str) -> Any:
        if not isinstance(node, Mapping):
            self.report(node.line, key, f"expected a mapping, got {self._describe(node, key, secret=False)}")
            return INVALID
        fields = {f.name: f for f in yaml_fields(cls)}
        hints = _type_hints(cls)
        self._report_unknown_keys(node, fields, key)
        values: dict[str, Any] = {}
        for name, field_ in fields.items():
            entry = node.entries.get(name)
            child_key = join_key(key, name)
            value = None
            if entry is not None:
                value = self.read(hints[name] | None, entry.value, child_key, secret=field_.metadata["secret"])
            if value is None:
                line = entry.key_line if entry is not None else node.line
                value = self._default(field_, hints[name], line, child_key, written=entry is not None)
            values[name] = value
        key_lines = {name: entry.key_line for name, entry in node.entries.items() if name in fields}
        where = Where(self.filename, key, node.line, key_lines)
        draft = Draft(self, values, where)
        finish = getattr(cls, "_finish", None)
        if finish is not None:
            finish(draft)
        built = cls(**draft.values, _where=where)
        self.built.append(built)
        return built

    def _report_unknown_keys(self, node: Mapping, fields: dict[str, Field], key: str) -> None:
        for name, entry in node.entries.items():
            if name in fields:
                continue
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "expected one of: " + ", ".join(fields)
            self.report(entry.key_line, join_key(key, name), f"unknown key ({hint})")

    def _default(self, field_: Field, tp: Any, line: int, key: str, *, written: bool) -> Any:
        default, factory = field_.default, field_.default_factory
        if default is MISSING and factory is MISSING:
            self.report(line, key, "must have a value" if written else "missing required key")
            return INVALID
        if is_config_class(tp):  # build it from an empty mapping so it knows its key and line
            return self.read_object(tp, Mapping(line, {}), key)
        if default is not MISSING:
            return default
        assert factory is not MISSING
        return factory()

    # -- values ------------------------------------------------------------------

    def read(self, tp: Any, node: Node, key: str, *, secret: bool = False) -> Any:
        """The value of ``node`` as type ``tp``, or INVALID after reporting why not."""
        if isinstance(node, Scalar) and node.is_broken:
            return INVALID
        origin = get_origin(tp)
        if origin is Annotated:
            return self._read_annotated(tp, node, key, secret)
        if origin in (Union, types.UnionType):
            options = [arg for arg in get_args(tp) if arg is not type(None)]
            if isinstance(node, Scalar):
                resolved = self._resolve(node, key)
                if resolved is INVALID:
                    return INVALID
                if resolved.value is None:
                    return None
            return self.read(options[0], node, key, secret=secret)
        if tp is Any:
            return self._read_free_form(node, key, secret)
        if origin is list:
            return self._read_list(get_args(tp)[0], node, key, secret)
        if tp is dict or origin is dict:
            key_type, value_type = get_args(tp) or (str, Any)
            return self._read_dict(key_type, value_type, node, key, secret)
        if is_config_class(tp):
            return self.read_object(tp, node, key)
        if tp in _SCALAR_TYPES:
            return self._read_scalar(tp, node, key, secret)
        raise TypeError(f"config reader cannot read type {tp!r}")  # a bug in a config class

    def _read_annotated(self, tp: Any, node: Node, key: str, secret: bool) -> Any:
        alternatives = [meta.cls for meta in tp.__metadata__ if isinstance(meta, OrMapping)]
        if alternatives and isinstance(node, Mapping):
            return self.read_object(alternatives[0], node, key)
        if alternatives and isinstance(node, Sequence):
            keys = ", ".join(f.name for f in yaml_fields(alternatives[0]))
            self.report(node.line, key, f"expected a single value or a mapping of {keys}, got a list")
            return INVALID
        parsers = [meta for meta in tp.__metadata__ if isinstance(meta, Parse)]
        checks = [meta for meta in tp.__metadata__ if isinstance(meta, Check)]
        if parsers:
            resolved = self._expect_scalar(node, key, secret)
            if resolved is INVALID:
                return INVALID
            try:
                value = parsers[0].function(resolved.value)
            except ValueError as exc:
                self.report(node.line, key, str(exc))
                return INVALID
        else:
            value = self.read(tp.__origin__, node, key, secret=secret)
        if value is INVALID or not self._passes(checks, value, node.line, key):
            return INVALID
        return value

    def _passes(self, checks: list[Check], value: Any, line: int, key: str) -> bool:
        for check in checks:
            message = check.function(value)
            if message:
                self.report(line, key, message)
                return False
        return True

    def _read_scalar(self, tp: type, node: Node, key: str, secret: bool) -> Any:
        resolved = self._expect_scalar(node, key, secret)
        if resolved is INVALID:
            return INVALID
        value = resolved.value
        if tp is str:
            return resolved.text
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and type(value) is int:
            return value
        if tp is float and type(value) in (int, float):
            return float(value)
        self.report(node.line, key, f"expected {_SCALAR_TYPES[tp]}, got {self._describe(node, key, secret)}")
        return INVALID

    def _read_list(self, item_type: Any, node: Node, key: str, secret: bool) -> Any:
        if not isinstance(node, Sequence):
            self.report(node.line, key, f"expected a list, got {self._describe(node, key, secret)}")
            return INVALID
        items = [self.read(item_type, item, join_index(key, i), secret=secret) for i, item in enumerate(node.items)]
        return items if known(*items) else INVALID

    def _read_dict(self, key_type: Any, value_type: Any, node: Node, key: str, secret: bool) -> Any:
        if not isinstance(node, Mapping):
            self.report(node.line, key, f"expected a mapping, got {self._describe(node, key, secret)}")
            return INVALID
        result: dict[str, Any] = {}
        for name, entry in node.entries.items():
            child_key = join_key(key, name)
            result[name] = self.read(value_type, entry.value, child_key, secret=secret)
            key_checks = [meta for meta in getattr(key_type, "__metadata__", ()) if isinstance(meta, Check)]
            if not self._passes(key_checks, name, entry.key_line, child_key):
                result[name] = INVALID
        return result if known(*result.values()) else INVALID

    def _read_free_form(self, node: Node, key: str, secret: bool) -> Any:
        if isinstance(node, Mapping):
            return self._read_dict(str, Any, node, key, secret)
        if isinstance(node, Sequence):
            return self._read_list(Any, node, key, secret)
        resolved = self._resolve(node, key)
        return resolved if resolved is INVALID else resolved.value

    # -- scalars -----------------------------------------------------------------

    def _expect_scalar(self, node: Node, key: str, secret: bool) -> Any:
        """The resolved scalar, or INVALID after reporting a list, mapping or null where a value belongs."""
        if isinstance(node, Scalar):
            resolved = self._resolve(node, key)
            if resolved is INVALID or resolved.value is not None:
                return resolved
        self.report(node.line, key, f"expected a single value, got {self._describe(node, key, secret)}")
        return INVALID

    def _resolve(self, node: Scalar, key: str) -> Any:
        """Interpolate and type a scalar once (errors are reported once, however often it is read)."""
        if id(node) not in self._scalars:
            self._scalars[id(node)] = self._interpolate_and_construct(node, key)
        return self._scalars[id(node)]

    def _interpolate_and_construct(self, node: Scalar, key: str) -> Any:
        try:
            text, from_env = interpolate(node.text, self.env)
        except InterpolationError as exc:
            self.report(node.line, key, str(exc))
            return INVALID
        tag = node.tag
        if from_env:  # re-typed even when quoted: flow style needs quotes around "${...}"
            tag = self._yaml.resolve(yaml.ScalarNode, text, (True, False))
        try:
            value = self._yaml.construct_object(yaml.ScalarNode(tag, text), deep=True)
        except yaml.YAMLError:
            self.report(node.line, key, f"cannot read a value tagged {tag}")
            return INVALID
        except ValueError as exc:  # e.g. an integer of more digits than Python converts (4300)
            self.report(node.line, key, f"cannot read the value: {str(exc).split(';')[0]}")
            return INVALID
        return _Resolved(text, value, from_env)

    def _describe(self, node: Node, key: str, secret: bool) -> str:
        """``a list``, ``a mapping``, ``null``, ``a string 'abc'``: never the value of a secret or an env variable."""
        if isinstance(node, Mapping):
            return "a mapping"
        if isinstance(node, Sequence):
            return "a list"
        resolved = self._resolve(node, key)
        value = resolved.value if isinstance(resolved, _Resolved) else node.text
        if value is None:
            return "null"
        kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
            type(value), f"a {type(value).__name__}"
        )
        if secret or (isinstance(resolved, _Resolved) and resolved.from_env):
            return kind
        text = resolved.text if isinstance(resolved, _Resolved) else node.text
        shown = text if len(text) <= 40 else text[:37] + "..."
        return f"{kind} {shown!r}"


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)
