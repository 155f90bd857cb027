"""dlwatch: runtime diagnostics and crash forensics for PyTorch DataLoaders.

``with dlwatch.watch(loader) as batches: ...`` watches a training loop from a
separate monitor process; ``dlwatch attach PID`` inspects a stuck process from a
shell; ``dlwatch report`` lists and shows the incident reports.  Importing
dlwatch never imports torch.

Layout (docs/design.md, "Process map"): ``inproc/`` runs in the training process,
``monitor/`` in the monitor process, ``cli/`` in the command; ``wire/`` is what crosses
between them; ``collect/``, ``detect/`` and ``report/`` read, judge and write.  The modules
at this level (``_fs``, ``_log``, ``_regex``, ``_spawn``, ``_version``, ``errors``, ``redact``,
``model``) are leaf helpers every side shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dlwatch._version import __version__

__all__ = ["watch", "Watch", "DlwatchWarning", "__version__"]

if TYPE_CHECKING:
    from dlwatch.inproc.agent import DlwatchWarning, Watch, watch


def __getattr__(name: str) -> Any:
    # watch is imported lazily so that `import dlwatch` in the CLI and the monitor stays light
    if name in ("watch", "Watch", "DlwatchWarning"):  # filter it: warnings.filterwarnings("ignore", category=...)
        from dlwatch.inproc import agent as _w

        return getattr(_w, name)
    raise AttributeError(f"module 'dlwatch' has no attribute {name!r}")
