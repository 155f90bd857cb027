"""The monitor's one-walk sample record writes what the general path wrote, byte for byte.

The general path (``to_dict`` -> ``build.compact`` -> ``_fs.json_line``, which redacts through
``redact.outbound``) is kept here as the reference (``general_line``).  The new path is compared
with it on every poll of a real Monitor watching a real watched DataLoader job whose samples carry
user text (a process name and an open file's path holding secrets), and on hostile samples made
up by hypothesis.  ``python tests/test_timeline_record.py --compare RUN_DIR POLLS`` is the
Monitor's side of the real-job test: a Monitor skips its own descendants, so it runs in a
process of its own, next to the job rather than above it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dlwatch._fs import json_line
from dlwatch.wire.heartbeat import Heartbeat
from dlwatch.model import FdSummary, GpuSample, ProcSample, SystemSample
from dlwatch.redact import outbound
from dlwatch.report import build
from dlwatch.monitor import timeline as timeline_record

SECRET_DIR_NAME = "ghp_" + "abcdefghijklmnopqrstuvwxyz0123456789"  # a GitHub token's shape
SECRET_NAME = "hunter2"  # the job names itself "pw=hunter2"


def general_line(
    ts: float,
    heartbeat: dict[str, Any] | None,
    procs: list[tuple[ProcSample, str]],
    system: SystemSample | None,
    gpus: list[GpuSample],
) -> tuple[dict[str, Any], bytes]:
    """The record and the timeline line as Monitor.poll made them before the one-walk serialiser."""
    record = build.compact(
        {
            "kind": "sample",
            "ts": ts,
            "heartbeat": heartbeat,
            "procs": [dict(s.to_dict(), role=role) for s, role in procs],
            "system": system.to_dict() if system else None,
            "gpus": [g.to_dict() for g in gpus],
        }
    )
    return record, json_line(record)


# --------------------------------------------------------------------------- a real watched job


def _monitor_run_dir(tmp_path: Any, pid: int, options: dict[str, Any], num_workers: int = 0) -> Any:
    """A run directory as a watch leaves it for its monitor (tmp_path/run): config.json naming ``pid``."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "dumps").mkdir(mode=0o700)
    (run / "config.json").write_text(
        json.dumps(
            {
                "pid": pid,
                "started_at": time.time(),
                "report_dir": str(tmp_path / "reports"),
                "options": options,
                "loader": {"num_workers": num_workers, "batch_size": 1},
            }
        )
    )
    return run


def _compare(run_dir: str, polls: int) -> None:
    """In a fresh process: a Monitor over the job named in RUN_DIR/config.json, both paths on every poll."""
    from dlwatch.monitor import loop as monitor

    calls: list[tuple[tuple[Any, ...], bytes]] = []
    real = timeline_record.sample_line

    def spy(*args: Any, **kwargs: Any) -> bytes:
        line = real(*args, **kwargs)  # the monitor's own call: its heartbeat text kept while unchanged
        calls.append((args, line))
        return line

    timeline_record.sample_line = spy  # type: ignore[assignment]
    m = monitor.Monitor(run_dir)
    for _ in range(polls):
        m.poll()
        time.sleep(0.05)
    m.journal.close()
    with open(os.path.join(run_dir, "timeline.jsonl"), "rb") as f:
        written = [line for line in f if line.startswith(b'{"kind": "sample"')]
    mismatches, record_mismatches, ring_mismatches, raw_text = [], 0, 0, []
    for (args, new), ring in zip(calls, list(m.journal.ring)[-len(calls) :]):
        old_record, old = general_line(*args)
        if new != old:
            mismatches.append([old.decode(errors="replace"), new.decode(errors="replace")])
        if timeline_record.encode(timeline_record.sample_record(*args)) != old:  # the one-walk record too
            record_mismatches += 1
        # what an incident makes of the ring (the report writer redacts) is what it made before
        if ring != new or outbound(json.loads(ring)) != outbound(old_record):
            ring_mismatches += 1
        raw_text += [s.name for s, _role in args[2] if s.name] + [
            path for s, _role in args[2] if s.fds for path, _n in s.fds.top_files
        ]
    print(
        json.dumps(
            {
                "records": len(calls),
                "procs_per_record": [len(args[2]) for args, _ in calls],
                "with_fds": sum(1 for args, _ in calls for s, _r in args[2] if s.fds is not None),
                "mismatches": mismatches[:3],
                "record_mismatches": record_mismatches,
                "ring_mismatches": ring_mismatches,
                "file_is_new_path": written == [line for _a, line in calls],
                "raw_text": sorted(set(raw_text)),
                "timeline": b"".join(written).decode(errors="replace"),
            }
        )
    )


def test_real_job_records_are_byte_identical_and_redacted(tmp_path, target):
    from conftest import REPO, run_bounded, wait_for

    secret_dir = tmp_path / SECRET_DIR_NAME
    secret_dir.mkdir()
    job = target("timeline_job.py", str(tmp_path / "reports"), str(secret_dir))
    run_dir = job.wait_line("READY", timeout=120).split(None, 1)[1]
    # the job's own monitor writes its timeline with the new path: wait for two samples in it
    own_timeline = os.path.join(run_dir, "timeline.jsonl")

    def own_samples() -> list[str]:
        try:
            with open(own_timeline) as f:
                return [line for line in f if line.startswith('{"kind": "sample"')]
        except FileNotFoundError:
            return []

    assert len(wait_for(lambda: own_samples() if len(own_samples()) >= 2 else [], timeout=30)) >= 2
    own = "".join(own_samples())

    mine = _monitor_run_dir(tmp_path, job.pid, {"poll_interval": 0.2}, num_workers=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    rc, out, err = run_bounded(
        [sys.executable, os.path.abspath(__file__), "--compare", str(mine), "6"], env=env, cwd=REPO, timeout=120
    )
    assert rc == 0, err[-2000:]
    got = json.loads(out)

    # preconditions: real samples of the job and its workers, with the user text in them
    assert got["records"] == 6
    assert min(got["procs_per_record"]) >= 3, got["procs_per_record"]  # main + 2 workers
    assert got["with_fds"] >= 3  # the first poll reads every process's fd breakdown (file paths)
    assert f"pw={SECRET_NAME}" in got["raw_text"]
    assert any(SECRET_DIR_NAME in p for p in got["raw_text"]), got["raw_text"]

    assert got["mismatches"] == []
    assert got["record_mismatches"] == 0
    assert got["ring_mismatches"] == 0
    assert got["file_is_new_path"]
    for text in (got["timeline"], own):
        assert SECRET_NAME not in text and SECRET_DIR_NAME not in text
        assert '"name": "pw=***"' in text  # redacted where it was, not dropped
    assert "/***/data.bin" in got["timeline"]


# --------------------------------------------------------------------------- hostile samples

SHAPES = [
    "password = {s}",
    "pw={s}",
    "--api-token={s}",
    "https://alice:{s}@example.invalid/x",
    "ghp_{s}{s}",
    "hf_{s}{s}",
    "sk-proj-{s}",
    "Bearer {s}",
    "key: {s}",
]
BODY = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=20, max_size=24)
text = st.one_of(
    st.none(), st.text(max_size=20), st.builds(lambda shape, s: shape.format(s=s), st.sampled_from(SHAPES), BODY)
)
num = st.one_of(st.none(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False))
# the line writes floats itself: NaN and the infinities as json.dumps writes them
num_any = st.one_of(st.none(), st.integers(-(2**63), 2**63), st.floats(), st.booleans(), text)
fds = st.one_of(
    st.none(),
    st.builds(
        FdSummary,
        file=st.integers(0, 99),
        shm=st.integers(0, 99),
        top_files=st.lists(
            st.tuples(text.filter(lambda t: t is not None).map(lambda t: f"/data/{t}/x.bin"), st.integers(1, 9)),
            max_size=3,
        ).map(tuple),
    ),
)


@st.composite
def proc_samples(draw) -> ProcSample:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ProcSample):
        if f.name in ("pid", "ts"):
            continue
        if f.name in ("name", "state", "wchan"):
            values[f.name] = draw(text)
        elif f.name == "fds":
            values[f.name] = draw(fds)
        elif f.name == "gone":
            values[f.name] = draw(st.booleans())
        else:
            values[f.name] = draw(num)
    return ProcSample(pid=draw(st.integers(1, 2**22)), ts=draw(st.floats(0, 2e9)), **values)


systems = st.one_of(
    st.none(),
    st.builds(
        SystemSample,
        ts=st.floats(0, 2e9),
        mem_available=num,
        mlocked=num,
        shm_free=num,
        cgroup_memory_limit=num,
        vm_oom_kills=num,
    ),
)
gpus = st.lists(st.builds(GpuSample, index=st.integers(0, 7), name=text, util_percent=num, memory_used=num), max_size=2)
heartbeats = st.one_of(
    st.none(),
    st.builds(
        lambda b, e, s, w: Heartbeat(b, b, e, s, 1, 0.0, 0.0, w, w, w).to_dict(),
        st.integers(0, 10**9),
        st.integers(0, 999),
        st.integers(0, 4),
        st.floats(0, 1e6),
    ),
)


@settings(max_examples=300)
@given(
    ts=st.floats(0, 2e9),
    hb=heartbeats,
    procs=st.lists(st.tuples(proc_samples(), st.sampled_from(["main", "worker", "other"])), max_size=4),
    system=systems,
    gpus=gpus,
)
def test_hostile_samples_are_byte_identical_and_redacted(ts, hb, procs, system, gpus):
    old_record, old = general_line(ts, hb, procs, system, gpus)
    record = timeline_record.sample_record(ts, hb, procs, system, gpus)
    assert timeline_record.encode(record) == old
    assert outbound(record) == outbound(old_record)  # what an incident makes of the ring
    line = timeline_record.sample_line(ts, hb, procs, system, gpus)
    assert line == old
    assert outbound(json.loads(line)) == outbound(old_record)  # the ring keeps the line; an incident decodes it


@settings(max_examples=300)
@given(
    values=st.lists(st.tuples(st.sampled_from([f.name for f in dataclasses.fields(ProcSample)]), num_any), max_size=12),
    role=st.one_of(st.sampled_from(["main", "worker", "other"]), text.filter(lambda t: t is not None)),
    ts=st.one_of(st.floats(), st.integers(0, 2**40)),
)
@example([("rss", float("nan")), ("cpu_s", float("inf")), ("uss_ts", float("-inf")), ("ts", -0.0)], "main", 1.0)
@example([("rss", True), ("name", None), ("wchan", 'say "hi"\n\u00e9\udcff'), ("gone", 1)], "worker", float("nan"))
@example([("state", 3.5), ("num_fds", "12"), ("pid", 2**70)], 'pw=hunter2 "x"', 2**40)
def test_any_value_in_any_field_gives_the_general_line(values, role, ts):
    """Every type in every field (NaN, infinities, bools and text where numbers go, None), any role:
    one template per shape, and a shape it does not know takes the general path."""
    s = ProcSample(**{"pid": 1, "ts": 0.5, **dict(values)})
    procs = [(s, role), (ProcSample(pid=2, ts=0.25), "worker")]
    assert timeline_record.sample_line(ts, None, procs, None, []) == general_line(ts, None, procs, None, [])[1]


@settings(max_examples=300)
@given(
    items=st.lists(
        st.tuples(
            st.one_of(
                st.sampled_from(["batches", "state", "data_wait_s", "password", "api_key", "x%sy", "a b", "é"]), text
            ),
            num_any,
        ),
        max_size=8,
    ),
)
@example([("batches", 3), ("state", "body"), ("data_wait_s", 0.25), ("step_s", float("nan")), ("x", None)])
@example([("token", "ghp_" + "Z" * 36), ("x%sy", 1), ("state", 'say "hi"\n\udcff')])
def test_any_heartbeat_mapping_gives_the_general_line(items):
    """The heartbeat's dict is written through a template per shape: any keys (secret-looking, not identifiers,
    with a % in them) and any values give the line the general path gives."""
    hb = {k: v for k, v in items if k is not None}
    assert timeline_record.sample_line(1.0, hb, [], None, []) == general_line(1.0, hb, [], None, [])[1]
    assert timeline_record.sample_line(1.0, hb, [], None, []) == general_line(1.0, hb, [], None, [])[1]  # cached
    # as the monitor writes an unchanged heartbeat: its text made once, handed back
    text = timeline_record.heartbeat_text(hb)
    assert (
        timeline_record.sample_line(2.0, hb, [], None, [], heartbeat_text=text)
        == general_line(2.0, hb, [], None, [])[1]
    )


def test_every_process_field_is_written():
    """A field added to ProcSample is written like the others (the byte comparison covers it)."""
    values = {f.name: 7 for f in dataclasses.fields(ProcSample)}
    values.update(
        name="python",
        state="S",
        wchan="do_poll",
        gone=False,
        cpu_s=0.5,
        fds=FdSummary(file=1, top_files=(("/data/train.bin", 1),)),
    )
    s = ProcSample(**values)
    entry = timeline_record.sample_record(1.0, None, [(s, "worker")], None, [])["procs"][0]
    assert list(entry) == [f.name for f in dataclasses.fields(ProcSample)] + ["role"]
    assert (
        timeline_record.encode(timeline_record.sample_record(1.0, None, [(s, "worker")], None, []))
        == general_line(1.0, None, [(s, "worker")], None, [])[1]
    )


def test_user_text_is_redacted_in_every_text_field():
    token = "ghp_" + "Z" * 36
    s = ProcSample(
        pid=5,
        ts=1.0,
        name="pw=hunter2",
        state=f"key: {token}",
        wchan=f"Bearer {token}",
        fds=FdSummary(file=2, top_files=((f"/data/{token}/a.bin", 2),)),
    )
    gpu = GpuSample(index=0, name=f"--api-token={token}")
    line = timeline_record.encode(timeline_record.sample_record(1.0, None, [(s, "main")], None, [gpu]))
    assert token not in line.decode() and b"hunter2" not in line
    assert line.count(b"***") == 5


@dataclasses.dataclass(frozen=True)
class _Secretive:
    """Field names the general path masks or rewrites: they take the careful path."""

    password: str | None = None
    api_key: int | None = None
    ok: str | None = None


@pytest.mark.parametrize(
    "value",
    [
        _Secretive(password="x", api_key=3, ok="Bearer abcdefghijklmnop1234"),
        _Secretive(password=None, api_key=None, ok=None),
        _Secretive(password="", api_key=0, ok="fine"),
    ],
)
def test_secret_field_names_are_masked_as_before(value):
    from dlwatch.model import plain

    got = timeline_record._dataclass(value)
    assert got == outbound(build.compact(plain(value)))
    assert json.dumps(got) == json.dumps(outbound(build.compact(plain(value))))


if __name__ == "__main__" and sys.argv[1:2] == ["--compare"]:
    _compare(sys.argv[2], int(sys.argv[3]))


@settings(max_examples=300)
@given(
    polls=st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.sampled_from([f.name for f in dataclasses.fields(ProcSample)][2:]), num_any), max_size=6
            ),
            st.sampled_from(["main", "worker"]),
            st.floats(0, 2e9),
        ),
        min_size=2,
        max_size=6,
    ),
)
@example([([("cpu_s", 1)], "worker", 1.0), ([("cpu_s", 1.0)], "worker", 2.0), ([("cpu_s", True)], "worker", 3.0)])
@example([([("cpu_s", 0.0)], "worker", 1.0), ([("cpu_s", -0.0)], "worker", 2.0)])
@example([([("rss", 5)], "worker", 1.0), ([("rss", 5)], "main", 2.0), ([("wchan", "pw=hunter2")], "main", 3.0)])
def test_one_process_polled_again_and_again_gives_the_general_line_each_time(polls):
    """The line of a process whose fields are what they were at the last poll is kept from that poll
    (an idle worker): poll after poll of the same pid, with values that are equal but print apart
    (1, 1.0, True; 0.0, -0.0), the role changing, and unchanged polls between, every line is the
    general path's."""
    timeline_record._SAME.clear()
    for values, role, ts in polls:
        for again in (ts, ts + 1.5):  # each poll, then the same values a poll later
            s = ProcSample(**{"pid": 7, "ts": again, **dict(values)})
            procs = [(s, role)]
            assert (
                timeline_record.sample_line(again, None, procs, None, [])
                == general_line(again, None, procs, None, [])[1]
            )


def test_the_monitor_writes_each_polls_own_heartbeat(tmp_path):
    """The monitor keeps an unchanged heartbeat's text from the poll before (the reader hands the same
    object back): every sample line still holds the heartbeat as read afresh at that poll, through
    batches, an epoch edge, a state-byte-only change and polls with nothing new."""
    from dlwatch.monitor import loop as monitor
    from dlwatch.wire import heartbeat

    run = _monitor_run_dir(
        tmp_path, os.getpid(), {"report_dir": str(tmp_path / "reports"), "poll_interval": 1.0, "playbooks": []}
    )
    hb_path = str(run / "heartbeat")
    writer = heartbeat.HeartbeatWriter(hb_path)
    m = monitor.Monitor(str(run))
    try:
        steps = [
            lambda: writer.write(heartbeat.STATE_WAITING),
            lambda: None,  # nothing new: the same heartbeat object
            lambda: writer.first_batch(time.monotonic() - 0.25, time.monotonic()),
            lambda: None,
            lambda: writer.mark(heartbeat.STATE_WAITING),  # the state byte only
            lambda: None,
            lambda: (writer.begin_epoch(), writer.write(heartbeat.STATE_OUTSIDE)),
            lambda: writer.close(),
            lambda: None,
        ]
        seen = []
        for step in steps:
            step()
            m.poll()
            with open(run / "timeline.jsonl", "rb") as f:
                last = [line for line in f if line.startswith(b'{"kind": "sample"')][-1]
            fresh = heartbeat.read(hb_path)
            assert fresh is not None
            assert json.loads(last)["heartbeat"] == json.loads(json.dumps(fresh.to_dict()))
            seen.append(fresh.to_dict()["state"])
        assert seen == ["waiting_for_data"] * 2 + ["in_loop_body"] * 2 + ["waiting_for_data"] * 2 + [
            "outside",
            "ended",
            "ended",
        ]
    finally:
        m._close()
        writer.close()
