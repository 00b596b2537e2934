"""Opt-in actions on flags: when a flag has held long enough on a node, a GPU or a workload's
GPUs, run a command or POST a webhook (config `actions:`; dry-run unless told otherwise).

    config.py   the `actions:` section (agent.config owns the settings) and its host checks
    policy.py   pure: targets, flag episodes, allow/deny lists, cooldowns -> decisions
    context.py  pure: what an action is told (JSON on stdin, GPULEDGER_* variables, webhook bodies)
    runner.py   worker threads that run commands (killed at their timeout) and POST webhooks
    engine.py   `Actions`: each poll's decisions logged, counted and run; the state file

The pipeline calls `Actions.observe` with each poll's published state and reads `counts()`
into the next state it publishes; nothing here reaches back into the pipeline's inputs.
"""

from __future__ import annotations

from agent.actions.engine import RESULTS, Actions
from agent.actions.policy import Selector, Trigger

__all__ = ["RESULTS", "Actions", "Selector", "Trigger"]
