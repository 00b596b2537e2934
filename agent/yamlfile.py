"""Reading a YAML file into plain data, with any failure as one line naming the file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.scrub import escape_control


def _check_unique_keys(node: yaml.MappingNode) -> None:
    """Each key of a mapping written once. YAML says a key is unique in its mapping, yet PyYAML
    keeps the last of two: a second `pricing:` block would silently drop the first one's prices.
    A merge (`<<: *base`) may still be overridden by the mapping's own keys."""
    seen: set[tuple[str, str]] = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = (key_node.tag, key_node.value)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key_node.value!r} in one mapping", key_node.start_mark
            )
        seen.add(key)


class _SafeLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _check_unique_keys(node)
        return super().construct_mapping(node, deep)


# libyaml's parser where PyYAML was built with it: 3-4x faster on a recorded trace (hundreds of
# KiB). Its error messages are terser ("did not find expected ','", some a line off), so a
# document it rejects is parsed again by the pure-Python parser, whose message is the one shown.
_FAST_LOADER: type[yaml.SafeLoader | yaml.CSafeLoader] = _SafeLoader
if hasattr(yaml, "CSafeLoader"):

    class _CSafeLoader(yaml.CSafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            _check_unique_keys(node)
            return super().construct_mapping(node, deep)

    _FAST_LOADER = _CSafeLoader


def _parse(text: str) -> object:
    try:
        return yaml.load(text, Loader=_FAST_LOADER)  # a safe loader: plain data only
    except yaml.YAMLError:
        if _FAST_LOADER is _SafeLoader:
            raise
    return yaml.load(text, Loader=_SafeLoader)


class YamlFileError(ValueError):
    """The file is missing, unreadable or not YAML; the message is one line with its path."""


def read_yaml(path: Path, what: str) -> object:
    """The parsed document (None for an empty file). `what` names the file's role in errors.

    Every mapping key must be a string: `1: x` or `yes: x` (YAML 1.1 reads `yes` as true) in a
    settings file is a mistake, and left in it would surface as a TypeError far from the file.
    """
    try:
        if path.exists() and not path.is_file() and not path.is_dir() and str(path) != os.devnull:
            # A FIFO or a device would be read until it ends: never, for /dev/zero or a pipe
            # nobody writes to. /dev/null, the usual empty file, ends at once.
            raise YamlFileError(f"{path}: not a regular file, not a {what} file")
        data = _parse(path.read_text())
    except FileNotFoundError:
        raise YamlFileError(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise YamlFileError(f"{path}: is a directory, not a {what} file") from None
    except OSError as exc:
        raise YamlFileError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise YamlFileError(f"{path}: not a text file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise YamlFileError(f"{path}:{where}: {problem}") from None
    except RecursionError:
        raise YamlFileError(f"{path}: nested too deeply") from None
    size = _expanded_size(data)
    if size is None:
        # Every reader of the document would walk it for ever.
        raise YamlFileError(f"{path}: an alias stands inside its own anchor's value, which would never end")
    if size > MAX_VALUES:
        raise YamlFileError(
            f"{path}: holds more than {MAX_VALUES:,} values once its aliases are expanded; "
            "a settings or scenario file is far smaller"
        )
    try:
        bad = _non_string_key(data, ())
    except RecursionError:
        raise YamlFileError(f"{path}: nested too deeply") from None
    if bad is not None:
        keys, key = bad
        at = f" {'.'.join(keys)}:" if keys else ""
        # The keys leading there may hold any text, newlines included: the message stays one line.
        message = f"{path}:{at} keys must be text, got {key!r} ({type(key).__name__}); quote it"
        raise YamlFileError(escape_control(message))
    return data


# How many values (scalars, lists and mappings) a document may hold with its aliases expanded.
# An alias is the one object the anchor made, so a few lines of anchors to anchors (the "billion
# laughs") stand for billions of values, which whatever walks the document then visits.
MAX_VALUES = 2_000_000


def _expanded_size(data: object) -> int | None:
    """How many values `data` holds counting each alias as often as it is used: each list and
    mapping is sized once, from its children's sizes, so this runs in the document's own size.
    None where a list or mapping holds itself (`a: &a [*a]`): endless once expanded."""
    sizes: dict[int, int] = {}
    opened: set[int] = set()  # begun, not yet sized: met again below itself, it holds itself
    stack: list[tuple[object, bool]] = [(data, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, dict | list) or id(node) in sizes:
            continue
        children = list(node.values()) if isinstance(node, dict) else node
        if not children_done:
            if id(node) in opened:
                return None
            opened.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if isinstance(child, dict | list))
            continue
        total = 1
        for child in children:
            total += sizes.get(id(child), 1) if isinstance(child, dict | list) else 1
        sizes[id(node)] = min(total, MAX_VALUES + 1)
    return sizes.get(id(data), 1)


def _non_string_key(node: object, where: tuple[str, ...]) -> tuple[tuple[str, ...], object] | None:
    """The first key that is not a string, and the path of keys leading to it."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                return where, key
            found = _non_string_key(value, (*where, key))
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found = _non_string_key(item, (*where, str(i)))
            if found is not None:
                return found
    return None


def undecodable_locs(value: object, loc: list[str]) -> list[list[str]]:
    """Where `value` holds text with bytes that were not UTF-8: Python hands an environment
    variable's undecodable bytes on as lone surrogates, and YAML's "\\ud800" gives one, which no
    log line, label or ledger row can encode (the ledger's first write failed with a traceback)."""
    if isinstance(value, str):
        return [] if value.isascii() or _encodes(value) else [loc]
    found: list[list[str]] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = [*loc, str(key)]
            found += [where] if isinstance(key, str) and not _encodes(key) else undecodable_locs(item, where)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found += undecodable_locs(item, [*loc, str(i)])
    return found


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
