"""The matcher on hand-built report dicts: torch's real messages, stalls, detector events, boundaries."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dlwatch.detect.match import errnos_in, match
from dlwatch.model import Finding
from dlwatch.wire.playbooks import ENV_VAR, load_playbooks

MiB = 1024 * 1024

# torch 2.13's messages, as reproduced on this machine (DESIGN.md)
WORKER_EMFILE = textwrap.dedent("""\
    Caught OSError in DataLoader worker process 0.
    Original Traceback (most recent call last):
      File "/usr/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 349, in _worker_loop
        data = fetcher.fetch(index)
      File "/home/user/examples/fd_leak.py", line 21, in __getitem__
        f = open(self.paths[i], "rb")
    OSError: [Errno 24] Too many open files: '/tmp/data/17.bin'
    """)
COMMUNICATION = (
    "Too many open files. Communication with the workers is no longer possible. Please increase "
    "the limit using `ulimit -n` in the shell or change the sharing strategy by calling "
    "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code"
)
SHM_OPEN_EMFILE = (
    "unable to open shared memory object </torch_4242_1779_3> in read-write mode: Too many open files (24)"
)
SHM_ALLOC_ENOSPC = "unable to allocate shared memory(shm) for file </torch_4242_90_0>: No space left on device (28)"
SHM_OPEN_ENOENT = (
    "unable to open shared memory object </torch_4242_1_0> in read-write mode: No such file or directory (2)"
)
SIGBUS = (
    "DataLoader worker (pid 4301) is killed by signal: Bus error. It is possible that dataloader's "
    "workers are out of shared memory. Please try to raise your shared memory limit."
)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def playbooks() -> tuple:
    return load_playbooks()


def proc(
    pid: int,
    role: str = "worker",
    worker_id: int | None = 0,
    *,
    num_fds: int = 40,
    fd_limit: int = 1024,
    fds: dict | None = None,
    frames: list | None = None,
    waiting_in: str | None = None,
    status: str | None = None,
    state: str = "S",
    syscall: int | None = None,
) -> dict[str, Any]:
    sample = {
        "ts": 1000.0,
        "state": state,
        "cpu_s": 1.0,
        "num_threads": 2,
        "num_fds": num_fds,
        "fd_limit": fd_limit,
        "syscall": syscall,
        "fds": fds,
        "gone": False,
    }
    threads = [{"thread_id": 1, "name": "MainThread", "frames": frames}] if frames else []
    return {
        "pid": pid,
        "role": role,
        "worker_id": worker_id if role == "worker" else None,
        "start_method": "fork",
        "name": "pt_data_worker" if role == "worker" else "python",
        "sample": sample,
        "status": status,
        "waiting_in": waiting_in,
        "cpu_progress_s": 0.0,
        "stack": {"source": "py-spy", "threads": threads, "error": None},
    }


def fr(function: str, filename: str = "", line: int | None = None, native: bool = False) -> dict[str, Any]:
    return {"function": function, "filename": filename, "line": line, "native": native}


def report(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "trigger": "exception",
        "classification": None,
        "exception": None,
        "loader": {
            "class": "torch.utils.data.dataloader.DataLoader",
            "batch_size": 4,
            "num_workers": 2,
            "prefetch_factor": 2,
            "sharing_strategy": "file_descriptor",
            "drop_last": False,
            "collate_fn": "torch.utils.data._utils.collate.default_collate",
            "worker_init_fn": None,
            "multiprocessing_context": "fork",
            "timeout": 0,
            "dataset_len": 40,
        },
        "processes": [proc(100, "main"), proc(101, worker_id=0), proc(102, worker_id=1)],
        "system": {"shm_total": 64 * MiB, "shm_free": 60 * MiB, "shm_torch_files": 0},
        "events": [
            {"ts": 1.0, "event": "worker_registered", "worker_id": 0, "pid": 101},
            {"ts": 1.0, "event": "worker_registered", "worker_id": 1, "pid": 102},
        ],
        "timeline": [],
    }
    base.update(kw)
    return base


def exc(
    message: str,
    type: str = "builtins.RuntimeError",
    errno: int | None = None,
    from_loader: bool = True,
    traceback: str = "",
) -> dict[str, Any]:
    return {"type": type, "message": message, "errno": errno, "traceback": traceback, "from_loader": from_loader}


def ids(findings: list[Finding]) -> list[str]:
    return [f.playbook for f in findings]


def check_well_formed(findings: list[Finding]) -> None:
    confs = [f.confidence for f in findings]
    assert confs == sorted(confs, reverse=True)
    for f in findings:
        assert isinstance(f, Finding) and 0 < f.confidence <= 1 and f.title and f.remediation
        assert f.evidence and f.evidence["matched"], f  # never a finding without evidence
        f.to_dict()


# --------------------------------------------------------------------------- healthy


def test_healthy_report_has_no_finding(playbooks: tuple) -> None:
    r = report(trigger="exit")
    r["events"] += [
        {
            "ts": 2.0,
            "event": "rng_fingerprint",
            "worker_id": 0,
            "pid": 101,
            "fingerprints": {"global:random": "a1", "global:numpy": "b1", "global:torch": "c1"},
        },
        {
            "ts": 2.0,
            "event": "rng_fingerprint",
            "worker_id": 1,
            "pid": 102,
            "fingerprints": {"global:random": "a2", "global:numpy": "b2", "global:torch": "c2"},
        },
        {"ts": 3.0, "event": "progress_resumed", "stall_s": 4.0},
    ]
    r["timeline"] = [
        {
            "kind": "sample",
            "ts": 10.0 + i,
            "procs": [{"pid": 101, "ts": 10.0 + i, "num_fds": 40 + i % 2, "fd_limit": 1024}],
        }
        for i in range(30)
    ]
    assert match(r, playbooks) == []


def test_healthy_user_exception_is_not_claimed(playbooks: tuple) -> None:
    r = report(exception=exc("division by zero", type="builtins.ZeroDivisionError", from_loader=False))
    assert match(r, playbooks) == []


def test_slow_stall_without_evidence_has_no_finding(playbooks: tuple) -> None:
    assert match(report(trigger="stall", classification="slow"), playbooks) == []
    assert match(report(trigger="stall", classification="lost-batch"), playbooks) == []


# --------------------------------------------------------------------------- fd exhaustion


def test_worker_emfile_file_system_strategy(playbooks: tuple) -> None:
    r = report(exception=exc(WORKER_EMFILE, type="builtins.OSError"))
    r["loader"]["sharing_strategy"] = "file_system"
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f)[0] == "fd-exhaustion" and "shm-exhaustion" not in ids(f)
    top = f[0]
    assert top.confidence >= 0.95
    assert top.evidence["exception"]["errno"] == 24
    assert top.evidence["cause"] == "regular-files"
    assert top.remediation.startswith("**The dataset leaves regular files open.**")
    assert "set_sharing_strategy" not in top.remediation.split("\n\n")[0]


def test_communication_lost_main_holds_shm_fds(playbooks: tuple) -> None:
    main = proc(
        100,
        "main",
        num_fds=1020,
        fd_limit=1024,
        fds={"file": 12, "shm": 990, "socket": 4, "pipe": 10, "other": 4, "shm_bytes": 990 * 4096, "top_files": []},
    )
    r = report(exception=exc(COMMUNICATION), processes=[main, proc(101), proc(102, worker_id=1)])
    f = match(r, playbooks)
    check_well_formed(f)
    top = f[0]
    assert top.playbook == "fd-exhaustion"
    ev = top.evidence
    assert ev["pid"] == 100 and ev["role"] == "main" and ev["num_fds"] == 1020 and ev["fd_limit"] == 1024
    assert ev["fds"]["shm"] == 990 and ev["cause"] == "shm-fds" and ev["sharing_strategy"] == "file_descriptor"
    assert top.remediation.startswith("**Shared-memory fds")
    assert "leaves regular files open" not in top.remediation


def test_regular_file_fds_pick_their_variant(playbooks: tuple) -> None:
    w = proc(
        101,
        num_fds=1022,
        fd_limit=1024,
        fds={
            "file": 1000,
            "shm": 2,
            "socket": 0,
            "pipe": 4,
            "other": 16,
            "shm_bytes": 0,
            "top_files": [["/data/train/000017.bin", 400], ["/data/train/000018.bin", 399]],
        },
    )
    r = report(trigger="stall", classification="lost-batch", processes=[proc(100, "main"), w])
    f = match(r, playbooks)
    assert ids(f) == ["fd-exhaustion"]
    ev = f[0].evidence
    assert ev["pid"] == 101 and ev["worker_id"] == 0 and ev["cause"] == "regular-files"
    assert ev["top_files"][0] == ["/data/train/000017.bin", 400]
    assert ev["at_fd_limit"] == [{"pid": 101, "role": "worker", "worker_id": 0, "num_fds": 1022, "fd_limit": 1024}]
    assert "with open(" in f[0].remediation and "Shared-memory fds" not in f[0].remediation


def test_unknown_cause_shows_both_variants(playbooks: tuple) -> None:
    r = report(exception=exc("[Errno 24] Too many open files", type="builtins.OSError", errno=24))
    f = match(r, playbooks)
    assert f[0].playbook == "fd-exhaustion" and f[0].evidence["cause"] == "unknown"
    assert "leaves regular files open" in f[0].remediation and "Shared-memory fds" in f[0].remediation


@pytest.mark.parametrize(
    "message, expected",
    [
        (SHM_OPEN_EMFILE, "fd-exhaustion"),
        (SHM_ALLOC_ENOSPC, "shm-exhaustion"),
        (SHM_OPEN_ENOENT, "shm-exhaustion"),
    ],
)
def test_errno_decides_between_shm_and_fd(playbooks: tuple, message: str, expected: str) -> None:
    f = match(report(exception=exc(message)), playbooks)
    check_well_formed(f)
    assert ids(f) == [expected]


def test_shm_open_emfile_is_shm_fds_cause(playbooks: tuple) -> None:
    f = match(report(exception=exc(SHM_OPEN_EMFILE)), playbooks)
    assert f[0].evidence["cause"] == "shm-fds" and f[0].evidence["exception"]["errno"] == 24


def test_ancdata(playbooks: tuple) -> None:
    f = match(report(exception=exc("received 0 items of ancdata")), playbooks)
    assert ids(f) == ["fd-exhaustion"]


def test_lost_batch_stall_at_fd_limit_is_fd_not_deadlock(playbooks: tuple) -> None:
    frames = [
        fr("get", "/usr/lib/python3.11/multiprocessing/queues.py", 113),
        fr("_worker_loop", "/x/torch/utils/data/_utils/worker.py", 300),
        fr("_bootstrap", "/usr/lib/python3.11/multiprocessing/process.py", 314),
        fr("_launch", "/usr/lib/python3.11/multiprocessing/popen_fork.py", 71),
        fr("main", "train.py", 50),
    ]
    workers = [
        proc(101 + i, worker_id=i, num_fds=62, fd_limit=64, frames=frames, waiting_in="poll", syscall=7, status="idle")
        for i in range(2)
    ]
    r = report(trigger="stall", classification="lost-batch", processes=[proc(100, "main")] + workers)
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["fd-exhaustion"]
    assert f[0].confidence >= 0.9
    assert {a["pid"] for a in f[0].evidence["at_fd_limit"]} == {101, 102}


def test_deadlock_classification_but_fds_at_limit_ranks_fd_first(playbooks: tuple) -> None:
    workers = [proc(101, num_fds=1022, fd_limit=1024, frames=[fr("get", "queues.py"), fr("_worker_loop", "worker.py")])]
    r = report(trigger="stall", classification="deadlock", processes=[proc(100, "main")] + workers)
    f = match(r, playbooks)
    assert ids(f) == ["fd-exhaustion", "worker-deadlock"]
    assert f[0].confidence > f[1].confidence + 0.4


def test_bare_eof_error_at_fd_limit(playbooks: tuple) -> None:
    eof = exc("", type="builtins.EOFError")
    at_limit = [proc(100, "main"), proc(101, num_fds=1022, fd_limit=1024)]
    f = match(report(exception=eof, processes=at_limit), playbooks)
    assert ids(f) == ["fd-exhaustion"] and f[0].confidence >= 0.88
    assert "eof-at-fd-limit" in [h["signal"] for h in f[0].evidence["matched"]]
    # the same EOFError with fds far from the limit claims nothing
    assert match(report(exception=eof), playbooks) == []


def test_fds_just_under_threshold_is_quiet(playbooks: tuple) -> None:
    # fd_share 0.9 of 1024 = 921.6; at-limit share 0.95 = 972.8
    r = report(trigger="exit", processes=[proc(100, "main"), proc(101, num_fds=921, fd_limit=1024)])
    r["timeline"] = [
        {"kind": "sample", "ts": float(t), "procs": [{"pid": 101, "ts": float(t), "num_fds": 921, "fd_limit": 1024}]}
        for t in range(10)
    ]
    assert match(r, playbooks) == []


def test_fd_pressure_event_before_any_error(playbooks: tuple) -> None:
    ev = {
        "ts": 5.0,
        "event": "threshold",
        "signal": "fd_pressure",
        "reason": "trend",
        "pid": 101,
        "role": "worker",
        "worker_id": 0,
        "num_fds": 700,
        "fd_limit": 1024,
        "fd_share": 0.6836,
        "threshold_share": 0.9,
        "slope_fds_per_s": 20.0,
        "limit_in_s": 16.2,
        "horizon_s": 60.0,
        "window_s": 10.0,
        "fds": {
            "file": 650,
            "shm": 10,
            "socket": 0,
            "pipe": 4,
            "other": 36,
            "shm_bytes": 0,
            "top_files": [["/data/a.bin", 650]],
        },
    }
    r = report(trigger="threshold")
    r["events"].append(ev)
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["fd-exhaustion"] and f[0].confidence == 0.6
    assert f[0].evidence["pressure"][0]["limit_in_s"] == 16.2
    assert f[0].evidence["cause"] == "regular-files"


def test_fd_trend_derived_from_timeline(playbooks: tuple) -> None:
    r = report(trigger="exit")
    r["timeline"] = [
        {
            "kind": "sample",
            "ts": float(t),
            "procs": [{"pid": 102, "ts": float(t), "num_fds": 500 + 25 * t, "fd_limit": 1024}],
        }
        for t in range(6)
    ]
    f = match(r, playbooks)
    assert ids(f) == ["fd-exhaustion"]
    assert f[0].evidence["pressure"][0]["pid"] == 102 and f[0].evidence["pressure"][0]["reason"] == "trend"


# --------------------------------------------------------------------------- shm


def test_shm_enospc_evidence(playbooks: tuple) -> None:
    r = report(
        exception=exc(SHM_ALLOC_ENOSPC), system={"shm_total": 64 * MiB, "shm_free": 1 * MiB, "shm_torch_files": 0}
    )
    f = match(r, playbooks)
    check_well_formed(f)
    ev = f[0].evidence
    assert f[0].playbook == "shm-exhaustion" and f[0].confidence >= 0.95
    assert ev["errno"] == 28 and ev["shm_total"] == 64 * MiB and ev["shm_free"] == 1 * MiB
    assert ev["loader"] == {
        "batch_size": 4,
        "num_workers": 2,
        "prefetch_factor": 2,
        "sharing_strategy": "file_descriptor",
    }
    assert "--shm-size" in f[0].remediation


@pytest.mark.parametrize(
    "message",
    [
        SIGBUS,
        "Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
    ],
)
def test_bus_errors_are_shm(playbooks: tuple, message: str) -> None:
    assert ids(match(report(exception=exc(message)), playbooks)) == ["shm-exhaustion"]


def test_enospc_on_dev_shm_oserror(playbooks: tuple) -> None:
    e = exc("[Errno 28] No space left on device: '/dev/shm/psm_1234'", type="builtins.OSError", errno=28)
    assert ids(match(report(exception=e), playbooks)) == ["shm-exhaustion"]
    # ENOSPC on a regular disk is not shared memory
    e = exc(
        "[Errno 28] No space left on device: '/ckpt/model.pt'", type="builtins.OSError", errno=28, from_loader=False
    )
    assert match(report(exception=e), playbooks) == []


def test_shm_pressure_event(playbooks: tuple) -> None:
    r = report(trigger="threshold")
    r["events"].append(
        {
            "ts": 4.0,
            "event": "threshold",
            "signal": "shm_pressure",
            "reason": "smaller_than_need",
            "shm_total": 64 * MiB,
            "shm_free": 60 * MiB,
            "free_share": 0.94,
            "threshold_free_share": 0.1,
            "need_bytes": 96 * MiB,
            "shm_torch_files": 0,
        }
    )
    f = match(r, playbooks)
    assert ids(f) == ["shm-exhaustion"] and f[0].evidence["need_bytes"] == 96 * MiB


# --------------------------------------------------------------------------- deadlock


def deadlocked_worker(pid: int, wid: int, frames: list) -> dict[str, Any]:
    return proc(pid, worker_id=wid, frames=frames, waiting_in="lock acquire", status="blocked", syscall=202)


def test_fork_held_lock_deadlock(playbooks: tuple) -> None:
    frames = [
        fr("__getitem__", "/home/user/examples/deadlock.py", 30),
        fr("fetch", "/v/site-packages/torch/utils/data/_utils/fetch.py", 52),
        fr("_worker_loop", "/v/site-packages/torch/utils/data/_utils/worker.py", 349),
        fr("run", "/usr/lib/python3.11/multiprocessing/process.py", 108),
        fr("_launch", "/usr/lib/python3.11/multiprocessing/popen_fork.py", 71),
        fr("<module>", "/home/user/examples/deadlock.py", 60),
    ]
    main = proc(
        100,
        "main",
        frames=[fr("_try_get_data", "/v/site-packages/torch/utils/data/dataloader.py", 1251)],
        waiting_in="poll",
        syscall=7,
    )
    r = report(
        trigger="stall",
        classification="deadlock",
        processes=[main, deadlocked_worker(101, 0, frames), deadlocked_worker(102, 1, frames)],
    )
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["worker-deadlock"]
    ev = f[0].evidence
    w0 = ev["workers"][0]
    assert w0["pid"] == 101 and w0["waiting_in"] == "lock acquire" and w0["syscall"] == 202
    assert w0["user_frame"] == "__getitem__ (/home/user/examples/deadlock.py:30)"
    assert w0["frames"][-1].startswith("_worker_loop")  # the parent's frames are cut
    assert ev["main"]["frames"][0].startswith("_try_get_data")
    assert "points_at" not in ev  # no library hint: the waiting site's variant says it is a lock
    assert "**A lock held across fork.**" in f[0].remediation and "nobody feeds" not in f[0].remediation
    assert 'multiprocessing_context="spawn"' in f[0].remediation and "timeout=" in f[0].remediation


def test_deadlock_pointing_at_opencv(playbooks: tuple) -> None:
    frames = [
        fr("futex_wait", "libc.so.6", native=True),
        fr("cv::parallel_for_", "/usr/lib/libopencv_core.so.4.5", native=True),
        fr("resize", "/v/site-packages/cv2/__init__.py"),
        fr("__getitem__", "/home/user/ds.py", 12),
        fr("_worker_loop", "worker.py"),
    ]
    r = report(
        trigger="stall",
        classification="deadlock",
        processes=[proc(100, "main"), proc(101, frames=frames, status="blocked")],
    )
    f = match(r, playbooks)
    assert f[0].playbook == "worker-deadlock"
    assert [p["hint"] for p in f[0].evidence["points_at"]][0] == "OpenCV"
    assert f[0].remediation.startswith("**The stacks point at OpenCV.**")
    assert "cv2.setNumThreads(0)" in f[0].remediation.split("\n\n")[1]


def test_deadlock_pointing_at_openmp_and_logging(playbooks: tuple) -> None:
    frames = [
        fr("gomp_team_barrier_wait_end", "/usr/lib/libgomp.so.1", native=True),
        fr("acquire", "/usr/lib/python3.11/logging/__init__.py", 917),
        fr("_worker_loop", "worker.py"),
    ]
    r = report(trigger="stall", classification="deadlock", processes=[proc(100, "main"), proc(101, frames=frames)])
    hints = [p["hint"] for p in match(r, playbooks)[0].evidence["points_at"]]
    assert hints[:2] == ["OpenMP/MKL thread pool", "logging handler"]


def test_dataloader_timeout_error_is_deadlock(playbooks: tuple) -> None:
    f = match(report(exception=exc("DataLoader timed out after 30 seconds")), playbooks)
    assert ids(f) == ["worker-deadlock"] and f[0].confidence == 0.6


# --------------------------------------------------------------------------- batch shapes and RNG


def test_batch_shape_event(playbooks: tuple) -> None:
    ev = {
        "ts": 3.0,
        "event": "batch_shape",
        "signal": "batch_shape",
        "reason": "inconsistent_leading_dims",
        "batch_index": 0,
        "batch_size": 4,
        "expected_batch_size": 4,
        "shapes": {"batch[0]": [12, 8, 8], "batch[1]": [4]},
        "leading_dims": {"batch[0]": 12, "batch[1]": 4},
        "collate_fn": "examples.cat_collate.cat_collate",
        "drop_last": False,
        "dataset_len": 40,
        "is_last_batch": False,
    }
    r = report(trigger="threshold")
    r["events"].append(ev)
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["batch-dim-mismatch"]
    e = f[0].evidence
    assert e["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]} and e["batch_index"] == 0
    assert e["collate_fn"] == "examples.cat_collate.cat_collate" and e["expected_batch_size"] == 4


def test_loss_batch_size_error_supports_batch_mismatch(playbooks: tuple) -> None:
    e = exc(
        "Expected input batch_size (12) to match target batch_size (4).", type="builtins.ValueError", from_loader=False
    )
    f = match(report(exception=e), playbooks)
    assert ids(f) == ["batch-dim-mismatch"] and f[0].evidence["collate_fn"].endswith("default_collate")


def test_rng_duplicate_event(playbooks: tuple) -> None:
    dups = [{"attribute": "dataset.rng", "workers": [0, 1, 2], "kind": "object"}]
    r = report(trigger="threshold")
    r["events"].append({"ts": 2.0, "event": "rng_duplicate", "duplicates": dups})
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["rng-duplication"] and f[0].evidence["duplicates"] == dups
    assert "get_worker_info().seed" in f[0].remediation


def rng_fp(wid: int, stage: str = "start", drawn: tuple = (), epoch: int = 1, **prints: str) -> dict:
    """An rng_fingerprint event; keyword ``dataset__np_rng`` stands for the path ``dataset.np_rng``,
    ``global__numpy`` for ``global:numpy``."""
    paths = {k.replace("dataset__", "dataset.").replace("global__", "global:"): v for k, v in prints.items()}
    ev = {
        "ts": 2.0,
        "event": "rng_fingerprint",
        "worker_id": wid,
        "pid": 100 * epoch + wid,
        "epoch": epoch,
        "stage": stage,
        "fingerprints": paths,
    }
    if stage == "after_first_batch":
        ev["drawn"], ev["rebound"] = list(drawn), []
    return ev


def test_rng_duplicates_derived_from_fingerprints(playbooks: tuple) -> None:
    r = report(trigger="exit")
    for wid in (0, 1):
        r["events"] += [
            rng_fp(wid, dataset__np_rng="same", global__random=f"g{wid}"),
            rng_fp(
                wid,
                "after_first_batch",
                ("dataset.np_rng", "global:random"),
                dataset__np_rng="drawn",
                global__random=f"h{wid}",
            ),
        ]
    f = match(r, playbooks)
    assert ids(f) == ["rng-duplication"]
    assert f[0].evidence["duplicates"] == [
        {"attribute": "dataset.np_rng", "workers": [0, 1], "kind": "object", "epoch": 1}
    ]
    assert "Every worker draws from its own copy" in f[0].remediation
    assert "The workers start the same stream every epoch" not in f[0].remediation


def test_rng_identical_but_never_drawn_from_is_quiet(playbooks: tuple) -> None:
    r = report(trigger="exit")
    for wid in (0, 1):  # a generator used in Dataset.__init__ only: alike in every worker, never moves
        r["events"] += [rng_fp(wid, dataset__rng="same"), rng_fp(wid, "after_first_batch", dataset__rng="same")]
    assert match(r, playbooks) == []
    r["events"] = [rng_fp(wid, dataset__rng="same") for wid in (0, 1)]  # the start alone proves nothing
    assert match(r, playbooks) == []


def test_rng_epoch_repeat_derived_from_fingerprints(playbooks: tuple) -> None:
    r = report(
        trigger="exit",
        loader={
            "persistent_workers": False,
            "worker_init_fn": "train.seed_by_id",
            "sampler": "torch.utils.data.sampler.RandomSampler",
        },
    )
    r["events"] += [
        rng_fp(0, global__numpy="s0"),
        rng_fp(0, "after_first_batch", ("global:numpy",), global__numpy="t0"),
        rng_fp(0, epoch=2, global__numpy="s0"),
    ]
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["rng-duplication"] and f[0].confidence == 0.85
    ev = f[0].evidence
    assert ev["repeats"] == [{"attribute": "global:numpy", "workers": [0], "epochs": [1, 2], "kind": "global"}]
    assert ev["persistent_workers"] is False and ev["worker_init_fn"] == "train.seed_by_id"
    assert ev["sampler"].endswith("RandomSampler")
    assert 'ignore="rng-duplication"' in f[0].remediation  # the way out for a validation loader seeded on purpose
    assert "torch.initial_seed()" in f[0].remediation
    assert "Every worker draws from its own copy" not in f[0].remediation


def test_rng_one_worker_only_is_quiet(playbooks: tuple) -> None:
    r = report(trigger="exit", processes=[proc(100, "main"), proc(101)])
    r["events"].append(
        {"ts": 2.0, "event": "rng_fingerprint", "worker_id": 0, "pid": 101, "fingerprints": {"dataset.np_rng": "same"}}
    )
    assert match(r, playbooks) == []


# --------------------------------------------------------------------------- ordering, user playbooks


def test_earlier_evidence_joins_a_later_exception(playbooks: tuple) -> None:
    r = report(exception=exc(WORKER_EMFILE, type="builtins.OSError"))
    r["events"].append(
        {
            "ts": 3.0,
            "event": "batch_shape",
            "signal": "batch_shape",
            "reason": "leading_dim_mismatch",
            "batch_index": 1,
            "shapes": {"batch": [12]},
            "leading_dims": {"batch": 12},
        }
    )
    f = match(r, playbooks)
    check_well_formed(f)
    assert ids(f) == ["fd-exhaustion", "batch-dim-mismatch"]


def test_user_regex_only_playbook_needs_no_code(tmp_path: Path) -> None:
    (tmp_path / "h5.toml").write_text(
        textwrap.dedent("""
        id = "hdf5-fork"
        title = "HDF5 file shared across fork"
        [[signals]]
        name = "h5-text"
        exception_text = "(?i)HDF5-DIAG|h5py"
        exception_type = "OSError$"
        confidence = 0.8
        [[signals]]
        name = "h5-frame"
        frame_filename = "h5py/"
        frame_function = "^__getitem__$"
        role = "worker"
        confidence = 0.6
        [remediation]
        text = "Open the file lazily in each worker."
    """)
    )
    pbs = load_playbooks([str(tmp_path)])
    e = exc(
        "Caught OSError in DataLoader worker process 1.\nOSError: Can't read data (h5py errors)",
        type="builtins.OSError",
    )
    f = match(report(exception=e), pbs)
    assert ids(f) == ["hdf5-fork"] and f[0].confidence == 0.8
    assert f[0].evidence["matched"][0]["matched_text"] == "OSError: Can't read data (h5py errors)"
    assert f[0].remediation == "Open the file lazily in each worker."
    # frames alone, in a worker (not in main)
    frames = [fr("__getitem__", "/v/site-packages/h5py/_hl/dataset.py", 700), fr("_worker_loop", "worker.py")]
    r = report(trigger="stall", classification="slow", processes=[proc(100, "main"), proc(101, frames=frames)])
    f = match(r, pbs)
    assert ids(f) == ["hdf5-fork"] and f[0].evidence["matched"][0]["frame"]["pid"] == 101
    r["processes"] = [proc(100, "main", frames=frames), proc(101)]
    assert match(r, pbs) == []


def test_user_override_changes_remediation_without_code(tmp_path: Path) -> None:
    builtin = (Path(__file__).parents[1] / "playbooks" / "fd-exhaustion.toml").read_text()
    (tmp_path / "fd.toml").write_text(
        builtin.replace("Check the limit each process runs with", "Page the data team, then check the limit")
    )
    f = match(report(exception=exc(COMMUNICATION)), load_playbooks([str(tmp_path)]))
    assert "Page the data team" in f[0].remediation


def test_match_does_not_mutate_report(playbooks: tuple) -> None:
    r = report(exception=exc(SHM_OPEN_EMFILE), trigger="exception")
    r["events"].append(
        {
            "ts": 2.0,
            "event": "rng_duplicate",
            "duplicates": [{"attribute": "dataset.rng", "workers": [0, 1], "kind": "object"}],
        }
    )
    before = copy.deepcopy(r)
    match(r, playbooks)
    assert r == before


def test_tolerates_sparse_and_odd_reports(playbooks: tuple) -> None:
    assert match({}, playbooks) == []
    odd = {
        "exception": {"type": "builtins.OSError", "message": None},
        "processes": [None, {"pid": 1}],
        "events": [None, "x", {"event": "threshold"}],
        "timeline": [None, {"kind": "sample", "procs": [None]}],
        "loader": None,
        "system": None,
        "classification": None,
    }
    assert match(odd, playbooks) == []


@pytest.mark.parametrize(
    "exc_dict, expected",
    [
        ({"message": "[Errno 24] Too many open files: 'x'"}, (24,)),
        ({"message": SHM_ALLOC_ENOSPC}, (28,)),
        ({"message": SHM_OPEN_EMFILE, "errno": None}, (24,)),
        ({"message": "DataLoader worker (pid 1234) exited unexpectedly", "errno": None}, ()),
        ({"message": "x", "errno": 28}, (28,)),
        (None, ()),
    ],
)
def test_errnos_in(exc_dict: dict | None, expected: tuple) -> None:
    assert errnos_in(exc_dict) == expected


def test_fd_evidence_names_no_process_when_none_is_near_its_limit(playbooks: tuple) -> None:
    # the worker that hit EMFILE is gone; healthy processes are context, not the culprit
    quiet = proc(
        100,
        "main",
        num_fds=30,
        fds={"file": 25, "shm": 0, "socket": 1, "pipe": 2, "other": 2, "shm_bytes": 0, "top_files": []},
    )
    f = match(report(exception=exc(WORKER_EMFILE, type="builtins.OSError"), processes=[quiet]), playbooks)
    ev = f[0].evidence
    assert "pid" not in ev and ev["fd_counts"] == [
        {"pid": 100, "role": "main", "worker_id": None, "num_fds": 30, "fd_limit": 1024}
    ]
    assert ev["cause"] == "regular-files" and ev["cause_basis"].startswith("the failing call")
