"""Parse YAML text into a small tree of nodes that remember their line numbers.

PyYAML's ``compose`` (with the safe loader's resolver) gives nodes with marks
but silently keeps the last of two equal keys; this module turns those nodes
into :class:`Mapping`, :class:`Sequence` and :class:`Scalar`, reporting
duplicate keys, non-string keys and recursive aliases, and applying merge
keys (``<<: *anchor``, where keys written in the mapping itself win). Scalars
keep their source text and resolved tag; turning them into Python values is
left to the reader, which interpolates environment variables first.

Hostile files are bounded: nesting deeper than :data:`MAX_DEPTH` is refused
while composing (PyYAML's composer recurses, so a 5,000-deep flow list would
otherwise end in a ``RecursionError``), and an alias re-used so often that its
copies would pass :data:`MAX_ALIAS_NODES` nodes is refused while converting (a
"billion laughs" file of a few hundred bytes expands to 10^9 nodes). Either is
one issue naming the line and key, and no tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from .issues import ConfigIssue, join_index, join_key

NULL_TAG = "tag:yaml.org,2002:null"
STR_TAG = "tag:yaml.org,2002:str"
MERGE_TAG = "tag:yaml.org,2002:merge"
BROKEN_TAG = "tag:llmgw,broken"  # stands in for a value already reported (a recursive alias)
MAX_DEPTH = 64  # lists and mappings inside each other; a real configuration nests fewer than 10
MAX_ALIAS_NODES = 100_000  # nodes produced by re-using anchored values: room for fleets of merged defaults


class _Refused(Exception):
    """A file beyond a bound: reported as one issue, and nothing of the file is read."""

    def __init__(self, line: int, key: str, message: str):
        super().__init__(message)
        self.line, self.key, self.message = line, key, message


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing collections nested deeper than :data:`MAX_DEPTH` before it recurses into them."""

    def __init__(self, stream):
        super().__init__(stream)
        self._paths = [""]  # the key path of each collection being composed

    def compose_node(self, parent, index):
        if not (self.check_event(yaml.SequenceStartEvent) or self.check_event(yaml.MappingStartEvent)):
            return super().compose_node(parent, index)
        path = self._paths[-1]
        if isinstance(index, yaml.ScalarNode):
            path = join_key(path, index.value)
        elif isinstance(index, int):
            path = join_index(path, index)
        if len(self._paths) > MAX_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise _Refused(line, path, f"lists and mappings are nested deeper than {MAX_DEPTH} levels")
        self._paths.append(path)
        try:
            return super().compose_node(parent, index)
        finally:
            self._paths.pop()


# Every node's ``line`` is 1-based: for a value in a mapping, the line of its
# key (so a block list or mapping is reported where it is introduced); for a
# list item, the line it starts on.


@dataclass(slots=True)
class Scalar:
    """A scalar: its text as written, its resolved YAML tag, and whether it was unquoted."""

    line: int
    text: str
    tag: str
    plain: bool

    @property
    def is_broken(self) -> bool:
        return self.tag == BROKEN_TAG


@dataclass(slots=True)
class Sequence:
    """A YAML list."""

    line: int
    items: list["Node"]


@dataclass(slots=True)
class Entry:
    """One key of a mapping: the line the key is written on and its value."""

    key_line: int
    value: "Node"


@dataclass(slots=True)
class Mapping:
    """A YAML mapping with string keys, in file order."""

    line: int
    entries: dict[str, Entry]


Node = Scalar | Sequence | Mapping


def parse_yaml(text: str, filename: str) -> tuple[Node | None, list[ConfigIssue]]:
    """The document in ``text`` (None when empty) and every structural problem found.

    A syntax error yields no tree and a single issue carrying its line.
    """
    try:
        root = yaml.compose(text, Loader=_BoundedLoader)
        if root is None:
            return None, []
        converter = _Converter(filename)
        return converter.convert(root, ""), converter.issues
    except _Refused as exc:
        return None, [ConfigIssue(filename, exc.line, exc.key, exc.message)]
    except yaml.MarkedYAMLError as exc:
        return None, [_syntax_issue(exc, filename, len(text))]
    except yaml.YAMLError as exc:  # e.g. a reader error without a mark
        return None, [ConfigIssue(filename, 0, "", f"invalid YAML: {exc}")]


def _syntax_issue(exc: yaml.MarkedYAMLError, filename: str, text_length: int) -> ConfigIssue:
    """An issue for a YAML syntax error, without quoting the offending line (it may hold a secret).

    When the problem is the end of the file (an unclosed bracket or quote), the
    line where the unclosed construct started is the useful one.
    """
    mark = exc.problem_mark or exc.context_mark
    if exc.context_mark and exc.problem_mark and exc.problem_mark.index >= text_length:
        mark = exc.context_mark
    line = mark.line + 1 if mark else 0
    message = exc.problem or exc.context or "syntax error"
    if exc.context and exc.problem:
        context_line = exc.context_mark.line + 1 if exc.context_mark else line
        where = "" if context_line == line else f" from line {context_line}"
        if exc.context.startswith("while "):
            message = f"{exc.problem} ({exc.context}{where})"
        else:  # e.g. "expected a single document in the stream", "but found another document"
            message = f"{exc.context}{where}, {exc.problem}"
    return ConfigIssue(filename, line, "", f"invalid YAML: {message}")


class _Converter:
    """Walks composed PyYAML nodes into :data:`Node` values, collecting issues."""

    def __init__(self, filename: str):
        self.filename = filename
        self.issues: list[ConfigIssue] = []
        self._open: set[int] = set()  # ids of nodes being converted (recursive aliases)
        self._seen: set[int] = set()  # ids of nodes converted at least once
        self._alias_nodes = 0  # conversions of nodes seen before: the copies that aliases make
        self._written_lines = [1]  # lines of the collections being converted that are not copies

    def report(self, line: int, key: str, message: str) -> None:
        self.issues.append(ConfigIssue(self.filename, line, key, message))

    def convert(self, node: yaml.Node, path: str) -> Node:
        line = node.start_mark.line + 1
        copy = id(node) in self._seen
        if copy:
            self._alias_nodes += 1
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise _Refused(self._written_lines[-1], path, f"aliases expand to more than {MAX_ALIAS_NODES} "
                                                              "nodes: write the values out, or use fewer aliases")
        else:
            self._seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            return Scalar(line, node.value, node.tag, node.style is None)
        if id(node) in self._open:
            self.report(line, path, "recursive alias")
            return Scalar(line, "", BROKEN_TAG, True)
        self._open.add(id(node))
        if not copy:
            self._written_lines.append(line)
        try:
            if isinstance(node, yaml.SequenceNode):
                return Sequence(line, [self.convert(item, join_index(path, i)) for i, item in enumerate(node.value)])
            assert isinstance(node, yaml.MappingNode)  # the composer makes scalars, sequences and mappings only
            return self._mapping(node, path)
        finally:
            self._open.discard(id(node))
            if not copy:
                self._written_lines.pop()

    def _mapping(self, node: yaml.MappingNode, path: str) -> Mapping:
        entries: dict[str, Entry] = {}
        merges: list[yaml.Node] = []
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if key_node.tag == MERGE_TAG:
                merges.append(value_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.report(key_line, path, "mapping keys must be strings, not lists or mappings")
                continue
            key = key_node.value
            if key in entries:
                first = entries[key].key_line
                self.report(key_line, join_key(path, key), f"duplicate key (first set on line {first})")
                continue
            value = self.convert(value_node, join_key(path, key))
            value.line = key_line  # a value is reported where its key is written
            entries[key] = Entry(key_line, value)
        for source in merges:
            for key, entry in self._merge_source(source, path).items():
                entries.setdefault(key, entry)
        return Mapping(node.start_mark.line + 1, entries)

    def _merge_source(self, node: yaml.Node, path: str) -> dict[str, Entry]:
        """The entries a ``<<`` value contributes; earlier mappings in a list win."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        merged: dict[str, Entry] = {}
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                self.report(source.start_mark.line + 1, path, "'<<' merges a mapping or a list of mappings")
                continue
            converted = self.convert(source, path)
            if isinstance(converted, Mapping):
                for key, entry in converted.entries.items():
                    merged.setdefault(key, entry)
        return merged
