"""Bad input gets one clear line and a documented exit code; nothing starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import DataLoader

import dlwatch
from conftest import REPO, TARGETS
from dlwatch.errors import PlaybookError

sys.path.insert(0, TARGETS)
from datasets import Squares  # noqa: E402


def test_watch_with_malformed_playbook_fails_at_the_call(tmp_path):
    (tmp_path / "bad.toml").write_text(
        'id = "my-playbook"\ntitle = "x"\n[[signals]]\nname = "s"\nexception_text = "("\nconfidence = 0.5\n'
    )
    dl = DataLoader(Squares(4), batch_size=2)
    with pytest.raises(PlaybookError) as info:
        dlwatch.watch(dl, playbooks=str(tmp_path), report_dir=tmp_path / "r")
    assert "bad.toml" in str(info.value) and "exception_text" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not (tmp_path / "r").exists()  # nothing started


def test_watch_with_missing_playbook_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        dlwatch.watch([1, 2], playbooks=str(tmp_path / "nope"))


def test_attach_to_another_users_process_is_permission_denied(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # the interpreter and everything the command needs are loaded as root, then the process
    # drops to nobody: its Python lives under a directory that nobody cannot read
    code = textwrap.dedent(f"""
        import os, sys, argparse, json, time
        sys.path.insert(0, {REPO!r})
        import dlwatch.cli, dlwatch.cli.attach_cmd, dlwatch.cli.report_cmd, dlwatch.cli.playbooks_cmd
        import dlwatch.cli.demo_cmd, dlwatch.errors, encodings.idna
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        sys.exit(dlwatch.cli.main(["attach", "{victim.pid}", "--out", "/tmp"]))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        victim.kill()
        victim.wait()
    assert out.returncode == 5, out.stderr
    assert out.stderr.count("\n") == 1 and "permission" in out.stderr.lower()
    assert "CAP_SYS_PTRACE" in out.stderr
