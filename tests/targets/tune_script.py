"""An unmodified training script for `dlwatch tune`: a loader, a loop whose every step leaves a mark.

    python tune_script.py MARK_FILE [io|slow] [ARGS...]

Prints ARGS (what it was given), then trains: each step appends a line to MARK_FILE and prints
STEP; its `finally` prints FINALLY, its atexit handler ATEXIT, the end AFTER.  Under `dlwatch tune`
none of those may appear: the loader is tuned before its first batch and the script ends there.
"""

import atexit
import os
import sys

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_data import IoBound

print("ARGS", " ".join(sys.argv[1:]), flush=True)
mark = sys.argv[1]
kind = sys.argv[2] if len(sys.argv) > 2 else "io"
atexit.register(lambda: print("ATEXIT", flush=True))
loader = DataLoader(IoBound(wait_s=0.01 if kind == "io" else 0.02), batch_size=4, shuffle=True)
try:
    for batch in loader:
        with open(mark, "a") as f:
            f.write("step\n")
        print("STEP", flush=True)
finally:
    print("FINALLY", flush=True)
print("AFTER", flush=True)
