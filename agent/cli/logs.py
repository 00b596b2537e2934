"""The agent's log format: one event, one line, no credentials.

Log messages interpolate values from processes (command lines, environment values, pod and job
names) and from HTTP clients. A newline in such a value would start a forged log line that
a log shipper takes for the agent's own, and a token in it would land in the log store. Every
message therefore goes through `agent.scrub.scrub_label`. An exception logged with the message
(`log.exception`) adds its type and text to that one line; only with --debug does its traceback
follow, each of its lines scrubbed too: the code's lines are the agent's, but the exception's
text may quote an input (a command line, a webhook URL with its key).
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType

from agent.scrub import scrub_label

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class SafeFormatter(logging.Formatter):
    """A Formatter whose `%(message)s` is scrubbed and has its control characters escaped, and
    which writes an exception's traceback only when `debug`."""

    def __init__(self, fmt: str, *, debug: bool = False) -> None:
        super().__init__(fmt)
        self.debug = debug

    def formatMessage(self, record: logging.LogRecord) -> str:
        # format() sets record.message from msg % args just before calling this.
        record.message = scrub_label(record.message)
        return super().formatMessage(record)

    def formatException(
        self, ei: tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]
    ) -> str:
        return "\n".join(scrub_label(line) for line in super().formatException(ei).splitlines())

    def format(self, record: logging.LogRecord) -> str:
        if self.debug or not record.exc_info or record.exc_info[1] is None:
            return super().format(record)
        exc = record.exc_info[1]
        # The record may go to other handlers too: it is handed back as it came.
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return line + scrub_label(f" ({type(exc).__name__}: {exc})")


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(LOG_FORMAT, debug=debug))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler], force=True)
    # APScheduler logs every job run at INFO; that is noise at a 5 s interval.
    logging.getLogger("apscheduler").setLevel(logging.DEBUG if debug else logging.WARNING)
