"""Advice is judged on what it is about: the same data for the sampler's epoch (not every loader of
the program pooled), a steady pattern for input-bound (not one long pause).

Real programs under `dlwatch run` (one monitor for the whole program: what pooled the loaders).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from conftest import run_bounded

SAMPLERS = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    class Task(Dataset):
        def __init__(self, n):
            self.n = n
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            return torch.tensor([i])

    def loader(ds):
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True))

    if sys.argv[1] == "eight":  # eight validation sets, each its own loader and sampler, each iterated once
        for task in range(8):
            for _ in loader(Task(16 + task)):
                pass
    elif sys.argv[1] == "fresh":  # one dataset, a new loader and sampler each epoch, never set_epoch: same order
        ds = Task(16)
        orders = [[int(b) for batch in loader(ds) for b in batch] for _ in range(3)]
        print("same order:", orders[0] == orders[1] == orders[2])
    print("done")
    """
)


def _run_program(tmp_path, source: str, *args: str) -> tuple[str, list[dict]]:
    script = tmp_path / "program.py"
    script.write_text(source)
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["DLWATCH_QUIET"] = "1"
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(reports), str(script), *args],
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert rc == 0, err[-3000:]
    runs = reports / "runs"
    summaries = [json.loads((runs / d / "summary.json").read_text()) for d in sorted(os.listdir(runs))]
    return out, summaries


def _advice_ids(summaries: list[dict]) -> list[str]:
    return [a["playbook"] for s in summaries for a in s.get("advice") or ()]


def test_different_loaders_each_iterated_once_are_not_one_sampler(tmp_path):
    out, summaries = _run_program(tmp_path, SAMPLERS, "eight")
    assert "done" in out and len(summaries) == 1
    assert len(summaries[0]["iterations"]) == 8  # every loader was watched
    assert "sampler-epoch-not-set" not in _advice_ids(summaries)


def test_one_dataset_reordered_by_a_fresh_sampler_each_epoch_is_advised(tmp_path):
    out, summaries = _run_program(tmp_path, SAMPLERS, "fresh")
    assert "same order: True" in out  # the program's own check: the bug is real
    (advice,) = [a for s in summaries for a in s.get("advice") or () if a["playbook"] == "sampler-epoch-not-set"]
    ev = advice["evidence"]
    assert ev["epochs_started"] == 3 and ev["sampler_epoch_each_epoch"] == [0, 0, 0]


# --------------------------------------------------------------------------- input-bound: a pattern, not a pause

PAUSES = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    import dlwatch

    SLOW = {int(i) for i in sys.argv[2].split(",") if i}  # items that sleep in the second epoch
    PAUSE_S = float(sys.argv[3])
    EPOCH = [0]  # set before each epoch's iter(): the workers (not persistent) fork with it

    class Items(Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            time.sleep(0.002)
            if EPOCH[0] == 1 and i in SLOW:
                time.sleep(PAUSE_S)
            return torch.tensor([i])

    loader = DataLoader(Items(), batch_size=1, num_workers=2)
    with dlwatch.watch(loader, report_dir=sys.argv[1], poll_interval=0.2) as w:
        for epoch in range(3):
            EPOCH[0] = epoch
            for _ in w:
                time.sleep(0.005)
    print("ADVICE", ",".join(a["playbook"] for a in w.summary.get("advice") or ()))
    print("LOOP", json.dumps(w.summary["loop"]))
    """
)


def _pauses_run(tmp_path, slow: str, pause_s: float) -> tuple[list[str], dict]:
    script = tmp_path / "pauses.py"
    script.write_text(PAUSES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["DLWATCH_QUIET"] = "1"
    rc, out, err = run_bounded(
        [sys.executable, str(script), str(tmp_path / "reports"), slow, str(pause_s)],
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert rc == 0, err[-3000:]
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("ADVICE", "LOOP")))
    return [a for a in lines["ADVICE"].strip().split(",") if a], json.loads(lines["LOOP"])


def _long_waits(reports) -> list[float]:
    """The waits for data of a second or more, from the run's timeline: each poll's heartbeat carries
    the steady wait so far (``data_wait_s``), which grows by a wait when its batch arrives."""
    waits, last = [], None
    for path in sorted(reports.glob("runs/*/timeline*.jsonl")):
        for line in path.read_text().splitlines():
            hb = json.loads(line).get("heartbeat") or {}
            wait = hb.get("data_wait_s")
            if isinstance(wait, (int, float)):
                if last is not None and wait - last >= 1.0:
                    waits.append(round(wait - last, 2))
                last = wait
    return waits


def test_one_long_pause_among_ready_batches_is_not_input_bound(tmp_path):
    pause_s = 10.0
    advice, loop = _pauses_run(tmp_path, "7", pause_s)
    # the premise: the run is long enough to be judged, and the one wait is most of the steady wait
    assert loop["steady_batches"] >= 20 and loop["steady_data_wait_s"] + loop["body_s"] >= 5
    assert loop["steady_data_wait_share"] >= 0.2
    others = (loop["steady_data_wait_s"] + loop["body_s"] - pause_s) / (loop["steady_batches"] - 1)
    if "steady_pauses" not in loop and others * 20 > pause_s:  # a loaded machine made every batch slow
        pytest.skip(f"the other batches took {others:.2f} s each here: the pause is not isolated on this load")
    waits = _long_waits(tmp_path / "reports")
    assert any(w >= pause_s - 1 for w in waits), waits  # the timeline saw the planted pause
    if "steady_pauses" not in loop and len(waits) > 1:  # two pauses in 45 batches are not "isolated" (by design)
        pytest.skip(f"a loaded machine made another batch wait a second or more here (waits {waits})")
    assert "steady_pauses" in loop, (waits, loop)
    pauses = loop["steady_pauses"]
    assert pauses["count"] == 1 and pauses["longest_s"] >= pause_s - 1
    # without it, too little steady loop is left to judge (the advice's own minimum)
    assert pauses["steady_loop_s_without"] < 5
    assert "input-bound" not in advice


def test_the_no_advice_line_says_the_pause_left_too_little_to_judge():
    from dlwatch.detect.advice import InputBound
    from dlwatch.report.runview import not_judged_words

    loop = {
        "steady_batches": 45,
        "steady_data_wait_s": 7.2,
        "body_s": 0.3,
        "steady_data_wait_share": 0.96,
        "steady_pauses": {
            "count": 1,
            "total_s": 7.0,
            "longest_s": 7.0,
            "steady_data_wait_share_without": 0.4,
            "steady_loop_s_without": 0.5,
        },
    }
    unmet = InputBound().unmet({"loop": loop}, {"num_workers": 2})
    assert unmet == [{"figure": "steady_loop_without_pauses_s", "needs": 5.0, "value": 0.5}]
    words = not_judged_words({"advice_not_judged": [{"playbook": "input-bound", "unmet": unmet}]})
    assert words == "input-bound (needs at least 5.00 s of steady loop time besides its long pauses, this run 0.50 s)"


def test_a_slow_item_every_few_batches_is_still_the_pipelines_pattern(tmp_path):
    # a shard fetched every fourth item: four waits of 1.5 s in one epoch is how this pipeline runs
    advice, loop = _pauses_run(tmp_path, "1,5,9,13", 1.5)
    assert loop["steady_data_wait_s"] + loop["body_s"] >= 5 and loop["steady_data_wait_share"] >= 0.2
    assert "steady_pauses" not in loop
    assert "input-bound" in advice


def _hb(batches, epoch_batches, state, ts_last, wait, step=0.0):
    from dlwatch.wire.heartbeat import Heartbeat

    return Heartbeat(
        batches=batches,
        epoch_batches=epoch_batches,
        epochs=1,
        state=state,
        pid=1,
        ts_last_batch=ts_last,
        ts_wait_start=1.0,
        total_wait_s=wait,
        total_step_s=step,
        last_interval_s=0.0,
    )


def test_a_wait_is_measured_only_when_two_polls_saw_it():
    from dlwatch.collect.runstats import RunStats, Steady
    from dlwatch.wire.heartbeat import STATE_BODY, STATE_WAITING

    rs = RunStats(0.0)

    def poll(hb):
        rs.update(hb, (), (), None)

    poll(_hb(10, 10, STATE_WAITING, 5.0, 1.0))  # a wait after batch 10: one poll only
    poll(_hb(11, 11, STATE_BODY, 5.2, 1.2))
    assert rs.long_waits == []
    waiting = _hb(11, 11, STATE_WAITING, 5.2, 1.2)
    for _ in range(3):  # the next wait, seen by three polls (an unchanged heartbeat: the same object)
        poll(waiting)
    poll(_hb(12, 12, STATE_BODY, 35.2, 31.2))  # it ended: total wait grew by 30 s
    assert rs.long_waits == [30.0]
    p = rs.pauses(Steady(batches=47, wait_s=31.5, body_s=0.5))
    assert p is not None and p["count"] == 1 and p["longest_s"] == 30.0
    assert p["steady_loop_s_without"] == 2.0
    # the same wait among waits as long as it: the pattern, not a pause
    assert rs.pauses(Steady(batches=47, wait_s=200.0, body_s=40.0)) is None
