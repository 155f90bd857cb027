"""Property tests: the /proc parsers never fail on truncated or garbled text except as documented."""

from __future__ import annotations

import os

from hypothesis import example, given, settings
from hypothesis import strategies as st

from dlwatch.collect import procfs

REAL_STAT = open(f"/proc/{os.getpid()}/stat").read()
REAL_MAPS = open(f"/proc/{os.getpid()}/maps").read()[:4000]
REAL_MEMINFO = open("/proc/meminfo").read()


@given(st.integers(min_value=0, max_value=len(REAL_STAT)), st.text(max_size=40))
def test_parse_stat_truncated_or_garbled(cut, junk):
    for text in (REAL_STAT[:cut], REAL_STAT[:cut] + junk, junk + REAL_STAT[cut:]):
        try:
            out = procfs.parse_stat(text)
        except ValueError:
            continue  # the one documented failure: the caller keeps what it read before
        assert isinstance(out["state"], str) and out["cpu_s"] >= 0


def test_parse_stat_comm_with_spaces_and_parens():
    text = REAL_STAT.replace(f"({REAL_STAT[REAL_STAT.find('(') + 1 : REAL_STAT.rfind(')')]})", "(a) b (c")
    text = text.replace("(a) b (c", "(a) b (c)") if text.count(")") < 2 else text
    out = procfs.parse_stat(f"123 (evil ) R 1 x) {REAL_STAT[REAL_STAT.rfind(')') + 2 :]}")
    assert out["name"] == "evil ) R 1 x"


@given(st.text(max_size=200))
def test_parse_syscall_never_raises(text):
    out = procfs.parse_syscall(text)
    assert out is None or isinstance(out, int)


def test_parse_syscall_values():
    assert procfs.parse_syscall("202 0x7f 0x80 0x0 0x0 0x0 0x0 0x7ffc 0x7f12\n") == 202
    assert procfs.parse_syscall("running\n") == -1
    assert procfs.parse_syscall("-1 0x7ffc 0x7f12\n") == -1
    assert procfs.parse_syscall("") is None


@given(st.integers(min_value=0, max_value=len(REAL_MEMINFO)), st.text(max_size=60))
@example(0, "Mlocked: \u00b2 kB\n")  # "²".isdigit() is true and int("²") raises: found by a random run once
def test_parse_kv_kib(cut, junk):
    out = procfs.parse_kv_kib(REAL_MEMINFO[:cut] + junk, ("MemAvailable", "Mlocked"))
    assert all(isinstance(v, int) and v >= 0 for v in out.values())


def test_parsers_read_ascii_digits_only():
    """Unicode digits that int() refuses (superscripts) or accepts (Arabic-Indic) are not kernel numbers."""
    for digit in ("\u00b2", "\u0661", "\uff11"):
        assert procfs.parse_kv_kib(f"Mlocked: {digit} kB\n", ("Mlocked",)) == {}
        assert procfs.parse_ctx_switches(f"voluntary_ctxt_switches: {digit}\n") == (None, None)
        assert procfs.parse_io_chars(f"rchar: {digit}\nwchar: 5\n") == (None, 5)


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=len(REAL_MAPS)), st.text(max_size=80))
def test_shm_mappings(cut, junk):
    count, total = procfs.shm_mappings(REAL_MAPS[:cut] + junk + "\nzz-yy rw-s 0 00:1 2 /dev/shm/torch_1 (deleted)\n")
    assert count >= 0 and total >= 0


def test_shm_mappings_counts_torch_segments():
    maps = (
        "7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 /dev/shm/torch_5_123_0 (deleted)\n"
        "7f0000100000-7f0000300000 rw-s 00000000 00:1a 13 /dev/shm/torch_5_124_0 (deleted)\n"
        "7f0000300000-7f0000400000 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n"
    )
    assert procfs.shm_mappings(maps) == (2, 0x100000 + 0x200000)


def test_classify_fd_target():
    assert procfs.classify_fd_target("/dev/shm/torch_1_2 (deleted)") == "shm"
    assert procfs.classify_fd_target("socket:[123]") == "socket"
    assert procfs.classify_fd_target("pipe:[9]") == "pipe"
    assert procfs.classify_fd_target("/data/img_001.jpg") == "file"
    assert procfs.classify_fd_target("anon_inode:[eventfd]") == "other"
    assert procfs.classify_fd_target("/dev/null") == "other"


# --------------------------------------------------------------------------- events.jsonl (issue 9, item 6)

import json  # noqa: E402
import tempfile  # noqa: E402

from hypothesis import HealthCheck  # noqa: E402

from dlwatch.wire import events as events_mod  # noqa: E402

EVENT_NAMES = [
    "exception",
    "worker_registered",
    "loader_workers",
    "rng_fingerprint",
    "batch_shape",
    "batch_bytes",
    "threshold",
    "stop-not",
    "unknown",
    "",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "ts",
    "pid",
    "ppid",
    "worker_id",
    "exception",
    "pids",
    "fingerprints",
    "dump_path",
    "start_method",
    "batch_bytes",
    "signal",
    "batch_index",
    "num_fds",
    "fd_limit",
    "duplicates",
]
events_st = st.builds(
    lambda name, extra: {"event": name, **extra},
    st.sampled_from(EVENT_NAMES) | json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
)
lines_st = st.one_of(
    events_st.map(lambda e: json.dumps(e).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),  # a list, a string, null where an object belongs
    st.binary(max_size=80).map(lambda b: b.replace(b"\n", b" ")),  # not JSON at all
    st.integers(min_value=1, max_value=200_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
    st.integers(min_value=1, max_value=200_000).map(lambda n: b'{"event":"exception","exception":' + b"[" * n),
)


def _monitor_on(tmp: str, **options):
    from dlwatch.monitor.loop import Monitor

    run_dir = os.path.join(tmp, "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "report_dir": os.path.join(tmp, "reports"),
                "options": {"poll_interval": 0.1, **options},
                "loader": {"num_workers": 2},
            },
            f,
        )
    return Monitor(run_dir)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(lines_st, max_size=8))
def test_event_reader_yields_only_well_typed_events(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "events.jsonl")
        with open(path, "wb") as f:
            f.write(b"\n".join(lines) + b"\n")
        for ev in events_mod.EventReader(path).new():
            assert isinstance(ev["event"], str)
            assert "pid" not in ev or (isinstance(ev["pid"], int) and ev["pid"] > 0)
            if ev["event"] == "exception":
                assert isinstance(ev["exception"]["message"], str)
            if ev["event"] == "loader_workers":
                assert all(isinstance(p, int) and p > 0 for p in ev["pids"])
            json.dumps(ev)  # depth-bounded: it serialises


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(lines_st, min_size=1, max_size=6), st.lists(lines_st, max_size=3))
def test_no_line_stops_the_monitor(lines, later):
    """Every handler of the monitor on hostile lines: no exception, and it still acts on a good event after.

    The handlers get events from EventReader, which type-checks them (events.normalize):
    an exception here would propagate out of _drain_events and end the monitor.
    """
    with tempfile.TemporaryDirectory() as tmp:
        monitor = _monitor_on(tmp)
        path = os.path.join(monitor.run_dir, "events.jsonl")
        with open(path, "ab") as f:
            f.write(b"\n".join(lines) + b"\n")
        monitor._drain_events()
        with open(path, "ab") as f:  # the same hostile lines once more, split at odd places
            data = b"\n".join(later) + b"\n"
            f.write(data[: len(data) // 2])
        monitor._drain_events()
        with open(path, "ab") as f:
            f.write(data[len(data) // 2 :])
            f.write(b'{"event": "worker_registered", "pid": 4194304, "worker_id": 0}\n')
        monitor._drain_events()
        assert monitor.procs[4194304].role == "worker"  # the reader kept going
        assert not monitor.notes.items, monitor.notes.items
        monitor._close()


def test_deeply_nested_and_mistyped_lines_are_skipped(tmp_path):
    monitor = _monitor_on(str(tmp_path))
    path = os.path.join(monitor.run_dir, "events.jsonl")
    hostile = [
        b"[" * 500_000 + b"]" * 500_000,
        b'{"event": "worker_registered", "pid": null}',
        b'{"event": "worker_registered", "pid": "12"}',
        b'{"event": "loader_workers", "pids": "1,2"}',
        b'{"event": "loader_workers", "pids": [1, null, "x", 2.5, true]}',
        b'{"event": "exception", "exception": "boom"}',
        b'{"event": "rng_fingerprint", "worker_id": []}',
        b'{"event": "rng_fingerprint", "worker_id": 0, "fingerprints": {"a": 1}}',
        b'{"event": "batch_bytes", "batch_bytes": {"x": 1}}',
        b"\xff\xfe",
        b'"a string"',
        b"null",
        b'{"event": "x"' + b', "k": {"k": ' * 200 + b"1" + b"}" * 201,
        b"x" * (2 << 20),
    ]
    with open(path, "wb") as f:
        f.write(b"\n".join(hostile) + b"\n")
        f.write(b'{"event": "exception", "exception": {"type": "builtins.ValueError", "message": 5}}\n')
    monitor._drain_events()
    assert set(monitor.procs) == {os.getpid(), 1} and monitor.sampler.loader_pids == {1}  # only the good pid kept
    assert monitor.incidents.exception == {
        "type": "builtins.ValueError",
        "message": "5",
        "errno": None,
        "traceback": None,
        "from_loader": False,
    }
    assert not monitor.notes.items
    monitor._close()


def test_real_monitor_survives_hostile_lines_and_still_reports(tmp_path, no_leftovers):
    """Hostile lines in a real run's events.jsonl; the real monitor still writes the exception incident."""
    import sys

    import pytest
    from torch.utils.data import DataLoader

    import dlwatch
    from conftest import TARGETS, drop_traceback, incidents, load, wait_for

    sys.path.insert(0, TARGETS)
    from datasets import Squares

    dl = DataLoader(Squares(64), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="after the hostile lines") as info:
        with dlwatch.watch(dl, report_dir=tmp_path / "r", poll_interval=0.05) as batches:
            for i, _ in enumerate(batches):
                if i == 2:
                    path = os.path.join(batches.run_dir, "events.jsonl")
                    with open(path, "ab") as f:
                        f.write(
                            b"[" * 300_000
                            + b"\n"
                            + b'{"event": "worker_registered", "pid": null}\n'
                            + b'{"event": "loader_workers", "pids": {"a": 1}}\n'
                            + b'{"event": "exception", "exception": "not an object"}\n'
                            + b'{"event": "rng_fingerprint", "worker_id": "0", "fingerprints": []}\n'
                        )
                    timeline = os.path.join(batches.run_dir, "timeline.jsonl")

                    def size() -> int:
                        return os.path.getsize(timeline) if os.path.exists(timeline) else 0

                    before = size()
                    # a few polls after the lines were written: the monitor read them
                    assert wait_for(lambda: size() > before + 2000, 20)
                    assert batches._session.monitor.poll() is None  # still running
                    raise ValueError("after the hostile lines")
    drop_traceback(info)
    found = incidents(str(tmp_path / "r"))
    assert len(found) == 1
    report = load(found[0])
    assert report["trigger"] == "exception" and "after the hostile lines" in report["exception"]["message"]
    assert not any("monitor process was not running" in n for n in report["notes"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.integers(min_value=0, max_value=255),
    st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=5, max_size=5),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=8, max_size=8),
    st.integers(min_value=0, max_value=2**32 - 1),
)
def test_no_heartbeat_stops_the_monitor(state, counters, times, pid):
    """The other channel the monitor reads every poll: any record with a valid frame is taken without raising."""
    from dlwatch.wire import heartbeat

    seq, batches, epoch_start, epochs, cseq = counters
    ts_last, wait_s, interval_s, ts_wait, ts_first, wait_base, closed_step, first_wait_s = times
    with tempfile.TemporaryDirectory() as tmp:
        monitor = _monitor_on(tmp, stall_timeout=1e12)  # a stall would dump this test's own stacks
        # the two-part layout: hot (state, seq, batches, ts_last, wait, interval, seq), then cold
        raw = heartbeat._REC.pack(
            heartbeat.MAGIC,
            state,
            seq,
            batches,
            ts_last,
            wait_s,
            interval_s,
            seq,
            cseq,
            epochs,
            epoch_start,
            pid,
            ts_wait,
            ts_first,
            wait_base,
            closed_step,
            first_wait_s,
            cseq,
        )
        with open(monitor.settings.hb_path, "wb") as f:
            f.write(raw)
        for _ in range(2):
            monitor.poll()
        assert monitor.sampler.last_hb is not None and monitor.sampler.last_hb.batches == batches
        monitor._close()
