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

Route decisions (``route_decisions``, :class:`RouteDecision`): per model and op, whether the
vLLM plugin routes the op ('route') or leaves vLLM's own path ('native'), as decided from
end-to-end model-step measurements on the device (``evaluate/model_step.py``). The key is
written only when the device has decisions, so an older manifest keeps its bytes; when it
is there it is in the fingerprint like everything else (a new decision is a new choice,
and so a new compile-cache key).

Per token range (``fltune adjudicate --per-range``): a decision may cover only the token
range ``min_tokens``..``max_tokens`` (``max_tokens`` None: no upper bound), one of vLLM's
compile ranges; an op then has one decision per range. The two keys are written only when
a decision does not cover the whole range, so a manifest without split decisions keeps its
bytes and fingerprint; written, they are in the fingerprint. :meth:`Manifest.ranges_for`
gives an op's ranges; :meth:`Manifest.decisions_for` one decision per op, where a split op
with routed and native ranges reads 'native' unless every range routes (the rule for a
seam that cannot serve per range) and carries its ranges (``RouteDecision.ranges``) for the
seams that can (the vLLM plugin: ``integrations/vllm/plugin.py``).

Engine-wide picks (``engine_picks``, :class:`EnginePick`): per model and engine-wide vLLM
setting (``attention_backend``, ``gdn_prefill_backend``, ...), the value measured fastest
against vLLM's own default ('pick') or vLLM's default kept ('default'), from
``evaluate/engine_pick.py``. Like route decisions, the key is written only when the device
has picks (older manifests keep their bytes and fingerprints; a reader of an older manifest
sees none) and is in the fingerprint when present. ``fltune serve`` applies a model's picks
as engine arguments.

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


# ---- what counts as vLLM's own path, and which model is served ----------------------------

#: impl-id prefixes of the implementations that are vLLM's own path, or PyTorch code vLLM
#: would compile anyway: an op whose winners all carry one is left native (not routed)
NATIVE_PREFIXES = ("reference.", "native.", "inductor.")


def is_native(impl_id: str) -> bool:
    """Whether ``impl_id`` is vLLM's own path or PyTorch code (see :data:`NATIVE_PREFIXES`)."""
    return str(impl_id).startswith(NATIVE_PREFIXES)


#: the config facts a model key is made of (text config of a multimodal model)
MODEL_KEY_FIELDS = (("hidden_size", "h"), ("intermediate_size", "i"),
                    ("num_hidden_layers", "L"), ("num_attention_heads", "a"),
                    ("num_key_value_heads", "kv"), ("head_dim", "d"))


def _get(cfg, name):
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def model_key(config, tp: int = 1) -> str:
    """The key a route decision is stored under: the model's architecture and the
    dimensions that fix its ops' shapes and its step's cost, e.g.
    ``Qwen3ForCausalLM:h64:i128:L2:a4:kv2:d16``, and the tensor-parallel size when it is
    above 1 (``...:d16:tp2``).

    Why these facts and not a name or a path: the plugin must recognise the model it
    serves from what vLLM hands it (``vllm_config.model_config.hf_config``), and the
    adjudication from a built-in profile or a config directory; a name or a path differs
    between the two (a profile name, a HF repo id, a local checkout), while the HF config's
    architectures and dimensions are the same in all of them. Weights do not enter: the
    step's cost does not depend on their values (measured with dummy weights, served with
    real ones). Two checkpoints of one architecture and size (a base and its instruct
    tune) share the key, rightly: their steps cost the same. ``config`` is the HF config
    as a dict or an object (``PretrainedConfig``); a multimodal model's dimensions are read
    from its ``text_config``.

    Why the TP size: a decision is a measurement of the model step in its context, and
    at TP > 1 the context is another one: every rank has its own shapes (a half of the
    MLP, of the heads), an all-reduce follows the row-parallel layers, and vLLM fuses
    that all-reduce with the next RMSNorm (``fuse_allreduce_rms``, on by default on
    Hopper with FlashInfer) only while the norm is its own op. A routed norm breaks
    that fusion, which no TP=1 run can see (H200, TP=2: FLTUNE_ROUTE=all made the
    2048-token prefill step 0.90x of vanilla, ``benchmarks/results/h200-2026-12-01-s8``).
    So a TP=1 decision does not carry over: TP=1 keys are unchanged (no suffix), and at
    TP=N the plugin looks for ``:tpN`` decisions, i.e. ``fltune adjudicate --engine
    '{"tensor_parallel_size": N}'``; without one the op stays on vLLM's path."""
    archs = _get(config, "architectures") or []
    text = _get(config, "text_config") or _get(config, "text_config_dict") or config
    parts = [",".join(archs) if archs else str(_get(config, "model_type") or "?")]
    for name, tag in MODEL_KEY_FIELDS:
        v = _get(text, name)
        if v is None and text is not config:
            v = _get(config, name)
        if v is None and name == "head_dim":       # HF's default where the config omits it
            h, a = _get(text, "hidden_size"), _get(text, "num_attention_heads")
            v = h // a if h and a else None
        if v is not None:
            parts.append(f"{tag}{int(v)}")
    if int(tp or 1) > 1:
        parts.append(f"tp{int(tp)}")
    return ":".join(parts)


def tp_of_key(key: Optional[str]) -> int:
    """The tensor-parallel size a :func:`model_key` names (``…:tpN``; 1 without it)."""
    last = (key or "").rsplit(":", 1)[-1]
    return int(last[2:]) if last.startswith("tp") and last[2:].isdigit() else 1


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
class RouteDecision:
    """Whether the plugin routes ``op`` when it serves ``model`` (a :func:`model_key`):
    ``decision`` 'route' or 'native', with the reason, the rule's version, a short summary
    of the evidence (per scenario: ratio median and CI) and the implementations the
    measured arm routed (a later calibration that changed them makes the decision stale:
    ``freeze`` drops it)."""
    model: str
    op: str
    decision: str
    reason: str = ""
    rule: str = ""
    model_name: Optional[str] = None
    routed_impls: list = field(default_factory=list)
    evidence: list = field(default_factory=list)
    #: the token range this decision covers (``max_tokens`` None: no upper bound)
    min_tokens: int = 1
    max_tokens: Optional[int] = None
    #: for an op split per range and confirmed as served (``adjudicate --confirm``): the
    #: confirmation's verdict and points (:func:`as_served_summary`), which the split was
    #: kept on; ``evidence`` holds the adjudication's per-range points. None (not written,
    #: so older manifests keep their bytes): no confirmation
    as_served: Optional[dict] = None
    #: for an op decided per range (:func:`combine_ranges`): every range's decision, by
    #: ``min_tokens``; empty for a decision of one range. Not written (derived)
    ranges: list = field(default_factory=list, compare=False, repr=False)

    @property
    def routes(self) -> bool:
        return self.decision == "route"

    @property
    def whole_range(self) -> bool:
        return self.min_tokens <= 1 and self.max_tokens is None

    @property
    def mixed(self) -> bool:
        """Routed in some token ranges and native in others."""
        return len({r.decision for r in self.ranges}) > 1

    def covers(self, tokens: int) -> bool:
        return self.min_tokens <= tokens and (self.max_tokens is None
                                              or tokens <= self.max_tokens)

    def range_text(self) -> str:
        return range_text(self.min_tokens, self.max_tokens)

    def native_ranges(self) -> list:
        """[(min, max or None)] of the ranges decided native (of a per-range op)."""
        return [(r.min_tokens, r.max_tokens) for r in self.ranges if not r.routes]

    def to_json(self) -> dict:
        d = {"model": self.model, "op": self.op, "decision": self.decision,
             "reason": self.reason, "rule": self.rule, "model_name": self.model_name,
             "routed_impls": list(self.routed_impls), "evidence": list(self.evidence)}
        if not self.whole_range:          # absent: the whole range (older bytes kept)
            d["min_tokens"], d["max_tokens"] = self.min_tokens, self.max_tokens
        if self.as_served is not None:    # absent: no as-served confirmation (same)
            d["as_served"] = self.as_served
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RouteDecision":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "ranges"})


#: what a point of evidence keeps in the manifest: the scenario and the wall ratio to
#: vanilla with its CI (an as-served summary adds n and the kernel ratio's CI)
EVIDENCE_KEYS = ("scenario", "ratio_median", "ci_low", "ci_high")


def as_served_summary(result: Optional[dict]) -> Optional[dict]:
    """An as-served confirmation's result (``model_step.served_verdict``: verdict, points,
    the scenarios it was slower at) as the manifest keeps it, or None without one."""
    if not isinstance(result, dict) or not result.get("verdict"):
        return None
    keys = EVIDENCE_KEYS + ("n", "kernel_ratio_median", "kernel_ci_low", "kernel_ci_high")
    return {"verdict": result["verdict"],
            "evidence": [{k: p.get(k) for k in keys if p.get(k) is not None}
                         for p in result.get("points") or []],
            "slower_at": list(result.get("slower_at") or [])}


def range_text(lo: int, hi: Optional[int]) -> str:
    """A token range as people read it: ``1-512``, ``513+``."""
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def combine_ranges(rows: list) -> "RouteDecision":
    """One op's per-range decisions as one: the row itself when there is one; else
    'route' only when every range routes (what a seam that cannot serve per range may
    do), the reason naming each range, and ``ranges`` holding them all."""
    rows = sorted(rows, key=lambda r: r.min_tokens)
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    every = all(r.routes for r in rows)
    per = "; ".join(f"{r.range_text()} tokens {r.decision} ({r.reason})" for r in rows)
    if every or not any(r.routes for r in rows):
        reason = f"per range: {per}"
    else:
        reason = ("per range, routed only in " + ", ".join(
            r.range_text() for r in rows if r.routes) + f": {per}")
    return RouteDecision(
        model=first.model, op=first.op, decision="route" if every else "native",
        reason=reason, rule=first.rule, model_name=first.model_name,
        routed_impls=list(first.routed_impls),
        evidence=[p for r in rows for p in r.evidence], min_tokens=first.min_tokens,
        max_tokens=rows[-1].max_tokens, as_served=first.as_served, ranges=rows)


@dataclass
class EnginePick:
    """The measured value of the engine-wide setting ``choice`` when serving ``model`` (a
    :func:`model_key`): ``decision`` 'pick' (serve with ``value``) or 'default' (vLLM's own
    rule, ``value`` 'auto'), the reason, the rule's version, the vLLM version it was
    measured with, and a short summary of the evidence (per value: verdict and, per
    scenario, ratio median and CI)."""
    model: str
    choice: str
    decision: str
    value: str
    reason: str = ""
    rule: str = ""
    model_name: Optional[str] = None
    vllm: Optional[str] = None
    evidence: dict = field(default_factory=dict)

    @property
    def picks(self) -> bool:
        return self.decision == "pick"

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("model", "choice", "decision", "value",
                                              "reason", "rule", "model_name", "vllm",
                                              "evidence")}

    @classmethod
    def from_json(cls, d: dict) -> "EnginePick":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


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
    #: model-step routing decisions of this device (written only when there are some)
    route_decisions: list = field(default_factory=list)
    #: engine-wide picks of this device (written only when there are some)
    engine_picks: list = field(default_factory=list)
    format: str = MANIFEST_FORMAT
    fingerprint: Optional[str] = None

    _FIELDS = ("format", "device", "driver", "stack", "policy", "order", "fl_substitutions",
               "band_rule", "source_db", "ops", "overrides", "launch_floor_us")

    def to_json(self) -> dict:
        """The on-disk dict, fingerprint computed over the rest."""
        d = {k: getattr(self, k) for k in self._FIELDS}
        d["ops"] = {op: e.to_json() for op, e in self.ops.items()}
        if self.route_decisions:
            d["route_decisions"] = [r.to_json() for r in self.route_decisions]
        if self.engine_picks:
            d["engine_picks"] = [p.to_json() for p in self.engine_picks]
        d["fingerprint"] = fingerprint_of(d)
        return d

    @classmethod
    def from_json(cls, d: dict, source: str = "manifest", verify: bool = True) -> "Manifest":
        if verify:
            verify_manifest(d, source)
        try:
            ops = {op: OpEntry.from_json(e) for op, e in d["ops"].items()}
            decisions = [RouteDecision.from_json(r) for r in d.get("route_decisions") or []]
            engine_picks = [EnginePick.from_json(p) for p in d.get("engine_picks") or []]
        except (KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"{source}: malformed manifest ({type(e).__name__}: {e}); "
                                f"re-create it with {refreeze_command(d, source)}") from None
        return cls(device=d.get("device") or {}, driver=d.get("driver"), ops=ops,
                   stack=d.get("stack", []), policy=d.get("policy", {}),
                   order=d.get("order", "measured"),
                   fl_substitutions=d.get("fl_substitutions", []),
                   band_rule=d.get("band_rule"), source_db=d.get("source_db", {}),
                   overrides=d.get("overrides", []),
                   launch_floor_us=d.get("launch_floor_us"), route_decisions=decisions,
                   engine_picks=engine_picks,
                   format=d.get("format", MANIFEST_FORMAT), fingerprint=d.get("fingerprint"))

    def decisions_for(self, model: Optional[str]) -> dict:
        """op -> :class:`RouteDecision` for the model key ``model`` (empty when the device
        has no decision for it: that model's routing is unmeasured). An op decided per token
        range gets :func:`combine_ranges` of its ranges."""
        return {op: combine_ranges(rows) for op, rows in self.ranges_for(model).items()}

    def ranges_for(self, model: Optional[str]) -> dict:
        """op -> its decisions for the model key ``model``, one per token range, by range."""
        out: dict = {}
        for r in self.route_decisions:
            if model is not None and r.model == model:
                out.setdefault(r.op, []).append(r)
        return {op: sorted(rows, key=lambda r: r.min_tokens) for op, rows in out.items()}

    def engine_picks_for(self, model: Optional[str]) -> list:
        """The :class:`EnginePick` rows for the model key ``model`` (empty when none)."""
        return [p for p in self.engine_picks if model is not None and p.model == model]

    def decided_models(self) -> dict:
        """model key -> its display name, for the models that have decisions."""
        return {r.model: r.model_name or r.model for r in self.route_decisions}

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
