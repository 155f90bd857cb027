"""A read stuck in state D on a FUSE filesystem whose daemon never answers READ, for real.

usage: fuse_hang.py REPORT_DIR MOUNTPOINT [--stall-timeout S] [--workers N]

This process makes a private mount namespace (root or CAP_SYS_ADMIN), mounts a
FUSE filesystem served by itself (a minimal server speaking the kernel's FUSE
protocol over /dev/fuse: no libfuse needed), and forks the training job into that
namespace. The files /shard-N.bin exist and open, but a READ is never answered:
the worker's read() sleeps in the kernel. FUSE first waits interruptibly (state S);
the server then sends the reader a signal it has a handler for, which makes the
kernel send FUSE_INTERRUPT and wait killably (state D), as a read from a
hard-mounted NFS server that went away does.

Prints `SKIP: reason` and exits 0 where the machine allows no FUSE mount;
prints READY once the loader is iterating. SIGKILL of the group ends everything:
the daemon's /dev/fuse fd closes, which aborts the connection, and the namespace
goes away with its last process.
"""

import ctypes
import os
import select
import signal
import struct
import sys

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 0x4000, 1 << 18

HDR_IN = struct.Struct("=IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
HDR_OUT = struct.Struct("=IiQ")  # len error unique
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")  # ino size blocks a/m/ctime, nsecs, mode nlink uid gid rdev blksize flags
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT, INTERRUPT, DESTROY, BATCH_FORGET = (
    1,
    2,
    3,
    14,
    15,
    18,
    25,
    26,
    36,
    38,
    42,
)
NO_REPLY = (FORGET, INTERRUPT, BATCH_FORGET)
ENOENT, ENOSYS = 2, 38
FOPEN_DIRECT_IO = 1


def skip(why):
    print(f"SKIP: {why}", flush=True)
    sys.exit(0)


def attr(nodeid):
    if nodeid == 1:
        return ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096, 0)
    return ATTR.pack(nodeid, 1 << 20, 2048, 0, 0, 0, 0, 0, 0, 0o100444, 1, 0, 0, 0, 4096, 0)


def serve(fd, stop_when_parentless):
    """Answer everything but READ; a READ gets no answer, and its reader a SIGUSR1 (once)."""
    signalled = set()
    while True:
        if stop_when_parentless and os.getppid() == 1:
            return
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            continue
        try:
            req = os.read(fd, 1 << 20)
        except OSError:
            return  # unmounted or aborted
        if len(req) < HDR_IN.size:
            continue
        _len, opcode, unique, nodeid, _uid, _gid, pid, _e, _p = HDR_IN.unpack_from(req)
        body = req[HDR_IN.size :]
        if opcode in NO_REPLY:
            continue
        if opcode == READ:
            if pid not in signalled:
                signalled.add(pid)
                try:
                    os.kill(pid, signal.SIGUSR1)  # interruptible wait -> FUSE_INTERRUPT -> killable (D)
                except OSError:
                    pass
            continue  # never answered
        error, out = 0, b""
        if opcode == INIT:
            major, minor = struct.unpack_from("=II", body)
            out = struct.pack("=IIIIHHIIHHII6I", 7, min(minor, 31), 0, 0, 1, 1, 1 << 17, 1, 32, 0, 0, 0, *([0] * 6))
        elif opcode == GETATTR:
            out = struct.pack("=QII", 0, 0, 0) + attr(nodeid)
        elif opcode == LOOKUP:
            name = body.split(b"\0", 1)[0]
            if nodeid == 1 and name.startswith(b"shard-"):
                out = struct.pack("=QQQQII", 2, 0, 3600, 3600, 0, 0) + attr(2)
            else:
                error = -ENOENT
        elif opcode == OPEN:
            out = struct.pack("=QII", 1, FOPEN_DIRECT_IO, 0)
        elif opcode in (RELEASE, FLUSH):
            pass
        elif opcode == DESTROY:
            return
        else:
            error = -ENOSYS
        try:
            os.write(fd, HDR_OUT.pack(HDR_OUT.size + len(out), error, unique) + out)
        except OSError:
            pass


def mount_fuse(mnt):
    libc = ctypes.CDLL(None, use_errno=True)
    if not os.path.exists("/dev/fuse"):
        skip("/dev/fuse does not exist (no FUSE in this kernel or container)")
    if libc.unshare(CLONE_NEWNS) != 0:
        skip(f"no private mount namespace: unshare: {os.strerror(ctypes.get_errno())} (needs root or CAP_SYS_ADMIN)")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        skip(f"cannot make mounts private: {os.strerror(ctypes.get_errno())}")
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        skip(f"cannot open /dev/fuse: {exc}")
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if libc.mount(b"dlwatch-test", mnt.encode(), b"fuse", MS_NOSUID | MS_NODEV, opts) != 0:
        skip(f"cannot mount a FUSE filesystem: {os.strerror(ctypes.get_errno())}")
    return fd, mnt


def train(mnt, report_dir, stall_timeout, workers):
    import torch
    from torch.utils.data import DataLoader, Dataset

    import dlwatch

    class Shards(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            with open(os.path.join(mnt, f"shard-{i}.bin"), "rb", buffering=0) as f:
                return torch.frombuffer(bytearray(f.read(4096)), dtype=torch.uint8)

    def init(_):
        signal.signal(signal.SIGUSR1, lambda *_: None)  # a handler: the signal interrupts, never kills

    dl = DataLoader(Shards(), batch_size=2, num_workers=workers, worker_init_fn=init, multiprocessing_context="fork")
    with dlwatch.watch(dl, report_dir=report_dir, stall_timeout=stall_timeout, poll_interval=0.2):
        it = iter(dl)
        print(f"READY {mnt}", flush=True)
        for _ in it:
            pass
    print("DONE", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("report_dir")
    ap.add_argument("mountpoint", help="an empty directory (the mount is visible only in this namespace)")
    ap.add_argument("--stall-timeout", type=float, default=1.5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    fuse_fd, mountpoint = mount_fuse(args.mountpoint)
    child = os.fork()
    if child == 0:
        os.close(fuse_fd)
        train(mountpoint, args.report_dir, args.stall_timeout, args.workers)
        os._exit(0)
    serve(fuse_fd, stop_when_parentless=False)
