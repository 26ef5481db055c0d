"""The frozen-dispatch manifest: one type for what ``freeze`` writes and the plugin, bench
and frozen dispatch read.

Why a type: the manifest used to be a dict assembled in one function and read in four
places, one of them by position (``p[3]``, ``p[4]`` of a point), so a field added or moved
on the writing side broke a reader silently. Here every field has a name
(:class:`Manifest` > :class:`OpEntry` > :class:`Table` > :class:`Band` / :class:`Point`),
``to_json``/``from_json`` are the only places that know the on-disk shape, and the format
carries a version (:data:`MANIFEST_FORMAT`).

On disk the format is unchanged (``fltune.manifest/1``): a point is still the compact list
``[lo, hi, winner, winner µs, native-compiled µs]`` (tables hold one per measured band),
and optional band fields (``refined``, ``coarse_hi``, ``crossover_probes``) appear only
where set — so shipped manifests keep their bytes and their fingerprints. ``from_json``
is tolerant of fields an older manifest lacks (``points``, ``weight``, ``shadowed``).

The fingerprint is sha256 over the canonical JSON of everything but the fingerprint: it is
the value vLLM's compile-cache key receives, so a different choice never reuses a graph.

This module sits in ``dispatch`` (the lowest stage that reads a manifest) and imports
nothing above it; the device comparison takes this machine's record as an argument so that
dispatch need not import the store.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from ..util import write_json_atomic

MANIFEST_FORMAT = "fltune.manifest/1"


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file/problem and the fix."""


# ---- the type --------------------------------------------------------------------------

@dataclass
class Band:
    """Token counts ``lo..hi`` (inclusive) go to ``impl_id``; adjacent measured bands with
    the same winner are merged (``merged`` counts them; times are the top band's)."""
    lo: int
    hi: int
    impl_id: str
    kind: Optional[str] = None
    vendor: Optional[str] = None
    callable: Optional[str] = None
    median_us: Optional[float] = None
    runner_up: Optional[str] = None
    runner_up_us: Optional[float] = None
    gap: Optional[float] = None
    merged: int = 1
    # set where ``fltune refine`` moved the edge to a measured crossover
    refined: Optional[bool] = None
    coarse_hi: Optional[int] = None
    crossover_probes: Optional[list] = None

    _OPTIONAL = ("refined", "coarse_hi", "crossover_probes")

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("lo", "hi", "impl_id", "kind", "vendor",
                                             "callable", "median_us", "runner_up",
                                             "runner_up_us", "gap", "merged")}
        for k in self._OPTIONAL:
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Band":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Point:
    """One measured band before merging: its winner's time and the native compiled path's
    (what the plugin weighs a routed op's win against)."""
    lo: int
    hi: int
    impl_id: str
    median_us: Optional[float]
    native_us: Optional[float]

    def to_json(self) -> list:
        return [self.lo, self.hi, self.impl_id, self.median_us, self.native_us]

    @classmethod
    def from_json(cls, p) -> "Point":
        if isinstance(p, dict):
            return cls(p["lo"], p["hi"], p["impl_id"], p.get("median_us"), p.get("native_us"))
        return cls(*p)


@dataclass
class Table:
    """One (dtype, signature) of an op: ordered bands keyed at run time by (dtype, trailing
    shape of the key argument); rows = tokens x ``rows_per_token``."""
    dtype: str
    signature: str
    bands: list
    dims: dict = field(default_factory=dict)
    trailing: list = field(default_factory=list)
    rows_per_token: int = 1
    weight: int = 1
    points: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.dtype, tuple(self.trailing))

    def point_at(self, tokens: int) -> Optional[Point]:
        return next((p for p in self.points if p.lo <= tokens <= p.hi), None)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "signature": self.signature, "dims": self.dims,
                "trailing": list(self.trailing), "rows_per_token": self.rows_per_token,
                "weight": self.weight, "bands": [b.to_json() for b in self.bands],
                "points": [p.to_json() for p in self.points]}

    @classmethod
    def from_json(cls, d: dict) -> "Table":
        return cls(dtype=d["dtype"], signature=d.get("signature", ""),
                   bands=[Band.from_json(b) for b in d.get("bands", [])],
                   dims=d.get("dims", {}), trailing=list(d.get("trailing", [])),
                   rows_per_token=d.get("rows_per_token", 1), weight=d.get("weight") or 1,
                   points=[Point.from_json(p) for p in d.get("points", [])])


@dataclass
class OpEntry:
    """An op's tables, the signatures another table serves (``shadowed``), the fallback
    for arguments no table matches, and whether every band is the native path."""
    tables: list
    fallback: str
    shadowed: list = field(default_factory=list)
    native_everywhere: bool = False

    def impl_ids(self) -> list:
        """Every band's implementation, or the fallback when there is no band."""
        return [b.impl_id for t in self.tables for b in t.bands] or [self.fallback]

    def to_json(self) -> dict:
        return {"tables": [t.to_json() for t in self.tables], "shadowed": self.shadowed,
                "fallback": self.fallback, "native_everywhere": self.native_everywhere}

    @classmethod
    def from_json(cls, d: dict) -> "OpEntry":
        return cls(tables=[Table.from_json(t) for t in d.get("tables", [])],
                   fallback=d["fallback"], shadowed=list(d.get("shadowed", [])),
                   native_everywhere=bool(d.get("native_everywhere", False)))


@dataclass
class Manifest:
    device: dict
    driver: Optional[str]
    ops: dict                                   # op name -> OpEntry
    stack: list = field(default_factory=list)
    policy: dict = field(default_factory=dict)
    order: str = "measured"
    fl_substitutions: list = field(default_factory=list)
    band_rule: Any = None
    source_db: dict = field(default_factory=dict)
    overrides: list = field(default_factory=list)
    launch_floor_us: Optional[float] = None
    format: str = MANIFEST_FORMAT
    fingerprint: Optional[str] = None

    _FIELDS = ("format", "device", "driver", "stack", "policy", "order", "fl_substitutions",
               "band_rule", "source_db", "ops", "overrides", "launch_floor_us")

    def to_json(self) -> dict:
        """The on-disk dict, fingerprint computed over the rest."""
        d = {k: getattr(self, k) for k in self._FIELDS}
        d["ops"] = {op: e.to_json() for op, e in self.ops.items()}
        d["fingerprint"] = fingerprint_of(d)
        return d

    @classmethod
    def from_json(cls, d: dict, source: str = "manifest", verify: bool = True) -> "Manifest":
        if verify:
            verify_manifest(d, source)
        try:
            ops = {op: OpEntry.from_json(e) for op, e in d["ops"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"{source}: malformed manifest ({type(e).__name__}: {e}); "
                                f"re-create it with {refreeze_command(d, source)}") from None
        return cls(device=d.get("device") or {}, driver=d.get("driver"), ops=ops,
                   stack=d.get("stack", []), policy=d.get("policy", {}),
                   order=d.get("order", "measured"),
                   fl_substitutions=d.get("fl_substitutions", []),
                   band_rule=d.get("band_rule"), source_db=d.get("source_db", {}),
                   overrides=d.get("overrides", []),
                   launch_floor_us=d.get("launch_floor_us"),
                   format=d.get("format", MANIFEST_FORMAT), fingerprint=d.get("fingerprint"))

    def table_for(self, op: str, dtype: str, trailing) -> Optional[Table]:
        """The table that serves (dtype, trailing shape) for ``op``, if any."""
        e = self.ops.get(op)
        if e is None:
            return None
        return next((t for t in e.tables if t.key == (dtype, tuple(trailing))), None)


# ---- fingerprint, check, load, write ---------------------------------------------------

def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint_of(manifest: dict) -> str:
    """sha256 over the canonical JSON of everything but the fingerprint itself."""
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def refreeze_command(manifest, out) -> str:
    """A complete ``fltune freeze`` command that writes ``out`` again: from the DB the
    manifest says it was frozen from when that is known, else from the default DB (which
    ``fltune freeze`` itself uses without ``--db``). Hints must run as printed."""
    src = manifest.get("source_db") if isinstance(manifest, dict) else None
    db = src.get("path") if isinstance(src, dict) else None
    target = out if out and out not in ("manifest",) and not str(out).startswith(
        "manifest frozen") else "manifest.json"
    return f"`fltune freeze{f' --db {db}' if db else ''} --out {target}`"


def verify_manifest(manifest: dict, source: str = "manifest") -> None:
    """The format is one this fltune reads, and the content matches its fingerprint."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{source}: not an fltune manifest (format "
                            f"{manifest.get('format') if isinstance(manifest, dict) else '?'!r}, "
                            f"expected {MANIFEST_FORMAT!r}); make one with "
                            f"{refreeze_command(None, source)}")
    want = manifest.get("fingerprint")
    got = fingerprint_of(manifest)
    if want != got:
        raise ManifestError(f"{source}: fingerprint mismatch (recorded {str(want)[:12]}, content "
                            f"{got[:12]}): the file was edited after freezing; re-run "
                            f"{refreeze_command(manifest, source)} instead of editing it")


def load_manifest(path: str) -> dict:
    """The manifest at ``path`` as its JSON dict, verified (see :func:`verify_manifest`)."""
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} not found; create it with "
                            f"{refreeze_command(None, path)}") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {path} is not valid JSON ({e}); re-create it with "
                            f"{refreeze_command(None, path)}") from None
    verify_manifest(m, path)
    return m


def write_manifest(manifest: dict, path: str) -> None:
    """Atomically: a vLLM worker reading it never sees half a manifest."""
    write_json_atomic(path, manifest, indent=1, sort_keys=True)


def device_mismatch(manifest: dict, me: dict, cuda_available: bool) -> Optional[str]:
    """None if ``manifest`` was measured on the device and driver ``me`` describes (this
    machine's record, ``store.device.current``), else why not."""
    d = manifest.get("device", {})
    if d.get("device_type") == "cuda" and not cuda_available:
        return (f"manifest is for {d.get('name')} [{d.get('device_key')}], a CUDA device; "
                f"this machine has none")
    if d.get("device_key") != me["device_key"]:
        return (f"manifest is for {d.get('name')} [{d.get('device_key')}], this machine is "
                f"{me['label']} [{me['device_key']}]")
    if manifest.get("driver") != me["driver"]:
        return f"manifest is for driver {manifest.get('driver')}, this machine has {me['driver']}"
    return None
