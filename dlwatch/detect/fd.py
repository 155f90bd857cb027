"""Detector for ``fd-exhaustion``: a process's fds above a share of its limit, or heading there.

The judgement is :func:`dlwatch.detect.thresholds.fd_pressure` (pure, shared with the
matcher); this module only decides which processes to judge each poll.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

from dlwatch.detect import thresholds as th
from dlwatch.detect.base import Detector, View

TREND_WINDOW = 30  # samples the fd trend is fitted on


class FdPressure(Detector):
    playbook = "fd-exhaustion"
    defaults = {
        "fd_share": th.FD_SHARE,
        "horizon_s": th.FD_HORIZON_S,
        "min_rise": th.FD_MIN_RISE,
        "min_window_s": th.FD_MIN_WINDOW_S,
        "trend_min_share": th.FD_TREND_MIN_SHARE,
    }

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        t = self.thresholds
        floor = min(t["fd_share"], t["trend_min_share"])
        for p in view.procs.values():
            if p.gone or len(p.history) < 2:
                continue
            last = p.history[-1]
            if last.num_fds is not None and last.fd_limit and last.num_fds < floor * last.fd_limit:
                continue  # below both of fd_pressure's bars: it would say None; skip the fit
            recent = list(itertools.islice(p.history, max(0, len(p.history) - TREND_WINDOW), None))
            evidence = th.fd_pressure(recent, **t)
            if evidence:
                if not evidence.get("fds") and p.last_fds is not None:
                    evidence["fds"] = p.last_fds.to_dict()
                return [
                    {
                        "ts": view.now,
                        "event": "threshold",
                        "signal": "fd_pressure",
                        "pid": p.pid,
                        "role": p.role,
                        "worker_id": p.worker_id,
                        **evidence,
                    }
                ]
        return ()
