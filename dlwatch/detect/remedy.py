"""No remedy that the loader's own arguments make invalid: DataLoader snippets checked against the loader.

A playbook's remediation suggests ``DataLoader(..., timeout=120)``, ``multiprocessing_context="spawn"``,
``persistent_workers=True``, ``prefetch_factor=2``.  For a loader without workers torch refuses each of
them (``_SingleProcessDataLoaderIter requires timeout == 0`` at the first ``next()``; a ``ValueError``
at construction for the others), so following that advice would break the program.  The matcher
hands every remediation it assembles, with the incident's loader settings, to :func:`fit`, which
leaves out the smallest piece of Markdown (a list item, else a paragraph or code block) that holds
a snippet torch would refuse.  The rules are torch's own, written here without importing torch
(the monitor never does); tests/test_remedy.py checks them against the real torch, snippet by
snippet of every shipped playbook, so that they cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Mapping

__all__ = ["fit", "invalid_reason", "snippets"]

_CALL = re.compile(r"DataLoader\(")
_PLACEHOLDER = "__dlwatch_placeholder__"


def _call_text(text: str, start: int) -> str | None:
    """``DataLoader(...)`` from ``start``, to its matching parenthesis (None when it does not close)."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def _kwargs(call: str) -> dict[str, Any] | None:
    """The keywords of one snippet: a literal where it is one, else the placeholder (a value that is given)."""
    source = call.replace("...", _PLACEHOLDER)
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    out: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            continue
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            out[kw.arg] = _PLACEHOLDER
    return out


def snippets(text: str) -> list[tuple[int, int, dict[str, Any]]]:
    """(start, end, keywords) of every ``DataLoader(...)`` call written in a text."""
    out = []
    for m in _CALL.finditer(text):
        call = _call_text(text, m.start() + len("DataLoader"))
        if call is None:
            continue
        kwargs = _kwargs("DataLoader" + call)
        if kwargs is not None:
            out.append((m.start(), m.start() + len("DataLoader") + len(call), kwargs))
    return out


def _workers(loader: Mapping[str, Any], kwargs: Mapping[str, Any]) -> int | None:
    """The workers the loader would have with the snippet applied (None: a value not known here)."""
    if "num_workers" in kwargs:
        nw = kwargs["num_workers"]
        return nw if isinstance(nw, int) and not isinstance(nw, bool) else None  # a given value: N, cpus - 1
    nw = loader.get("num_workers")
    return nw if isinstance(nw, int) and not isinstance(nw, bool) else None


def invalid_reason(loader: Mapping[str, Any], kwargs: Mapping[str, Any]) -> str | None:
    """Why torch would refuse the loader with these keywords (None: it would take them).

    Only what is certain is judged: a keyword whose value is not written out (``N``, ``...``) is
    taken as the snippet means it (a worker count above zero, a timeout above zero)."""
    nw = _workers(loader, kwargs)
    if nw != 0:
        return None  # the rules below are those of a loader without workers
    if "timeout" in kwargs and kwargs["timeout"] != 0:
        return "timeout needs worker processes (torch: _SingleProcessDataLoaderIter requires timeout == 0)"
    if kwargs.get("multiprocessing_context") is not None:
        return "multiprocessing_context needs worker processes (num_workers > 0)"
    if kwargs.get("persistent_workers") not in (None, False):
        return "persistent_workers needs worker processes (num_workers > 0)"
    if "prefetch_factor" in kwargs and kwargs["prefetch_factor"] is not None:
        return "prefetch_factor needs worker processes (num_workers > 0)"
    return None


_ITEM = re.compile(r"^(\s*)([-*]|\d+\.)\s")


def _pieces(text: str) -> list[tuple[int, int]]:
    """Spans of the text's removable pieces: each list item (with its continuation lines), each other
    paragraph, each fenced code block (with the paragraph that introduces it, ending in a colon)."""
    lines = text.split("\n")
    spans: list[tuple[int, int]] = []
    pos = [0]
    for line in lines:
        pos.append(pos[-1] + len(line) + 1)
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        start = i
        if line.lstrip().startswith("```"):
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                i += 1
            i += 1
        elif _ITEM.match(line):
            indent = len(_ITEM.match(line).group(1))  # type: ignore[union-attr]
            i += 1
            while (
                i < len(lines)
                and lines[i].strip()
                and not _ITEM.match(lines[i])
                and (len(lines[i]) - len(lines[i].lstrip()) > indent)
            ):
                i += 1
        else:
            i += 1
            while (
                i < len(lines)
                and lines[i].strip()
                and not _ITEM.match(lines[i])
                and not lines[i].lstrip().startswith("```")
            ):
                i += 1
        spans.append((pos[start], min(pos[i], len(text))))
    # a paragraph ending in ":" belongs with the code block after it
    merged: list[tuple[int, int]] = []
    for s, e in spans:
        if (
            merged
            and text[merged[-1][0] : merged[-1][1]].rstrip().endswith(":")
            and text[s:e].lstrip().startswith("```")
        ):
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def fit(text: str, loader: Mapping[str, Any] | None) -> str:
    """The remediation without the pieces whose DataLoader snippet the loader's settings make invalid."""
    if not loader or "DataLoader(" not in text:
        return text
    bad = [(s, e) for s, e, kw in snippets(text) if invalid_reason(loader, kw) is not None]
    if not bad:
        return text
    drop = [(ps, pe) for ps, pe in _pieces(text) if any(ps <= s < pe for s, _ in bad)]
    out, last = [], 0
    for ps, pe in drop:
        out.append(text[last:ps])
        last = pe
    out.append(text[last:])
    return re.sub(r"\n{3,}", "\n\n", "".join(out)).strip()
