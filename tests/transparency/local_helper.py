"""A module of the program's own directory, first imported by a dataset in the main process while the loop
runs (lazy-local-imports, no workers): under ``dlwatch run``, from inside the run hook's iteration."""


def triple(i: int) -> int:
    return 3 * i
