"""What crosses between dlwatch's processes, and the formats both sides agree on.

The run directory's files (``config`` writes config.json; ``heartbeat``: the mmap record the
loop writes and the monitor reads; ``events``: events.jsonl, one line per ``write``;
``dumps``: the faulthandler dump and crash files), the report directory and run ids
(``reportdir``), the job and rank of a process (``job``) and the playbook catalogue
(``playbooks``).

May import: only the shared helpers at the package's top.  Imported by every side.
"""
