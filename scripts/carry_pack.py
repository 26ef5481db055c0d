"""Pack files into carry folders for the GPU machine's device calls (stage-vllm.sh,
stage-ray.sh, stage-sglang.sh).

A device call carries at most 64 MiB, the checkout itself included, so a large wheel
travels as parts and the files are spread over folders (``.ve1``, ``.rc1``, ``.sgc1``, …),
one folder a call, made back to back while the machine stays warm. The scripts differ in
what they download and how they name parts (each install step on the machine joins its
own names); the packing is this module's.
"""
from __future__ import annotations

import os
import sys

MiB = 2**20


def split(path: str, chunk: int, part_path) -> list:
    """``path`` cut into files of at most ``chunk`` bytes, named ``part_path(i)``."""
    parts = []
    with open(path, "rb") as src:
        i = 0
        while data := src.read(chunk):
            part = part_path(i)
            with open(part, "wb") as out:
                out.write(data)
            parts.append(part)
            i += 1
    return parts


def split_counted(path: str, chunk: int) -> list:
    """:func:`split` beside ``path``, each part named with its index and the count
    (``NAME.part003of009``), so that the join on the machine can tell a missing piece: on
    2026-12-02 a refused call left one out, and a join by ``NAME.part*`` made a wheel
    without it and deleted the rest (repaired there by hand)."""
    n = max(1, -(-os.path.getsize(path) // chunk))
    return split(path, chunk, lambda i: f"{path}.part{i:03d}of{n:03d}")


def first_fit(items: list, cap: int) -> list:
    """Folders of at most ``cap`` bytes: the files, largest first, each into the first
    folder with room. Returns ``[[total bytes, [paths]], ...]``."""
    bins: list = []
    for p in sorted(items, key=os.path.getsize, reverse=True):
        s = os.path.getsize(p)
        for b in bins:
            if b[0] + s <= cap:
                b[0] += s
                b[1].append(p)
                break
        else:
            bins.append([s, [p]])
    return bins


def link_bins(bins: list, prefix: str) -> int:
    """Hard-link each folder's files into ``<prefix>1``, ``<prefix>2``, …; returns the count."""
    for k, (_, paths) in enumerate(bins, 1):
        d = f"{prefix}{k}"
        os.makedirs(d, exist_ok=True)
        for p in paths:
            os.link(p, os.path.join(d, os.path.basename(p)))
    return len(bins)


def calls(prefix: str, n: int, dest: str, then: str) -> list:
    """The device calls that carry ``<prefix>1..n`` into ``dest`` there, one a call; the last
    also carries .whl and runs ``then``."""
    out = []
    for k in range(1, n + 1):
        carry = f'["{prefix}{k}"]' if k < n else f'["{prefix}{k}", ".whl"]'
        cmd = f"mkdir -p {dest} && cp {prefix}{k}/* {dest}/" + (f" && {then}" if k == n else "")
        out.append(f"  {k}/{n}  carry {carry:<22} command: {cmd}")
    return out


if __name__ == "__main__":            # carry_pack.py calls PREFIX N DEST THEN
    if len(sys.argv) != 6 or sys.argv[1] != "calls":
        sys.exit("usage: carry_pack.py calls PREFIX N DEST THEN")
    print("\n".join(calls(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])))
