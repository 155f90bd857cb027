"""The monitor's slow-cadence USS read (smaps_rollup, a walk of the page tables: ~2.5 ms a torch worker):
made for a process whose memory moved since its last read, or whose read is MEM_DETAIL_MAX_AGE_S old.

A real process polled by a real Monitor: quiet, it keeps its last read; once it has faulted in pages,
the next slow-cadence poll reads it again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from dlwatch.collect.growth import moved_since
from dlwatch.collect.procfs import PAGE_SIZE
from dlwatch.monitor import loop as monitor
from dlwatch.monitor import sampling

MiB = 1 << 20
_GROWER = "import sys\nblocks = []\nfor line in sys.stdin:\n    blocks.append(bytearray(64 << 20))\n    print('grown', flush=True)\n"


def test_moved_since():
    args = {"page_size": PAGE_SIZE, "min_bytes": MiB}
    assert not moved_since(100 * MiB, 5000, 100 * MiB, 5000, **args)  # nothing faulted, RSS the same
    assert not moved_since(100 * MiB + 4096, 5010, 100 * MiB, 5000, **args)  # under a MiB either way
    assert moved_since(100 * MiB, 5000 + MiB // PAGE_SIZE, 100 * MiB, 5000, **args)  # a MiB of pages faulted in
    assert moved_since(99 * MiB, 5000, 100 * MiB, 5000, **args)  # a MiB freed: RSS fell
    assert moved_since(None, 5000, 100 * MiB, 5000, **args) and moved_since(100 * MiB, 5000, None, None, **args)


def test_a_quiet_process_keeps_its_read_and_a_growing_one_is_read_again(tmp_path, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", _GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    m = None
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700)
        (run_dir / "dumps").mkdir(mode=0o700)
        (run_dir / "config.json").write_text(
            json.dumps({"pid": child.pid, "started_at": time.time(), "report_dir": str(tmp_path / "r"), "options": {}})
        )
        time.sleep(0.5)  # the child's interpreter has started (its pages are in)
        monkeypatch.setattr(sampling, "MEM_DETAIL_EVERY_S", 0.0)  # every poll is a slow-cadence poll
        m = monitor.Monitor(str(run_dir))
        m.poll()
        t = m.procs[child.pid]
        first = t.last
        assert first is not None and first.uss is not None and first.uss_ts == first.ts
        m.poll()
        quiet = t.last
        assert quiet.ts > first.ts and quiet.uss_ts == first.uss_ts and quiet.uss == first.uss  # carried, not read
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline() == "grown\n"
        m.poll()  # the faults are seen by this poll's read of /proc/<pid>/stat: the next one reads USS
        m.poll()
        grown = t.last
        assert grown.uss_ts == grown.ts and grown.uss >= first.uss + 60 * MiB
        m.poll()
        assert t.last.uss_ts == grown.uss_ts  # quiet again
        monkeypatch.setattr(sampling, "MEM_DETAIL_MAX_AGE_S", 0.0)
        m.poll()
        assert t.last.uss_ts == t.last.ts  # an old read is made again, moved or not
    finally:
        if m is not None:
            m._close()
        child.kill()
        child.wait(10)
