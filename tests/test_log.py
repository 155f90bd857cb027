"""dlwatch's own logging: structlog over the stdlib logger, made only when an event is emitted.

An event below the stdlib logger's effective level is dropped before structlog's processors (and
before structlog is imported: it pulls asyncio into the monitor); an emitted event is rendered and
redacted exactly as structlog renders it.  Each check runs in a fresh interpreter, so that what
is imported is the process's own doing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import dlwatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dlwatch.__file__)))
TOKEN = "ghp_" + "a" * 36


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )


def test_a_dropped_event_imports_nothing_and_prints_nothing():
    out = _run(
        "import sys\n"
        "from dlwatch._log import configure_own_process, get_logger\n"
        "configure_own_process()\n"  # warnings and above, as the monitor and the CLI
        "log = get_logger('dlwatch.monitor')\n"
        "log.debug('gpu_unavailable', reason='no NVML')\n"
        "log.info('started')\n"
        "print('structlog' in sys.modules, 'asyncio' in sys.modules)\n"
    )
    assert out.stdout.split() == ["False", "False"]
    assert out.stderr == ""


def test_an_emitted_event_is_structlogs_line_redacted():
    code = (
        "import structlog, logging\n"
        "from structlog.stdlib import BoundLogger\n"
        "from dlwatch._log import configure_own_process, get_logger\n"
        "from dlwatch.redact import outbound\n"
        "configure_own_process()\n"
        f"get_logger('dlwatch.monitor').warning('timeline_write_failed', error='disk full', token={TOKEN!r}, n=3)\n"
        # the same event through a structlog logger made the way dlwatch made it before
        "plain = structlog.wrap_logger(logging.getLogger('dlwatch.monitor'), wrapper_class=BoundLogger,\n"
        "    processors=[lambda l, n, d: outbound(d), structlog.processors.KeyValueRenderer(key_order=['event'])])\n"
        f"plain.warning('timeline_write_failed', error='disk full', token={TOKEN!r}, n=3)\n"
    )
    lines = _run(code).stderr.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert lines[0] == "dlwatch: event='timeline_write_failed' error='disk full' token='***' n=3"
    assert TOKEN not in lines[0]


def test_a_host_that_asks_for_debug_gets_it():
    """dlwatch never sets its host's levels; a host that turns dlwatch's logger to DEBUG sees debug events."""
    out = _run(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format='%(name)s %(levelname)s %(message)s')\n"
        "from dlwatch._log import get_logger\n"
        "get_logger('dlwatch.report').debug('summary_written', path='/x')\n"
    )
    assert out.stdout.strip() == "dlwatch.report DEBUG event='summary_written' path='/x'"
