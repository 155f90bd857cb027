"""Can a fork of this process run torch's intra-op threads?  Asked once per tune, of a throwaway fork.

Every candidate runs in a fork of the tuning process (``guard``).  Where this process has already
run a parallel region of torch's CPU kernels (a model built, a large tensor op: nearly every
training script before its first batch), torch's OpenMP runtime (libgomp) holds a team of threads
that a fork does not copy, and the fork's first parallel region waits for them for good: a
candidate with ``num_workers=0`` whose dataset or collate makes a large tensor hangs, and the
loader's own configuration eats the whole budget (measured: "No recommendation" for a 4 MiB-a-sample
dataset after one ``torch.full`` in the parent).  DataLoader workers are safe (torch's worker loop
sets one thread first).

A throwaway fork runs one parallel region, bounded by ``TIMEOUT_S``; where it does not answer, every
candidate sets ``torch.set_num_threads(1)`` first (the driver's ``Plan.intra_op_threads``) and the
result says so: the candidate's own process then loads with one thread, where the program's would
use torch's default.  A slow answer on a loaded machine takes the same safe side.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

from dlwatch.collect.rundir import collect_child

TIMEOUT_S = 2.0
# above torch's grain size (32768 elements): a parallel region wherever more than one thread is set
_ELEMENTS = 1 << 20

NOTE = (
    "this process had started torch's intra-op threads before the tune (a model built, a large tensor op), "
    "and a fork cannot use them: every candidate ran with torch.set_num_threads(1); where num_workers=0 "
    "loads with large tensor ops in the main process, your program may load faster than its row shows"
)


def fork_can_use_intra_op_threads(timeout_s: float = TIMEOUT_S) -> bool:
    """True when a fork of this process finishes a parallel region of torch's within ``timeout_s``."""
    torch = sys.modules.get("torch")
    if torch is None or torch.get_num_threads() <= 1:
        return True  # no parallel region will be entered
    r, w = os.pipe()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads: the child uses none
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(r)
                torch.full((_ELEMENTS,), 1.0).sum()
                os.write(w, b"1")
            finally:
                os._exit(0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    os.close(w)
    try:
        return collect_child(r, pid, 1, timeout_s) == b"1"  # the child is killed and reaped whatever it did
    finally:
        os.close(r)
