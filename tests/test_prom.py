"""Prometheus metrics: the node_exporter textfile parsed with prometheus_client's own parser,
the HTTP endpoint fetched on 127.0.0.1, both from a real watched DataLoader run."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import dlwatch  # noqa: E402
from conftest import wait_for  # noqa: E402
from dlwatch.model import ProcSample, SystemSample  # noqa: E402
from dlwatch.monitor.prom import PromSink, prom_options, textfile_path  # noqa: E402
from dlwatch.monitor.sinks import PollState, ProcState  # noqa: E402

RANK = {
    "rank": 1,
    "local_rank": 0,
    "world_size": 2,
    "local_world_size": 1,
    "job_id": "job-x",
    "job_id_source": "DLWATCH_JOB_ID",
}


def samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def find(all_samples: list, name: str, **labels: str) -> list:
    return [s for s in all_samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def _state(batches: int = 7) -> PollState:
    from dlwatch.wire.heartbeat import Heartbeat

    hb = Heartbeat(
        batches=batches,
        epoch_batches=batches,
        epochs=1,
        state=2,
        pid=10,
        ts_last_batch=1.0,
        ts_wait_start=1.0,
        total_wait_s=1.0,
        total_step_s=3.0,
        last_interval_s=0.1,
    )
    procs = (
        ProcState(10, "main", None, ProcSample(pid=10, ts=1.0, num_fds=40, fd_limit=1024, rss=5 << 20, uss=4 << 20)),
        ProcState(
            11, "worker", 0, ProcSample(pid=11, ts=1.0, num_fds=12, fd_limit=1024, rss=3 << 20, shm_map_bytes=1 << 20)
        ),
    )
    return PollState(
        now=1.0,
        monotonic=1.0,
        pid=10,
        started_at=0.0,
        rank=RANK,
        heartbeat=hb,
        procs=procs,
        system=SystemSample(ts=1.0, shm_total=64 << 20, shm_free=60 << 20),
        stalls=1,
        incidents=2,
        stalled=True,
    )


def test_textfile_has_every_metric_with_job_and_rank(tmp_path) -> None:
    path = str(tmp_path / "dlwatch.prom")
    sink = PromSink({"file": path, "port": None}, RANK, pid=10)
    own = textfile_path(path, RANK, 10)
    assert own == str(tmp_path / "dlwatch.rank1.10.prom")
    # a link planted at the name is replaced, never written through
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, own)
    sink.on_poll(_state())
    assert victim.read_text() == "keep" and not os.path.islink(own)
    assert oct(os.stat(own).st_mode & 0o777) == "0o600"
    got = samples(open(own).read())
    base = {"job_id": "job-x", "rank": "1"}
    assert find(got, "dlwatch_batches_total", **base)[0].value == 7
    assert find(got, "dlwatch_stalls_total", **base)[0].value == 1
    assert find(got, "dlwatch_incidents_total", **base)[0].value == 2
    assert find(got, "dlwatch_data_wait_share", **base)[0].value == 0.25
    assert find(got, "dlwatch_stalled", **base)[0].value == 1
    assert find(got, "dlwatch_shm_free_bytes", **base)[0].value == 60 << 20
    assert find(got, "dlwatch_process_open_fds", role="main", worker="main", **base)[0].value == 40
    assert find(got, "dlwatch_process_max_fds", role="worker", worker="0", pid="11", **base)[0].value == 1024
    assert find(got, "dlwatch_process_unique_memory_bytes", worker="main", **base)[0].value == 4 << 20
    assert find(got, "dlwatch_process_shm_bytes", worker="0", **base)[0].value == 1 << 20
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary file left
    sink.close(None, clean=True)
    assert not os.path.lexists(own)  # a finished run leaves no stale series


def test_bad_prometheus_options_are_clear_errors(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="TCP port number"):
        prom_options({"DLWATCH_PROM_PORT": "abc"})
    with pytest.raises(ValueError, match="ending in .prom"):
        prom_options({"DLWATCH_PROM_FILE": str(tmp_path / "metrics.txt")})
    with pytest.raises(ValueError, match="does not exist"):
        prom_options({"DLWATCH_PROM_FILE": str(tmp_path / "nope" / "d.prom")})
    assert prom_options({}) == {"file": None, "port": None}  # nothing by default
    # the training process fails open (issue 29): the bad variable is left off, with the same line to warn
    problems: list[str] = []
    assert prom_options({"DLWATCH_PROM_PORT": "99999"}, problems=problems) == {"file": None, "port": None}
    assert len(problems) == 1 and "DLWATCH_PROM_PORT must be a TCP port number" in problems[0]
    monkeypatch.setenv("DLWATCH_PROM_PORT", "99999")
    with pytest.warns(dlwatch.DlwatchWarning, match="DLWATCH_PROM_PORT must be a TCP port number"):
        assert dlwatch.watch([1, 2, 3])._settings.prometheus == {"file": None, "port": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_run_exports_textfile_and_http(target, tmp_path, no_leftovers) -> None:
    textdir = tmp_path / "textfile"
    textdir.mkdir(mode=0o700)
    port = _free_port()
    stop = tmp_path / "stop"
    env = {
        "DLWATCH_PROM_FILE": str(textdir / "dlwatch.prom"),
        "DLWATCH_PROM_PORT": str(port),
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "DLWATCH_JOB_ID": "job-x",
    }
    t = target("prom_target.py", str(tmp_path / "reports"), str(stop), env=env)
    t.wait_line("READY", timeout=60)
    path = textdir / f"dlwatch.rank1.{t.pid}.prom"

    def scraped() -> list | None:
        try:
            got = samples(path.read_text())
        except OSError:
            return None
        workers = {s.labels.get("worker") for s in find(got, "dlwatch_process_open_fds")}
        batches = find(got, "dlwatch_batches_total", job_id="job-x", rank="1")
        return got if batches and batches[0].value > 0 and {"main", "0", "1"} <= workers else None

    got = wait_for(scraped, timeout=30, interval=0.1)
    assert got, f"textfile never had batches and both workers: {path.read_text() if path.exists() else 'missing'}"
    assert find(got, "dlwatch_process_max_fds", role="main", job_id="job-x", rank="1")[0].value > 0
    assert find(got, "dlwatch_process_resident_memory_bytes", worker="0", job_id="job-x")[0].value > 0
    # the endpoint: 127.0.0.1 only, at the port plus LOCAL_RANK (0 here)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    http = samples(body)
    assert find(http, "dlwatch_rank_info", job_id="job-x", rank="1", local_rank="0", world_size="2")
    assert find(http, "dlwatch_batches_total", job_id="job-x", rank="1")[0].value > 0
    with socket.socket() as s:  # nothing on the other interfaces
        s.settimeout(2)
        other = socket.gethostbyname(socket.gethostname())
        if other != "127.0.0.1" and not other.startswith("127."):
            assert s.connect_ex((other, port)) != 0
    stop.write_text("")
    out, _err = t.communicate(timeout=60)
    assert "DONE" in out
    assert not path.exists()  # removed when the run ended
