"""Epochs that end short of len(loader), and the look-alikes that must stay quiet.

    python short_epochs.py FORM CASE REPORT_DIR

FORM: ``plain`` (watch() around ``for b in loader``), ``as`` (``for b in batches``) or ``bare`` (no
watch: run under ``dlwatch run``).  CASE: ``short`` (a batch sampler whose __len__ says 6 and yields
4), ``iterable`` (an IterableDataset whose __len__ estimates 6, yields 4), ``unasked`` (the short
sampler, len() never asked), ``drop_last``, ``last_batch`` (a short last batch), ``break``,
``exception``.  Prints ``ASKED n GOT m``.
"""

import sys

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

import dlwatch


class Items(Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return torch.tensor([i])


class ShortSampler(Sampler):
    def __iter__(self):
        return iter([[0, 1], [2, 3], [4, 5], [6, 7]])

    def __len__(self):
        return 6


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8))

    def __len__(self):
        return 12  # an estimate: with batch_size 2, len(loader) says 6; it yields 4


def make(case):
    if case in ("short", "unasked"):
        return DataLoader(Items(), batch_sampler=ShortSampler(), num_workers=2)
    if case == "iterable":
        return DataLoader(Stream(), batch_size=2)
    if case == "drop_last":
        return DataLoader(Items(), batch_size=4, drop_last=True, num_workers=2)  # 5 batches, 2 items left
    return DataLoader(Items(), batch_size=4, num_workers=2)  # last_batch, break, exception: 6, the last of 2


def main():
    form, case, report_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    loader = make(case)
    w = dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2) if form != "bare" else None
    if w is not None:
        w.__enter__()
    source = w if form == "as" else loader
    asked = len(source) if case != "unasked" else None
    got = 0
    try:
        for _ in source:
            got += 1
            if case == "break" and got == 2:
                break
            if case == "exception" and got == 2:
                raise ValueError("the program's own error")
    except ValueError:
        pass
    if w is not None:
        w.__exit__(None, None, None)
    print(f"ASKED {asked} GOT {got}", flush=True)


if __name__ == "__main__":
    main()
