"""Logging for dlwatch as a library: structlog over the stdlib logger "dlwatch".

dlwatch never configures logging or structlog for its host.  ``get_logger``
wraps a stdlib logger with structlog's BoundLogger (structlog is a dependency)
without touching structlog's global configuration, so events like ``log.warning("worker_gone", pid=12)``
reach whatever handlers the host installed, and nothing else.  The monitor
process (our own program) and the CLI configure a stderr handler for
themselves with ``configure_own_process``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logging.getLogger("dlwatch").addHandler(logging.NullHandler())


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
}


class _Logger:
    """``get_logger``'s logger: structlog's, made at the first event the stdlib logger would emit.

    A stdlib logger drops an event below its effective level before any handler sees it; asking
    first (``isEnabledFor``, what ``Logger.debug`` itself asks) drops it before structlog's
    processors and redaction run, and keeps structlog (which imports asyncio) out of a process
    that never logs: the monitor of a healthy run starts ~30 ms sooner.  An event that is
    emitted goes through the same structlog logger as before.
    """

    __slots__ = ("_name", "_std", "_bound")

    def __init__(self, name: str) -> None:
        self._name = name
        self._std = logging.getLogger(name)
        self._bound: Any = None

    def _logger(self) -> Any:
        if self._bound is None:
            self._bound = _structlog_logger(self._name)
        return self._bound

    def __getattr__(self, method: str) -> Any:
        level = _LEVELS.get(method)
        if level is None:  # bind, new, ...: structlog's own
            return getattr(self._logger(), method)

        def emit(*args: Any, **kwargs: Any) -> Any:
            if not self._std.isEnabledFor(level):
                return None
            return getattr(self._logger(), method)(*args, **kwargs)

        return emit


def get_logger(name: str = "dlwatch") -> Any:
    """A structlog BoundLogger over the stdlib logger ``name`` (made at its first emitted event);
    structlog's global config is untouched."""
    return _Logger(name)


def _structlog_logger(name: str) -> Any:
    import structlog
    from structlog.stdlib import BoundLogger

    from dlwatch.redact import outbound

    def _redact(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        return outbound(event_dict)  # the one redaction point, as for files and CLI output

    return structlog.wrap_logger(
        logging.getLogger(name),
        wrapper_class=BoundLogger,
        processors=[_redact, structlog.processors.KeyValueRenderer(key_order=["event"])],
    )


def configure_own_process(level: int = logging.WARNING) -> None:
    """For dlwatch's own processes only (monitor, CLI): warnings to stderr."""
    root = logging.getLogger("dlwatch")
    if any(getattr(h, "_dlwatch_own", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dlwatch: %(message)s"))
    handler._dlwatch_own = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
