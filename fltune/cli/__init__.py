"""The ``fltune`` command (``main.py``: the argument parser and one thin driver per verb)
and all of its screen output (``render.py``: the only module that imports rich).

The console script is ``fltune = "fltune.cli:main"``; ``python -m fltune`` and
``python -m fltune.cli`` run the same ``main``.
"""
from .main import main  # noqa: F401
