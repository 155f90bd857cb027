"""Logging for dlwatch as a library: structlog over the stdlib logger "dlwatch".

dlwatch never configures logging or structlog for its host.  ``get_logger``
wraps a stdlib logger with structlog's BoundLogger without touching structlog's
global configuration, so events like ``log.warning("worker_gone", pid=12)``
reach whatever handlers the host installed, and nothing else.  The monitor
process (our own program) and the CLI configure a stderr handler for
themselves with ``configure_own_process``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logging.getLogger("dlwatch").addHandler(logging.NullHandler())


class _KeyValueLogger:
    """A tiny structlog-shaped logger: ``log.info("event", key=value)``.

    structlog's own BoundLogger is used when structlog is importable; this
    stand-in keeps the same call shape if it is not (a sidecar with a minimal
    install), so that logging can never be why dlwatch fails.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def _log(self, level: int, event: str, **kw: Any) -> None:
        if self._logger.isEnabledFor(level):
            from dlwatch.redact import redact

            pairs = " ".join(f"{k}={v!r}" for k, v in kw.items())
            self._logger.log(level, redact(f"{event} {pairs}".rstrip()))

    def debug(self, event: str, **kw: Any) -> None:
        self._log(logging.DEBUG, event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log(logging.INFO, event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log(logging.WARNING, event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log(logging.ERROR, event, **kw)


def get_logger(name: str = "dlwatch") -> Any:
    stdlib = logging.getLogger(name)
    try:
        import structlog
        from structlog.stdlib import BoundLogger, ProcessorFormatter  # noqa: F401

        from dlwatch.redact import redact

        def _redact(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
            return {k: redact(v) if isinstance(v, str) else v for k, v in event_dict.items()}

        return structlog.wrap_logger(
            stdlib,
            wrapper_class=BoundLogger,
            processors=[_redact, structlog.processors.KeyValueRenderer(key_order=["event"])],
        )
    except Exception:  # pragma: no cover - structlog missing or incompatible
        return _KeyValueLogger(stdlib)


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
