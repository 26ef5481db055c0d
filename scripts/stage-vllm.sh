#!/usr/bin/env bash
# Stage vLLM 0.24.0 (+ what the GPU image lacks: scripts/vllm-0.24-deps.txt, tested on the H200)
# for the GPU machine, in folders .ve1 .. .veN that each fit one device call.
#
# Why a cap computed here: a call carries at most 64 MiB *including the checkout itself*
# (tracked and untracked-not-ignored files). On 2026-12-01 chunks of 51 MiB that had fitted
# earlier were refused once the checkout had grown to ~15 MiB, and the machine went cold while
# they were re-cut. So each folder gets 64 MiB - the checkout - VE_MARGIN_MIB (default 4: the
# last call also carries .whl, ~7 MiB, so that folder is cut smaller; session 18: 6 left under 16 MiB a call beside a 36 MiB checkout, 4 fitted it in 17 calls; session 19
# gzipped the big raw results: a 27 MiB checkout, 12 calls).
#
# Budget (session 46): a device call that finds no machine is not free. A refusal that
# tried to start one cost 90-180 s of the session's 30 minutes (a refusal inside the
# "none is tried" window, 15 s); twenty calls over 85 minutes (ten of them tries to
# start one) spent 1156 s and got none.
# Staging costs ~100-250 s and a measuring call up to 600: below ~800 s left, a lent
# machine can no longer stage and measure, so stop trying there and say so.
#
# Run here, in the checkout, where pip reaches PyPI (downloads ~330 MB once into .vstage/):
#   scripts/stage-vllm.sh            # prints the calls to make back to back on a warm machine
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
stage=.vstage
exclude() { grep -qxF "/$1/" .git/info/exclude 2>/dev/null || echo "/$1/" >> .git/info/exclude; }
exclude "$stage"; exclude ".ve[0-9]*"
mkdir -p "$stage"
if ! ls "$stage"/vllm-0.24.0-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux1_x86_64 -d "$stage" vllm==0.24.0 \
    $(grep -v '^#' scripts/vllm-0.24-deps.txt) 2>&1 | grep -v '^WARNING' || true
fi
ls "$stage"/vllm-0.24.0-*.whl >/dev/null 2>&1 \
  || { echo "stage-vllm.sh: the vLLM 0.24.0 wheel did not download (pip's output above)" >&2; exit 1; }
tree_kib=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
            | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1 || true)  # deleted files: du errs
[ -n "$tree_kib" ] || { echo "stage-vllm.sh: could not size the checkout" >&2; exit 1; }
whl_kib=$(du -sk .whl 2>/dev/null | cut -f1); whl_kib=${whl_kib:-0}
margin_mib=${VE_MARGIN_MIB:-4}
n=$(python3 - "$stage" "$tree_kib" "$whl_kib" "$margin_mib" <<'PY'
import os, sys
sys.path.insert(0, "scripts")
from carry_pack import MiB, first_fit, link_bins, split_counted
stage, tree_kib, whl_kib, margin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cap = 64 * MiB - tree_kib * 1024 - margin * MiB
last_cap = cap - whl_kib * 1024                # the last folder travels with .whl
if last_cap < 16 * MiB:
    sys.exit(f"stage-vllm.sh: the checkout ({tree_kib // 1024} MiB) and .whl "
             f"({whl_kib // 1024} MiB) leave under 16 MiB a call")
# the earlier cut's folders go only now that this one fits (session 18: a check that failed
# after they were removed left the checkout with none)
import glob, shutil
for d in glob.glob(".ve[0-9]*"):
    shutil.rmtree(d)
for f in sorted(os.listdir(stage)):
    if f.startswith("vpart") or f == "VLLM_WHEEL" or ".whl.part" in f:   # an earlier cut
        os.remove(os.path.join(stage, f))
items = []
for f in sorted(os.listdir(stage)):
    p = os.path.join(stage, f)
    if not f.endswith(".whl"):
        continue
    if os.path.getsize(p) > cap - MiB:
        # a wheel larger than one call (vLLM's; xgrammar, 43 MiB, was refused on 2026-12-01
        # once the checkout had grown to 25 MiB): cut, joined back by VLLM_INSTALL
        # (each piece named with the count: VLLM_INSTALL joins only when all are there)
        items += split_counted(p, cap - MiB)
    else:
        items.append(p)
bins = sorted(first_fit(items, cap), key=lambda b: -b[0])   # the smallest last: beside .whl
if bins and bins[-1][0] > last_cap:
    bins.append([0, []])
n = link_bins(bins, ".ve")
if not bins[-1][1]:                            # so that the call's `cp .veN/*` finds a file
    with open(f".ve{n}/ONLY_WHL", "w") as out:
        out.write("nothing but .whl travels in this call\n")
print(n)
PY
)
du -sh .ve[0-9]* | tr '\n' ' '; echo
echo "checkout ${tree_kib} KiB, .whl ${whl_kib} KiB. On the GPU machine make these calls back to back"
echo "(within ~30 s of each other, or it goes cold), each carrying the one folder named; each costs"
echo "5-25 s of device time (session 13: ~150 s for all on one machine, ~250 s on another;"
echo "session 14: ~5 s each, 108 s in all with the cold start, when issued as one batch of calls), and"
echo "nothing else fits beside a folder: carry .fiaot/ in a call of its own"
python3 scripts/carry_pack.py calls .ve "$n" /tmp/stage "VLLM_INSTALL; <your run>"
# (a join runs only where parts are left, so a second try after a failed pip install does
# not truncate the joined wheel; a failed join stops the install)
install='( [ -d /tmp/vsite/vllm ] || (cd /tmp/stage && for p in $(ls *.whl.part000of* 2>/dev/null); do b=${p%.part000of*}; n=${p##*of}; h=$(ls $b.part*of$n | wc -l); [ $h -eq $((10#$n)) ] || { echo "VLLM_INSTALL: $h of $((10#$n)) pieces of $b here: a staging call is missing; its pieces are kept"; exit 1; }; cat $(ls $b.part*of$n | sort) > $b && rm $b.part*of$n || exit 1; done && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite ./*.whl) )'
echo "VLLM_INSTALL = $install"
# the last call's command as a file (ignored), so that it is not pasted by hand each session
# (sessions 35-44 kept it as s35.sh): carry [".ve$n", ".whl", "vllm-install.sh"] and run
# `bash vllm-install.sh && <your run>` (h200_s7.sh's preamble then installs .whl itself)
grep -qxF /vllm-install.sh .git/info/exclude 2>/dev/null || echo /vllm-install.sh >> .git/info/exclude
printf '%s\n' "# written by scripts/stage-vllm.sh: the last staging call's copy, then the install" \
  "mkdir -p /tmp/stage && cp .ve$n/* /tmp/stage/ && $install" > vllm-install.sh
echo "wrote vllm-install.sh: the last call is carry [\".ve$n\", \".whl\", \"vllm-install.sh\"], command \`bash vllm-install.sh && <your run>\`"
