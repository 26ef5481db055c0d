"""scripts/carry_pack.py: the packing behind scripts/stage-{vllm,ray,sglang}.sh. A device call
carries at most 64 MiB with the checkout, so what travels must be cut and binned exactly:
a part lost or a folder over its cap costs a cold GPU machine."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import carry_pack  # noqa: E402


def test_split_parts_join_back_to_the_file(tmp_path):
    data = random.Random(0).randbytes(10_000)
    src = tmp_path / "big.whl"
    src.write_bytes(data)
    parts = carry_pack.split(str(src), 3_000, lambda i: str(tmp_path / f"p{i:02d}"))
    assert [os.path.getsize(p) for p in parts] == [3000, 3000, 3000, 1000]
    joined = b"".join(Path(p).read_bytes() for p in sorted(parts))
    assert hashlib.sha256(joined).digest() == hashlib.sha256(data).digest()


def test_first_fit_keeps_every_file_once_and_each_folder_under_its_cap(tmp_path):
    rng = random.Random(1)
    files = []
    for i in range(40):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * rng.randrange(1, 900))
        files.append(str(p))
    bins = carry_pack.first_fit(files, 1000)
    placed = [p for _, ps in bins for p in ps]
    assert sorted(placed) == sorted(files)
    for total, ps in bins:
        assert total == sum(os.path.getsize(p) for p in ps) <= 1000
    # first fit over sizes sorted largest first never leaves two folders that one would hold
    totals = sorted(t for t, _ in bins)
    assert len(totals) < 2 or totals[0] + totals[1] > 1000
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        n = carry_pack.link_bins(bins, ".c")
    finally:
        os.chdir(cwd)
    assert n == len(bins)
    assert sorted(f.name for k in range(1, n + 1) for f in (tmp_path / f".c{k}").iterdir()) \
        == sorted(Path(p).name for p in files)


def test_calls_carry_each_folder_once_and_the_last_with_the_wheels_and_the_run():
    lines = carry_pack.calls(".rc", 3, "/tmp/raystage", "bash run.sh")
    assert len(lines) == 3
    assert '[".rc1"]' in lines[0] and "cp .rc1/* /tmp/raystage/" in lines[0]
    assert "bash run.sh" not in lines[0] + lines[1]
    assert '[".rc3", ".whl"]' in lines[2] and lines[2].endswith(
        "cp .rc3/* /tmp/raystage/ && bash run.sh")


def _vllm_install_join() -> str:
    """The join loop of scripts/stage-vllm.sh's VLLM_INSTALL, as the script prints it and
    writes it into vllm-install.sh (its ``install=`` line)."""
    line = next(ln for ln in (ROOT / "scripts" / "stage-vllm.sh").read_text().splitlines()
                if ln.startswith("install='"))
    return line[line.index("for p in"):line.index("; done") + len("; done")]


def test_vllm_install_joins_a_cut_wheel_only_when_every_piece_is_there(tmp_path):
    data = random.Random(2).randbytes(10_000)
    whl = tmp_path / "v-1.whl"
    whl.write_bytes(data)
    parts = carry_pack.split_counted(str(whl), 3_000)     # as stage-vllm.sh cuts a wheel
    assert [Path(p).name for p in parts] == [f"v-1.whl.part{i:03d}of004" for i in range(4)]
    whl.unlink()
    held = tmp_path / "held"
    os.replace(tmp_path / "v-1.whl.part002of004", held)       # a call that never came
    join = _vllm_install_join()
    r = subprocess.run(["bash", "-c", join], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1 and "3 of 4 pieces of v-1.whl" in r.stdout
    assert not (tmp_path / "v-1.whl").exists()
    assert len(list(tmp_path.glob("v-1.whl.part*"))) == 3    # kept for the next try
    os.replace(held, tmp_path / "v-1.whl.part002of004")
    r = subprocess.run(["bash", "-c", join], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "v-1.whl").read_bytes() == data
    assert not list(tmp_path.glob("v-1.whl.part*"))
