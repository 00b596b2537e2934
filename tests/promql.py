"""Reading PromQL in tests: which metric names an expression selects."""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# Not preceded by a name character, a digit or a dot: "5m" and "1e3" hold no name; nor by $:
# a Grafana variable ($__interval_ms) is a number.
_NAMES = re.compile(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
    | {"atan2", "inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (by plain name; no __name__ matchers here).

    Strings, label matchers, ranges and label lists are cut out first; of what is left, a name
    followed by "(" is a function or an aggregation, and the operators are keywords."""
    text = _STRINGS.sub('""', expr)
    text = _LABEL_LISTS.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    names = set()
    for match in _NAMES.finditer(text):
        rest = text[match.end() :].lstrip()
        if match.group() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(match.group())
    return names
