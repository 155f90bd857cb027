"""/dev/shm that this loader does not use, or has room in: no shm-exhaustion (item: trust on real jobs).

Each test makes a small tmpfs on /dev/shm in a private mount namespace (``unshare
--mount``, root or CAP_SYS_ADMIN; skipped with the reason where not permitted), has
"another tenant" fill most of it with a file of its own, and runs a real DataLoader
under watch inside.  The monitor, a child of the training process, sees the same small
/dev/shm.  A tight case, whose in-flight need does not fit beside the tenant's file,
shows the detector does judge there.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO, TARGETS, in_private_mount_namespace, incidents, load

MiB = 1 << 20


def run_beside_tenant(tmp_path, size_mib: int, tenant_mib: int, mode: str, timeout: float = 120) -> dict:
    reports = tmp_path / "reports"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]))
    env.pop("DLWATCH_IGNORE", None)
    cmd = (
        f"mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm || exit 77; "
        f"head -c {tenant_mib * MiB} /dev/zero > /dev/shm/other-tenant-cache && "
        f"exec {sys.executable} {os.path.join(TARGETS, 'shm_tenant.py')} {reports} {mode}"
    )
    returncode, out, err = in_private_mount_namespace(cmd, env=env, timeout=timeout)
    if returncode == 77:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm: {err.strip()}")
    assert returncode == 0, (out, err[-3000:])
    fields = {
        line.split()[0]: [int(x) for x in line.split()[1:]]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("BATCHES", "BATCH_BYTES", "SHM")
    }
    assert fields["SHM"][0] == size_mib * MiB, out  # the run saw the small tmpfs
    return {
        "batches": fields["BATCHES"][0],
        "batch_bytes": fields["BATCH_BYTES"][0],
        "shm_free": fields["SHM"][1],
        "incidents": incidents(str(reports)),
        "stderr": err,
    }


def test_small_full_shm_with_num_workers_zero(tmp_path):
    # 8 MiB batches; /dev/shm is 4 MiB and the tenant filled all of it
    r = run_beside_tenant(tmp_path, 4, 4, "workers0")
    assert r["batches"] == 24 and r["batch_bytes"] == 8 * MiB + 4 * 8  # the need was known: 0 without workers
    assert r["shm_free"] <= 1 * MiB
    assert r["incidents"] == [], [load(i)["findings"][:1] for i in r["incidents"]]
    assert "dlwatch:" not in r["stderr"]


def test_nearly_full_shm_with_room_for_this_jobs_batches(tmp_path):
    # file_system strategy, 2 workers x prefetch 2 x 256 KiB = 1 MiB in flight; the tenant leaves 4 of 64 MiB
    r = run_beside_tenant(tmp_path, 64, 60, "file_system")
    assert r["batches"] == 32 and r["batch_bytes"] == 256 * 1024 + 4 * 8
    assert r["incidents"] == [], [load(i)["findings"][:1] for i in r["incidents"]]
    assert "dlwatch:" not in r["stderr"]


def test_tight_shm_beside_a_tenant_is_pressure(tmp_path):
    # 2 workers x prefetch 16 x 512 KiB = 16 MiB in flight; the tenant leaves 8 of 32 MiB. The batches are
    # consumed at once, so the run itself fits: the estimate warns before a slower loop would not.
    r = run_beside_tenant(tmp_path, 32, 24, "tight")
    assert r["batches"] == 32
    (path,) = r["incidents"]
    report = load(path)
    assert report["trigger"] == "threshold" and report["findings"][0]["playbook"] == "shm-exhaustion"
    pressure = report["findings"][0]["evidence"]["pressure"][0]
    assert pressure["reason"] == "free_below_need" and pressure["need_bytes"] == 2 * 16 * (512 * 1024 + 4 * 8)
    assert pressure["available_bytes"] < pressure["need_bytes"] and pressure["shm_total"] == 32 * MiB
