#!/usr/bin/env bash
# Stage Ray for the GPU machine (H200: Python 3.12, x86-64, no internet), for
# `fltune calibrate --ray` / `fltune verify --ray` there (benchmarks/h200_ray.sh).
#
# Why chunks: the ray wheel is ~76 MiB and a device call carries at most 64 MiB of working tree
# (the checkout itself, ~12 MiB, and .whl, ~5 MiB, included). So the wheel is split into parts
# and the parts, with the small wheels the GPU image lacks, are packed into folders .rc1 .. .rcN
# of at most RAY_CHUNK_MIB (default 40, never over 50) each, carried one per call while the
# machine stays warm; benchmarks/h200_ray.sh joins and installs them.
#
# What travels: ray==2.60.0 (cp312 manylinux2014) and jsonschema with its deps — the GPU image
# has ray's other requirements (click, filelock, msgpack, packaging, protobuf, pyyaml,
# requests; /work/.library/device/KINDS.md lists them).
#
# Run here, in the checkout, where pip reaches PyPI: scripts/stage-ray.sh
# Everything it writes (.raystage/, .rc1 ...) is ignored through .git/info/exclude.
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
cap_mib=${RAY_CHUNK_MIB:-40}
if [ "$cap_mib" -gt 50 ] || [ "$cap_mib" -lt 8 ]; then
  echo "stage-ray.sh: RAY_CHUNK_MIB=$cap_mib: use 8..50 (a call carries at most 64 MiB, the checkout included)" >&2
  exit 2
fi
stage=.raystage
exclude() { grep -qx "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude; }
exclude "$stage"
mkdir -p "$stage"
pkgs=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
      rpds-py==2026.9.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$stage" "${pkgs[@]}" 2>&1 | grep -v '^WARNING' || true
ls "$stage"/ray-2.60.0-cp312-*.whl >/dev/null 2>&1 \
  || { echo "stage-ray.sh: the ray 2.60.0 cp312 wheel did not download (see pip's output above)" >&2; exit 1; }
rm -rf .rc[0-9]*
n=$(python3 - "$stage" "$cap_mib" <<'PY'
import os, sys
sys.path.insert(0, "scripts")
from carry_pack import MiB, first_fit, link_bins, split
stage, cap = sys.argv[1], int(sys.argv[2]) * MiB
items = []
for f in sorted(os.listdir(stage)):
    if f.startswith("ray.part"):
        os.remove(os.path.join(stage, f))
for f in sorted(os.listdir(stage)):
    p = os.path.join(stage, f)
    if f.startswith("ray-") and f.endswith(".whl"):
        items += split(p, cap - MiB, lambda i: os.path.join(stage, f"ray.part{i}"))
        with open(os.path.join(stage, "RAY_WHEEL"), "w") as out:
            out.write(f + "\n")
        items.append(os.path.join(stage, "RAY_WHEEL"))
    elif f.endswith(".whl"):
        items.append(p)
print(link_bins(first_fit(items, cap), ".rc"))
PY
)
for k in $(seq 1 "$n"); do exclude ".rc$k"; done
du -sh .rc[0-9]*
echo
echo "Ray staged in $n folders of at most $cap_mib MiB. On the GPU machine, make these calls back to"
echo "back while it stays warm (each: carry the one folder named):"
python3 scripts/carry_pack.py calls .rc "$n" /tmp/raystage "bash benchmarks/h200_ray.sh"
echo "(benchmarks/h200_ray.sh joins the parts and installs Ray into /tmp/raysite once per machine;"
echo " .whl must hold a fltune wheel built from this checkout: pip wheel --no-deps -w .whl .)"
