"""dlwatch: runtime diagnostics and crash forensics for PyTorch DataLoaders.

``with dlwatch.watch(loader) as batches: ...`` watches a training loop from a
separate monitor process; ``dlwatch.tune(loader)`` measures which DataLoader settings keep it fed; ``dlwatch attach PID`` inspects a stuck process from a
shell; ``dlwatch report`` lists and shows the incident reports.  Importing
dlwatch never imports torch.

Layout (docs/design.md, "Process map"): ``inproc/`` runs in the training process,
``monitor/`` in the monitor process, ``cli/`` in the command; ``wire/`` is what crosses
between them; ``collect/``, ``detect/`` and ``report/`` read, judge and write.  The modules
at this level (``_entry``, ``_fs``, ``_log``, ``_regex``, ``_spawn``, ``_version``, ``errors``,
``redact``, ``model``) are leaf helpers every side shares.
"""

# `python -m dlwatch`: this is the first code of dlwatch that runs, with the working directory first on
# sys.path; nothing may be imported before it is taken off (dlwatch/_entry.py; so no __future__ import)
import sys as _sys

if _sys.argv[:1] == ["-m"]:
    from dlwatch import _entry

    if _entry.running_as_main_module():
        _entry.isolate()
    del _entry
del _sys

from typing import TYPE_CHECKING, Any  # noqa: E402

from dlwatch._version import __version__  # noqa: E402

__all__ = ["watch", "Watch", "DlwatchWarning", "tune", "TuneResult", "__version__"]

if TYPE_CHECKING:
    from dlwatch.inproc.agent import DlwatchWarning, Watch, watch
    from dlwatch.tuning.api import tune
    from dlwatch.tuning.result import TuneResult


def __getattr__(name: str) -> Any:
    # watch is imported lazily so that `import dlwatch` in the CLI and the monitor stays light
    if name in ("watch", "Watch", "DlwatchWarning"):  # filter it: warnings.filterwarnings("ignore", category=...)
        from dlwatch.inproc import agent as _w

        return getattr(_w, name)
    if name == "tune":  # dlwatch.tune(loader): measured DataLoader settings (dlwatch/tuning)
        from dlwatch.tuning.api import tune

        return tune
    if name == "TuneResult":
        from dlwatch.tuning.result import TuneResult

        return TuneResult
    raise AttributeError(f"module 'dlwatch' has no attribute {name!r}")
