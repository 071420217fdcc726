"""The GPU's clocks, power and throttle reasons while a benchmark runs (NVML through ctypes).

Why: the same kernel timed alone and inside the forward can differ by 20 %
with identical inputs (the FP8 index scoring: 1.45x the bf16 keys alone,
1.18-1.26x in the forward).  A kernel that runs after seconds of dense GEMMs
may run at a lower SM clock (the board's power cap, thermal limits).  A
timing without the clock cannot tell that from a slower code path, so the
benchmarks that compare such figures record, for each timed window, the SM
and memory clocks, the board power and the reasons NVML gives for holding
the clock down.

One thread polls NVML every ``period_s`` (default 10 ms, about 50 µs of host
time a sample; NVML releases the GIL inside its calls).  The library is
``libnvidia-ml.so.1``, which every NVIDIA driver installs; no Python package
is needed.  Where it cannot be loaded (a CPU machine) :attr:`GpuState.why`
says so and every window is ``None``: a benchmark reports that and goes on.

    state = GpuState.start(torch.cuda.current_device())
    t0 = state.now(); run(); t1 = state.now()
    state.window(t0, t1)   # {"samples", "sm_mhz": {...}, "mem_mhz", "power_w", "temp_c", "throttle": [...]}
    state.stop()
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from typing import Callable

# nvmlClocksEventReasons (formerly ...ThrottleReasons) bits, as NVML documents them.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clocks_setting",
}
_CLOCK_SM, _CLOCK_MEM = 1, 2  # nvmlClockType_t
_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t

Sample = tuple  # (perf_counter s, sm MHz, mem MHz, power W, temperature C, reason bits)


def reason_names(bits: int) -> list[str]:
    """NVML's reason bits as names (an unknown bit as its hex value)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if bits & bit]
    rest = bits & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[Sample]) -> dict | None:
    """Medians and ranges of a window's samples; ``throttle``: every reason seen, with the share of samples."""
    if not samples:
        return None
    n = len(samples)
    seen: dict[str, int] = {}
    for s in samples:
        for name in reason_names(s[5]):
            seen[name] = seen.get(name, 0) + 1
    return {
        "samples": n,
        "sm_mhz": _stats([s[1] for s in samples]),
        "mem_mhz": _stats([s[2] for s in samples]),
        "power_w": _stats([s[3] for s in samples]),
        "temp_c": max(s[4] for s in samples),
        "throttle": {name: round(c / n, 3) for name, c in sorted(seen.items(), key=lambda kv: -kv[1])},
    }


def describe(summary: dict | None) -> str:
    """One log phrase: ``SM 1755 MHz (1650-1980), 690 W, 61 C, sw_power_cap 80 %``."""
    if summary is None:
        return "no clock samples"
    sm, pw = summary["sm_mhz"], summary["power_w"]
    text = f"SM {sm['median']:.0f} MHz ({sm['min']:.0f}-{sm['max']:.0f}), {pw['median']:.0f} W, {summary['temp_c']:.0f} C"
    held = [f"{name} {share:.0%}" for name, share in summary["throttle"].items() if name != "gpu_idle"]
    return text + (", " + ", ".join(held) if held else ", no throttle reason")


def _nvml_reader(cuda_index: int) -> Callable[[], Sample]:
    """A function returning one sample of the GPU that CUDA calls ``cuda_index``; raises OSError if NVML is absent."""
    lib = ctypes.CDLL("libnvidia-ml.so.1")

    def check(ret: int, what: str) -> None:
        if ret != 0:
            raise OSError(f"NVML {what} returned {ret}")

    check(lib.nvmlInit_v2(), "nvmlInit_v2")
    handle = ctypes.c_void_p()
    bus_id = _pci_bus_id(cuda_index)
    if bus_id is not None:  # CUDA's and NVML's device orders can differ: name the device by its PCI address
        check(lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle)), "GetHandleByPciBusId")
    else:
        check(lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(cuda_index), ctypes.byref(handle)), "GetHandleByIndex")
    sm, mem, power, temp = (ctypes.c_uint() for _ in range(4))
    reasons = ctypes.c_ulonglong()
    reasons_fn = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or lib.nvmlDeviceGetCurrentClocksThrottleReasons

    def read() -> Sample:
        t = time.perf_counter()
        lib.nvmlDeviceGetClockInfo(handle, _CLOCK_SM, ctypes.byref(sm))
        lib.nvmlDeviceGetClockInfo(handle, _CLOCK_MEM, ctypes.byref(mem))
        lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))
        lib.nvmlDeviceGetTemperature(handle, _TEMPERATURE_GPU, ctypes.byref(temp))
        reasons_fn(handle, ctypes.byref(reasons))
        return (t, sm.value, mem.value, power.value / 1000.0, temp.value, reasons.value)

    read()
    return read


def _pci_bus_id(cuda_index: int) -> str | None:
    try:
        import torch

        p = torch.cuda.get_device_properties(cuda_index)
        return f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - an older torch without the PCI fields: NVML's index order
        return None


class GpuState:
    """Polls one GPU's clocks on a daemon thread; :meth:`window` summarises the samples between two times."""

    def __init__(self, read: Callable[[], Sample] | None, period_s: float = 0.01, why: str | None = None):
        self.read, self.period_s, self.why = read, period_s, why
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, cuda_index: int = 0, period_s: float = 0.01) -> "GpuState":
        """A running sampler, or one that says why there is none (no NVML: a CPU machine)."""
        if os.environ.get("CPGRAPH_BENCH_NO_NVML"):
            return cls(None, period_s, "CPGRAPH_BENCH_NO_NVML is set")
        try:
            read = _nvml_reader(cuda_index)
        except (OSError, AttributeError) as exc:
            return cls(None, period_s, f"no NVML ({' '.join(str(exc).split())})")
        state = cls(read, period_s)
        state._thread = threading.Thread(target=state._poll, name="gpu-state", daemon=True)
        state._thread.start()
        return state

    @property
    def available(self) -> bool:
        return self.read is not None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception as exc:  # noqa: BLE001 - a failing read ends the sampling, never the benchmark
                self.why = f"NVML read failed: {' '.join(str(exc).split())}"
                return
            self._stop.wait(self.period_s)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def window(self, t0: float, t1: float) -> dict | None:
        """Summary of the samples taken in ``[t0, t1]`` (``None`` without samples)."""
        return summarize([s for s in list(self.samples) if t0 <= s[0] <= t1])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
