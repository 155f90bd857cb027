"""sampler-exhausted-early: an epoch that ends (StopIteration) short of the len(loader) the program asked,
under both watch() forms and `dlwatch run`; quiet for an IterableDataset, a length never asked, drop_last,
a short last batch, break and an exception.  Real loaders (with workers where torch allows), real runs."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import TARGETS, incidents, load, run_bounded

SCRIPT = os.path.join(TARGETS, "short_epochs.py")


def _run(tmp_path, form, case):
    reports = tmp_path / f"{form}-{case}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["DLWATCH_QUIET"] = "1"
    prefix = (
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(reports)] if form == "bare" else [sys.executable]
    )
    rc, out, err = run_bounded([*prefix, SCRIPT, form, case, str(reports)], env=env, cwd=str(tmp_path), timeout=120)
    assert rc == 0, err[-3000:]
    return out, [load(path) for path in incidents(str(reports))]


@pytest.mark.parametrize("form", ["plain", "as", "bare"])
def test_an_epoch_short_of_what_the_program_asked_is_an_incident(tmp_path, form):
    out, found = _run(tmp_path, form, "short")
    assert "ASKED 6 GOT 4" in out  # the program's own view: the bug is real
    (report,) = found
    assert report["trigger"] == "threshold"
    top = report["findings"][0]
    assert top["playbook"] == "sampler-exhausted-early"
    ev = top["evidence"]
    assert (ev["epoch"], ev["batches"], ev["asked_len"], ev["missing_batches"]) == (0, 4, 6, 2)


@pytest.mark.parametrize("case", ["iterable", "unasked", "drop_last", "last_batch", "break", "exception"])
def test_the_look_alikes_stay_quiet(tmp_path, case):
    out, found = _run(tmp_path, "plain", case)
    assert "ASKED" in out
    assert [r["findings"][0]["playbook"] for r in found if r["findings"]] == []


def test_dlwatch_never_asks_the_length_itself(tmp_path):
    """The program never asks len(loader): the sampler's __len__ is not called at all (it may be costly)."""
    counting = tmp_path / "counting.py"
    counting.write_text(
        "import sys, torch, dlwatch\n"
        "from torch.utils.data import DataLoader, Sampler\n"
        "calls = []\n"
        "class S(Sampler):\n"
        "    def __iter__(self): return iter([[0, 1], [2, 3]])\n"
        "    def __len__(self): calls.append(1); return 2\n"
        "loader = DataLoader(list(range(4)), batch_sampler=S())\n"
        "with dlwatch.watch(loader, report_dir=sys.argv[1]):\n"
        "    n = sum(1 for _ in loader)\n"
        "print('CALLS', len(calls), 'BATCHES', n)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    for prefix in ([sys.executable], [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r")]):
        rc, out, err = run_bounded(
            [*prefix, str(counting), str(tmp_path / "w")], env=env, cwd=str(tmp_path), timeout=120
        )
        assert rc == 0 and "CALLS 0 BATCHES 2" in out, (out, err[-2000:])
