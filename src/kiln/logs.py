"""Structured (JSON-lines) logging shared by every Kiln process.

One line per record with time, level, service, logger, message, and the gRPC request id when the
record is emitted while a request is being served. `KILN_LOG_FORMAT` is `json` (the default) or
`text` (plain lines); `KILN_LOG_LEVEL` the root level (`DEBUG`, `INFO` the default, `WARNING`,
`ERROR`).

In JSON, the libraries' records are JSON lines too: Python warnings (`warnings.warn`, how
Megatron and torch say "Apex is not installed") go through logging (`logging.captureWarnings`),
and so do uncaught and unraisable exceptions; vLLM, which configures logging itself in every
process that imports it (the engine-core processes it starts included), is given a logging
config file (`VLLM_LOGGING_CONFIG_PATH`) that installs this JSON handler; and a library logger
that has a stderr handler of its own (transformers') is made to hand its records to the root
handler instead.

What never passes through Python's logging (C++ warnings of torch and vLLM's kernels, `[W...
utils.cpp] Warning: ...`; progress bars, tqdm's "Loading safetensors checkpoint shards"; a
library's bare `print`; a fatal error's traceback) is caught below it in a service
(`setup_logging(..., relay=True)`): the process's stdout and stderr become a pipe to a small
relay process (`python -m kiln.logs SERVICE`) that writes each line as a JSON record of logger
`stdout` (levels from glog's `[W`/`[E`/`[F` prefixes), and passes lines that already are records
(a child process's) through unchanged. The log handler itself writes to the original stderr. The
relay is a process rather than a thread so that what a dying process writes last still gets
out; it ends when every writer (the service and the children that inherited the pipe) has
closed it.
"""
from __future__ import annotations

import atexit
import contextvars
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            # A captured warning's text ends with a newline of its own.
            "msg": record.getMessage().rstrip("\n"),
        }
        rid = request_id_var.get()
        if rid:
            entry["request_id"] = rid
        ref = getattr(record, "k8s_ref", None)  # the object a kopf handler logs about
        if isinstance(ref, dict) and ref.get("name"):
            entry["object"] = "/".join(x for x in (ref.get("namespace"), ref.get("name")) if x)
        for key, value in getattr(record, "fields", {}).items():
            entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


FORMATS = ("json", "text")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
VLLM_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


def setup_logging(service: str, level: str | None = None, *, relay: bool = False) -> None:
    """Configure the root logger once per process. ValueError naming the variable for a
    `KILN_LOG_FORMAT` or `KILN_LOG_LEVEL` it does not know. `relay` (a service's own process,
    in JSON): stdout and stderr through the relay (module docstring)."""
    level = (level or os.environ.get("KILN_LOG_LEVEL") or "INFO").upper()
    if level not in LEVELS:
        raise ValueError(f"KILN_LOG_LEVEL: {level!r} is not a level (expected one of {', '.join(LEVELS)})")
    fmt = os.environ.get("KILN_LOG_FORMAT") or "json"
    if fmt not in FORMATS:
        raise ValueError(f"KILN_LOG_FORMAT: {fmt!r} is not a format (expected json or text)")
    stream = _start_relay(service) if relay and fmt == "json" else sys.stderr
    handler = logging.StreamHandler(stream)
    if fmt == "text":
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.Formatter.converter = time.gmtime
    if fmt == "json":
        _route_to_logging()
        adopt_library_loggers()
        _configure_vllm(service, level)


def json_formatter(service: str) -> JsonFormatter:
    """The formatter of a process a library starts and configures from `_configure_vllm`'s
    file (vLLM's engine core): its warnings, uncaught errors and unraisable exceptions go
    through logging there too."""
    _route_to_logging()
    return JsonFormatter(service)


def _configure_vllm(service: str, level: str) -> None:
    """vLLM configures logging itself in every process that imports it, this one and the engine
    processes it starts, from `VLLM_LOGGING_CONFIG_PATH` when set: a file that gives the root
    logger this process's JSON handler (a user's own file or `VLLM_CONFIGURE_LOGGING=0` wins;
    one a parent Kiln process wrote names the parent's service, and is replaced)."""
    given = os.environ.get(VLLM_CONFIG_ENV, "")
    if (given and not Path(given).name.startswith("kiln-")) \
            or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"kiln": {"()": f"{__name__}.json_formatter", "service": service}},
        "handlers": {"kiln": {"class": "logging.StreamHandler", "formatter": "kiln",
                              "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["kiln"], "level": level},
    }
    fd, path = tempfile.mkstemp(prefix=f"kiln-{service}-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    os.environ[VLLM_CONFIG_ENV] = path
    # The engine processes read it as they start, long before this process exits.
    atexit.register(lambda: os.path.exists(path) and os.remove(path))


def _route_to_logging() -> None:
    """Python warnings, uncaught exceptions (main thread and others) and unraisable ones
    (an error in a `__del__` at shutdown) as log records rather than bare stderr text."""
    logging.captureWarnings(True)
    crash = logging.getLogger("kiln.uncaught")

    def excepthook(kind, value, tb) -> None:
        crash.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    def thread_excepthook(args) -> None:
        if args.exc_type is SystemExit:
            return
        crash.error("uncaught %s in thread %s: %s", args.exc_type.__name__,
                    args.thread.name if args.thread else "?", args.exc_value,
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def unraisablehook(u) -> None:
        crash.warning("%s: %s: %s", u.err_msg or "Exception ignored", u.object, u.exc_value,
                      exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_type else None)

    sys.excepthook, threading.excepthook, sys.unraisablehook = excepthook, thread_excepthook, unraisablehook


def adopt_library_loggers() -> None:
    """Loggers with a stderr/stdout handler of their own (a library's plain-text one) lose it
    and pass their records up to the root handler, which writes them as JSON."""
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue  # a placeholder for a logger not created yet
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler
               and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)]
        for h in own:
            logger.removeHandler(h)
        if own:
            logger.propagate = True


# -- the relay for what bypasses logging ------------------------------------------------------
_relayed: list = []  # the relay's process and the stream onto the original stderr


def _start_relay(service: str):
    """Point fds 1 and 2 at a relay process that writes JSON onto the original stderr; returns a
    text stream onto that original stderr, for the log handler. Once per process."""
    if _relayed:
        return _relayed[1]
    import subprocess

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    original = os.dup(2)
    # The relay stays in the service's session (a supervisor that kills the session takes it
    # too) but ignores the signals that stop the service, to drain what the service's last
    # moments wrote; it ends at end of input.
    proc = subprocess.Popen([sys.executable, "-m", __name__, service], stdin=subprocess.PIPE,
                            stdout=original, stderr=original, close_fds=True)
    os.dup2(proc.stdin.fileno(), 1)
    os.dup2(proc.stdin.fileno(), 2)
    proc.stdin.close()
    out = os.fdopen(original, "w", buffering=1, encoding="utf-8", errors="replace")
    _relayed.extend([proc, out])
    try:
        import faulthandler
        if faulthandler.is_enabled():  # its dump must not depend on the relay's pipe
            faulthandler.enable(file=out)
    except (ImportError, ValueError):
        pass
    return out


_GLOG = {"W": "warning", "E": "error", "F": "critical", "I": "info"}


def relay_line(service: str, text: str) -> str:
    """One line of stray output as a JSON record (unchanged if it already is one)."""
    if text.startswith('{"ts": '):
        return text
    level = "info"
    if len(text) > 2 and text[0] == "[" and text[1] in _GLOG and text[2].isdigit():
        level = _GLOG[text[1]]
    elif text.startswith("Traceback (most recent call last)"):
        level = "error"
    return json.dumps({"ts": round(time.time(), 3), "level": level, "service": service,
                       "logger": "stdout", "msg": text}, ensure_ascii=False)


def _relay_main(service: str) -> int:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    source, sink = sys.stdin.buffer, sys.stdout
    pending = b""
    while True:
        chunk = source.read1(65536)
        if not chunk:
            break
        # Progress bars redraw with \r: each redraw is a line of its own.
        lines = (pending + chunk).replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop()
        for raw in lines:
            text = raw.decode("utf-8", "replace").rstrip()
            if text:
                sink.write(relay_line(service, text) + "\n")
        sink.flush()
    if pending.strip():
        sink.write(relay_line(service, pending.decode("utf-8", "replace").rstrip()) + "\n")
    sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_relay_main(sys.argv[1] if len(sys.argv) > 1 else "kiln"))
