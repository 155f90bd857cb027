"""The training process died without a word: OOM kill or vanished, judged on hand-built samples.

The real runs are tests/test_faults.py (a cgroup's OOM killer, ``oom-kill``) and tests/test_watch.py
(SIGKILL from outside, ``vanished``); here the rule itself, with its look-alikes.
"""

from __future__ import annotations

from dlwatch.detect.process_exit import OOM_KILL, VANISHED, judge_exit
from dlwatch.model import SystemSample


def _system(cgroup: int | None, host: int | None = 0) -> SystemSample:
    return SystemSample(ts=0.0, cgroup_oom_kills=cgroup, vm_oom_kills=host)


def test_a_rise_of_the_cgroups_oom_kill_count_is_the_oom_killer():
    verdict = judge_exit(_system(0), _system(1))
    assert verdict.cause == OOM_KILL == "oom-kill"
    assert verdict.text == "killed by the OOM killer (the cgroup's oom_kill count rose from 0 to 1)"


def test_anything_else_vanished():
    for first, now in (
        (_system(3), _system(3)),  # the count did not move: SIGKILL from outside, os._exit
        (_system(None), _system(None)),  # no cgroup counter here
        (_system(None), _system(2)),  # a count first seen at the end proves no rise
        (_system(2), _system(None)),  # the cgroup could not be read afterwards
        (None, None),  # the monitor never sampled the system
        (_system(5), _system(4)),  # a counter that went down (a new cgroup) is no kill
    ):
        verdict = judge_exit(first, now)
        assert verdict.cause == VANISHED == "vanished", (first, now)
        assert verdict.text.startswith("ended without leaving the watch block")


def test_the_hosts_kills_are_another_jobs():
    # a shared host's /proc/vmstat counts every job's OOM kills: a rise there, with the cgroup's
    # count flat, is not this process's death
    assert judge_exit(_system(0, host=7), _system(0, host=9)).cause == VANISHED
