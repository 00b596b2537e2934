"""Reading a YAML file into plain data, with any failure as one line naming the file."""

from __future__ import annotations

from pathlib import Path

import yaml


class YamlFileError(ValueError):
    """The file is missing, unreadable or not YAML; the message is one line with its path."""


def read_yaml(path: Path, what: str) -> object:
    """The parsed document (None for an empty file). `what` names the file's role in errors."""
    try:
        return yaml.safe_load(path.read_text())
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
