"""How long a stall investigation takes, and what it calls each hang: ``python bench/stall_window.py [--runs N]``.

Runs the real hangs of tests/targets (a fork-held lock, 16 CPU-bound workers, a
silent socket directly and through a thread pool) under ``watch`` and prints, per
run, the time from the monitor's stall event to report.json on disk (the /proc
window, the thread and socket reads, the py-spy dumps, the write) and the
classification. Not part of bench/run.py: it takes about a minute and needs py-spy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

from conftest import Target, incidents, load, wait_for  # noqa: E402
from test_io_hang import silent_listener  # noqa: E402

CASES = (
    ("deadlock", "hang.py", []),
    ("starved", "io_hang.py", ["--workers", "16", "--stall-timeout", "3"]),
    ("socket", "io_hang.py", []),
    ("pool", "io_hang.py", []),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print("| hang | stall_timeout | investigation + write (s) | classification |")
    print("|---|---|---|---|")
    for mode, script, extra in CASES:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as d, silent_listener() as port:
                argv = [mode, d] + (["--port", str(port)] if script == "io_hang.py" else []) + extra
                t = Target(script, *argv)
                try:
                    t.wait_line("READY", 60)
                    found = wait_for(lambda: incidents(d), 40)
                    if not found:
                        print(f"| {mode} | - | no incident | - |")
                        continue
                    r = load(found[0])
                    ev = next(e for e in r["events"] if e.get("event") == "stall")
                    took = os.stat(os.path.join(found[0], "report.json")).st_mtime - ev["ts"]
                    print(f"| {mode} | {r['config']['stall_timeout']} | {took:.2f} | {r['classification']} |")
                finally:
                    t.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
