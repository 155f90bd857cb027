"""The monitor process and what only it runs.

``loop`` is the process (``python -I … dlwatch.monitor.loop RUN_DIR``): it polls the training
process and its workers, keeps the timeline (``timeline``), runs the detectors, assembles
incidents and feeds the sinks (``sinks``, ``outputs``, ``prom``, ``rankfigures``).
``forensics`` is the stall procedure (shared with ``dlwatch attach``).  ``finish`` runs in a
short-lived child of the training process when the monitor is gone at the end of a block.

May import: the shared helpers, ``wire``, ``collect``, ``detect``, ``report``.
"""
