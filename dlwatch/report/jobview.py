"""The job view: the incidents and figures of every rank of one multi-rank job, merged.

When one rank's DataLoader hangs, the other ranks soon block in a collective
(``all_reduce``, ``barrier``) and later die with a gloo or NCCL error that names
the collective, not the data.  Each rank's incident says what it saw; this module
says which rank stalled first and how, which ranks only waited for it, and which
rank is a straggler.

- :func:`annotate` marks one incident (before it is written): a rank whose main
  process waits in a collective while its own loader is healthy, or whose exception
  is a collective's error, is a *waiting* rank; its DataLoader findings are dropped
  (the cause is elsewhere) and it points at ``dlwatch report --job``.
- :func:`job_view` reads a report directory (incidents through ``store.load_report_head``, a
  bounded read, rank figures through ``rankfigures.read_job_figures``) and merges the newest job.
  A job id can be reused (``DLWATCH_JOB_ID=$SLURM_JOB_ID`` for each ``srun``, a fixed
  ``--rdzv-id``): the records of one id are split into runs by their ``launched_at`` and
  ``run_id`` (:func:`split_runs`); the newest run is the job, an older one is a job of its own,
  named ``ID@<launch time>``.
- :func:`job_lines` renders it for the terminal.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Iterator, Mapping

from dlwatch._regex import compile as _re2
from dlwatch.errors import NotFoundError, ReportError

__all__ = ["annotate", "job_view", "job_lines", "is_waiting"]

# An exception of a rank that waited for another: the collective's own error, not the data's.
_COLLECTIVE_ERROR = _re2(
    r"(?i)ProcessGroupGloo|ProcessGroupNCCL|NCCL (error|communicator|watchdog)|"
    r"Watchdog caught collective operation timeout|gloo/transport|DistBackendError|"
    r"DistNetworkError|Connection closed by peer|Timed out waiting .* for (the )?collective|"
    r"monitoredBarrier|barrier timed out"
)
_DIST_TRACE = _re2(r"torch[/\\]distributed[/\\]")


def _main(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for p in report.get("processes") or ():
        if isinstance(p, dict) and p.get("role") == "main":
            return p
    return None


def _collective_wait(report: Mapping[str, Any]) -> str | None:
    """What the rank waits in, when it only waits for other ranks; else None."""
    if report.get("classification") == "main-blocked":
        main = _main(report)
        waiting = str((main or {}).get("waiting_in") or "")
        workers = [p for p in report.get("processes") or () if isinstance(p, dict) and p.get("role") == "worker"]
        loader_ok = not any(p.get("status") in ("blocked", "gone") and not p.get("alive_by") for p in workers)
        if waiting.startswith("collective: ") and loader_ok:
            return waiting
    exc = report.get("exception") or {}
    if report.get("trigger") == "exception" and isinstance(exc, dict):
        text = f"{exc.get('type') or ''}\n{exc.get('message') or ''}"[:4000]
        trace = str(exc.get("traceback") or "")[:100_000]
        if _COLLECTIVE_ERROR.search(text) and _DIST_TRACE.search(trace):
            return f"collective error: {str(exc.get('type') or 'exception').rsplit('.', 1)[-1]}"
    return None


def view_command(report_dir: str | None, job_id: str | None) -> str:
    cmd = "dlwatch report --job"
    if report_dir:
        cmd += f" {report_dir}"
    if job_id:
        cmd += f" --job-id {job_id}"
    return cmd


def annotate(report: dict[str, Any]) -> None:
    """Set ``report["job"]`` for a rank of a job; a waiting rank keeps no DataLoader finding of its own."""
    rank = report.get("rank") or {}
    waiting = _collective_wait(report)
    job_id = rank.get("job_id") if isinstance(rank, dict) else None
    if waiting is None and not job_id:
        return
    view = view_command((report.get("config") or {}).get("report_dir"), job_id)
    if waiting is None:
        report["job"] = {"role": "own", "waiting_in": None, "job_id": job_id, "view": view}
        return
    report["job"] = {"role": "waiting", "waiting_in": waiting, "job_id": job_id, "view": view}
    if report.get("findings"):
        dropped = ", ".join(str(f.get("playbook")) for f in report["findings"] if isinstance(f, dict))
        report["notes"].append(
            f"this rank only waits for other ranks ({waiting}); DataLoader findings "
            f"left to the rank that stalled first: {dropped}"
        )
    report["findings"] = []


def is_waiting(report: Mapping[str, Any]) -> bool:
    job = report.get("job")
    if isinstance(job, dict) and job.get("role") == "waiting":
        return True
    return _collective_wait(report) is not None


# --------------------------------------------------------------------------- merging


def _ts(text: Any) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(text)).timestamp()
    except (TypeError, ValueError):
        return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="milliseconds")


def _incident_entry(path: str, r: Mapping[str, Any]) -> dict[str, Any]:
    rank = r.get("rank") or {}
    findings = [f for f in r.get("findings") or () if isinstance(f, dict)]
    top = findings[0] if findings else {}
    prog = r.get("progress") or {}
    created = _ts(r.get("created_at"))
    last_batch = _num(prog.get("last_batch_ts"))
    stall_s = _num(prog.get("stall_s"))
    # when this rank stopped making progress: its last batch, else the incident minus the stall
    stalled_at = (
        last_batch
        if last_batch is not None
        else (created - stall_s if created is not None and stall_s is not None else created)
    )
    main = _main(r) or {}
    return {
        "id": r.get("id"),
        "path": path,
        "rank": rank.get("rank"),
        "host": r.get("host"),
        "pid": r.get("pid"),
        "trigger": r.get("trigger"),
        "created_at": r.get("created_at"),
        "created_ts": created,
        "classification": r.get("classification"),
        "top_finding": top.get("playbook"),
        "top_title": top.get("title"),
        "summary": r.get("summary"),
        "waiting": is_waiting(r),
        "waiting_in": (r.get("job") or {}).get("waiting_in") or _collective_wait(r) or main.get("waiting_in"),
        "stalled_at": stalled_at,
        "batches": prog.get("batches"),
        "stall_s": stall_s,
    }


# A run's records split by launch: those launched within SAME_LAUNCH_S of the one before are one launch
# (one torchrun agent, one srun step's tasks on a node); launches follow each other within JOIN_GAP_S
# in one run (the nodes of a step start within seconds), and a run never holds one rank twice.
SAME_LAUNCH_S = 2.0
JOIN_GAP_S = 60.0
JOB_READ_BYTES = 4 << 20  # of each incident of a job: what dlwatch writes (report.json's cap), no more


def _launch(rank: Any) -> tuple[float | None, str | None]:
    """(launched_at, run_id) of a record's rank object (None, None for records of older dlwatch)."""
    if not isinstance(rank, Mapping):
        return None, None
    at = _num(rank.get("launched_at"))
    run_id = rank.get("run_id")
    return at, run_id if isinstance(run_id, str) and run_id else None


def split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records of one job id (each with ``launched_at``, ``run_id``, ``rank``) grouped into runs.

    Records of one run id are sorted by launch time and cut into launches (a gap over
    ``SAME_LAUNCH_S``); consecutive launches are one run unless a gap over ``JOIN_GAP_S`` or a rank
    in both says they are two.  Records of different run ids are different runs; records without a
    launch time (older dlwatch) form one run of their own, first."""
    known = sorted(
        (r for r in records if r["launched_at"] is not None), key=lambda r: (r["run_id"] or "", r["launched_at"])
    )
    launches: list[dict[str, Any]] = []
    for rec in known:
        last = launches[-1] if launches else None
        if last is None or last["run_id"] != rec["run_id"] or rec["launched_at"] - last["last"] > SAME_LAUNCH_S:
            last = {"run_id": rec["run_id"], "first": rec["launched_at"], "records": []}
            launches.append(last)
        last["last"] = rec["launched_at"]
        last["records"].append(rec)
    runs: list[dict[str, Any]] = []
    for launch in launches:
        ranks = {r["rank"] for r in launch["records"] if r["rank"] is not None}
        run = runs[-1] if runs else None
        if (
            run is None
            or run["run_id"] != launch["run_id"]
            or launch["first"] - run["last"] > JOIN_GAP_S
            or run["ranks"] & ranks
        ):
            run = {"run_id": launch["run_id"], "ranks": set(), "records": []}
            runs.append(run)
        run["last"] = launch["last"]
        run["ranks"] |= ranks
        run["records"] += launch["records"]
    unknown = [r for r in records if r["launched_at"] is None]
    return ([unknown] if unknown else []) + [r["records"] for r in runs]


def _jobs(report_dir: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    from dlwatch.report import rankfigures, store

    summaries, warnings = store.list_incidents(report_dir)
    by_id: dict[str, list[dict[str, Any]]] = {}

    def record(jid: str, kind: str, rank_obj: Any, rank: Any, item: dict[str, Any]) -> None:
        at, run_id = _launch(rank_obj)
        by_id.setdefault(jid, []).append(
            {"kind": kind, "launched_at": at, "run_id": run_id, "rank": rank, "item": item}
        )

    for s in summaries:
        if s.damaged:
            continue
        try:  # a bounded read: the keys the view uses come first; a longer file is cut, not loaded whole
            r = store.load_report_head(s.path, JOB_READ_BYTES)
        except (ReportError, NotFoundError) as exc:
            warnings.append(f"skipped {s.id}: {exc.message}")
            continue
        rank_obj = r.get("rank") or {}
        jid = rank_obj.get("job_id")
        if not isinstance(jid, str) or not jid:
            continue
        entry = _incident_entry(s.path, r)
        entry["world_size"] = rank_obj.get("world_size")
        record(jid, "incident", rank_obj, entry["rank"], entry)
    figs, fig_warnings = rankfigures.read_job_figures(report_dir)
    warnings += fig_warnings
    for f in figs:
        record(f["job_id"], "figures", f, f.get("rank"), f)
    jobs: dict[str, dict[str, Any]] = {}
    for jid, records in by_id.items():
        runs = []
        for recs in split_runs(records):
            j: dict[str, Any] = {
                "job_id": jid,
                "incidents": [],
                "figures": [],
                "newest": 0.0,
                "world_size": None,
                "launched_at": min((r["launched_at"] for r in recs if r["launched_at"] is not None), default=None),
                "run_id": recs[0]["run_id"],
            }
            for rec in recs:
                item = rec["item"]
                if rec["kind"] == "incident":
                    j["incidents"].append(item)
                    j["newest"] = max(j["newest"], item["created_ts"] or 0.0)
                else:
                    j["figures"].append(item)
                    j["newest"] = max(j["newest"], float(item["updated_at"]))
                if isinstance(item.get("world_size"), int):
                    j["world_size"] = item["world_size"]
            runs.append(j)
        runs.sort(key=lambda j: j["newest"])
        for i, j in enumerate(runs):  # the newest run is the job id; an older one is a job of its own
            key = jid if i == len(runs) - 1 else f"{jid}@{_run_label(j)}"
            while key in jobs:
                key += "'"
            j["runs_of_id"] = len(runs)
            jobs[key] = j
    return jobs, warnings


def _run_label(j: Mapping[str, Any]) -> str:
    at = j.get("launched_at")
    if at is None:
        return "launch-unknown"
    return _dt.datetime.fromtimestamp(at, _dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def job_view(report_dir: str, job_id: str | None = None, *, playbooks: Any = None) -> dict[str, Any]:
    """The merged view of one job (the newest in ``report_dir`` unless ``job_id``); NotFoundError if none."""
    from dlwatch.detect import straggler

    jobs, warnings = _jobs(report_dir)
    if not jobs:
        raise NotFoundError(
            f"no multi-rank job in {report_dir}",
            help="incidents name a job when the training ran under torchrun (or with "
            "WORLD_SIZE and DLWATCH_JOB_ID set)",
        )
    if job_id is None:
        job_id = max(jobs, key=lambda k: jobs[k]["newest"])
    elif job_id not in jobs:
        raise NotFoundError(f"no job {job_id!r} in {report_dir}", help="known jobs: " + ", ".join(sorted(jobs)[:20]))
    j = jobs[job_id]
    incidents = sorted(j["incidents"], key=lambda e: e["created_ts"] or 0.0)
    for e in incidents:
        e.pop("world_size", None)
    own = [e for e in incidents if not e["waiting"]]
    waiting = [e for e in incidents if e["waiting"]]
    origin = (
        min(
            own,
            key=lambda e: (e["stalled_at"] if e["stalled_at"] is not None else float("inf"), e["created_ts"] or 0.0),
        )
        if own
        else None
    )
    waiting_ranks: dict[Any, dict[str, Any]] = {}
    own_ranks = {e["rank"] for e in own}
    for e in waiting:
        if e["rank"] not in own_ranks:
            waiting_ranks.setdefault(e["rank"], e)
    figures = sorted(j["figures"], key=lambda f: (f.get("rank") is None, f.get("rank") or 0, f["updated_at"]))
    # one figures record per rank: the newest (a restarted rank writes a new one)
    per_rank: dict[Any, dict[str, Any]] = {}
    for f in figures:
        key = f.get("rank") if f.get("rank") is not None else (f.get("host"), f.get("pid"))
        if key not in per_rank or f["updated_at"] >= per_rank[key]["updated_at"]:
            per_rank[key] = f
    seen_ranks = {e["rank"] for e in incidents} | {f.get("rank") for f in per_rank.values()}
    world = j["world_size"]
    missing = [r for r in range(world) if r not in seen_ranks] if isinstance(world, int) and world < 100_000 else []
    timeline: list[dict[str, Any]] = []
    for e in incidents:
        if e["stalled_at"] is not None and e["trigger"] in ("stall", "attach", "interrupt"):
            timeline.append(
                {
                    "ts": e["stalled_at"],
                    "rank": e["rank"],
                    "host": e["host"],
                    "what": "no progress from here on" + (" (waiting for its first batch)" if not e["batches"] else ""),
                }
            )
        what = f"{e['trigger']} incident"
        if e["classification"]:
            what += f": {e['classification']}"
        if e["waiting"]:
            what += f", waiting in {e['waiting_in']}"
        elif e["top_finding"]:
            what += f" -> {e['top_finding']}"
        timeline.append(
            {"ts": e["created_ts"], "rank": e["rank"], "host": e["host"], "what": what, "incident": e["id"]}
        )
    timeline.sort(key=lambda t: (t["ts"] is None, t["ts"] or 0.0))
    for t in timeline:
        t["at"] = _iso(t["ts"])
    stragglers = straggler.judge(list(per_rank.values()), straggler.thresholds(playbooks))
    notes: list[str] = []
    older = sorted((k for k, o in jobs.items() if o is not j and o["job_id"] == j["job_id"]), reverse=True)
    if older:
        notes.append(
            f"job id {j['job_id']} was used by {len(older) + 1} runs; this is "
            + ("the newest" if job_id == j["job_id"] else f"the one launched {_run_label(j)}")
            + f"; the other runs are separate jobs: {', '.join(older[:5])}"
            + (" ..." if len(older) > 5 else "")
        )
    if origin is None and waiting:
        notes.append(
            "every incident of this job is a rank waiting in a collective: the rank that stalled first "
            "wrote none (not watched, or killed before its monitor wrote)"
            + (f"; ranks with nothing at all: {', '.join(map(str, missing))}" if missing else "")
        )
    return {
        "job_id": j["job_id"],
        "run": {"key": job_id, "launched_at": _iso(j["launched_at"]), "run_id": j["run_id"]},
        "world_size": world,
        "report_dir": report_dir,
        "origin": origin,
        "waiting": list(waiting_ranks.values()),
        "incidents": incidents,
        "ranks": list(per_rank.values()),
        "missing_ranks": missing,
        "timeline": timeline,
        "stragglers": stragglers,
        "other_jobs": sorted(k for k in jobs if k != job_id),
        "notes": notes,
        "warnings": warnings,
    }


# --------------------------------------------------------------------------- rendering


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def job_lines(v: Mapping[str, Any]) -> Iterator[str]:
    """Plain lines (the caller passes each through ``render.terminal_line``)."""
    world = v.get("world_size")
    run = v.get("run") or {}
    about = [f"{world} ranks" if world else "", f"launched {run['launched_at']}" if run.get("launched_at") else ""]
    shown = ", ".join(a for a in about if a)
    yield f"job {run.get('key') or v.get('job_id')}" + (f"  ({shown})" if shown else "")
    o = v.get("origin")
    if o:
        yield (
            f"  stalled first: rank {o.get('rank')} on {o.get('host')} (pid {o.get('pid')}): "
            f"{o.get('classification') or o.get('trigger')}"
            + (f" -> {o.get('top_finding')}" if o.get("top_finding") else ", no playbook matched")
        )
        if o.get("summary"):
            yield f"    {o['summary']}"
        yield f"    incident: {o.get('path')}"
    elif v.get("incidents"):
        yield "  stalled first: unknown (no rank's incident names a cause of its own)"
    else:
        yield "  no incident: no rank stalled"
    for w in v.get("waiting") or ():
        yield (
            f"  waited for it: rank {w.get('rank')} on {w.get('host')} (pid {w.get('pid')}) in "
            f"{w.get('waiting_in')}; incident {w.get('id')}"
        )
    if v.get("missing_ranks"):
        yield f"  ranks with no incident and no figures: {', '.join(map(str, v['missing_ranks']))}"
    stragglers = v.get("stragglers") or []
    for s in stragglers:
        yield f"  straggler-rank: rank {s.get('rank')} on {s.get('host')}: {s.get('reason')}"
    if v.get("ranks"):
        yield (
            f"  per rank:  {'RANK':>5} {'HOST':<16} {'BATCHES':>8} {'DATA-WAIT':>9} {'BATCH/S':>8} "
            f"{'FIRST BATCH':>12} {'STALLS':>6} {'INCIDENTS':>9}"
        )
        for f in v["ranks"]:
            first = (
                "-"
                if f.get("first_batch_s") is None
                else (("" if f.get("first_batch_exact") else "<=") + format(f["first_batch_s"], ".2f") + " s")
            )
            share = f.get("data_wait_share")
            yield (
                f"             {str(f.get('rank')):>5} {str(f.get('host'))[:16]:<16} {f.get('batches'):>8} "
                f"{'-' if share is None else format(share * 100, '.0f') + '%':>9} "
                f"{_f(f.get('batch_rate_per_s'), '.2f'):>8} {first:>12} {f.get('stalls'):>6} "
                f"{f.get('incidents'):>9}"
            )
    if stragglers:
        yield "  advice (straggler-rank): look at the slow rank's data path first: its shard (a larger or "
        yield "    remote share of the data), its node (CPU, disk, network), its num_workers; see "
        yield "    `dlwatch playbooks straggler-rank`"
    if v.get("timeline"):
        yield "  time line:"
        for t in v["timeline"]:
            yield f"    {t.get('at') or '-'}  rank {t.get('rank')}  {t.get('what')}"
    for n in v.get("notes") or ():
        yield f"  note: {n}"
    if v.get("other_jobs"):
        shown = v["other_jobs"][:5]
        yield f"  other jobs here: {', '.join(shown)}" + (" ..." if len(v["other_jobs"]) > 5 else "")
