"""Memory probes: MLX's own counters and the process footprint, per platform.

- MLX: active (live arrays), peak (since the last reset) and cache (freed buffers kept for reuse).
- Linux: VmRSS and VmHWM from /proc/self/status.
- macOS: phys_footprint through proc_pid_rusage, which is what Activity Monitor shows (RSS misses GPU memory).
"""

import ctypes
import os
import sys
from dataclasses import dataclass, asdict

from . import backend  # noqa: F401
import mlx.core as mx

GB = 1024 ** 3


class _RusageInfoV2(ctypes.Structure):
    _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [(n, ctypes.c_uint64) for n in (
        "user_time", "system_time", "pkg_idle_wkups", "interrupt_wkups", "pageins", "wired_size", "resident_size",
        "phys_footprint", "proc_start_abstime", "proc_exit_abstime", "child_user_time", "child_system_time",
        "child_pkg_idle_wkups", "child_interrupt_wkups", "child_pageins", "child_elapsed_abstime",
        "diskio_bytesread", "diskio_byteswritten")]


def process_footprint(pid=None) -> dict:
    """{'footprint': bytes, 'peak': bytes or None} for a process (this one by default)."""
    pid = pid or os.getpid()
    if sys.platform == "darwin":
        info = _RusageInfoV2()
        libc = ctypes.CDLL("/usr/lib/libSystem.dylib")
        if libc.proc_pid_rusage(pid, 2, ctypes.byref(info)) == 0:  # RUSAGE_INFO_V2
            return {"footprint": info.phys_footprint, "peak": None}
        return {"footprint": None, "peak": None}
    path = "/proc/self/status" if pid == os.getpid() else f"/proc/{pid}/status"
    vals = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    vals[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {"footprint": vals.get("VmRSS"), "peak": vals.get("VmHWM")}


def reset_footprint_peak():
    """Linux: reset VmHWM so that the next reading is the peak of the coming phase (writes 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class Snapshot:
    active: int
    peak: int
    cache: int
    footprint: int | None
    footprint_peak: int | None

    def as_dict(self):
        return asdict(self)


def snapshot() -> Snapshot:
    proc = process_footprint()
    return Snapshot(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(),
                    proc["footprint"], proc["peak"])


def fmt_gb(n) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"
