"""Target: a plain Python process that says it is ready and sleeps.  Usage: sleeper.py FIFO"""

import sys
import time


def sleep_here() -> None:
    time.sleep(120)


with open(sys.argv[1], "w") as fifo:
    fifo.write("ready\n")
sleep_here()
