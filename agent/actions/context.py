"""What an action is told about the flag it acts on: one JSON document (a command's stdin),
the same facts as `GPULEDGER_*` variables (a command's environment), and the webhook bodies
(Alertmanager's webhook JSON, or a chat message). Pure.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from agent import __version__
from agent.actions.policy import Decision
from agent.model import WORKLOAD_LABELS
from agent.units import format_duration

CONTEXT_VERSION = 1
ALERTNAME = "GPULedgerAction"
RECEIVER = "gpuledger-actions"
# Alertmanager writes this for an alert that has not resolved.
ZERO_TIME = "0001-01-01T00:00:00Z"


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def summary(decision: Decision) -> str:
    """One sentence: what was flagged, for how long, what it cost meanwhile."""
    target = decision.target
    where = "every GPU" if len(target.gpus) > 1 else "GPU " + ", ".join(str(i) for i, _ in target.gpus)
    if len(target.gpus) > 1:
        where += f" ({len(target.gpus)})"
    return (
        f"{target.describe()}: {target.rule} on {where} for {format_duration(target.held_s)}, "
        f"${target.dollars:.2f} so far"
    )


def context(decision: Decision, now: float) -> dict[str, Any]:
    """The document a command reads on stdin."""
    target = decision.target
    workload = target.workloads[0].label_dict() if target.scope == "workload" else None
    return {
        "version": CONTEXT_VERSION,
        "action": decision.trigger.name,
        "at": rfc3339(now),
        "rule": target.rule,
        "scope": target.scope,
        "node": target.node,
        "target": target.describe(),
        "episode_start": rfc3339(decision.episode_since),
        "held_seconds": target.held_s,
        "dollars": target.dollars,
        "gpus": [{"gpu": index, "uuid": uuid} for index, uuid in target.gpus],
        "workload": workload,
        "holders": [w.label_dict() for w in target.workloads],
        "summary": summary(decision),
    }


def environment(decision: Decision, now: float) -> dict[str, str]:
    """The flag's context as GPULEDGER_* variables: the workload's labels (scope workload), and
    for every scope the node, rule, GPUs, held time and dollars."""
    target = decision.target
    env = {
        "GPULEDGER_ACTION": decision.trigger.name,
        "GPULEDGER_AT": rfc3339(now),
        "GPULEDGER_RULE": target.rule,
        "GPULEDGER_SCOPE": target.scope,
        "GPULEDGER_NODE": target.node,
        "GPULEDGER_GPUS": ",".join(str(index) for index, _ in target.gpus),
        "GPULEDGER_GPU_UUIDS": ",".join(uuid for _, uuid in target.gpus),
        "GPULEDGER_EPISODE_START": rfc3339(decision.episode_since),
        "GPULEDGER_HELD_SECONDS": f"{target.held_s:.0f}",
        "GPULEDGER_DOLLARS": f"{target.dollars:.2f}",
        "GPULEDGER_SUMMARY": summary(decision),
    }
    labels = target.workloads[0].label_dict() if target.scope == "workload" else dict.fromkeys(WORKLOAD_LABELS, "")
    env.update({f"GPULEDGER_{name.upper()}": value for name, value in labels.items()})
    return env


def alert_labels(decision: Decision) -> dict[str, str]:
    target = decision.target
    labels = {"alertname": ALERTNAME, "action": decision.trigger.name, "rule": target.rule, "node": target.node}
    labels["scope"] = target.scope
    if target.scope == "gpu":
        labels["gpu"], labels["uuid"] = str(target.gpus[0][0]), target.gpus[0][1]
    if target.scope == "workload":
        labels.update({k: v for k, v in target.workloads[0].label_dict().items() if v})
    return labels


def alertmanager_body(decision: Decision) -> dict[str, Any]:
    """Alertmanager's webhook JSON (version 4) holding one firing alert: what a receiver written
    for Alertmanager reads without change."""
    labels = alert_labels(decision)
    fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    annotations = {
        "summary": summary(decision),
        "description": (
            f"gpuledger {__version__} action {decision.trigger.name}: the flag has held since "
            f"{rfc3339(decision.episode_since)}"
        ),
        "held_seconds": f"{decision.target.held_s:.0f}",
        "dollars": f"{decision.target.dollars:.2f}",
    }
    group = {"action": decision.trigger.name}
    return {
        "version": "4",
        "groupKey": '{}:{action="' + decision.trigger.name + '"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": RECEIVER,
        "groupLabels": group,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [
            {
                "status": "firing",
                "labels": labels,
                "annotations": annotations,
                "startsAt": rfc3339(decision.episode_since),
                "endsAt": ZERO_TIME,
                "generatorURL": "",
                "fingerprint": fingerprint,
            }
        ],
    }


def chat_body(decision: Decision) -> dict[str, Any]:
    """A Slack incoming-webhook message (Mattermost and others take the same)."""
    return {"text": f"gpuledger: {summary(decision)} (action {decision.trigger.name})"}
