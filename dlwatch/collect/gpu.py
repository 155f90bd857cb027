"""GPU utilisation and memory through NVML.  No NVML or no GPU is a quiet "unavailable".

NVML is initialised once per process; after a failure dlwatch does not retry on
every poll (a host without a driver would log the same error forever).
"""

from __future__ import annotations

from typing import Any

from dlwatch.model import GpuSample


class GpuProbe:
    def __init__(self) -> None:
        self.unavailable: str | None = None  # why, once; None while it works
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
