"""Loading and validating playbook files: the shipped six, user directories, malformed files."""

from __future__ import annotations

import dataclasses

import os
import re
import textwrap
from pathlib import Path

import pytest

from dlwatch.cli import main
from dlwatch.errors import NotFoundError, PlaybookError
from dlwatch.wire.playbooks import ENV_VAR, builtin_dir, load_file, load_playbooks, parse_playbook


def _shipped_ids() -> tuple[set[str], set[str]]:
    """The shipped failure and advice ids as playbooks/README.md records them (the public contract).

    That sentence is written by docs/gendocs.py from the playbook files and checked by
    tests/test_docs.py, so a removed or renamed id shows in the committed docs' diff; here the
    loaded playbooks and the failure registry must agree with it.
    """
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "playbooks", "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^Shipped ids [^:]*: (?P<failures>.*?); and the advice ids [^:]*: (?P<advice>.*?)\.$", text, re.M)
    assert m, "playbooks/README.md lost its generated sentence of shipped ids (python docs/gendocs.py)"
    return set(re.findall(r"`([a-z0-9-]+)`", m["failures"])), set(re.findall(r"`([a-z0-9-]+)`", m["advice"]))


FAILURE_IDS, ADVICE_IDS = _shipped_ids()
IDS = FAILURE_IDS | ADVICE_IDS

MINIMAL = """
id = "my-thing"
title = "My thing"
[[signals]]
exception_text = "boom"
confidence = 0.7
"""


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def write(d: Path, name: str, text: str) -> Path:
    p = d / name
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_playbooks_load_and_are_complete() -> None:
    pbs = load_playbooks()
    assert {p.id for p in pbs} == IDS
    for p in pbs:
        assert p.builtin and p.title and p.summary and p.remediation and p.references
        assert (p.kind == "advice") == (p.id in ADVICE_IDS)
        assert bool(p.signals) == (p.kind == "failure")  # advice is found by code, not matched
        assert all(0 <= s.confidence <= 1 for s in p.signals)
        assert all(r.startswith("https://") for r in p.references)
        assert p.evidence


def test_builtin_dir_holds_the_toml_files() -> None:
    names = {e.name for e in builtin_dir().iterdir()}
    assert {f"{i}.toml" for i in IDS} <= names


def test_remediation_content_is_specific() -> None:
    pbs = {p.id: p for p in load_playbooks()}
    fd = pbs["fd-exhaustion"]
    assert set(fd.variants) == {"regular-files", "shm-fds"}
    assert "with open(" in fd.variants["regular-files"] and "RLIMIT_NOFILE" in fd.variants["regular-files"]
    assert 'set_sharing_strategy("file_system")' in fd.variants["shm-fds"] and "ulimit -n" in fd.variants["shm-fds"]
    shm = pbs["shm-exhaustion"].remediation
    for needle in (
        "--shm-size",
        "--ipc=host",
        "medium: Memory",
        "file_system",
        "prefetch_factor",
        "/dev/shm/torch_",
        "Windows",
    ):
        assert needle in shm, needle
    dl = pbs["worker-deadlock"]
    # the remedy depends on the waiting site (#21 item 2): "lock held across fork" only for a lock;
    # never what the loader already does (#21 item 7)
    assert set(dl.variants) == {
        "lock",
        "no-fork-start",
        "queue",
        "condition",
        "semaphore",
        "held-by-training-process",
        "no-timeout",
    }
    lock = dl.remediation + dl.variants["lock"] + "".join(h.text for h in dl.hints)
    for needle in ("cv2.setNumThreads(0)", "cv2.ocl.setUseOpenCL(False)", "spawn", "forkserver"):
        assert needle in lock, needle
    assert "timeout=" in dl.variants["no-timeout"]
    for site in ("queue", "condition", "semaphore", "no-fork-start"):
        assert "held across fork" not in dl.variants[site] and '"spawn"' not in dl.variants[site], site
        assert "timeout" in dl.variants[site] or "time out" in dl.variants[site], site
    bd = pbs["batch-dim-mismatch"].remediation
    assert "torch.stack" in bd and "torch.cat" in bd and "assert" in bd and "DDP" in bd
    rng = pbs["rng-duplication"].remediation
    for needle in (
        "get_worker_info()",
        "info.seed",
        "np.random.default_rng",
        "generator=torch.Generator().manual_seed",
    ):
        assert needle in rng, needle


def test_thresholds_are_data() -> None:
    pbs = {p.id: p for p in load_playbooks()}
    assert pbs["fd-exhaustion"].threshold("fd_share", 0.5) == 0.9
    assert pbs["fd-exhaustion"].threshold("missing", 0.5) == 0.5
    assert pbs["shm-exhaustion"].threshold("need_factor", 0) == 1.0


def test_user_dir_adds_and_overrides(tmp_path: Path) -> None:
    write(tmp_path, "mine.toml", MINIMAL)
    write(
        tmp_path,
        "fd.toml",
        """
        id = "fd-exhaustion"
        title = "Site-specific fd advice"
        [[signals]]
        errno = 24
        confidence = 0.9
        [remediation]
        text = "call the ops team"
    """,
    )
    pbs = load_playbooks([str(tmp_path)])
    by_id = {p.id: p for p in pbs}
    assert set(by_id) == IDS | {"my-thing"}
    assert by_id["fd-exhaustion"].title == "Site-specific fd advice" and not by_id["fd-exhaustion"].builtin
    assert by_id["my-thing"].source == str(tmp_path / "mine.toml")


def test_env_var_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write(a, "x.toml", MINIMAL)
    write(b, "y.toml", MINIMAL.replace("my-thing", "other-thing"))
    monkeypatch.setenv(ENV_VAR, os.pathsep.join([str(a), "", str(b)]))
    assert {"my-thing", "other-thing"} <= {p.id for p in load_playbooks()}


def test_missing_dir_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotFoundError, match="does-not-exist"):
        load_playbooks([str(tmp_path / "does-not-exist")])
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(NotFoundError, match=re.escape(ENV_VAR)):  # `dlwatch playbooks`: the user checks them
        load_playbooks(strict_env=True)
    # everywhere else the environment fails open (issue 29): the directory is skipped, the shipped ones load
    problems: list[str] = []
    skipped = [pb.id for pb in load_playbooks(problems=problems)]
    monkeypatch.delenv(ENV_VAR)
    assert skipped == [pb.id for pb in load_playbooks()] and problems == []  # config.resolve says it is missing


@pytest.mark.parametrize(
    "body, field, problem",
    [
        ('title = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5', "id", "missing"),
        ('id = "Bad_Id"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5', "id", "kebab"),
        ('id = "x"\n[[signals]]\nerrno = 24\nconfidence = 0.5', "title", "missing"),
        ('id = "x"\ntitle = 3\n[[signals]]\nerrno = 24\nconfidence = 0.5', "title", "string"),
        ('id = "x"\ntitle = "t"', "signals", "at least one"),
        ('id = "x"\ntitle = "t"\nkind = "hint"', "kind", "not one of"),
        (
            'id = "x"\ntitle = "t"\nkind = "advice"\n[[signals]]\nerrno = 24\nconfidence = 0.5',
            "signals",
            "found by code",
        ),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nexception_text = "(unclosed"\nconfidence = 0.5',
            "signals[0].exception_text",
            "bad regular expression",
        ),
        ('id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 1.5', "signals[0].confidence", "outside 0..1"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = -0.1', "signals[0].confidence", "outside 0..1"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24', "signals[0].confidence", "missing"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nerrno = "24"\nconfidence = 0.5', "signals[0].errno", "integer"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5\nfoo = 1', "signals[0].foo", "unknown key"),
        ('id = "x"\ntitle = "t"\ncolour = "red"\n[[signals]]\nerrno = 24\nconfidence = 0.5', "colour", "unknown key"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nconfidence = 0.5', "signals[0]", "no positive condition"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nnot_errno = 24\nconfidence = 0.5', "signals[0]", "no positive condition"),
        ('id = "x"\ntitle = "t"\n[[signals]]\nfd_at_limit = false\nconfidence = 0.5', "signals[0]", "no positive"),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nframe = "x"\nrole = "gpu"\nconfidence = 0.5',
            "signals[0].role",
            "not one of",
        ),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5\n[thresholds]\nfd_share = "high"',
            "thresholds.fd_share",
            "number",
        ),
        (
            'id = "x"\ntitle = "t"\nreferences = "http://x"\n[[signals]]\nerrno = 24\nconfidence = 0.5',
            "references",
            "array",
        ),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5\n[remediation]\ntxt = "a"',
            "remediation.txt",
            "unknown key",
        ),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5\n[[hints]]\nname = "h"',
            "hints[0]",
            "needs",
        ),
        (
            'id = "x"\ntitle = "t"\n[[signals]]\nerrno = 24\nconfidence = 0.5\n[[hints]]\nname = "h"\nframe = "["',
            "hints[0].frame",
            "bad regular expression",
        ),
        ('id = "x"\ntitle = [unclosed', "(toml)", "not valid TOML"),
    ],
)
def test_malformed_file_names_file_and_field(tmp_path: Path, body: str, field: str, problem: str) -> None:
    path = write(tmp_path, "bad.toml", body)
    with pytest.raises(PlaybookError) as info:
        load_playbooks([str(tmp_path)])
    err = info.value
    assert err.path == str(path) and err.field == field
    assert problem in str(err) and str(path) in str(err)
    assert err.exit_code == 7


def test_duplicate_id_in_one_dir(tmp_path: Path) -> None:
    write(tmp_path, "a.toml", MINIMAL)
    write(tmp_path, "b.toml", MINIMAL)
    with pytest.raises(PlaybookError, match="also defined in"):
        load_playbooks([str(tmp_path)])


def test_playbook_is_frozen_and_read_only() -> None:
    pb = parse_playbook(MINIMAL + "\n[thresholds]\nx = 1\n", "mem.toml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        pb.id = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        pb.thresholds["x"] = 2  # type: ignore[index]


def test_load_file_missing(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        load_file(tmp_path / "nope.toml")
    assert load_file(write(tmp_path, "m.toml", MINIMAL)).id == "my-thing"


def test_remediation_as_plain_string() -> None:
    pb = parse_playbook('remediation = "do this"\n' + MINIMAL, "m.toml")
    assert pb.remediation == "do this" and dict(pb.variants) == {}
    # the TOML trap: a top-level key written after [[signals]] belongs to that signal
    with pytest.raises(PlaybookError, match=re.escape("'signals[0].remediation': unknown key")):
        parse_playbook(MINIMAL + 'remediation = "do this"\n', "m.toml")


# --------------------------------------------------------------------------- CLI


def test_cli_lists(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbooks"]) == 0
    out = capsys.readouterr().out
    for i in IDS:
        assert re.search(rf"^{i}\s+\S", out, re.M), i


def test_cli_shows_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbooks", "shm-exhaustion"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shm-exhaustion: ") and "--shm-size" in out and "Signals" in out and "References" in out


def test_cli_unknown_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbooks", "no-such"]) == 3
    err = capsys.readouterr().err
    assert "no-such" in err and "fd-exhaustion" in err


def test_cli_malformed_user_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "bad.toml", 'id = "x"\n')
    assert main(["playbooks", "--dir", str(tmp_path)]) == 7
    assert "bad.toml" in capsys.readouterr().err


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    write(tmp_path, "m.toml", MINIMAL)
    assert main(["playbooks", "--dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"id": "my-thing", "title": "My thing", "source": str(tmp_path / "m.toml"), "builtin": False} in listed
    assert main(["playbooks", "my-thing", "--dir", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["signals"][0]["when"] == "exception text ~ /boom/"
