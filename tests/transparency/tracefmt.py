"""What makes a trace independent of the run: pids and addresses replaced (imports nothing heavy;
shared by the harness's program and its tests)."""

from __future__ import annotations

import re

_VOLATILE = [(re.compile(r"\bpid(?:s|\(s\))?[ (]*\d+(?:, \d+)*"), "pid N"), (re.compile(r"0x[0-9a-fA-F]+"), "0xADDR")]


def normalised(text: str) -> str:
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text
