"""The calibration store: the SQLite DB (``db.py``) and what its rows are keyed by — the
device, driver and software stack, and the one ``--device`` resolver (``device.py``).

Tune writes here and everything later (freeze, evaluate, cli) reads here; the store
imports nothing above it (only ``fltune.util``), so it can be used from any later stage.
"""
from .db import (BUSY_TIMEOUT_MS, DEFAULT_DB, SCHEMA_VERSION, CalibrationDB,  # noqa: F401
                 DBError, band_key)
from .device import device_row_for_this_machine, resolve_device  # noqa: F401
