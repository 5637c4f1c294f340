"""YAML text → plain data, refusing what PyYAML's ``safe_load`` lets through (issue #16).

``safe_load`` keeps the last of two equal keys without a word; expands aliases without limit
(the "billion laughs": nine levels of nine aliases are 10^9 values once a validator walks them);
recurses once per nesting level, so 10000 ``[`` raise RecursionError (after quadratic time in
the scanner); and lets ``int()`` raise a bare ValueError on an integer of over 4300 digits.
:func:`parse_yaml` reads with :class:`ConfigLoader`, a ``SafeLoader`` (still no Python tags),
and turns each of these into one :class:`ConfigError` line. Aliases and merge keys (``<<:
*base``) stay allowed: they are checked on the composed node graph, where an alias is one
shared node, before anything expands them.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.error import Mark
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from impasto.config.errors import ConfigError

MAX_DEPTH = 64  # nesting levels, aliases expanded; a config uses 5
MAX_VALUES = 100_000  # values, aliases expanded; a config has a few hundred
MERGE_TAG = "tag:yaml.org,2002:merge"
_FLATTEN = "a config needs a few levels; flatten it"
_SMALLER = "use a number of sensible size"


class _Refused(Exception):
    """One refused construct: ``problem`` at ``mark``, and how to fix it."""

    def __init__(self, problem: str, mark: Mark | None, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.mark, self.fix = problem, mark, fix


class ConfigLoader(yaml.SafeLoader):
    """``SafeLoader`` with a nesting limit while scanning and composing, and a guard on huge
    integers."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        # The composer recurses per level; stop long before Python's recursion limit.
        if self._depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", mark, _FLATTEN)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, token_class: type) -> None:
        # The scanner looks ahead over every open "[" / "{" per token (quadratic), so stop
        # here already rather than in the composer.
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", self.get_mark(), _FLATTEN)
        super().fetch_flow_collection_start(token_class)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # int() refuses over 4300 digits (CVE-2020-10735)
            digits = len(node.value)
            raise _Refused(f"an integer of {digits} digits", node.start_mark, _SMALLER) from None


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def parse_yaml(text: str, source: str, key: str = "") -> Any:
    """The data of the YAML document ``text``; ``source`` names it in messages (a file, or
    ``--set KEY``) and ``key`` is the dotted key the document sits at (for an override)."""
    loader = None
    try:
        loader = ConfigLoader(text)  # refuses control characters at once
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, key, source)
        return loader.construct_document(node)
    except _Refused as error:
        raise ConfigError(f"{source}: {error.problem}{_where(error.mark)}; {error.fix}") from None
    except yaml.reader.ReaderError as error:
        line = text[: error.position].count("\n") + 1
        character = f"#x{error.character:04x}" if isinstance(error.character, int) else "?"
        raise ConfigError(
            f"{source}: unacceptable character {character} at line {line}; remove it"
        ) from None
    except yaml.MarkedYAMLError as error:
        problem = error.problem or "invalid YAML"
        raise ConfigError(
            f"{source}: {problem}{_where(error.problem_mark)}; fix the YAML syntax"
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: {str(error).splitlines()[0]}; fix the YAML") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_graph(root: Node, key: str, source: str) -> None:
    """Refuse duplicate keys, an alias inside its own anchor, and documents that aliases
    expand past :data:`MAX_VALUES` values or :data:`MAX_DEPTH` levels.

    Each node is visited once (aliases share nodes), so this is linear in the text. An anchor
    comes before its aliases in the text, so an alias meets a finished node (or one still open:
    a cycle); the recursion is as deep as the text's nesting, which the composer bounded.
    """
    finished: dict[int, tuple[int, int]] = {}  # id(node) → (values, depth) expanded
    open_nodes: set[int] = set()

    def visit(node: Node, path: str) -> tuple[int, int]:
        if id(node) in finished:
            return finished[id(node)]
        if id(node) in open_nodes:
            fix = "an alias cannot refer to the value that contains it"
            raise _Refused(f"{path or 'the document'}: alias inside its own anchor", None, fix)
        open_nodes.add(id(node))
        values, depth = 1, 1
        for child, child_path in _children(node, path, source):
            child_values, child_depth = visit(child, child_path)
            values, depth = values + child_values, max(depth, child_depth + 1)
        if values > MAX_VALUES:
            fix = "write the values out instead of nesting aliases"
            raise _Refused(f"aliases expand to over {MAX_VALUES} values", node.start_mark, fix)
        if depth > MAX_DEPTH:
            raise _Refused(
                f"aliases nest deeper than {MAX_DEPTH} levels", node.start_mark, _FLATTEN
            )
        open_nodes.discard(id(node))
        finished[id(node)] = values, depth
        return values, depth

    visit(root, key)


def _children(node: Node, path: str, source: str) -> list[tuple[Node, str]]:
    """The child nodes of ``node`` with their dotted keys; a duplicate mapping key raises."""
    if isinstance(node, SequenceNode):
        return [(item, _join(path, str(index))) for index, item in enumerate(node.value)]
    if not isinstance(node, MappingNode):
        return []
    children, first_line = [], {}
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:  # explicit keys may override merged ones
            children.append((value_node, path))
            continue
        name = key_node.value if isinstance(key_node, ScalarNode) else None
        if name is not None:
            line = key_node.start_mark.line + 1
            if (key_node.tag, name) in first_line:
                first = first_line[key_node.tag, name]
                raise ConfigError(
                    f"{_join(path, name)}: duplicate key at line {line} of {source} (first at "
                    f"line {first}); keep one of them"
                )
            first_line[key_node.tag, name] = line
        children += [(key_node, path), (value_node, _join(path, str(name)))]
    return children


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _where(mark: Mark | None) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
