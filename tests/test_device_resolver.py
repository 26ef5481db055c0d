"""One ``--device`` resolver (``store.device``): ``KEY | NAME[@DRIVER]`` everywhere.

A device calibrated under two drivers has two rows with one key: a name or key alone is
ambiguous there (and says how to choose), ``@DRIVER`` picks one — for ``freeze`` and
``report`` too, which used to be unable to choose.
"""
import pytest

from fltune.evaluate import report
from fltune.freeze import build_manifest
from fltune.store import CalibrationDB, DBError
from fltune.store.device import match_devices, parse_device_spec, resolve_device

DEV = {"device_key": "abc123def4567890", "device_type": "cuda", "name": "NVIDIA H200",
       "capability": "9.0", "sms": 132, "memory_bytes": 150 * 2**30, "runtime": "cuda 12"}


@pytest.fixture
def two_drivers(tmp_path):
    path = tmp_path / "two.db"
    db = CalibrationDB(path)
    db.upsert_device({**DEV, "driver": "570.1"})
    db.upsert_device({**DEV, "driver": "580.2"})
    db.upsert_device({**DEV, "device_key": "ffff000011112222", "name": "Other GPU",
                      "driver": "570.1"})
    db.close()
    return str(path)


def test_parse():
    assert parse_device_spec("H200@580.2") == ("H200", "580.2")
    assert parse_device_spec("abc1") == ("abc1", None)
    assert parse_device_spec("abc1@") == ("abc1", None)


def test_name_or_key_with_driver(two_drivers):
    db = CalibrationDB(two_drivers, create=False)
    try:
        rows = db.devices()
        assert len(match_devices(rows, "h200")) == 2          # name substring, any case
        assert len(match_devices(rows, "abc1")) == 2          # key prefix
        for spec in ("H200@580.2", "abc1@580.2"):
            r = resolve_device(db, spec)
            assert (r["device_key"], r["driver"]) == (DEV["device_key"], "580.2")
        with pytest.raises(DBError, match=r"matches 2 devices.*@DRIVER"):
            resolve_device(db, "H200")
        with pytest.raises(DBError, match="matches 0 devices"):
            resolve_device(db, "H200@999")
        assert resolve_device(db, "Other")["device_key"] == "ffff000011112222"
    finally:
        db.close()


def test_freeze_and_report_pick_one_driver(two_drivers):
    """Both now resolve NAME@DRIVER to that row (there are no winners in it, which is what
    they then say, naming the driver chosen)."""
    with pytest.raises(DBError, match="no winners for NVIDIA H200 .* driver 580.2"):
        build_manifest(two_drivers, device="H200@580.2")
    rep = report.build(two_drivers, device="H200@570.1")
    assert rep["device"]["driver"] == "570.1" and rep["rows"] == []
    with pytest.raises(DBError, match="matches 2 devices"):
        report.build(two_drivers, device="H200")
