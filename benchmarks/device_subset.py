"""A calibration DB holding one device's rows of another DB: its device row and its
engine-wide picks (session 36: the H100's capture-size pick, adjudicated into a copy of the
shipped H200 DB on the GPU machine, shipped as a DB of its own so each file in db/ is one
device's, as its name says). Only the tables a picks-only device has are copied: a device
with raced ops needs `fltune merge` of whole DBs instead, and this script refuses it.

    python3 benchmarks/device_subset.py SRC.db DEVICE_KEY OUT.db
"""
import os
import sys

from fltune.store.db import CalibrationDB


def main(src: str, key: str, out: str) -> int:
    if os.path.exists(out):
        sys.exit(f"{out} exists; pick a new file")
    s = CalibrationDB(src, create=False)
    try:
        devs = [d for d in s.devices() if d["device_key"] == key]
        if not devs:
            sys.exit(f"{src} has no device {key}")
        (dev,) = devs
        if s.winners(key, dev["driver"]):
            sys.exit(f"device {key} in {src} has raced ops: use `fltune merge`, not this")
        picks = s.engine_picks(key, dev["driver"])
    finally:
        s.close()
    o = CalibrationDB(out)
    try:
        o.upsert_device(dev)
        o.record_engine_picks(picks)
        print(f"{out}: {dev['name']} [{key}] driver {dev['driver']}, {len(picks)} engine pick(s)")
    finally:
        o.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
