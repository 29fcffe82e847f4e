"""The daemon's log lines: `--log-format text` (one human line each) or
`json` (one JSON object per line, for log shippers)."""
from __future__ import annotations

import datetime
import json
import logging

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """{"time": ISO 8601 UTC, "level", "logger", "message"[, "exception"]}: one
    line per record whatever the message holds (json.dumps escapes newlines)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "text") -> None:
    """Configure the root logger: level (a name, any case), fmt in FORMATS."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
