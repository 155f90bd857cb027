"""A module of the program's own directory, imported only inside a DataLoader worker (lazy-local-imports).

The main process first imports it when it unpickles a batch of ``Value`` objects, inside torch's code and
under ``dlwatch run`` inside the run hook's iteration: it must come from where bare Python finds it.
"""


class Value:
    def __init__(self, v: int) -> None:
        self.v = v

    def __repr__(self) -> str:
        return f"Value({self.v})"
