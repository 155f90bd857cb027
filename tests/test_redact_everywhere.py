"""Issue 9, items 4 and 5: every secret pattern, planted in every field dlwatch writes or prints, is gone.

The property test plants one pattern (with a random body) in one field, writes the incident
the way the monitor does (report.json, report.md, timeline.jsonl, stacks/<pid>.txt), appends it
to events and the timeline the way the agent and monitor do, prints it the way `dlwatch attach`
does (--json and the summary), and checks that the body appears nowhere.  detect-secrets'
detectors (a maintained pattern set, a test-only dependency) then scan everything that came out,
as an independent check.  The attach test does the same end to end on a real process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import string
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import kill_tree
from dlwatch.wire import events
from dlwatch.cli import attach_cmd
from dlwatch.monitor.journal import Timeline
from dlwatch._fs import write_json
from dlwatch.redact import outbound
from dlwatch.report import build, store

BODY = st.text(string.ascii_letters + string.digits, min_size=20, max_size=40)  # real tokens are this long or longer
HEX = st.text("0123456789abcdef", min_size=32, max_size=64)

# (name, template): "{s}" is where the random body goes.  One per item of the issue, and the
# name-independent token shapes.
PATTERNS = [
    ("name-spaces", 'password = "{s}"'),
    ("url-slash-at", "https://alice:{s}/x@y@example.invalid/data"),
    ("basic-auth", "Authorization: Basic {s}=="),
    ("option-dash-value", "--password -{s}"),
    ("passphrase", "--passphrase {s}"),
    ("pass", "--pass {s}"),
    ("pw", "pw={s}"),
    ("key", "--key {s}"),
    ("auth", "--auth {s}"),
    ("secret", "--secret {s}"),
    ("api-token", "--api-token={s}"),
    ("yaml", "client_secret: {s}"),
    ("openai", "sk-proj-{s}"),
    ("openai-plain", "sk-{s}"),
    ("gitlab", "glpat-{s}"),
    ("jwt", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{s}"),
    ("sas", "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig={s}%3D&se=2030"),
    ("amz", "https://b.s3.amazonaws.com/k?X-Amz-Signature={s}&X-Amz-Date=1"),
    ("goog", "https://storage.googleapis.com/b/k?X-Goog-Signature={s}"),
    ("huggingface", "hf_{s}{s}"),
    ("github", "ghp_{s}{s}"),
    ("slack", "xoxb-{s}"),
    ("stripe", "sk_live_{s}"),
    ("npm", "npm_{s}{s}"),
    ("bearer", "Bearer {s}"),
    ("aws", "aws_secret_access_key={s}"),
]


def _plant_key(report, text):
    report["config"][text] = 1  # a dict key


def _plant_bytes(report, text):
    report["notes"].append(text.encode())


def _plant_exception_obj(report, text):
    report["notes"].append(ValueError(text))


FIELDS = {
    "exception.message": lambda r, t: r.__setitem__(
        "exception", {"type": "builtins.ValueError", "message": t, "traceback": "", "errno": None}
    ),
    "exception.traceback": lambda r, t: r.__setitem__(
        "exception", {"type": "x", "message": "m", "traceback": f'  File "train.py", line 3\n    {t}\n'}
    ),
    "summary": lambda r, t: r.__setitem__("summary", t),
    "notes": lambda r, t: r["notes"].append(t),
    "notes.bytes": _plant_bytes,
    "notes.exception": _plant_exception_obj,
    "config.key": _plant_key,
    "loader": lambda r, t: r.__setitem__("loader", {"dataset": t, "num_workers": 2}),
    "processes.cmdline": lambda r, t: r["processes"].append(
        build.process_entry(1, "main", name="python", cmdline=["python", "train.py", *t.split(" ")])
    ),
    "processes.where": lambda r, t: r["processes"].append(
        {**build.process_entry(2, "worker", worker_id=0), "where": t, "status": "blocked"}
    ),
    "processes.stack": lambda r, t: r["processes"].append(
        {
            **build.process_entry(3, "worker", worker_id=1),
            "stack": {
                "pid": 3,
                "source": "py-spy",
                "threads": [{"thread_id": 1, "name": t, "frames": [{"function": t, "filename": t, "line": 1}]}],
            },
        }
    ),
    "events": lambda r, t: r["events"].append({"ts": 1.0, "event": "exception", "text": t, t: t}),
    "timeline": lambda r, t: r["timeline"].append({"kind": "event", "ts": 1.0, "event": t}),
    "findings": lambda r, t: r["findings"].append(
        {"playbook": "x", "title": t, "confidence": 0.5, "evidence": {"seen": t, t: 1}}
    ),
    "classification_reason": lambda r, t: r.__setitem__("classification_reason", t),
}

try:
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    # the token detectors (entropy, keyword heuristics and IP addresses flag ordinary text)
    _DS = [
        cls()
        for name, cls in get_mapping_from_secret_type_to_class().items()
        if name not in ("Base64 High Entropy String", "Hex High Entropy String", "Secret Keyword", "Public IP (ipv4)")
    ]
except ImportError:  # pragma: no cover - the test extra installs it
    _DS = []


def detect_secrets_findings(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        for plugin in _DS:
            found.extend(f"{type(plugin).__name__}: {s}" for s in plugin.analyze_string(line))
    return found


def everything_written(report_dir: str) -> str:
    chunks = []
    for root, _dirs, files in os.walk(report_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read().decode("utf-8", "replace"))
    return "\n".join(chunks)


def printed_by_attach(report: dict, path: str) -> str:
    """What `dlwatch attach` prints, through the same calls attach_cmd.run makes."""
    shown = outbound(report)
    buf = io.StringIO()
    json.dump(shown, buf, indent=2)
    attach_cmd.print_summary(shown, outbound(path), buf)
    return buf.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.sampled_from(PATTERNS), field=st.sampled_from(sorted(FIELDS)), body=BODY, in_stack_file=st.booleans())
def test_every_pattern_in_every_field_is_redacted(pattern, field, body, in_stack_file):
    _name, template = pattern
    text = template.format(s=body)
    d = tempfile.mkdtemp()
    try:
        report = store.skeleton(trigger="threshold", pid=1234, now=time.time())  # keeps its summary
        FIELDS[field](report, text)
        extra = (
            {"stacks/1234.txt": f'Thread 0x1 (most recent call first):\n  File "{text}", line 1 in f\n'.encode()}
            if in_stack_file
            else None
        )
        path = build.write(report, os.path.join(d, "r"), extra_files=extra)
        run = os.path.join(d, "run")
        os.mkdir(run, 0o700)
        events.emit(os.path.join(run, "events.jsonl"), "exception", text=text, nested={text: [text.encode()]})
        tl = Timeline(os.path.join(run, "timeline.jsonl"))
        tl.append({"kind": "event", text: text, "err": ValueError(text)})
        tl.close()
        out = everything_written(d) + printed_by_attach(report, path)
        assert body not in out, (field, text)
        assert detect_secrets_findings(out) == [], (field, text)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# fields that hold one value: every pattern goes in at once, one per line
SINGLE = {"exception.message", "exception.traceback", "summary", "loader", "classification_reason"}


@pytest.mark.parametrize("field", sorted(FIELDS))
@settings(max_examples=15, deadline=None)
@given(bodies=st.lists(BODY, min_size=len(PATTERNS), max_size=len(PATTERNS), unique=True))
def test_all_patterns_at_once_in_each_field(field, bodies):
    texts = [template.format(s=body) for (_n, template), body in zip(PATTERNS, bodies)]
    d = tempfile.mkdtemp()
    try:
        report = store.skeleton(trigger="threshold", pid=1234, now=time.time())
        for text in ["\n".join(texts)] if field in SINGLE else texts:
            FIELDS[field](report, text)
        path = build.write(
            report,
            os.path.join(d, "r"),
            extra_files={"stacks/1234.txt": "\n".join(f'  File "{t}", line 1 in f' for t in texts).encode()},
        )
        out = everything_written(d) + printed_by_attach(report, path)
        assert [b for b in bodies if b in out] == [], field
        assert detect_secrets_findings(out) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_detect_secrets_check_is_live():
    """The oracle is not empty: it flags what it should before redaction."""
    if not _DS:
        pytest.skip("detect-secrets is not installed (pip install -e '.[test]')")
    assert detect_secrets_findings("AKIA" + "IOSFODNN7EXAMPLE and glpat-" + "a" * 20)


SECRET_ARGS = [
    "--api-token=tok-3f9a8b7c6d5e4f3a",
    "--password",
    "-dashpass-0123456789",
    "--passphrase",
    "pp-0123456789",
    "--key",
    "key-0123456789abc",
    "--auth",
    "auth-0123456789",
    "pw=pwval-0123456789",
    "https://bob:p/a@ss-0123456789@example.invalid/x",
    "sk-" + "proj-" + "A1b2C3d4E5f6G7h8I9j0",
    "glpat-" + "Z9y8X7w6V5u4T3s2R1q0",
]
SECRET_VALUES = [
    "tok-3f9a8b7c6d5e4f3a",
    "dashpass-0123456789",
    "pp-0123456789",
    "key-0123456789abc",
    "auth-0123456789",
    "pwval-0123456789",
    "ss-0123456789",
    "A1b2C3d4E5f6G7h8I9j0",
    "Z9y8X7w6V5u4T3s2R1q0",
]
HF_FN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz12345678"
TARGET = f"""
import sys, time
def {HF_FN}():
    print("READY", flush=True)
    time.sleep(120)
{HF_FN}()
"""


@pytest.mark.timeout(60)
def test_attach_json_and_summary_are_redacted(tmp_path, capsys):
    """Item 4: what `dlwatch attach` prints is redacted like what it writes (a real process, real py-spy)."""
    from dlwatch.cli import main

    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET, *SECRET_ARGS], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        for as_json in (True, False):
            out_dir = tmp_path / ("json" if as_json else "text")
            assert (
                main(
                    [
                        "attach",
                        str(proc.pid),
                        "--out",
                        str(out_dir),
                        "--no-native",
                        "--duration",
                        "0.1",
                        *(["--json"] if as_json else []),
                    ]
                )
                == 0
            )
            printed = capsys.readouterr().out
            shown = printed + everything_written(str(out_dir))
            if as_json:
                report = json.loads(printed)
                main_proc = next(p for p in report["processes"] if p["role"] == "main")
                assert "--password ***" in main_proc["cmdline"]  # readable, without the value
                frames = [f for t in main_proc["stack"]["threads"] for f in t["frames"]]
                assert any(f["function"] == "***" for f in frames), frames  # the planted function name
            for secret in [*SECRET_VALUES, HF_FN[3:]]:
                assert secret not in shown, (secret, as_json)
            assert detect_secrets_findings(shown) == []
    finally:
        kill_tree(proc.pid)
        proc.stdout.close()


# --------------------------------------------------------------------------- issue 18: glued tokens, warnings

UPPER16 = st.text(string.ascii_uppercase + string.digits, min_size=16, max_size=16)
GCP35 = st.text(string.ascii_letters + string.digits + "_-", min_size=35, max_size=35)
# Every shape of redact.TOKEN_PATTERNS (by its name), as (template, body): "{s}" is the random body.
TOKEN_SHAPES = {
    "aws-access-key-id": [("AKIA{s}", UPPER16), ("ASIA{s}", UPPER16)],
    "gcp-api-key": [("AIza{s}", GCP35)],
    "google-oauth": [("ya29.{s}", BODY)],
    "huggingface": [("hf_{s}{s}", BODY)],
    "github": [(p + "{s}", BODY) for p in ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_")],
    "gitlab": [("glpat-{s}", BODY), ("gldt-{s}", BODY)],
    "slack": [("xoxb-{s}", BODY), ("xoxp-{s}", BODY)],
    "openai": [("sk-{s}", BODY), ("sk-proj-{s}", BODY)],
    "openai-glued": [("sk-svcacct-{s}", BODY)],
    "stripe": [("sk_live_{s}", BODY), ("rk_test_{s}", BODY)],
    "sendgrid": [("SG.{s}.{s}", BODY)],
    "npm": [("npm_{s}{s}", BODY)],
    "pypi": [("pypi-AgE{s}{s}{s}", BODY)],
    "jwt": [("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{s}", BODY)],
}
SHAPES = [(name, template, body) for name, forms in TOKEN_SHAPES.items() for template, body in forms]
GLUE = st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=8)  # a word character in front


def test_every_token_shape_is_planted():
    from dlwatch.redact import TOKEN_PATTERNS

    assert sorted(TOKEN_SHAPES) == sorted(name for name, _rx in TOKEN_PATTERNS)


@st.composite
def glued_token(draw):
    name, template, body = draw(st.sampled_from(SHAPES))
    s = draw(body)
    return name, draw(GLUE) + template.format(s=s), s


def warned(text: str) -> str:
    """What reaches stderr when dlwatch warns with ``text``: the watch's, the run hook's and a preflight warning,
    printed by Python's own warning machinery (the way a training program shows them)."""
    import warnings

    from types import SimpleNamespace

    from dlwatch.inproc import runhook
    from dlwatch.inproc.agent.advisor import Advisor
    from dlwatch.inproc.agent.warning import warn_program

    # the preflight glue with no events file: it only warns (and keeps the finding for the summary)
    advisor = Advisor(SimpleNamespace(events_path=None, preflight=[]), SimpleNamespace(ignored=set(), advice_pbs={}))
    thread = {"name": text, "daemon": False, "runs": f"{text}.run"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_program(f"could not read {text}")
        runhook._warn(f"could not patch {text}")
        advisor.send([{"event": "preflight", "playbook": "fork-with-threads", "confidence": 0.6, "threads": [thread]}])
    # the lines Python's default showwarning writes to stderr
    return "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)


@settings(max_examples=250, deadline=None)
@given(token=glued_token(), field=st.sampled_from(sorted(FIELDS)))
def test_glued_token_in_every_field_and_warning_is_redacted(token, field):
    """Issue 18, item 7 and 8: a token shape right after a word character, in every field (report.json/.md,
    timeline, stacks/<pid>.txt, events, config.json, a run summary, attach's --json and summary) and in warning text."""
    _name, text, body = token
    d = tempfile.mkdtemp()
    try:
        report = store.skeleton(trigger="threshold", pid=1234, now=time.time())
        FIELDS[field](report, text)
        path = build.write(
            report,
            os.path.join(d, "r"),
            extra_files={"stacks/1234.txt": f'  File "/data/{text}.py", line 1 in f\n'.encode()},
        )
        run = os.path.join(d, "run")
        os.mkdir(run, 0o700)
        events.emit(os.path.join(run, "events.jsonl"), "exception", text=text)
        write_json(os.path.join(run, "config.json"), {"loader": {"dataset": text}, "argv": ["train.py", text]})
        from dlwatch.report import summary as sm

        s = sm.skeleton(run_id="20260101T000000-1-abcdef", pid=1, now=time.time())
        s["notes"].append(text)
        s["loader"] = {"dataset": text}
        store.write_summary(d, s, render_markdown=sm.render_markdown)
        out = everything_written(d) + printed_by_attach(report, path)
        printed = warned(text)
        assert "dlwatch: could not read" in printed and "fork-with-threads" in printed  # the warnings were shown
        assert body not in out, (field, text)
        assert body not in printed, printed
        assert detect_secrets_findings(out + printed) == [], (field, text)
    finally:
        shutil.rmtree(d, ignore_errors=True)


THREAD_TOKEN = "shard_ghp_" + "Q1w2E3r4T5y6U7i8O9p0AbCdEfGh"
FORK_WITH_THREADS = f"""
import sys, threading
import torch
from torch.utils.data import DataLoader
import dlwatch

stop = threading.Event()
t = threading.Thread(target=stop.wait, name="{THREAD_TOKEN}", daemon=True)
t.start()
loader = DataLoader(list(range(8)), batch_size=4, num_workers=1, multiprocessing_context="fork")
with dlwatch.watch(loader, report_dir=sys.argv[1], poll_interval=0.2) as batches:
    n = sum(1 for _ in batches)
stop.set()
print("batches", n, flush=True)
"""


@pytest.mark.timeout(120)
def test_thread_name_token_in_a_real_warning_is_redacted(tmp_path):
    """Item 8 end to end: fork with a live thread whose name holds a token; the warning on stderr has none."""
    from conftest import REPO, run_bounded

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    rc, out, err = run_bounded(
        [sys.executable, "-c", FORK_WITH_THREADS, str(tmp_path)], env=env, cwd=str(tmp_path), timeout=90
    )
    assert rc == 0 and "batches 2" in out, err[-2000:]
    assert "fork-with-threads" in err and "shard_***" in err, err[-2000:]  # the warning was printed, redacted
    shown = out + err + everything_written(str(tmp_path))
    assert THREAD_TOKEN[len("shard_ghp_") :] not in shown


def test_warnings_still_point_at_the_callers_line():
    """Routing warnings through redact.warn keeps their stacklevel: the line shown is the caller's, not dlwatch's."""
    import warnings

    from dlwatch.inproc.agent.warning import warn_program

    def caller():
        warn_program(f"could not read {THREAD_TOKEN}")  # <- the line: the first frame outside dlwatch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        caller()
    assert (
        caught[0].filename == __file__ and "# <- the line" in open(__file__).read().splitlines()[caught[0].lineno - 1]
    )
    assert "shard_***" in str(caught[0].message)


BOOT_FAILS = """
import os, sys
real = os.path.join(sys.argv[1], "dlwatch")
__path__.append(real)  # dlwatch.redact and the rest come from the real package
"""


def test_bootstrap_warning_line_is_redacted(tmp_path):
    """Item 8: `dlwatch run`'s bootstrap line when the run hook cannot be installed: its message is redacted."""
    from conftest import REPO, run_bounded

    fake = tmp_path / "shadow" / "dlwatch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(BOOT_FAILS.replace("sys.argv[1]", repr(REPO)))
    (fake / "inproc").mkdir()
    (fake / "inproc" / "__init__.py").write_text("")
    (fake / "inproc" / "runhook.py").write_text(
        f"def install():\n    raise OSError('cannot open /data/{THREAD_TOKEN}/x')\n"
    )
    boot = os.path.join(REPO, "dlwatch", "inproc", "_boot")
    # the bootstrap acts only where it belongs (issue 18, item 11): here, the package `dlwatch run` recorded
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([boot, str(tmp_path / "shadow")]), DLWATCH_RUN_PACKAGE=str(fake))
    rc, out, err = run_bounded([sys.executable, "-c", "print('ran')"], env=env, cwd=str(tmp_path), timeout=60)
    assert rc == 0 and out.strip() == "ran"  # the program runs unwatched
    assert "could not install the run hook (OSError: cannot open /data/shard_***/x)" in err, err
    assert THREAD_TOKEN[len("shard_ghp_") :] not in err
