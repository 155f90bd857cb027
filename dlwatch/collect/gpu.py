"""GPU utilisation and memory through NVML.  No NVML or no GPU is a quiet "unavailable".

NVML is initialised once per process; after a failure dlwatch does not retry on
every poll (a host without a driver would log the same error forever).  Whether a GPU
is expected at all is read from the NVIDIA device nodes (``/dev/nvidia0``...,
``/dev/nvidiactl``): on a machine without them, NVML missing explains nothing, and the
report keeps the fact as a quiet note (``quiet_notes``, shown with ``-v``).
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from dlwatch.model import GpuSample


_DEVICE_NODE = re.compile(r"nvidia([0-9]+|ctl)")


def nvidia_device_nodes(dev: str = "/dev") -> tuple[str, ...]:
    """The NVIDIA character devices in ``dev`` (``nvidia0``..., ``nvidiactl``): where the driver put
    them, a GPU is expected (a container given a GPU has them too).  Never raises."""
    try:
        names = sorted(n for n in os.listdir(dev) if _DEVICE_NODE.fullmatch(n))
    except OSError:
        return ()
    found = []
    for name in names:
        try:
            if stat.S_ISCHR(os.stat(os.path.join(dev, name)).st_mode):
                found.append(os.path.join(dev, name))
        except OSError:
            continue
    return tuple(found)


def gpu_notes(probe: "GpuProbe | None") -> tuple[list[str], list[str]]:
    """The report's notes on the GPUs and those of them that are quiet (shown with ``-v`` only):
    why no GPU is sampled, quiet where no NVIDIA device node says that one is expected."""
    if probe is None or not probe.unavailable:
        return [], []
    note = f"GPU: {probe.unavailable}"
    return [note], ([] if probe.expected else [note])


class GpuProbe:
    def __init__(self) -> None:
        self.unavailable: str | None = None  # why, once; None while it works
        self.expected = bool(nvidia_device_nodes())  # an NVIDIA device node exists on this machine
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            if not self._handles:
                self.unavailable = "NVML found no GPU"
        except ImportError:
            self.unavailable = "pynvml (nvidia-ml-py) is not installed"
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.unavailable = f"NVML unavailable: {type(exc).__name__}: {exc}".rstrip(": ")

    def sample(self) -> tuple[GpuSample, ...]:
        if self._nvml is None:
            return ()
        nv = self._nvml
        out = []
        for i, handle in enumerate(self._handles):
            name = util = used = total = None
            try:
                raw = nv.nvmlDeviceGetName(handle)
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
            except Exception:
                pass
            try:
                util = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                pass
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(mem.used), int(mem.total)
            except Exception:
                pass
            out.append(GpuSample(index=i, name=name, util_percent=util, memory_used=used, memory_total=total))
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
