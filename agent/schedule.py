"""The daemon's schedules: APScheduler's BackgroundScheduler running interval jobs, kept to real
time when the wall clock is stepped.

APScheduler 3 schedules by the wall clock: an interval job's next run is its last run plus the
interval, and the scheduler sleeps until that time by `datetime.now()`. A clock stepped back by
NTP (or by hand) by an hour would leave every job waiting an hour (the polls stop, /healthz
turns 503); one stepped forward would owe every run it skipped, and work through all of them
(coalesced into one run, but counted one by one: millions for a clock set from 1970) before
running anything. So:

  forward   a job that owes whole intervals runs once, now, and every interval from then
            (`_SteadyInterval`), within the scheduler's own thread, so no burst and no backlog
  back      a thread compares the wall clock with the monotonic one every second; when they
            part by more than STEP_TOLERANCE_S it says so once, with the step's size, and runs
            every job whose next run is stranded beyond one interval from now at once, each
            then every interval from then
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from agent.units import format_duration

log = logging.getLogger(__name__)

STEP_TOLERANCE_S = 1.0  # more than NTP's slewing (0.5 ms a second at most) or a late wake-up adds
WATCH_EVERY_S = 1.0


class _SteadyInterval(IntervalTrigger):  # type: ignore[misc]  # APScheduler is untyped
    """An interval trigger that owes no runs: where the next run by the interval is already past
    (the wall clock stepped forward, or the process was stopped), the next run is now."""

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        next_fire: datetime | None = super().get_next_fire_time(previous_fire_time, now)
        if previous_fire_time is not None and next_fire is not None and next_fire < now:
            return now
        return next_fire


def _wall_minus_monotonic() -> float:
    # The wall clock as the scheduler reads it (datetime.now), not time.time.
    return datetime.now(UTC).timestamp() - time.monotonic()


class Schedule:
    """Interval jobs on a BackgroundScheduler of their own (`name`, in its thread's name and
    the step's log line), each run at most once at a time, late runs coalesced. `says_steps`:
    log each wall-clock step (one schedule in the process says it, not each)."""

    def __init__(self, name: str, *, says_steps: bool = True) -> None:
        self.name = name
        self._says_steps = says_steps
        self._scheduler = BackgroundScheduler(daemon=True)
        self._stopped = threading.Event()
        self._watch = threading.Thread(target=self._watch_clock, name=f"gpuledger-{name}-clock", daemon=True)

    def add(
        self,
        job_id: str,
        run: Callable[[], object],
        interval_s: float,
        *,
        at_start: bool = False,
        misfire_grace_s: int | None = None,
    ) -> None:
        """Run `run` every `interval_s` (from now, or from one interval on unless `at_start`)."""
        options: dict[str, Any] = {"max_instances": 1, "coalesce": True, "id": job_id}
        if at_start:
            options["next_run_time"] = datetime.now(UTC)
        if misfire_grace_s is not None:
            options["misfire_grace_time"] = misfire_grace_s
        self._scheduler.add_job(run, _SteadyInterval(seconds=interval_s, timezone=UTC), **options)

    def add_listener(self, callback: Callable[[Any], object], mask: int) -> None:
        self._scheduler.add_listener(callback, mask)

    def start(self) -> None:
        self._scheduler.start()
        self._watch.start()

    def shutdown(self, wait: bool) -> None:
        self._stopped.set()
        self._scheduler.shutdown(wait=wait)

    def _watch_clock(self) -> None:
        offset = _wall_minus_monotonic()
        while not self._stopped.wait(WATCH_EVERY_S):  # the wait runs on the monotonic clock
            now_offset = _wall_minus_monotonic()
            step_s, offset = now_offset - offset, now_offset
            if abs(step_s) > STEP_TOLERANCE_S:
                self._stepped(step_s)

    def _stepped(self, step_s: float) -> None:
        log.log(
            logging.WARNING if self._says_steps else logging.DEBUG,
            "the wall clock was stepped %s by %s: the %s schedule runs now and every interval from now",
            "forward" if step_s > 0 else "back",
            format_duration(abs(step_s)),
            self.name,
            extra={"event": "clock_stepped", "step_s": step_s},
        )
        now = datetime.now(UTC)
        for job in self._scheduler.get_jobs():
            interval = timedelta(seconds=job.trigger.interval_length)
            next_run: datetime | None = job.next_run_time
            # A job the scheduler already put back on time (a step forward) keeps its rhythm.
            if next_run is None or not now - interval < next_run <= now + interval:
                job.modify(next_run_time=now)
