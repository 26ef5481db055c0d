"""fltune in SGLang: the general plugin (``plugin.register``, entry point
``sglang.srt.plugins``), the layer seams (``layers``) and, for the CPU test venv only, the
torchvision fix (``tvcompat``).

Importing this package imports neither SGLang nor torch (``tvcompat.install`` runs at every
interpreter start of the SGLang venv).
"""
