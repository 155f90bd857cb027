"""A DataLoader worker is SIGKILLed while dlwatch's own code runs in the training process.

usage: worker_dies.py MOMENT REPORT_DIR
MOMENT: shape-check (the per-batch hook's batch check), preflight (the checks made as epoch 2's
iterator is created), fallback-summary (the summary the training process writes when the monitor
is gone), or bare-body / bare-after (no dlwatch: killed in the loop body / after the loop).

torch's SIGCHLD handler raises "DataLoader worker (pid N) is killed by signal: Killed." in whatever
Python code the main thread runs next.  The kill happens inside a wrapper of the named dlwatch
function, which then waits until the handler has had its chance to run there.  Prints EXC <type>:
<message, pid made N>, OWN_FRAMES <n> (dlwatch frames in its traceback) and BATCHES <n>.
"""

import os
import re
import sys
import time
import traceback

from torch.utils.data import DataLoader

from datasets import Squares

DLWATCH_DIR = None


def kill_a_worker(loader) -> None:
    pid = loader._iterator._workers[0].pid
    os.kill(pid, 9)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the kernel sends SIGCHLD when the worker becomes a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except OSError:
            break
        time.sleep(0.01)
    for _ in range(20):  # Python code of the wrapper (in dlwatch's call path): the handler runs here
        time.sleep(0.01)


def main(moment: str, report_dir: str) -> int:
    loader = DataLoader(Squares(64), batch_size=4, num_workers=2, persistent_workers=True)
    seen = 0
    try:
        if moment.startswith("bare"):
            for epoch in range(2):
                for _ in loader:
                    seen += 1
                    if moment == "bare-body" and seen == 2:
                        kill_a_worker(loader)
            if moment == "bare-after":
                kill_a_worker(loader)
            return 0
        import dlwatch
        from dlwatch.inproc import preflight, shapes
        from dlwatch.inproc.agent.session import Session

        if moment == "shape-check":
            original = shapes.BatchShapeProbe.check

            def check(self, batch, index):
                if index == 1:
                    kill_a_worker(loader)
                return original(self, batch, index)

            shapes.BatchShapeProbe.check = check
        elif moment == "preflight":
            original_state = preflight.sampler_state

            def sampler_state(dl):
                if dl._iterator is not None:  # epoch 2: epoch 1's persistent workers are registered
                    kill_a_worker(loader)
                return original_state(dl)

            preflight.sampler_state = sampler_state
        elif moment == "fallback-summary":
            original_fallback = Session.fallback_summary

            def fallback(self, pending):
                kill_a_worker(loader)
                return original_fallback(self, pending)

            Session.fallback_summary = fallback
        with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.1) as batches:
            for epoch in range(2):
                for _ in batches:
                    seen += 1
            if moment == "fallback-summary":  # the monitor is gone: the training process writes the summary
                os.kill(batches.monitor_pid, 9)
                while (
                    os.path.exists(f"/proc/{batches.monitor_pid}")
                    and open(f"/proc/{batches.monitor_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
                ):
                    time.sleep(0.01)
        return 0
    except RuntimeError as exc:
        here = os.path.dirname(os.path.abspath(__import__("dlwatch").__file__)) if "dlwatch" in sys.modules else None
        own = sum(1 for f in traceback.extract_tb(exc.__traceback__) if here and f.filename.startswith(here + os.sep))
        print(f"EXC {type(exc).__name__}: {re.sub(r'pid [0-9]+', 'pid N', str(exc))}")
        print(f"OWN_FRAMES {own}")
        return 1
    finally:
        print(f"BATCHES {seen}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
