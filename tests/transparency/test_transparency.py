"""The differential harness (issue 17): a watched program does exactly what the bare program does.

Every loader shape in program.py (the ones users write: DataLoader subclasses, Lightning-style
fetchers, the YOLOv5/timm infinite loader, accelerate and Lightning themselves, samplers, iterable
datasets, threads, breaks, worker exceptions, start methods...) runs in fresh processes in each mode:
bare, ``with dlwatch.watch(loader): for b in loader``, ``with dlwatch.watch(loader) as batches: for b
in batches`` and ``dlwatch run``.  Each shape's trace (every batch's bytes, the calls into user code
in the main process and in the workers, the RNG states afterwards, the values the workers drew, the
exceptions with their frames, the workers still alive) must be the bare one; and each program's exit
code, stdout and stderr (less dlwatch's own notices and warnings) must be the bare program's, with no
process left behind.  Divergences found and not fixed yet are listed in harness.KNOWN: hidden from
these comparisons, and each checked on its own so that the list cannot go stale.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterator

import pytest

from transparency.harness import (
    GROUPS,
    KNOWN,
    MODES,
    comparable,
    differences,
    missing,
    printed,
    program_stderr,
    results,
)

pytestmark = pytest.mark.timeout(900)  # a group's first test runs its programs


def _trace_cases() -> Iterator[Any]:
    for name, group in GROUPS.items():
        for shape in group.shapes:
            if shape.startswith("uncaught-"):
                continue  # no trace line: its program's exit code and stderr are the trace
            for mode in group.modes:
                if mode != "bare":
                    suffix = "-as-module" if group.as_module else ""  # the same shapes run as a script too
                    yield pytest.param(name, shape, mode, id=f"{shape}-{mode}{suffix}")


@pytest.mark.parametrize("group, shape, mode", list(_trace_cases()))
def test_trace_is_the_bare_one(group, shape, mode, tmp_path_factory):
    why = missing(GROUPS[group]).get(shape)
    if why:
        pytest.skip(why)
    runs = results(group, tmp_path_factory.mktemp)
    bare, other = runs["bare"], runs[mode]
    assert shape in bare.traces, f"bare: no trace for {shape} (exit code {bare.rc}):\n{bare.stderr[-3000:]}"
    expected = bare.traces[shape]
    # the bare run really ran the shape: batches came (or the exception it is about), nothing escaped,
    # no worker outlived its loader
    caught = [note for note in expected["notes"] if note[0] == "caught"]
    assert expected["batches"] or caught, expected
    assert expected["escaped"] is None and expected["workers_alive"] == 0, expected
    assert shape in other.traces, f"{mode}: no trace for {shape} (exit code {other.rc}):\n{other.stderr[-3000:]}"
    diff = differences(comparable(expected), comparable(other.traces[shape]))
    assert not diff, f"{shape} under {mode} is not what it is bare:\n" + "\n".join(diff)


def _program_cases() -> Iterator[Any]:
    for name, group in GROUPS.items():
        for mode in group.modes:
            if mode != "bare":
                yield pytest.param(name, mode, id=f"{name}-{mode}")


@pytest.mark.parametrize("group, mode", list(_program_cases()))
def test_program_is_the_bare_one(group, mode, tmp_path_factory):
    """Exit code, stdout (every trace line and what the shapes print), stderr less dlwatch's own
    lines, and no process left in the program's session once it has ended."""
    if len(missing(GROUPS[group])) == len(GROUPS[group].shapes):
        pytest.skip("; ".join(sorted(set(missing(GROUPS[group]).values()))))
    runs = results(group, tmp_path_factory.mktemp)
    bare, other = runs["bare"], runs[mode]
    assert bare.rc is not None and other.rc is not None, "a program did not end by itself"
    if group == "uncaught":  # the precondition: the bare program died of the worker's exception
        assert bare.rc == 1 and "ValueError: sample 6 is unreadable" in bare.stderr, bare.stderr[-3000:]
    else:
        assert bare.rc == 0, bare.stderr[-3000:]
    assert not bare.left, f"the bare program left {bare.left}"
    assert other.rc == bare.rc, f"exit code {other.rc}, bare {bare.rc}:\n{other.stderr[-3000:]}"
    assert printed(other.stdout) == printed(bare.stdout), "stdout differs:\n" + "\n".join(
        difflib.unified_diff(printed(bare.stdout), printed(other.stdout), "bare", mode, lineterm="", n=1)
    )
    assert program_stderr(other.stderr) == program_stderr(bare.stderr), "stderr differs:\n" + "\n".join(
        difflib.unified_diff(
            program_stderr(bare.stderr).splitlines(),
            program_stderr(other.stderr).splitlines(),
            "bare",
            mode,
            lineterm="",
            n=1,
        )
    )
    assert not other.left, f"processes left behind: {other.left}"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "bare"])
@pytest.mark.parametrize("known", KNOWN, ids=[k.id for k in KNOWN])
def test_known_divergence_still_there(known, mode, tmp_path_factory):
    """Each entry of harness.KNOWN still shows (an expected failure, with what differs), or this
    fails: the divergence is gone and the entry must go, so that the comparisons see that field again."""
    runs = results("fork", tmp_path_factory.mktemp)
    bare, other = runs["bare"], runs[mode]
    diff = []
    for shape, trace in bare.traces.items():
        if shape in other.traces:  # what differs with this entry shown, and not with it hidden
            hidden = set(differences(comparable(trace), comparable(other.traces[shape])))
            shown = differences(comparable(trace, keep=known.id), comparable(other.traces[shape], keep=known.id))
            diff += [f"{shape}: {d}" for d in shown if d not in hidden]
    if diff:
        pytest.xfail(f"{known.id}: {known.reason}; e.g. " + "; ".join(diff[:3]))
    pytest.fail(f"the known divergence {known.id!r} no longer shows under {mode}: remove it from harness.KNOWN")


def test_only_dlwatchs_own_lines_leave_stderr():
    """The stderr comparison hides dlwatch's notices and warnings, and nothing the program wrote."""
    err = (
        "dlwatch: exception incident (no playbook matched): /r/x\n"
        "/p/train.py:12: DlwatchWarning: dlwatch: pin-memory-without-cuda: pin_memory=True without a CUDA device\n"
        "  for b in loader:\n"
        "/p/train.py:13: UserWarning: the program's own warning about dlwatch: kept\n"
        "  warnings.warn(msg)\n"
        "the program says dlwatch: kept too\n"
        "DataLoader worker (pid 4242) exited unexpectedly\n"
    )
    assert program_stderr(err).splitlines() == [
        "/p/train.py:13: UserWarning: the program's own warning about dlwatch: kept",
        "  warnings.warn(msg)",
        "the program says dlwatch: kept too",
        "DataLoader worker (pid N) exited unexpectedly",
    ]


def test_every_field_is_compared():
    """Each divergence found so far is fixed (harness.KNOWN is empty): the comparison hides nothing,
    so dataset __len__ calls and worker tracebacks count as in any other field."""
    trace = {
        "calls": {"Dataset.__len__": 3, "collate_fn": 2},
        "escaped": None,
        "notes": [["caught", {"message": 'x\n  File "/a/dlwatch/worker_hook.py", line 60, in __call__\n'}]],
    }
    assert comparable(trace) == trace
    assert differences(comparable(trace), comparable({**trace, "calls": {"Dataset.__len__": 4, "collate_fn": 2}}))
