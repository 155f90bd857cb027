"""Run the commands the README shows and keep what they printed, for docs/gendocs.py to quote.

    python docs/capture.py          # about a minute: real hangs, real workers, real py-spy

Writes docs/samples/<name>.txt.  The README quotes these files (blocks ``sample-<name>``), so what it
shows a newcomer is what these commands printed on this machine, never typed by hand; the report
directory's path is written as ``./dlwatch-reports`` and the checkout's as ``.``.  Run it again after
a change to what the terminal shows, then ``python docs/gendocs.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SAMPLES = os.path.join(HERE, "samples")
EXAMPLES = os.path.join(REPO, "examples")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_") and k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = REPO
    env["COLUMNS"] = "100"
    return env


def _clean(text: str, reports: str, workdir: str) -> str:
    text = text.replace(reports, "./dlwatch-reports").replace(workdir + "/", "").replace(REPO + "/", "")
    return re.sub(r"[ \t]+\n", "\n", text).strip() + "\n"


def _run(argv: list[str], cwd: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    return proc.stdout + proc.stderr


def _write(name: str, text: str) -> None:
    os.makedirs(SAMPLES, exist_ok=True)
    with open(os.path.join(SAMPLES, f"{name}.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    print(f"capture: docs/samples/{name}.txt ({len(text.splitlines())} lines)")


def demo(work: str) -> None:
    reports = os.path.join(work, "dlwatch-reports")
    out = _run([sys.executable, "-m", "dlwatch", "demo", "--report-dir", reports], cwd=work)
    _write("demo", "$ dlwatch demo\n" + _clean(out, reports, work))
    listing = _run([sys.executable, "-m", "dlwatch", "report", "--dir", reports], cwd=work)
    if "usage:" in listing:  # a dlwatch without --dir: the directory as the argument
        listing = _run([sys.executable, "-m", "dlwatch", "report", reports], cwd=work)
    _write("report", "$ dlwatch report\n" + _clean(listing, reports, work))


def run_advice(work: str) -> None:
    reports = os.path.join(work, "dlwatch-reports")
    shutil.copy(os.path.join(EXAMPLES, "input_bound.py"), os.path.join(work, "train.py"))
    shutil.copy(os.path.join(EXAMPLES, "_common.py"), os.path.join(work, "_common.py"))
    out = _run(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", reports, "train.py", "--report-dir", reports],
        cwd=work,
    )
    lines = [line for line in out.splitlines() if line.startswith("dlwatch")]
    _write("run", "$ dlwatch run train.py\n" + _clean("\n".join(lines), reports, work))


def attach(work: str) -> None:
    reports = os.path.join(work, "attach-reports")
    target = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "tests", "targets", "hang.py"),
            "deadlock",
            os.path.join(work, "r"),
            "--unwatched",
        ],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert target.stdout is not None
        while "READY" not in (target.stdout.readline() or "READY"):
            pass
        time.sleep(2.0)  # the workers are in the lock for good
        out = _run([sys.executable, "-m", "dlwatch", "attach", str(target.pid), "--out", reports], cwd=work)
        text = _clean(out, reports, work).replace(str(target.pid), "4242")
        _write("attach", "$ dlwatch attach 4242\n" + text)
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()


def main() -> int:
    with tempfile.TemporaryDirectory() as work:
        for step in (demo, run_advice, attach):
            os.makedirs(os.path.join(work, step.__name__), exist_ok=True)
            step(os.path.join(work, step.__name__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
