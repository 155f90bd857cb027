"""A hostile job for root's `dlwatch attach`: a deadlocked "worker" whose stack names the files it chooses.

Usage: lock_source_job.py REPORT_DIR SPEC_JSON

SPEC_JSON: {"frames": [[FILE, LINE], ...] (the worker's stack, outermost first: each frame is code
compiled under FILE running at LINE; the innermost blocks on a lock there), "holder": [[FILE, LINE],
...] (the frames the fork record claims a thread of the main process had at the fork),
"fifo_writer": FIFO or null (a thread that opens FIFO for writing, which blocks until someone opens
it for reading, then writes FIFO + ".opened")}.

The main process makes a run directory under REPORT_DIR/.runs/ the way dlwatch.watch does (a
heartbeat file it keeps mapped, config.json, events.jsonl registering the worker and a
``fork_threads`` record), then sleeps.  The worker is a forked child blocked for good on a lock
inside the chosen frames: state S, futex, no CPU: a deadlock to attach.  The named files need not
exist, or be readable by this job, or be Python: the frames are the job's to choose.  Needs only
the standard library (it runs as a second uid).  Prints "READY <main pid> <worker pid>".
"""

import json
import mmap
import os
import sys
import threading
import time

report_dir, spec = sys.argv[1], json.loads(sys.argv[2])
run_dir = os.path.join(report_dir, ".runs", f"20260101T000000-{os.getpid()}-lock01")
os.makedirs(os.path.join(run_dir, "dumps"), mode=0o700)

LOCK = threading.Lock()


def run_frames(frames):
    """Run the outermost frame's code, which calls the next one in, down to the lock."""
    (path, line), rest = frames[0], frames[1:]
    call = "NEXT(REST)" if rest else "LOCK.acquire()"
    code = compile("\n" * (line - 1) + call + "\n", path, "exec")
    exec(code, {"NEXT": run_frames, "REST": rest, "LOCK": LOCK})


r, w = os.pipe()
worker = os.fork()
if worker == 0:
    LOCK.acquire()
    os.write(w, b"x")
    run_frames(spec["frames"])  # blocks for good: the lock is taken
    os._exit(0)
os.read(r, 1)

fifo = spec.get("fifo_writer")
if fifo:

    def write_when_opened():
        fd = os.open(fifo, os.O_WRONLY)  # blocks until a reader opens the FIFO
        with open(fifo + ".opened", "w") as f:
            f.write("opened by a reader\n")
        os.close(fd)

    threading.Thread(target=write_when_opened, daemon=True).start()

with open(os.path.join(run_dir, "heartbeat"), "wb") as f:
    f.write((b"DLWHB002\x01").ljust(4096, b"\0"))  # dlwatch's heartbeat: waiting for data, no batch yet
hb = open(os.path.join(run_dir, "heartbeat"), "r+b")
m = mmap.mmap(hb.fileno(), 4096)
with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({"pid": os.getpid(), "loader": {"num_workers": 1}}, f)
holder = [{"function": "hold", "filename": p, "line": n} for p, n in reversed(spec.get("holder") or [])]
with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
    now = time.time()
    f.write(json.dumps({"event": "worker_registered", "ts": now, "pid": worker, "worker_id": 0}) + "\n")
    f.write(
        json.dumps(
            {
                "event": "fork_threads",
                "ts": now,
                "pids": [worker],
                "forks": [[{"name": "lock-holder", "frames": holder, "idle": None}]],
            }
        )
        + "\n"
    )
print("READY", os.getpid(), worker, flush=True)
time.sleep(600)
