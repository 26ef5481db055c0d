"""``fltune.evaluate.results_file.read_json``: the one reader of committed result files
(plain or gzipped, named either way), and the message a bad file gets."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fltune.evaluate.results_file import ResultsFileError, read_json, resolve

ROOT = Path(__file__).resolve().parent.parent
DOC = {"baseline": "vanilla", "scenarios": [], "samples": [{"arm": "vanilla", "time_s": 0.5}]}


def test_plain_and_gzipped_read_alike(tmp_path):
    plain = tmp_path / "e2e-raw.json"
    plain.write_text(json.dumps(DOC))
    packed = tmp_path / "other-raw.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump(DOC, f)
    assert read_json(str(plain)) == DOC
    assert read_json(str(packed)) == DOC


def test_uncompressed_name_finds_the_committed_gz(tmp_path):
    # a README names e2e-raw.json; the repository holds e2e-raw.json.gz
    with gzip.open(tmp_path / "e2e-raw.json.gz", "wt") as f:
        json.dump(DOC, f)
    name = str(tmp_path / "e2e-raw.json")
    assert resolve(name) == name + ".gz"
    assert read_json(name) == DOC
    # where both exist the name given wins
    (tmp_path / "e2e-raw.json").write_text(json.dumps({**DOC, "plain": True}))
    assert read_json(name)["plain"] is True


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    (b'{"baseline": "vani', "not JSON"),                 # truncated JSON
])
def test_bad_file_names_itself_and_the_way_out(tmp_path, content, says):
    p = tmp_path / "e2e-raw.json"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(ResultsFileError) as e:
        read_json(str(p))
    msg = str(e.value)
    assert str(p) in msg and says in msg and "--out DIR" in msg


def test_gz_that_is_not_gzip_or_is_cut(tmp_path):
    fake = tmp_path / "fake.json.gz"
    fake.write_text(json.dumps(DOC))                  # named .gz, plain inside
    whole = gzip.compress(json.dumps(DOC).encode())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(whole[: len(whole) // 2])         # a copy that stopped midway
    for p in (fake, cut):
        with pytest.raises(ResultsFileError, match="cannot be read"):
            read_json(str(p))


@pytest.mark.parametrize("script", ["process_variance.py", "probe_check.py",
                                    "interleave_check.py", "profile_round_check.py"])
def test_scripts_refuse_a_bad_raw_file_with_the_message(tmp_path, script):
    bad = tmp_path / "e2e-raw.json"
    bad.write_text('{"samples": [')
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert str(bad) in r.stderr and "not JSON" in r.stderr


def test_a_summary_given_for_the_raw_file_is_named_so(tmp_path):
    summary = tmp_path / "e2e-summary.json"
    summary.write_text(json.dumps({"device": "H100", "points": []}))
    with pytest.raises(ResultsFileError) as e:
        read_json(str(summary))
    msg = str(e.value)
    assert "'samples'" in msg and "e2e-summary.json?" in msg and "--out DIR" in msg
    # a caller that reads another kind of file says what it needs
    assert read_json(str(summary), require=("points",))["device"] == "H100"
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ResultsFileError, match="JSON without"):
        read_json(str(listed))
