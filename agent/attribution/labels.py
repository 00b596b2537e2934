"""The labelling rules (`attribution.rules` in the config): how a workload gets its `model` and
`team` labels. Pure.

Each rule matches fields of a workload (or its process's cmdline, Slurm account and allowlisted
environment) against regular expressions and sets labels from templates that may use the
match's groups (`$1`). The first rule that sets a label wins it; a model no rule names is
recognised from the cmdline (`agent.attribution.recognise`), else is the one the process
inherits from an ancestor's (`ProcessFacts.inherited_model`: a server's renamed workers). Rules
match the process's own cmdline only. These are not the flag rules, which judge GPUs (`rules/`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from agent.attribution.recognise import recognise_model
from agent.model import ProcessFacts, Workload
from agent.scrub import CACHED_TEXT_MAX_CHARS, scrub, scrub_named

# Pure, and sees the same few cmdlines every poll: remember its answers, for cmdlines of a usual
# length only (`agent.scrub.CACHED_TEXT_MAX_CHARS` says why); a longer one is recognised anew,
# which costs little next to reading it.
_model_cached = lru_cache(maxsize=8192)(recognise_model)

# Fields a rule may match on, beyond `env.<KEY>` for allowlisted environment variables.
MATCH_FIELDS = ("cmdline", "namespace", "pod", "container", "hpc_job", "unit", "user", "account")
# Older names a rule may still use: `job` was the Slurm job's label before it became `hpc_job`.
MATCH_ALIASES = {"job": "hpc_job"}
SET_FIELDS = ("model", "team")


@dataclass(frozen=True, slots=True)
class LabelRule:
    """One rule: every `match` (field, pattern) must match for its `set` (label, template) to apply."""

    match: tuple[tuple[str, re.Pattern[str]], ...]
    set: tuple[tuple[str, str], ...]


def compile_rules(rules: Sequence[tuple[Mapping[str, str], Mapping[str, str]]]) -> tuple[LabelRule, ...]:
    """(match, set) pairs, as the config validated them, into rules."""
    return tuple(
        LabelRule(
            match=tuple((MATCH_ALIASES.get(key, key), re.compile(pattern)) for key, pattern in match.items()),
            set=tuple(sets.items()),
        )
        for match, sets in rules
    )


def rule_env_keys(rules: Sequence[LabelRule]) -> set[str]:
    """Environment keys the rules read: they join the allowlist, and nothing else does."""
    return {key.removeprefix("env.") for rule in rules for key, _ in rule.match if key.startswith("env.")}


def _field_value(
    key: str, w: Workload, cmdline: Sequence[str], facts: ProcessFacts | None, account: str | None
) -> str | None:
    # The process's own cmdline and environment are matched scrubbed: a group (`$1`) would lift a
    # secret out of the context that marks it (`--password=([^ ]+)` captures a bare "hunter2",
    # which no later scrub can tell from a team name).
    if key == "cmdline":
        return scrub(" ".join(cmdline)) if cmdline else None
    if key == "account":
        return account
    if key.startswith("env."):
        value = facts.env_value(key[4:]) if facts is not None else None
        return scrub_named(key[4:], value) if value else value
    value = str(getattr(w, key))
    return value or None


def apply_rules(
    w: Workload,
    cmdline: Sequence[str],
    facts: ProcessFacts | None,
    rules: Sequence[LabelRule],
    account: str | None = None,
    team_from_account: bool = False,
) -> Workload:
    """`w` with the labels the rules set: config rules first (the first rule that sets a
    field wins it), then the built-in recognisers for a model no rule named, and (with
    `team_from_account`) the Slurm account as the team no rule named. `cmdline`, `facts` (for
    `env.` keys) and `account` are what a rule may match besides the workload's fields; an
    allocation without a process has only the account its map file names."""
    inherited = facts.inherited_model if facts is not None else None
    if not rules:
        argv, team = tuple(cmdline), account if team_from_account and account else ""
        if _cacheable(argv):
            return _recognised(w, argv, team, inherited)
        return _recognise(w, argv, team, inherited)
    chosen: dict[str, str] = {}
    for rule in rules:
        if all(name in chosen for name, _ in rule.set):
            continue
        groups: list[str] = []
        for key, pattern in rule.match:
            value = _field_value(key, w, cmdline, facts, account)
            found = pattern.search(value) if value is not None else None
            if found is None:
                break
            groups.extend(g or "" for g in found.groups())
        else:
            for name, template in rule.set:
                if name not in chosen:
                    chosen[name] = _expand(template, groups)
    if "model" not in chosen:
        recognised = (_model_of(tuple(cmdline)) if cmdline else None) or inherited
        if recognised:
            chosen["model"] = recognised
    if "team" not in chosen and team_from_account and account:
        chosen["team"] = account
    return replace(w, **chosen) if chosen else w


def _cacheable(cmdline: Sequence[str]) -> bool:
    return sum(map(len, cmdline)) <= CACHED_TEXT_MAX_CHARS


def _model_of(cmdline: tuple[str, ...]) -> str | None:
    return _model_cached(cmdline) if _cacheable(cmdline) else recognise_model(cmdline)


def _recognise(w: Workload, cmdline: tuple[str, ...], team: str, inherited: str | None = None) -> Workload:
    """`apply_rules` without configured rules: the model the built-in recognisers see in the
    cmdline, else the `inherited` one, and `team` (the account, where it names the team) where
    set. Remembered (`_recognised`), as every poll asks about the same few; answering with the
    same object each time also lets later lookups find it by identity."""
    model = (_model_of(cmdline) if cmdline else None) or inherited
    chosen = {"model": model} if model else {}
    if team:
        chosen["team"] = team
    return replace(w, **chosen) if chosen else w


_recognised = lru_cache(maxsize=8192)(_recognise)


def _expand(template: str, groups: Sequence[str]) -> str:
    return re.sub(
        r"\$(\d)", lambda m: groups[int(m.group(1)) - 1] if 0 < int(m.group(1)) <= len(groups) else "", template
    )
