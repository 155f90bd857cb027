"""The part of dlwatch that lives in the training process: ``dlwatch.watch`` and ``dlwatch run``'s watch.

One role a module (docs/design.md, "Do no harm"):

- ``block``: :class:`Watch`, the ``with`` block (the loader it is given, its entry and exit), and ``watch()``.
- ``program``: ``dlwatch run``'s one watch per process (:class:`~program.Program`) and its loader
  iterations (:class:`~program.Segment`).
- ``session``: the lifecycle of a run: run directory, heartbeat, monitor process, stop, summary, finisher.
- ``probes``: what is attached to a loader's iterations (worker and collate hooks, the batch-shape
  probe, the workers seen) and the exception report.
- ``timed``: the timed iterator, the one piece on the per-batch path.
- ``ctrlc``: the Ctrl-C protocol (an ``interrupt`` event, the wait for the monitor's answer).
- ``advisor``: preflight glue (the checks of ``inproc/preflight``, each finding said once a run).
- ``settings``: options, the thresholds the checks declare, what is ignored.
- ``loaderinfo``: loader introspection (configuration, start method, lengths that run no program code).
- ``sigchld``: torch's SIGCHLD handler held while dlwatch's code runs (``with HeldSigchld():``).
- ``warning``: ``DlwatchWarning`` and the warning at the program's line.

Every module here is one of dlwatch's wrappers: their frames are taken off the tracebacks the
program sees (``inproc/frames.py`` hides this folder).
"""

from __future__ import annotations

from dlwatch.inproc.agent.block import Watch, watch
from dlwatch.inproc.agent.loaderinfo import loader_config
from dlwatch.inproc.agent.warning import DlwatchWarning

__all__ = ["watch", "Watch", "DlwatchWarning", "loader_config"]
