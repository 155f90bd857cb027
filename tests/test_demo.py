"""`dlwatch demo`: finding the example scripts in both layouts, the table, and one real run."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, kill_tree, run_bounded
from dlwatch.cli import demo_cmd, main
from dlwatch.cli.demo_cmd import ADVICE, Outcome, examples, examples_dir, table_lines
from dlwatch.errors import NotFoundError


def test_list_names_every_example_and_its_playbook(capsys):
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    for name, playbook in examples().items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        if name in ADVICE:
            assert (f"advice {ADVICE[name]}" if ADVICE[name] else "no advice") in line
        else:
            assert (playbook or "no incident") in line
    assert f"scripts: {examples_dir()}" in out


def test_unknown_example_is_a_usage_error_naming_the_valid_ones(capsys):
    assert main(["demo", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no example named 'nope'" in err
    for name in examples():
        assert name in err
    assert "all" in err


def test_every_playbook_has_an_example():
    from dlwatch.wire.playbooks import load_playbooks

    # advice playbooks have an example each, except the preflight-only checks (test_summary.py covers
    # them: a CUDA device, a low fd limit or a tiny /dev/shm are not for a demo on any machine)
    preflight_only = {
        "fork-with-threads",
        "fork-after-cuda",
        "fd-limit-low",
        "shm-too-small",
        "dataset-memory-per-worker",
    }
    shown = {p for p in examples().values() if p} | {p for p in ADVICE.values() if p}
    assert {pb.id for pb in load_playbooks(())} - preflight_only <= shown


def test_examples_found_in_a_checkout():
    assert os.path.samefile(examples_dir(), os.path.join(REPO, "examples"))


def test_examples_found_as_package_data(tmp_path, monkeypatch):
    # what a non-editable install has: the scripts inside the package as dlwatch._examples
    shipped = tmp_path / "site-packages" / "dlwatch" / "_examples"
    shutil.copytree(os.path.join(REPO, "examples"), shipped)
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name == demo_cmd.PACKAGE:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(shipped)]
            return spec
        return real_find_spec(name, *a, **kw)

    monkeypatch.setattr(demo_cmd.importlib.util, "find_spec", find_spec)
    assert examples_dir() == str(shipped)


def test_no_examples_anywhere_is_not_found(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_cmd.importlib.util, "find_spec", lambda name, *a, **kw: None)
    monkeypatch.setattr(demo_cmd, "__file__", str(tmp_path / "dlwatch" / "cli" / "demo_cmd.py"))
    with pytest.raises(NotFoundError, match="example scripts are not installed"):
        examples_dir()


def test_table_lines():
    outcomes = [
        Outcome("deadlock", "worker-deadlock", reports=["/r/a"], top_findings=["worker-deadlock"], seconds=6.21),
        Outcome(
            "fd_exhaustion",
            "fd-exhaustion",
            reports=["/r/b", "/r/c"],
            top_findings=["fd-exhaustion", "shm-exhaustion"],
            seconds=3.0,
        ),
        Outcome("shm_exhaustion", "shm-exhaustion", skipped="no namespace", seconds=0.1),
        Outcome("healthy_fast", None, seconds=1.5),
        Outcome("healthy_slow", None, reports=["/r/d"], top_findings=[None], seconds=4.0),
    ]
    assert list(table_lines(outcomes)) == [
        "EXAMPLE            EXPECTED             TOP FINDING                    MATCHED  TIME",
        "deadlock           worker-deadlock      worker-deadlock                yes      6.2 s",
        "fd_exhaustion      fd-exhaustion        fd-exhaustion, shm-exhaustion  NO       3.0 s",
        "shm_exhaustion     shm-exhaustion       skipped: no namespace          skipped  0.1 s",
        "healthy_fast       (no incident)        -                              yes      1.5 s",
        "healthy_slow       (no incident)        no playbook matched            NO       4.0 s",
        "",
        "failures matched right: 1/2",
        "healthy runs that raised a finding: 1/2",
        "skipped: shm_exhaustion",
    ]
    wide = list(table_lines([Outcome("healthy_detection_collate", None, seconds=4.9), outcomes[0]]))
    assert wide[1].startswith("healthy_detection_collate  (no incident)") and wide[2].startswith("deadlock" + " " * 19)
    col = wide[0].index("EXPECTED")  # the columns stay aligned under their headers
    assert wide[1].index("(no incident)") == col == wide[2].index("worker-deadlock") == 27


def test_outcome_of_an_example_that_fails_is_not_a_match():
    assert Outcome("cat_collate", "batch-dim-mismatch", error="exit status 1").matched is False
    assert Outcome("cat_collate", "batch-dim-mismatch").matched is False  # no incident at all
    assert Outcome("healthy_fast", None, error="still running after 90 s; killed").matched is False


def test_demo_runs_an_example_and_shows_its_report(tmp_path):
    report_dir = tmp_path / "reports"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlwatch", "demo", "cat_collate", "--report-dir", str(report_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, err
    (incident,) = [n for n in os.listdir(report_dir) if not n.startswith(".") and n != "runs"]  # runs: summaries
    path = os.path.join(report_dir, incident)
    assert f"  | REPORT {path}" in out  # the example's own output, passed through
    assert "THRESHOLD: " in out and f"incident {incident}," in out  # the rendered report, headline first
    assert "finding: batch-dim-mismatch" in out
    assert f"full report: {os.path.join(path, 'report.md')}" in out
    assert f"charts: dlwatch report {path} --html" in out  # the way to the page with the charts
    assert os.path.isfile(os.path.join(path, "report.md"))


def test_demo_bounds_an_example_in_time(tmp_path, monkeypatch):
    # a stand-in example that never ends: the demo kills it at --timeout and says so
    fake = tmp_path / "examples"
    shutil.copytree(os.path.join(REPO, "examples"), fake)
    (fake / "healthy_fast.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(demo_cmd, "examples_dir", lambda: str(fake))
    o = demo_cmd.run_example("healthy_fast", str(fake), str(tmp_path / "reports"), timeout=1.0)
    assert o.error == "still running after 1 s; killed"
    assert o.output == ["started"] and o.matched is False and o.seconds < 10


def _venv_without_numpy(root) -> str:
    """A fresh venv (no pip, built in a second) seeing this venv's packages, numpy left out, and this
    dlwatch: what `pip install torch==2.13.0 && pip install .` gives a newcomer who has no numpy."""
    import torch

    packages = os.path.dirname(os.path.dirname(torch.__file__))
    farm = root / "packages"
    farm.mkdir()
    for name in os.listdir(packages):
        if not name.lower().startswith("numpy") and not name.endswith(".pth") and name != "__pycache__":
            os.symlink(os.path.join(packages, name), farm / name)
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    python = str(env_dir / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    with open(os.path.join(purelib, "dlwatch-test.pth"), "w") as f:
        f.write(f"{REPO}\n{farm}\n")  # read by site at start-up, as an install's would be
    return python


def test_the_demo_shows_no_torch_warning_without_numpy(tmp_path):
    """The README's demo in a venv without numpy: torch's 'Failed to initialize NumPy' warnings (two of
    them before the report, before the fix) do not reach the newcomer's screen."""
    python = _venv_without_numpy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS", "DLWATCH_DIR")}
    # the precondition: in this venv, importing torch does warn
    rc, out, err = run_bounded(
        [python, "-c", "import torch, dlwatch; print(dlwatch.__file__)"], env=env, cwd=str(tmp_path), timeout=120
    )
    assert rc == 0 and "Failed to initialize NumPy" in err, err
    assert out.strip() == os.path.join(REPO, "dlwatch", "__init__.py")  # this dlwatch
    rc, out, err = run_bounded(
        [python, "-m", "dlwatch", "demo", "--report-dir", str(tmp_path / "reports")],
        env=env,
        cwd=str(tmp_path),
        timeout=180,
    )
    assert rc == 0, (out[-2000:], err[-2000:])
    assert "STALL (deadlock)" in out  # the demo ran and showed its report
    assert "Failed to initialize NumPy" not in out + err and "UserWarning" not in out + err, out[:3000]
