"""Reading a result file as it is committed: plain or gzipped, named either way.

The instrument writes ``e2e-raw.json``; the repository stores raw files over 100 KB gzipped
(``benchmarks/results/README.md``: the checkout travels with every GPU call), and a README
that names ``e2e-raw.json`` means the ``.gz`` beside it. Every script that reads raw data
(``benchmarks/probe_check.py``, ``process_variance.py``, ``interleave_check.py``,
``profile_round_check.py``, ``compile_state_history.py``) once carried its own copy of the
gzip-or-plain opener, and each failed differently on a missing or truncated file (a
traceback, or a silent skip). One reader here: it takes either name, and a file it cannot
read raises :class:`ResultsFileError`, whose message names the file, what is wrong with it
and where such a file comes from.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib


class ResultsFileError(ValueError):
    """A result file that is missing, unreadable, not gzip where named so, or not JSON."""


def resolve(path: str) -> str:
    """``path`` if it exists, else ``path + ".gz"`` if that does (the committed form of a
    file a README names uncompressed); otherwise ``path`` unchanged."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        return path + ".gz"
    return path


#: the keys every instrument raw file has (``E2EResult.raw``); a summary
#: (``e2e-summary.json``) has ``points`` but not these
RAW_KEYS = ("baseline", "scenarios", "samples")


def read_json(path: str, *, require: tuple = RAW_KEYS,
              what: str = "an `fltune bench --e2e` raw file "
                          "(e2e-raw.json or e2e-raw.json.gz in its --out DIR)"):
    """The JSON document at ``path`` (gzipped when its name ends in ``.gz``), an object
    with the keys ``require`` (default: an instrument raw file's).

    ``what`` says in the error what the file should have been, so the message gives the
    way out (which file to pass) and not only the failure."""
    real = resolve(path)
    opener = gzip.open if real.endswith(".gz") else open
    try:
        with opener(real, "rt") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultsFileError(f"{path}: no such file (nor {path}.gz); give {what}") from None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:   # unreadable, not gzip
        raise ResultsFileError(f"{real}: cannot be read ({e}); give {what}") from None
    except json.JSONDecodeError as e:                                   # truncated, not JSON
        raise ResultsFileError(f"{real}: not JSON ({e}); give {what}") from None
    missing = [k for k in require if not isinstance(doc, dict) or k not in doc]
    if missing:
        hint = (" (an e2e-summary.json? its raw data is the e2e-raw.json[.gz] beside it)"
                if isinstance(doc, dict) and "points" in doc else "")
        raise ResultsFileError(f"{real}: JSON without {', '.join(map(repr, missing))}{hint}; "
                               f"give {what}")
    return doc
