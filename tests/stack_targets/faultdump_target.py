"""Target: installs dlwatch's faulthandler fallback, forks a child that installs too, both hang.

Usage: faultdump_target.py FIFO DUMP_DIR -- writes "ready PID PATH CHILD_PID CHILD_PATH\n".
The parent waits in hang_in_parent(), the child in hang_in_child(); a second
parent thread waits on a lock in blocked_thread().
"""

import os
import sys
import threading

from dlwatch.collect import faultdump


def blocked_thread(lock: threading.Lock, entered: threading.Event) -> None:
    entered.set()
    lock.acquire()


def hang_in_child(ready_fd: int, path: str) -> None:
    # readiness is sent from inside the frame the test looks for, so no race
    os.write(ready_fd, f"{path}\n".encode())
    os.close(ready_fd)
    threading.Event().wait()


def hang_in_parent(fifo_path: str, line: str) -> None:
    with open(fifo_path, "w") as fifo:
        fifo.write(line)
    threading.Event().wait()


def main() -> None:
    fifo_path, dump_dir = sys.argv[1], sys.argv[2]
    path = faultdump.install(dump_dir)
    assert faultdump.install(dump_dir) == path  # idempotent
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        child_path = faultdump.install(dump_dir)  # a fork re-registers with its own file
        hang_in_child(w, str(child_path))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        child_path = fh.readline().strip()
    lock = threading.Lock()
    lock.acquire()
    entered = threading.Event()
    threading.Thread(target=blocked_thread, args=(lock, entered), name="blocked", daemon=True).start()
    entered.wait(10)
    hang_in_parent(fifo_path, f"ready {os.getpid()} {path} {child} {child_path}\n")


if __name__ == "__main__":
    main()
