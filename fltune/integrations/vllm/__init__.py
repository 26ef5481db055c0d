"""fltune in vLLM: the general plugin (``plugin.register``), the op seams (``ops``), the
``load_model`` hook (``hooks``) and ``fltune serve`` (``serve``).

Importing this package imports neither vLLM nor the custom ops; ``plugin`` does the latter.
"""
