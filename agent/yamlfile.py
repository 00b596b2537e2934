"""Reading a YAML file into plain data, with any failure as one line naming the file."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent.scrub import escape_control

# libyaml's parser where PyYAML was built with it: 3-4x faster on a recorded trace (hundreds of
# KiB). Its error messages are terser ("did not find expected ','", some a line off), so a
# document it rejects is parsed again by the pure-Python parser, whose message is the one shown.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse(text: str) -> object:
    try:
        return yaml.load(text, Loader=_FAST_LOADER)  # a safe loader: plain data only
    except yaml.YAMLError:
        if _FAST_LOADER is yaml.SafeLoader:
            raise
    return yaml.safe_load(text)


class YamlFileError(ValueError):
    """The file is missing, unreadable or not YAML; the message is one line with its path."""


def read_yaml(path: Path, what: str) -> object:
    """The parsed document (None for an empty file). `what` names the file's role in errors.

    Every mapping key must be a string: `1: x` or `yes: x` (YAML 1.1 reads `yes` as true) in a
    settings file is a mistake, and left in it would surface as a TypeError far from the file.
    """
    try:
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
    bad = _non_string_key(data, ())
    if bad is not None:
        keys, key = bad
        at = f" {'.'.join(keys)}:" if keys else ""
        # The keys leading there may hold any text, newlines included: the message stays one line.
        message = f"{path}:{at} keys must be text, got {key!r} ({type(key).__name__}); quote it"
        raise YamlFileError(escape_control(message))
    return data


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
