"""Batches bigger than /dev/shm: torch cannot allocate the shared memory that carries them.

Workers hand every batch to the main process through /dev/shm. Containers often
have a tiny one (Docker's default is 64 MB). This script makes one: it re-runs
itself in a private mount namespace (`unshare --mount`) with an 8 MiB tmpfs on
/dev/shm, visible to this process tree only, and loads 16 MiB batches. The
worker fails with "unable to allocate shared memory(shm) ... No space left on
device (28)", re-raised in the training loop; dlwatch writes an `exception`
incident with playbook shm-exhaustion.

A mount namespace needs root or CAP_SYS_ADMIN (and a kernel and container that
allow it). Where it is not permitted, the script says why and exits 0.

    python examples/shm_exhaustion.py [--report-dir DIR]
"""

import os
import shutil
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

SHM_SIZE = "8m"
INSIDE = "DLWATCH_EXAMPLE_IN_NAMESPACE"


class BigSamples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.zeros(1024, 1024)  # 4 MiB a sample, 16 MiB a batch of 4


def skip(reason):
    print(f"SKIP: {reason}", flush=True)
    sys.exit(0)


def reexec_in_namespace():
    """Run this script again in a private mount namespace; return its exit status."""
    unshare = shutil.which("unshare")
    if unshare is None:
        skip("the `unshare` program (util-linux) is not installed")
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        skip(
            f"no private mount namespace here ({probe.stderr.strip() or f'exit {probe.returncode}'}); "
            "it needs root or CAP_SYS_ADMIN"
        )
    env = dict(os.environ, **{INSIDE: "1"})
    return subprocess.call([unshare, "--mount", "--propagation", "private", sys.executable, *sys.argv], env=env)


def main():
    args = parse_args(__doc__.splitlines()[0])
    if os.environ.get(INSIDE) != "1":
        sys.exit(reexec_in_namespace())
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SHM_SIZE}", "tmpfs", "/dev/shm"], capture_output=True, text=True
    )
    if mount.returncode != 0:
        skip(f"cannot mount a small tmpfs on /dev/shm ({mount.stderr.strip()})")
    before = incidents(args.report_dir)
    loader = DataLoader(BigSamples(), batch_size=4, num_workers=2)
    try:
        with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                pass
    except RuntimeError as exc:  # the worker's error, re-raised by the DataLoader
        print(f"training loop failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
