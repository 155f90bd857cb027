"""``dlwatch.watch`` and ``dlwatch run``'s watch: the part of dlwatch that lives in the training process."""

from __future__ import annotations

from dlwatch.inproc.agent.block import DlwatchWarning, Watch, loader_config, watch

__all__ = ["watch", "Watch", "DlwatchWarning", "loader_config"]
