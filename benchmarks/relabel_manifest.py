"""A DIAGNOSTIC, not a calibration: a manifest frozen for one device, re-labelled for this one.

    python3 benchmarks/relabel_manifest.py IN.json OUT.json

Why it exists: the GPU machine lent to a session is sometimes an H100 while the shipped DB
was measured on the H200. Serving that DB there is refused by design (`check_device`: a
pick measured on one device says nothing about another's speed), so the plugin serves
vanilla and the "calibrated" arm becomes a third A/A. Some questions do not depend on which
device measured the picks, only on what routing them does to the engine: session 30's
Qwen3-0.6B arm read 24-27 % slower by wall with its kernel time as fast, and what that costs
(compile ranges, CUDA-graph capture, host time) can be watched on any Hopper card. So this
copies the manifest, sets its device record and driver to this machine's, records where it
came from under ``relabelled_from``, and computes the fingerprint again.

Never ship or serve the result as a calibration: its speed claims are the other device's.
Figures taken with it say "relabelled" wherever they are reported.
"""
import sys

from fltune.dispatch.manifest import fingerprint_of, load_manifest, write_manifest
from fltune.store import device as devmod


def relabel(manifest: dict, me: dict) -> dict:
    """``manifest`` as if frozen on the device ``me`` describes (``store.device.current``)."""
    out = {k: v for k, v in manifest.items() if k != "fingerprint"}
    out["relabelled_from"] = {"device": manifest.get("device"), "driver": manifest.get("driver"),
                              "fingerprint": manifest.get("fingerprint")}
    out["device"] = {**(manifest.get("device") or {}),
                     **{k: me[k] for k in ("device_type", "name", "capability", "sms",
                                           "memory_bytes", "device_key") if k in me}}
    out["driver"] = me["driver"]
    out["fingerprint"] = fingerprint_of(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src = load_manifest(argv[0])
    me = devmod.current(src.get("device", {}).get("device_type"))
    out = relabel(src, me)
    write_manifest(out, argv[1])
    print(f"relabelled {argv[0]} ({src['device'].get('name')}, driver {src.get('driver')}) "
          f"for {devmod.label(me)} driver {me['driver']}: {argv[1]} (diagnostic only)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
