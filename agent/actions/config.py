"""The `actions:` section of the config: what to do when a flag has held long enough.

Read by `agent.config` (which owns the settings) and turned into plain `Trigger`s by the
command line's wiring; nothing in `agent.actions` reads the config itself.

    actions:
      dry_run: true                  # the default: log and count what would run, run nothing
      workers: 2                     # actions running at once; more wait, up to queue_size
      queue_size: 16
      state_file: /var/lib/gpuledger/actions.json
      deny: {namespaces: [kube-system]}
      triggers:
        stop-idle-node:              # the name: the `action` label of gpuledger_actions_total
          flag: idle                 # a flag rule, built-in or custom
          scope: node                # node: on every GPU of the node; gpu; workload: on every GPU it holds
          after: 2h                  # the flag has held this long (gpuledger_gpu_flag_seconds)
          command: [/etc/gpuledger/actions/stop-instance-aws.sh]
          timeout: 2m
          cooldown: 6h
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from agent.model import WORKLOAD_LABELS
from agent.units import parse_duration

Duration = Annotated[float, BeforeValidator(parse_duration)]

SCOPES = ("node", "gpu", "workload")
# Rule conditions under which nobody holds the GPU: a workload-scoped action has no one to act on.
UNHELD_CONDITIONS = frozenset({"idle"})
# Variables a command gets from the agent's own environment without being asked: enough to find
# programs and print text. Nothing else of the agent's environment reaches a command.
BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# The flag's context, as every command gets it (agent/actions/context.py sets each): a gpuledger
# the command itself runs must not take them for misspelt settings (agent.config.unknown_variables).
CONTEXT_VARIABLES = frozenset(
    {
        "GPULEDGER_ACTION",
        "GPULEDGER_AT",
        "GPULEDGER_RULE",
        "GPULEDGER_SCOPE",
        "GPULEDGER_NODE",
        "GPULEDGER_GPUS",
        "GPULEDGER_GPU_UUIDS",
        "GPULEDGER_EPISODE_START",
        "GPULEDGER_HELD_SECONDS",
        "GPULEDGER_DOLLARS",
        "GPULEDGER_SUMMARY",
        *(f"GPULEDGER_{label.upper()}" for label in WORKLOAD_LABELS),
    }
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetList(_Section):
    """Glob patterns (fnmatch) naming what an action may, or may never, act on."""

    namespaces: list[str] = []
    hpc_jobs: list[str] = []
    users: list[str] = []
    nodes: list[str] = []

    def empty(self) -> bool:
        return not (self.namespaces or self.hpc_jobs or self.users or self.nodes)


class WebhookConfig(_Section):
    url: str
    # alertmanager: Alertmanager's webhook JSON (version "4"); slack: {"text": ...}, which Slack's
    # incoming webhooks and the chat tools that copy them (Mattermost, Rocket.Chat) take.
    format: Literal["alertmanager", "slack"] = "alertmanager"
    timeout: Duration = Field(default=10.0, gt=0)
    headers: dict[str, str] = {}

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value


class TriggerConfig(_Section):
    flag: str
    scope: Literal["node", "gpu", "workload"]
    after: Duration = 0.0
    command: list[str] | None = None
    webhook: WebhookConfig | None = None
    timeout: Duration = Field(default=60.0, gt=0)  # a command running longer is killed
    # Once an action ran (or would have) on a target, it waits this long before it runs on that
    # target again, whatever its flags do meanwhile.
    cooldown: Duration = 3600.0
    dry_run: bool | None = None  # None: the section's dry_run
    allow: TargetList = TargetList()
    deny: TargetList = TargetList()
    env: dict[str, str] = {}  # fixed variables for the command
    pass_env: list[str] = []  # names of the agent's own variables the command gets too (AWS_REGION)

    @field_validator("command")
    @classmethod
    def _argv(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not value[0].strip()):
            raise ValueError("must name a program: an argv list such as [/usr/bin/scancel, --signal=TERM]")
        return value

    @field_validator("env", "pass_env")
    @classmethod
    def _env_names(cls, value: dict[str, str] | list[str]) -> dict[str, str] | list[str]:
        for name in value:
            if not re.match(_ENV_NAME, name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.startswith("GPULEDGER_"):
                raise ValueError(f"{name}: GPULEDGER_* variables carry the flag's context; choose another name")
        return value

    @model_validator(mode="after")
    def _one_way_to_act(self) -> TriggerConfig:
        if (self.command is None) == (self.webhook is None):
            raise ValueError("give exactly one of command (an argv list) or webhook")
        return self


class ActionsConfig(_Section):
    dry_run: bool = True
    workers: int = Field(default=2, ge=1, le=64)
    queue_size: int = Field(default=16, ge=0, le=10_000)
    # Which flag episodes were acted on, and the cooldowns: read at start, so a restarted agent
    # does not act twice on one episode. None: kept in memory only.
    state_file: str | None = "/var/lib/gpuledger/actions.json"
    allow: TargetList = TargetList()
    deny: TargetList = TargetList()
    triggers: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", max_length=64)], TriggerConfig] = {}


def cross_problems(actions: ActionsConfig, rules: dict[str, tuple[str, bool]], source: str) -> list[str]:
    """What the triggers ask of the flag rules: each names a rule that exists and is enabled, and
    a workload scope needs a rule under which somebody holds the GPU. `rules` maps each rule's
    name to (condition, enabled)."""
    problems = []
    for name, trigger in actions.triggers.items():
        key = f"actions.triggers.{name}"
        found = rules.get(trigger.flag)
        if found is None:
            problems.append(f"{source}: {key}.flag: no flag rule named {trigger.flag!r} (known: {', '.join(rules)})")
        elif not found[1]:
            problems.append(f"{source}: {key}.flag: the rule {trigger.flag!r} is disabled (rules.{trigger.flag})")
        elif trigger.scope == "workload" and found[0] in UNHELD_CONDITIONS:
            problems.append(
                f"{source}: {key}.scope: {trigger.flag!r} flags GPUs nobody holds, so there is no workload to "
                "act on (use scope node or gpu)"
            )
    return problems


def host_problems(actions: ActionsConfig, source: str, environ: dict[str, str] | None = None) -> list[str]:
    """What `run` would refuse on this host: a command it cannot find or execute, a state file
    that cannot be a file. Dry-run triggers too: turning dry_run off must not be what reveals a
    mistyped program."""
    problems = []
    path = (environ if environ is not None else dict(os.environ)).get("PATH", os.defpath)
    for name, trigger in actions.triggers.items():
        if trigger.command is None:
            continue
        program = trigger.command[0]
        found = shutil.which(program, path=path) if os.sep not in program else program
        if found is None or not (Path(found).is_file() and os.access(found, os.X_OK)):
            problems.append(
                f"{source}: actions.triggers.{name}.command: {program}: no such executable file"
                + ("" if os.sep in program else " on PATH")
            )
    if actions.state_file:
        state = Path(actions.state_file)
        if state.is_dir():
            problems.append(f"{source}: actions.state_file: {state} is a directory, not a file")
        elif state.exists() and not state.is_file():
            # A FIFO would hold the start-up in its read for good; a device (/dev/null) would be
            # replaced by the first save.
            problems.append(f"{source}: actions.state_file: {state} is not a regular file")
        else:
            parent = next((p for p in state.parents if p.exists()), None)
            if parent is not None and not parent.is_dir():
                problems.append(f"{source}: actions.state_file: {parent} is not a directory")
    return problems
