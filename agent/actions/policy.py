"""Which actions are due, from the agent's published state. Pure: state in, state and
decisions out, the time taken from the snapshot (the backend clock).

A target is what an action acts on: a node (its flag raised on every GPU of the node), a GPU,
or a workload (the flag raised on every GPU it holds). While a target's flag holds it is in
one *episode*; the episode ends at the first poll that finds the flag down. Each (trigger,
target, episode) is decided once, when the flag has held for the trigger's `after`:

    run       hand the action to the runner (its outcome, executed / failed / timeout, comes later)
    dry_run   what would have run, logged and counted, nothing run
    denied    an allowlist does not name the target, or a denylist does

and never again in that episode, whatever happens to the run. Two outcomes leave the episode
waiting, logged once each: `cooldown` (the action ran on this target less than its cooldown
ago) and `deferred` (the runner's queue is full); it is decided once they pass.

A restarted agent has no flag history: its rules raise again only after their `for`, and the
flag's held time starts over. Episodes decided before the restart (`run` and `dry_run`, from
the state file) are kept for `Trigger.resume_s` after the first poll: a flag on the same
target raised within it is taken for the same episode, so nothing runs twice across a restart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

from agent.model import AgentState, Workload

RUN = "run"
DRY_RUN = "dry_run"
DENIED = "denied"
COOLDOWN = "cooldown"
DEFERRED = "deferred"
# Decisions that end an episode's deciding; COOLDOWN and DEFERRED leave it waiting.
FINAL = frozenset({RUN, DRY_RUN, DENIED})
# Decisions worth remembering across a restart: what ran, or would have.
KEPT = frozenset({RUN, DRY_RUN})


@dataclass(frozen=True, slots=True)
class Selector:
    """Glob patterns per kind of name; see `matches`."""

    namespaces: tuple[str, ...] = ()
    hpc_jobs: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()

    def empty(self) -> bool:
        return not (self.namespaces or self.hpc_jobs or self.users or self.nodes)

    def matches(self, target: Target, claims: bool = True) -> str | None:
        """The first pattern that names the target or one of its workloads ("namespaces=kube-*"),
        or None. Empty names never match: a Slurm job has no namespace to be listed by. With
        `claims` False, a job only its own processes' environment names (`Target.claimed`) is
        not a name to match: what a process says of itself must not put it on an allowlist."""
        jobs = tuple(w.hpc_job for w in target.workloads if claims or w not in target.claimed)
        for kind, patterns, values in (
            ("nodes", self.nodes, (target.node,)),
            ("namespaces", self.namespaces, tuple(w.namespace for w in target.workloads)),
            ("hpc_jobs", self.hpc_jobs, jobs),
            ("users", self.users, tuple(w.user for w in target.workloads)),
        ):
            for pattern in patterns:
                if any(value and fnmatchcase(value, pattern) for value in values):
                    return f"{kind}={pattern}"
        return None


@dataclass(frozen=True, slots=True)
class Trigger:
    """One configured action, as the policy and the runner need it (built from the config by
    the command line's wiring)."""

    name: str
    flag: str  # the flag rule's name
    scope: str  # node, gpu or workload
    after_s: float = 0.0
    cooldown_s: float = 3600.0
    dry_run: bool = True
    # Every allowlist that is not empty must name the target; no denylist may.
    allow: tuple[Selector, ...] = ()
    deny: tuple[Selector, ...] = ()
    # How long after a restart an episode decided before it waits for its flag to raise again:
    # the flag rule's `for` and a few polls.
    resume_s: float = 0.0
    command: tuple[str, ...] = ()
    timeout_s: float = 60.0
    env: tuple[tuple[str, str], ...] = ()  # fixed variables for the command
    pass_env: tuple[str, ...] = ()  # names of the agent's variables the command gets too
    webhook_url: str = ""
    webhook_format: str = "alertmanager"
    webhook_headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Target:
    """What one action acts on, as the latest poll shows it."""

    key: str  # stable across polls and restarts: "node:<name>", "gpu:<uuid>", "workload:<labels>"
    scope: str
    node: str
    rule: str
    gpus: tuple[tuple[int, str], ...]  # (index, uuid) of the flagged GPUs
    workloads: tuple[Workload, ...]  # the workload (scope workload) or the GPUs' holders
    held_s: float  # how long the flag has held on all of them (the shortest)
    dollars: float  # what the flagged GPUs cost while the flag held
    # Those of `workloads` that only their own processes name (SLURM_JOB_ID in their environment,
    # which any local user can set; `Holding.self_reported` on every GPU they hold): never acted
    # on as themselves, and no allowlist entry for their job admits them.
    claimed: frozenset[Workload] = frozenset()

    def describe(self) -> str:
        if self.scope == "node":
            return f"node {self.node}"
        if self.scope == "gpu":
            return f"GPU {self.gpus[0][0]} on {self.node}"
        return f"{self.workloads[0].describe()} on {self.node}"


@dataclass(frozen=True, slots=True)
class Episode:
    since: float  # backend clock: when the flag began holding on the target
    decided: str = ""  # a FINAL decision, once made
    noted: frozenset[str] = frozenset()  # waiting outcomes already logged in this episode
    resumed: bool = False  # from before a restart, not yet seen again
    dry_run: bool = False  # decided under dry-run


@dataclass(frozen=True, slots=True)
class Cooldown:
    until: float  # backend clock
    dry_run: bool = False  # started by a dry run: a trigger switched to live does not wait for it


@dataclass(frozen=True)
class PolicyState:
    episodes: Mapping[tuple[str, str], Episode] = field(default_factory=dict)  # (trigger, target key)
    cooldowns: Mapping[tuple[str, str], Cooldown] = field(default_factory=dict)
    started_at: float | None = None  # the first poll this run observed


@dataclass(frozen=True, slots=True)
class Decision:
    trigger: Trigger
    result: str  # RUN, DRY_RUN, DENIED, COOLDOWN or DEFERRED
    target: Target
    episode_since: float
    reason: str = ""  # denied: the list entry; cooldown: until when


def targets(state: AgentState, rule: str, scope: str) -> list[Target]:
    """The targets on which `rule`'s flag is raised now, in `scope`."""
    snapshot = state.snapshot
    if snapshot is None:
        return []
    node = snapshot.node.hostname
    raised = {f.uuid: f for f in state.flags if f.rule == rule and f.raised}
    gpus = snapshot.gpus
    parent = {d.uuid: d.parent_uuid or d.uuid for d in snapshot.devices}
    holders: dict[str, set[Workload]] = {}
    trusted: set[Workload] = set()  # named by a trusted source on at least one device
    for h in state.attribution.holdings:
        gpu_uuid = parent.get(h.device_uuid)
        if gpu_uuid is not None and h.workload != Workload():
            holders.setdefault(gpu_uuid, set()).add(h.workload)
            if not h.self_reported:
                trusted.add(h.workload)
    claimed = frozenset(w for held in holders.values() for w in held if w not in trusted)
    found: list[Target] = []
    if scope == "node":
        if gpus and all(g.uuid in raised for g in gpus):
            flags = [raised[g.uuid] for g in gpus]
            found.append(
                Target(
                    key=f"node:{node}",
                    scope=scope,
                    node=node,
                    rule=rule,
                    gpus=tuple((g.index, g.uuid) for g in gpus),
                    workloads=tuple(sorted({w for g in gpus for w in holders.get(g.uuid, ())})),
                    held_s=min(f.held_s for f in flags),
                    dollars=sum(f.dollars for f in flags),
                    claimed=claimed,
                )
            )
    elif scope == "gpu":
        for g in gpus:
            flag = raised.get(g.uuid)
            if flag is not None:
                found.append(
                    Target(
                        key=f"gpu:{g.uuid}",
                        scope=scope,
                        node=node,
                        rule=rule,
                        gpus=((g.index, g.uuid),),
                        workloads=tuple(sorted(holders.get(g.uuid, ()))),
                        held_s=flag.held_s,
                        dollars=flag.dollars,
                        claimed=claimed,
                    )
                )
    elif scope == "workload":
        # By the units it holds, each flagged on its own: a GPU, or a MIG instance (whose GPU
        # holds no condition).
        held_by: dict[Workload, set[str]] = {}
        for h in state.attribution.holdings:
            if h.device_uuid in parent and h.workload != Workload():
                held_by.setdefault(h.workload, set()).add(h.device_uuid)
        for w, uuids in sorted(held_by.items()):
            if all(u in raised for u in uuids):
                flags = sorted((raised[u] for u in uuids), key=lambda f: (f.gpu, f.uuid))
                found.append(
                    Target(
                        key="workload:" + json.dumps(w.label_dict(), sort_keys=True, separators=(",", ":")),
                        scope=scope,
                        node=node,
                        rule=rule,
                        gpus=tuple((f.gpu, f.uuid) for f in flags),
                        workloads=(w,),
                        held_s=min(f.held_s for f in flags),
                        dollars=sum(f.dollars for f in flags),
                        claimed=claimed,
                    )
                )
    else:
        raise ValueError(f"unknown scope {scope!r}")
    return found


def _denied(trigger: Trigger, target: Target) -> str | None:
    if target.scope == "workload" and target.workloads[0] in target.claimed:
        # Its job id is what its own processes' environment says: any local user can name
        # another user's job there, and a command given it (scancel) would act on the victim.
        return "its job is named only by its own processes' environment (self-reported)"
    for deny in trigger.deny:
        hit = deny.matches(target)
        if hit is not None:
            return f"denylist {hit}"
    for allow in trigger.allow:
        if not allow.empty() and allow.matches(target, claims=False) is None:
            return "no allowlist entry names it"
    return None


def decide(
    state: PolicyState, agent: AgentState, triggers: Sequence[Trigger], capacity: int
) -> tuple[PolicyState, list[Decision]]:
    """The decisions the latest poll calls for. `capacity` is how many more runs the runner
    takes now; runs beyond it are deferred to a later poll."""
    snapshot = agent.snapshot
    if snapshot is None:
        return state, []
    now = snapshot.taken_at
    started_at = state.started_at if state.started_at is not None else now
    episodes: dict[tuple[str, str], Episode] = {}
    cooldowns = {k: c for k, c in state.cooldowns.items() if c.until > now}
    decisions: list[Decision] = []
    by_flag: dict[tuple[str, str], list[Target]] = {}
    for trigger in triggers:
        found = by_flag.get((trigger.flag, trigger.scope))
        if found is None:
            found = by_flag[(trigger.flag, trigger.scope)] = targets(agent, trigger.flag, trigger.scope)
        seen = set()
        for target in found:
            key = (trigger.name, target.key)
            seen.add(key)
            old = state.episodes.get(key)
            episode = (
                replace(old, resumed=False) if old is not None else Episode(since=now - target.held_s)
            )  # fmt: skip
            if not episode.decided and target.held_s >= trigger.after_s:
                episode, decision = _decide(trigger, target, episode, cooldowns, now, capacity)
                if decision is not None:
                    decisions.append(decision)
                    if decision.result in (RUN, DRY_RUN) and trigger.cooldown_s > 0:
                        cooldowns[key] = Cooldown(now + trigger.cooldown_s, decision.result == DRY_RUN)
                    if decision.result == RUN:
                        capacity -= 1
            episodes[key] = episode
        # Episodes whose flag is down now have ended; those carried over a restart wait a while.
        episodes.update(
            (key, old)
            for key, old in state.episodes.items()
            if key[0] == trigger.name and key not in seen and old.resumed and now - started_at <= trigger.resume_s
        )
    return PolicyState(episodes, cooldowns, started_at), decisions


def _decide(
    trigger: Trigger,
    target: Target,
    episode: Episode,
    cooldowns: Mapping[tuple[str, str], Cooldown],
    now: float,
    capacity: int,
) -> tuple[Episode, Decision | None]:
    since = episode.since
    denied = _denied(trigger, target)
    if denied is not None:
        return replace(episode, decided=DENIED), Decision(trigger, DENIED, target, since, denied)
    cooldown = cooldowns.get((trigger.name, target.key))
    if cooldown is not None:
        return _wait(episode, Decision(trigger, COOLDOWN, target, since, f"{cooldown.until - now:.0f}s left"))
    if trigger.dry_run:
        return replace(episode, decided=DRY_RUN, dry_run=True), Decision(trigger, DRY_RUN, target, since)
    if capacity <= 0:
        return _wait(episode, Decision(trigger, DEFERRED, target, since, "the action queue is full"))
    return replace(episode, decided=RUN), Decision(trigger, RUN, target, since)


def changed(decision: Decision, decided_at: float, agent: AgentState, state: PolicyState) -> str | None:
    """Why a run decided at the poll of `decided_at` no longer fits `agent`, the latest poll (with
    `state`, the policy's state after it), or None when it still does. A run waits in the
    runner's queue while others run (a command may take its whole timeout), and meanwhile a job
    may start on an idle node or a GPU change hands: stopping the node or cancelling the new
    holder's job would hit the wrong target."""
    target = decision.target
    if agent.snapshot is None or agent.snapshot.taken_at <= decided_at:
        return None  # nothing newer than what it was decided on
    episode = state.episodes.get((decision.trigger.name, target.key))
    if episode is None or episode.since != decision.episode_since:
        return "its flag has cleared since it was decided"
    now = next((t for t in targets(agent, target.rule, target.scope) if t.key == target.key), None)
    if now is None:
        return "its flag has cleared since it was decided"
    if now.workloads != target.workloads or now.gpus != target.gpus:
        return "who holds its GPUs has changed since it was decided"
    return None


def _wait(episode: Episode, decision: Decision) -> tuple[Episode, Decision | None]:
    """Still waiting: the decision is reported the first time in the episode only."""
    if decision.result in episode.noted:
        return episode, None
    return replace(episode, noted=episode.noted | {decision.result}), decision


# -- what survives a restart ----------------------------------------------------------------

STATE_VERSION = 1


def dump_state(state: PolicyState) -> dict[str, object]:
    """The part of `state` a restarted agent needs, as JSON-ready data: the episodes that ran
    (or would have) and the cooldowns still running."""
    return {
        "version": STATE_VERSION,
        "episodes": [
            {"trigger": t, "target": k, "since": e.since, "decided": e.decided, "dry_run": e.dry_run}
            for (t, k), e in sorted(state.episodes.items())
            if e.decided in KEPT
        ],
        "cooldowns": [
            {"trigger": t, "target": k, "until": c.until, "dry_run": c.dry_run}
            for (t, k), c in sorted(state.cooldowns.items())
        ],
    }


def load_state(data: object, triggers: Sequence[Trigger]) -> PolicyState:
    """The state `dump_state` wrote, for the triggers configured now: episodes of triggers gone
    are dropped, and so are episodes and cooldowns of dry runs for a trigger that now runs (it
    must get its real run). ValueError for data that is not such a state."""
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise ValueError(f"not a version {STATE_VERSION} actions state")
    live = {t.name: t for t in triggers}
    episodes: dict[tuple[str, str], Episode] = {}
    cooldowns: dict[tuple[str, str], Cooldown] = {}
    try:
        for e in data.get("episodes", []):
            trigger = live.get(str(e["trigger"]))
            if trigger is None or (bool(e["dry_run"]) and not trigger.dry_run) or e["decided"] not in KEPT:
                continue
            episodes[(trigger.name, str(e["target"]))] = Episode(
                since=float(e["since"]), decided=str(e["decided"]), resumed=True, dry_run=bool(e["dry_run"])
            )
        for c in data.get("cooldowns", []):
            trigger = live.get(str(c["trigger"]))
            if trigger is not None and not (bool(c["dry_run"]) and not trigger.dry_run):
                cooldowns[(trigger.name, str(c["target"]))] = Cooldown(float(c["until"]), bool(c["dry_run"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed actions state: {exc!r}") from None
    return PolicyState(episodes, cooldowns)
