"""What `dlwatch run` adds per DataLoader iteration: ``python bench/run_cost.py [--iterations N] [--workers W]``.

Runs one script that iterates a small DataLoader N times (each iteration under its own
watch: a monitor started and stopped), as ``python script.py`` and as ``dlwatch run
script.py``, alternating, and prints the wall time of each and the added time per
iteration. Not part of bench/run.py: it takes about half a minute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

# the checkout, for bench._common: last, so that an installed dlwatch comes first
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import add_install_option, dlwatch_under_test  # noqa: E402

SCRIPT = """
import sys, torch
from torch.utils.data import DataLoader
loader = DataLoader(list(range(64)), batch_size=8, num_workers=int(sys.argv[2]))
for _ in range(int(sys.argv[1])):
    for batch in loader:
        pass
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    add_install_option(ap)
    args = ap.parse_args()
    dlwatch_under_test(editable=args.editable)
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "loop.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        argv = [script, str(args.iterations), str(args.workers)]
        env = dict(os.environ, DLWATCH_DIR=os.path.join(d, "reports"))
        plain, run = [], []
        for _ in range(args.rounds):
            for out, cmd in ((plain, [sys.executable, *argv]), (run, [sys.executable, "-m", "dlwatch", "run", *argv])):
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, cwd=d)
                out.append(time.perf_counter() - t0)
    p, r = statistics.median(plain), statistics.median(run)
    print(
        f"{args.iterations} iterations, num_workers={args.workers}: python {p:.2f} s, dlwatch run {r:.2f} s "
        f"(median of {args.rounds}); added {1000 * (r - p) / args.iterations:.0f} ms per iteration"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
