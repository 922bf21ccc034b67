"""SM clock and board power while a benchmark runs, read through NVML (`nvidia-ml-py`, a bench-only
package) every 100 ms in a thread; read only, no setting is touched. The same kernel on the same
shapes taking longer is usually the GPU clocking down at its power limit, which only these show.

    with ClockSampler() as clocks:
        with clocks.window(res["run"]):
            run()          # res["run"]["gpu_clocks"] = {"sm_mhz_mean": ..., "power_w_mean": ..., ...}

Without NVML the windows record nothing and the benchmark runs on."""

import threading
import time
from contextlib import contextmanager

POWER_CAP, THERMAL = 0x4, 0x20 | 0x40  # SwPowerCap; Sw/HwThermalSlowdown (NVML's clocks event reasons)


class ClockSampler:
    def __init__(self, every_s: float = 0.1, gpu: int = 0):
        self.samples: list[tuple[float, float, float, float, int]] = []
        self.stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no package or no driver: figures without clocks
            self.nvml = None
            return
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu)
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def _run(self, every_s):
        n, h = self.nvml, self.handle
        reasons = (
            getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        )  # renamed in newer NVML
        while not self.stop.wait(every_s):
            self.samples.append(
                (
                    time.time(),
                    n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                    n.nvmlDeviceGetPowerUsage(h) / 1000,
                    n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    reasons(h),
                )
            )

    @contextmanager
    def window(self, into: dict, key: str = "gpu_clocks"):
        t0 = time.time()
        try:
            yield
        finally:
            t1 = time.time()
            s = [x for x in self.samples if t0 <= x[0] <= t1]
            if s:
                into[key] = {
                    "samples": len(s),
                    "sm_mhz_mean": round(sum(x[1] for x in s) / len(s)),
                    "sm_mhz_min": min(x[1] for x in s),
                    "sm_mhz_max": max(x[1] for x in s),
                    "power_w_mean": round(sum(x[2] for x in s) / len(s)),
                    "temp_c_max": max(x[3] for x in s),
                    "power_capped_fraction": round(sum(bool(x[4] & POWER_CAP) for x in s) / len(s), 2),
                    "thermal_fraction": round(sum(bool(x[4] & THERMAL) for x in s) / len(s), 2),
                }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.nvml is not None:
            self.stop.set()
            self.thread.join()
            self.nvml.nvmlShutdown()
