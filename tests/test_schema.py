"""The typed report and run summary (dlwatch/report/schema.py): load -> typed -> dump is the identity.

Round trips are checked on the documents of real runs kept in tests/golden/raw (written by the
dict-based code before the schema existed) and on generated documents (hypothesis, a fixed
profile): every valid document, extra keys and null lists included, comes back equal with its keys
in the same order at every level.  The renderers take the typed object and make, of the golden
documents, exactly what the dict-based renderers made.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlwatch.errors import ReportError
from dlwatch.report import build, schema, store
from dlwatch.report.schema import Finding, Incident, ProcessEntry, RunSummary, Stack

from test_schema_golden import renderings

RAW = os.path.join(os.path.dirname(__file__), "golden", "raw")
DOCS = sorted(glob.glob(os.path.join(RAW, "*.json")))


def _ordered(obj):
    """``obj`` with every dict as its list of items: equality then includes the key order."""
    if isinstance(obj, dict):
        return [(k, _ordered(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [_ordered(v) for v in obj]
    return obj


def _kind(path: str) -> str:
    return "summary" if os.path.basename(path).split("-", 1)[1].startswith("summary") else "report"


def test_golden_documents_exist():
    assert len(DOCS) == 8, DOCS  # four runs: exception, finish, killed (incident + summary each), hang (two)


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_real_documents_round_trip_through_the_loader(path, tmp_path):
    with open(path) as f:
        doc = json.load(f)
    target = tmp_path / ("summary.json" if _kind(path) == "summary" else "report.json")
    target.write_text(json.dumps(doc))
    typed = store.load_run_summary(str(tmp_path)) if _kind(path) == "summary" else store.load_incident(str(tmp_path))
    assert isinstance(typed, RunSummary if _kind(path) == "summary" else Incident)
    assert _ordered(typed.to_dict()) == _ordered(doc)
    assert json.dumps(typed.to_dict()) == json.dumps(doc)  # the bytes json.dumps makes of it, too


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_renderers_take_the_typed_object_and_say_what_they_said(path):
    """report.md, summary.md, the terminal view and report.html of the real runs: as before the schema."""
    with open(path) as f:
        doc = json.load(f)
    kind = _kind(path)
    typed = schema.run_summary(doc) if kind == "summary" else schema.incident(doc)
    got = renderings(kind, typed)
    for ext, text in got.items():
        with open(path[: -len(".json")] + "." + ext) as f:
            assert text == f.read(), f"{os.path.basename(path)}: {ext} differs"


def test_typed_values_are_typed():
    with open(os.path.join(RAW, "hang-report-stall.json")) as f:
        r = Incident.from_dict(json.load(f))
    assert r.trigger == "stall" and r.classification == "deadlock"
    assert isinstance(r.findings[0], Finding) and [f.playbook for f in r.findings][:2] == [
        "lock-held-at-fork",
        "worker-deadlock",
    ]
    workers = [p for p in r.processes if p.role == "worker"]
    assert len(workers) == 2 and all(isinstance(p, ProcessEntry) for p in workers)
    assert all(isinstance(p.stack, Stack) and p.stack.threads for p in workers)
    frames = [f.function for t in workers[0].stack.threads for f in t.frames]
    assert any(str(name).endswith("__getitem__") for name in frames)
    assert isinstance(r.notes, tuple) and r.has("classification_reason") and not r.has("job")


def test_replace_appends_a_new_key_last_like_a_dict():
    r = store.new_incident(trigger="stall", pid=1, now=1.7e9)
    d = r.to_dict()
    d["classification_reason"] = "why"
    d["summary"] = "s"
    r2 = r.replace(classification_reason="why", summary="s")
    assert list(r2.to_dict()) == list(d) and r2.to_dict() == d
    assert "classification_reason" not in r.to_dict()  # frozen: the original is unchanged
    with pytest.raises(Exception):
        r.summary = "x"  # type: ignore[misc]


def test_builder_lays_out_an_incident_as_the_skeleton_did():
    now = 1.7e9
    proc = build.process(7, "worker", worker_id=0, sample={"num_fds": 3}, crash={"signal": "SIGSEGV"}, status="gone")
    r = build.incident(
        "exception",
        5,
        now=now,
        rank={"rank": 1, "world_size": 2},
        exception={"type": "builtins.ValueError", "message": "m", "errno": None},
        processes=[proc],
        notes=["n"],
    )
    d = r.to_dict()
    assert list(d) == list(store.skeleton(trigger="exception", pid=5, now=now))
    assert d["rank"] == {"rank": 1, "world_size": 2}
    assert d["processes"] == [
        {
            "pid": 7,
            "role": "worker",
            "worker_id": 0,
            "start_method": None,
            "name": None,
            "cmdline": None,
            "sample": {"num_fds": 3},
            "status": "gone",
            "waiting_in": None,
            "cpu_progress_s": None,
            "stack": None,
            "crash": {"signal": "SIGSEGV"},
        }
    ]
    assert build.process_entry(7, "main") == build.process(7, "main").to_dict()


def test_a_damaged_dict_is_refused_by_the_renderers_as_by_the_loader():
    from dlwatch.report import render

    bad = store.skeleton(trigger="stall", pid=1, now=1.7e9)
    bad["findings"] = [{"playbook": 3}]
    with pytest.raises(ReportError, match=r"findings\[\]\.playbook is int"):
        render.render_markdown(bad)
    s = {"schema_version": 1, "kind": "run_summary", "id": "x", "created_at": "t", "pid": 1, "advice": ["no"]}
    from dlwatch.report import summary

    with pytest.raises(ReportError, match=r"advice\[\] holds a non-object"):
        summary.render_markdown(s)


# --------------------------------------------------------------------------- generated documents

_text = st.text(max_size=12)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), _text, st.floats(allow_nan=False))
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=8,
)
_opt_str = st.one_of(st.none(), _text)
_opt_int = st.one_of(st.none(), st.integers(-5, 10**6))


def _obj(fixed: dict, *, extra: bool = True):
    """A JSON object with some of ``fixed``'s keys (typed as the loader wants) and maybe unknown keys,
    in a drawn order."""

    @st.composite
    def build_it(draw):
        keys = draw(st.lists(st.sampled_from(sorted(fixed)), unique=True)) if fixed else []
        out = {k: draw(fixed[k]) for k in keys}
        if extra:
            for k, v in draw(st.dictionaries(st.sampled_from(["x_new", "zz", "later_key"]), _json, max_size=2)).items():
                if k not in out:
                    out[k] = v
        order = draw(st.permutations(list(out)))
        return {k: out[k] for k in order}

    return build_it()


_frame = _obj({"function": _opt_str, "filename": _opt_str, "line": _opt_int, "native": _json})
_thread = _obj(
    {
        "name": _opt_str,
        "frames": st.one_of(st.none(), st.lists(_frame, max_size=3)),
        "frames_omitted": _json,
        "owns_gil": _json,
    }
)
_stack = _obj({"source": _opt_str, "error": _opt_str, "threads": st.one_of(st.none(), st.lists(_thread, max_size=2))})
_sample = _obj({"fds": st.one_of(st.none(), st.dictionaries(_text, _json, max_size=3)), "rss": _json})
_process = _obj(
    {
        "pid": _opt_int,
        "role": _opt_str,
        "worker_id": _opt_int,
        "status": _opt_str,
        "waiting_in": _opt_str,
        "where": _opt_str,
        "sample": st.one_of(st.none(), _sample),
        "stack": st.one_of(st.none(), _stack),
        "alive_by": _json,
        "io_wait": _json,
        "crash": _json,
    }
)
_finding = _obj(
    {
        "playbook": _opt_str,
        "title": _opt_str,
        "confidence": st.one_of(st.none(), st.integers(0, 1), st.floats(0, 1)),
        "evidence": st.one_of(st.none(), st.dictionaries(_text, _json, max_size=3)),
        "remediation": _opt_str,
    }
)
_opt_dict = st.one_of(st.none(), st.dictionaries(_text, _json, max_size=3))
_opt_list = lambda item: st.one_of(st.none(), st.lists(item, max_size=3))  # noqa: E731


@st.composite
def incidents(draw):
    fixed = {
        "summary": _opt_str,
        "host": _opt_str,
        "classification": _opt_str,
        "classification_reason": _opt_str,
        "rank": st.one_of(st.none(), _obj({"rank": _opt_int, "world_size": _opt_int, "job_id": _opt_str})),
        "job": st.one_of(st.none(), _obj({"role": _opt_str, "waiting_in": _opt_str, "view": _opt_str})),
        "progress": _opt_dict,
        "exception": st.one_of(
            st.none(), _obj({"type": _opt_str, "message": _opt_str, "errno": _opt_int, "traceback": _opt_str})
        ),
        "findings": _opt_list(_finding),
        "processes": _opt_list(_process),
        "system": _opt_dict,
        "gpus": _opt_list(st.dictionaries(_text, _json, max_size=2)),
        "loader": _opt_dict,
        "notes": _opt_list(_text),
        "timeline": _opt_list(_json),
        "events": _opt_list(_json),
        "config": _opt_dict,
        "truncated": _json,
        "exit_cause": _json,
        "dlwatch_version": _json,
    }
    body = draw(_obj(fixed))
    head = {"schema_version": 1, "id": draw(_text), "created_at": draw(_text), "trigger": draw(_text), "pid": 4}
    order = draw(st.permutations(list(head) + list(body)))
    both = {**head, **body}
    return {k: both[k] for k in order}


@st.composite
def summaries(draw):
    fixed = {
        "loop": _opt_dict,
        "peaks": _opt_dict,
        "advice": _opt_list(_finding),
        "preflight": _opt_list(_finding),
        "incidents": _opt_list(_json),
        "notes": _opt_list(_json),
        "workers": _opt_list(_json),
        "cpus": _json,
        "main": _json,
        "rank": _json,
        "ended": _json,
        "loader": _json,
    }
    body = draw(_obj(fixed))
    head = {"schema_version": 1, "kind": "run_summary", "id": draw(_text), "created_at": draw(_text), "pid": 4}
    order = draw(st.permutations(list(head) + list(body)))
    both = {**head, **body}
    return {k: both[k] for k in order}


_FIXED = settings(
    max_examples=300, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@_FIXED
@given(incidents())
def test_every_valid_report_round_trips(doc):
    assert store._type_problem(doc) is None  # what the loader accepts
    typed = Incident.from_dict(doc)
    assert _ordered(typed.to_dict()) == _ordered(doc)
    assert _ordered(Incident.from_dict(typed.to_dict()).to_dict()) == _ordered(doc)


@_FIXED
@given(summaries())
def test_every_valid_summary_round_trips(doc):
    assert store.summary_type_problem(doc) is None
    typed = RunSummary.from_dict(doc)
    assert _ordered(typed.to_dict()) == _ordered(doc)
