"""Logging for every `switchyard` process: `--log-level`, `--log-format text|json`."""

import json
import logging
import sys
import time

# Fields a record may carry in `extra=` that the JSON format writes as top-level keys
# (the gateway's access line: tenant, pool, route, status, tokens, latency_ms, ...).
STRUCTURED_ATTR = "fields"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is now, so a live status display that redirects
    stderr prints log lines above itself instead of through it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, STRUCTURED_ATTR, None)
        if isinstance(extra, dict):
            doc.update(extra)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = _CurrentStderr()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
    # Neither format writes the caller's file and line, thread or process: not gathering
    # them saves a stack walk and three lookups per record (the logging HOWTO's
    # "Optimization"), which the gateway pays once per request for its access line.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per HTTP request from client libraries is noise (and, in benchmarks, load).
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def route_uvicorn_logs() -> None:
    """uvicorn's loggers through ours (one format); its per-request access log off."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True
