"""How a process logs: to standard error, as text for people or as JSON lines for a log
collector (`--log-format json`)."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Literal

__all__ = ["JsonLines", "LogFormat", "LogLevel", "setup_logging"]

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


class JsonLines(logging.Formatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message, node_id, and
    the traceback as `exception` when there is one."""

    def __init__(self, node_id: str = "") -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        event = {
            "time": when.isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "node_id": self.node_id,
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event)


def setup_logging(level: str, fmt: str = "text") -> logging.Formatter:
    """Log to standard error at `level`, as text or JSON lines; the formatter."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = (
        JsonLines()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler])
    return formatter
