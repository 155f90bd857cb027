"""What runs in the training process and its DataLoader workers.

``agent/`` is ``dlwatch.watch`` and ``dlwatch run``'s watch, one module per role (see its
``__init__``); ``worker_hook`` runs first in every worker; ``runhook`` and
``_boot/`` are ``dlwatch run``'s hook and bootstrap; ``preflight``, ``shapes`` and ``rngcheck``
are the cheap checks made where the data is.  Everything here must leave the user's program
as it is (docs/design.md, "Do no harm").

May import: the shared helpers at the package's top, ``dlwatch.wire`` and ``dlwatch.collect``.
Never ``monitor``, ``detect``, ``report`` or ``cli`` (tests/test_layout.py): judging and
rendering happen in the monitor and the CLI.  Imported only by the package root and
``cli/run_cmd``.
"""
