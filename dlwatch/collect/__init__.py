"""Readers: what the monitor and the CLI measure, as plain frozen dataclasses in raw units.

``procfs`` (per process), ``system`` (meminfo, /dev/shm, cgroups), ``gpu`` (NVML), ``stacks``
(py-spy), ``faultdump`` (the monitor's half of the faulthandler fallback), ``syscalls`` (the one
table per architecture), ``bounds`` and ``pidhandle`` (reading and signalling safely),
``rundir`` (attach's reader of another user's run directory), ``runstats`` and ``growth``
(figures and trends over what was read).  No judgement here.

May import: the shared helpers and ``wire``.
"""
