"""Freeze: the calibration DB -> the frozen dispatch manifest (``build.py``).

A stage of its own because it is the only reader of the DB that decides: everything that
serves (the vLLM plugin, ``fltune serve``, frozen dispatch) reads the manifest it writes and
never the DB, and everything that evaluates (``evaluate/``) compares against it.
"""
from .build import (NATIVE_COMPILED, ORDERS, StackMismatch, build_manifest,  # noqa: F401
                    check_device, fl_pick_row, key_shape, manifest_for_this_device,
                    stack_differences, write_manifest)
