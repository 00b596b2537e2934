"""The agent's log format: one event, one line, no credentials.

Log messages interpolate values from processes (command lines, environment values, pod and job
names) and from HTTP clients. A newline in such a value would start a forged log line that
a log shipper takes for the agent's own, and a token in it would land in the log store. Every
message therefore goes through `agent.scrub.scrub_label`; tracebacks (debug only) keep their
lines, since they come from the agent's code, not from its inputs.
"""

from __future__ import annotations

import logging
import sys

from agent.scrub import scrub_label

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class SafeFormatter(logging.Formatter):
    """A Formatter whose `%(message)s` is scrubbed and has its control characters escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        # format() sets record.message from msg % args just before calling this.
        record.message = scrub_label(record.message)
        return super().formatMessage(record)


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler], force=True)
    # APScheduler logs every job run at INFO; that is noise at a 5 s interval.
    logging.getLogger("apscheduler").setLevel(logging.DEBUG if debug else logging.WARNING)
