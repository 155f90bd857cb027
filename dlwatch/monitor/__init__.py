"""The monitor process and what only it runs.

``loop`` is the process (``python -I … dlwatch.monitor.loop RUN_DIR``): it polls the training
process and its workers and hands what it reads to its rooms: ``sampling`` (the tracked
processes and each poll's reads), ``incidents`` (every incident, assembled and written),
``program`` (`dlwatch run`'s segments), ``runsummary`` (the run summary), ``journal`` (the
timeline and the monitor's notes), ``settings`` (config.json); it runs the detectors, handles the
events declared in ``dlwatch.wire.contract`` and feeds the sinks (``sinks``, ``outputs``,
``prom``, ``rankfigures``).  ``timeline`` writes a poll's sample line.  ``forensics`` is the stall
procedure (shared with ``dlwatch attach``).  ``finish`` runs in a short-lived child of the
training process when the monitor is gone at the end of a block.

May import: the shared helpers, ``wire``, ``collect``, ``detect``, ``report``.
"""
