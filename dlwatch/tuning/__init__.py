"""``dlwatch.tune`` and ``dlwatch tune``: measured DataLoader settings for the user's own pipeline.

Runs in the process that holds the loader (the user's script, or the program ``dlwatch tune``
started).  Each candidate configuration runs in a forked copy of that process, in its own
process group, so that nothing the candidates do (sampler draws, RNG streams, a dataset's
lazily opened files, a worker that hangs or dies) reaches the program or outlives the tune.

- ``space``: what is varied (``Config``) and what stays the loader's (``LoaderFacts``); the
  ladder of worker counts.
- ``driver``: what runs inside a candidate's process: builds the candidate loader over the
  same dataset, sampler, batch size, collate and worker_init_fn, and times it.
- ``guard``: starts a candidate, samples it with dlwatch's collectors (``collect.procfs``,
  ``collect.system``), stops it on a stall, a death or a limit, and leaves nothing behind.
- ``search``: the plan within the time budget (hill climb and bisection on ``num_workers``,
  prefetch variants, repeats, the epoch-start cost that ``persistent_workers`` saves).
- ``recommend``: pure: the measured rows and the step time in, the recommendation and its
  reasons out.
- ``iterable``: the IterableDataset rule (sample fingerprints across workers).
- ``result``, ``render``, ``page``: the result, its terminal table and its HTML page.
- ``api`` (``dlwatch.tune``), ``hook`` and ``_boot/`` (``dlwatch tune``'s hook in the script).

May import: the shared helpers, ``wire``, ``collect``, ``detect`` (the failure's playbook,
from the exception text), ``report`` (the page rules of report.html) and ``inproc.preflight``
(the fork-safety facts for the start-method advice).  Imported only by the package root
(``dlwatch.tune``, lazily) and ``cli/tune_cmd`` (tests/test_layout.py).
"""
