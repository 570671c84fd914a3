"""Log output for banyan's processes: plain text lines, or one JSON object per line (`--log-format json`).

A JSON line carries the time, level, logger, process role and message, plus the fields a caller passes as
`extra={"fields": {...}}` (the audit log's request id, tenant, token counts, ...) as top-level keys, so a
log pipeline indexes them without parsing the message. Both processes of `banyan serve` (the API server
and the engine core, whose stderr the server forwards) log in the format the server was given.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
RESERVED = {"time", "level", "logger", "process", "message", "exception"}  # fields never overwrite these


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": self.role,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update({k: v for k, v in fields.items() if k not in RESERVED})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str | int, log_format: str = "text", role: str = "server") -> None:
    """Replace the root logger's handlers with one writing to stderr in `log_format`; `role` names the process."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python's warnings become log lines too (one format on the stream)


def announce(text: str, log_format: str = "text", role: str = "server") -> None:
    """A line for the operator on stdout (e.g. "serving ... at URL"): as it is, or (json) as a log record."""
    if log_format == "json":
        text = JsonFormatter(role).format(logging.LogRecord("banyan.server", logging.INFO, __file__, 0, text, None, None))
    try:
        print(text, flush=True)
    except OSError:  # stdout on a full disk, or a closed pipe: the server serves on without its banner
        pass
