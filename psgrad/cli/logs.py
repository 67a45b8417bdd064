"""Logging for the command line: `--log-level` and `--log-format text|json` for psgrad's operational messages."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_PREFIX = {"psgrad.server": "psgrad server: ", "psgrad.run": "psgrad run: "}  # text lines as they always read; workers' carry their rank


def _utc(record: logging.LogRecord) -> str:
    """The record's time, UTC, ISO 8601 to the millisecond: 2026-11-25T14:03:07.412Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """Readable lines: the message after its logger's prefix (`psgrad server: ...`); `stamped` (a
    server's log) puts the time and the level first: `2026-11-25T14:03:07.412Z INFO psgrad server: ...`."""

    def __init__(self, stamped: bool = False) -> None:
        super().__init__()
        self.stamped = stamped

    def format(self, record: logging.LogRecord) -> str:
        line = _PREFIX.get(record.name, "") + record.getMessage()
        if self.stamped:
            line = f"{_utc(record)} {record.levelname} {line}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, pid."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _utc(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def configure(level: str = "info", fmt: str = "text", stamped: bool = False) -> None:
    """Send the `psgrad` loggers' records at `level` and above to stdout (below warning) and stderr;
    `stamped` text lines start with their time and level (servers: their log is read after the fact)."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level must be one of {LEVELS} and format one of {FORMATS}")
    root = logging.getLogger("psgrad")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else TextFormatter(stamped)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_Below(logging.WARNING))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


def quiet_grpc(level: str, command: str) -> None:
    """Keep gRPC's own log lines off a client command's console unless `level` is debug: psgrad
    names the problems they report in its own words, and a stray line breaks a --log-format json
    stream. A server's console keeps gRPC's default (`server`, `run`, and `launch`, whose children
    inherit the environment): there gRPC logs why a peer's TLS handshake failed, the only record
    of it. GRPC_VERBOSITY set by the user wins. Must run before grpc is imported (it reads it once)."""
    if level == "debug":
        os.environ.setdefault("GRPC_VERBOSITY", "INFO")
    elif command not in ("server", "run", "launch"):
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def one_line_warnings(command: str) -> None:
    """psgrad's own warnings on a command's console as one line each (`psgrad worker: warning:
    ...`), not Python's `FILE:LINE: UserWarning: ...` with the source line under it; other
    packages' warnings keep their form (a user's task names its own file)."""
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if not os.path.abspath(filename).startswith(package):
            default(message, category, filename, lineno, file, line)
            return
        print(f"psgrad {command}: warning: {message}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show
