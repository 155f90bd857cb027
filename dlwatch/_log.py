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


def get_logger(name: str = "dlwatch") -> Any:
    """A structlog BoundLogger over the stdlib logger ``name``; structlog's global config is untouched."""
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
