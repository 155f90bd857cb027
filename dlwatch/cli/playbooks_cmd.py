"""List the playbooks dlwatch matches incidents against, or show one.

  dlwatch playbooks              list them: id, title, where each comes from
  dlwatch playbooks ID           show one: meaning, signals, thresholds, evidence, remediation
  dlwatch playbooks --dir DIR    also load the playbooks in DIR (as $DLWATCH_PLAYBOOKS does)

A playbook in DIR or $DLWATCH_PLAYBOOKS with the id of a shipped one replaces it.
The file format is described in the README.md of the shipped playbooks folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator, Sequence

from dlwatch.errors import NotFoundError
from dlwatch.wire.playbooks import Playbook, Signal, load_playbooks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", nargs="?", help="the playbook to show (omit to list them all)")
    parser.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help="an extra playbook directory (repeatable; after $DLWATCH_PLAYBOOKS)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    playbooks = load_playbooks(args.dir, strict_env=True)  # the command that shows them says what is wrong
    if args.id is None:
        if args.json:
            json.dump(
                [{"id": p.id, "title": p.title, "source": p.source, "builtin": p.builtin} for p in playbooks],
                sys.stdout,
                indent=2,
            )
            print()
        else:
            for line in list_lines(playbooks):
                print(line)
        return 0
    pb = next((p for p in playbooks if p.id == args.id), None)
    if pb is None:
        known = ", ".join(p.id for p in playbooks)
        raise NotFoundError(f"no playbook with id {args.id!r}", help=f"known ids: {known}")
    if args.json:
        json.dump(to_dict(pb), sys.stdout, indent=2)
        print()
    else:
        for line in show_lines(pb):
            print(line)
    return 0


def list_lines(playbooks: Sequence[Playbook]) -> Iterator[str]:
    width = max((len(p.id) for p in playbooks), default=0)
    for p in playbooks:
        origin = "" if p.builtin else f"  [{p.source}]"
        yield f"{p.id:<{width}}  {p.title}{origin}"


def _condition_text(s: Signal) -> str:
    parts = []
    if s.exception_type is not None:
        parts.append(f"exception type ~ /{s.exception_type.pattern}/")
    if s.exception_text is not None:
        parts.append(f"exception text ~ /{s.exception_text.pattern}/")
    if s.errno:
        parts.append("errno in " + ", ".join(map(str, s.errno)))
    if s.not_errno:
        parts.append("errno not in " + ", ".join(map(str, s.not_errno)))
    if s.from_loader is not None:
        parts.append("raised by the DataLoader" if s.from_loader else "raised by the loop body")
    for label, rx in (("frame", s.frame), ("frame function", s.frame_function), ("frame file", s.frame_filename)):
        if rx is not None:
            parts.append(f"{label} ~ /{rx.pattern}/" + (f" in {s.role}" if s.role != "any" else ""))
    if s.classification:
        parts.append("stall classified " + " or ".join(s.classification))
    if s.signal:
        parts.append(f"signal {s.signal}")
    if s.fd_at_limit is not None:
        parts.append("a process at its fd limit" if s.fd_at_limit else "no process at its fd limit")
    parts.extend(f"fact {name}" for name in s.facts)
    parts.extend(f"not fact {name}" for name in s.not_facts)
    return "; ".join(parts)


def show_lines(pb: Playbook) -> Iterator[str]:
    yield f"{pb.id}: {pb.title}"
    yield f"  source: {pb.source}" + (" (shipped)" if pb.builtin else "")
    yield ""
    yield from pb.summary.splitlines()
    yield ""
    if pb.is_advice:
        yield "Advice: measured by dlwatch (the run summary, or the preflight check before the workers"
        yield "start); never an incident."
    else:
        yield "Signals (confidence):"
    for s in pb.signals:
        yield f"  {s.confidence:.2f}  {s.name}: {s.description or _condition_text(s)}"
        if s.description:
            yield f"        when {_condition_text(s)}"
    if pb.thresholds:
        yield ""
        yield "Thresholds:"
        for k, v in pb.thresholds.items():
            yield f"  {k} = {v}"
    if pb.evidence:
        yield ""
        yield "Evidence shown:"
        for k, v in pb.evidence.items():
            yield f"  {k}: {v}"
    if pb.hints:
        yield ""
        yield "Causes named from the stacks: " + ", ".join(dict.fromkeys(h.name for h in pb.hints))
    yield ""
    yield "Remediation:"
    for name, text in pb.variants.items():
        yield f"  [{name}]"
        yield from ("  " + line if line else "" for line in text.splitlines())
        yield ""
    yield from ("  " + line if line else "" for line in pb.remediation.splitlines())
    if pb.references:
        yield ""
        yield "References:"
        for r in pb.references:
            yield f"  {r}"


def to_dict(pb: Playbook) -> dict[str, Any]:
    return {
        "id": pb.id,
        "title": pb.title,
        "summary": pb.summary,
        "source": pb.source,
        "builtin": pb.builtin,
        "signals": [
            {"name": s.name, "confidence": s.confidence, "description": s.description, "when": _condition_text(s)}
            for s in pb.signals
        ],
        "thresholds": dict(pb.thresholds),
        "evidence": dict(pb.evidence),
        "remediation": pb.remediation,
        "variants": dict(pb.variants),
        "hints": [h.name for h in pb.hints],
        "references": list(pb.references),
    }
