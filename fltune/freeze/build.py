"""Freeze: calibration DB -> frozen dispatch manifest (a pure function of the DB rows for
one device and driver, and the policy).

Per op, one table per (dtype, signature): the ordered bands, adjacent bands with the same
winner merged, each with the implementation (impl_id, kind, vendor, callable path), its
measured time, the runner-up and the gap. The band rule, the policy and the software stack
are written in, and a sha256 fingerprint over the canonical JSON of all of it — the value
vLLM's compile-cache key receives, so a different choice can never reuse a compiled graph
built for another.

Where ``fltune refine`` stored a crossover between two adjacent bands' winners (and it still
holds: same winners, same stack), the edge between them is the refined token count instead
of the band edge; the manifest marks that band ``refined``. ``order="fl"`` ignores them.

The policy still applies to measured winners: a vendor the policy denies (a human
deny-list, like vllm-plugin-FL's nvidia.yaml) never wins; the fastest permitted candidate
measured for that band takes its place and the override is written into the manifest with
its reason.
"""
from __future__ import annotations

import json
import logging
import shlex
from collections import defaultdict
from typing import Optional

import torch

from ..dispatch.manifest import (EVIDENCE_KEYS, Band, EnginePick, Manifest,  # noqa: F401
                                 OpEntry, Point, RouteDecision, Table, as_served_summary,
                                 device_mismatch, is_native, write_manifest)
from ..dispatch.policy import SelectionPolicy, fl_pick
from ..ops import get_op
from ..store import CalibrationDB, DBError, band_key
from ..store import device as devmod
from ..store.device import resolve_device
from ..store.hints import calibrate_hint, workload_commands
from ..tune.bands import BAND_RULE
from ..tune.crossover import crossover_valid
from ..tune.workload import profiles_running

log = logging.getLogger("fltune.freeze")


class StackMismatch(RuntimeError):
    pass


def key_shape(op: str, dims: dict):
    """(trailing shape of the key argument, rows per token) for an op at these dims."""
    spec = get_op(op)
    args = spec.make_inputs(1, dims, torch.float32, "cpu", torch.Generator().manual_seed(0))
    x = args[spec.key_arg]
    extra = list(spec.key_extra(args)) if spec.key_extra is not None else []
    return list(x.shape[1:]) + extra, int(x.shape[0])


def stack_differences(recorded: dict, now: dict) -> list[str]:
    return [f"{k}: calibrated with {recorded.get(k)}, running {now.get(k)}"
            for k in sorted(set(recorded) | set(now))
            if k != "python" and recorded.get(k) != now.get(k)]


#: what a manifest's bands pick: the measured winner, or what the fixed FL order runs
ORDERS = ("measured", "fl")


def build_manifest(db_path: str, *, device: Optional[str] = None,
                   policy: Optional[SelectionPolicy] = None, registry=None,
                   strict: bool = False, check_stack: bool = True,
                   order: str = "measured",
                   stale_out: Optional[dict] = None,
                   db: Optional[CalibrationDB] = None) -> tuple[dict, list[str]]:
    """Returns (manifest, warnings). Raises DBError when there is nothing for the device,
    StackMismatch when ``strict`` and the stack changed since calibration.

    ``device`` is ``KEY | NAME[@DRIVER]`` (``store.device.resolve_device``); None is this
    machine's device and driver.

    ``order="fl"`` freezes the *fixed FL order* instead of the measured winners: every band
    picks the first qualified candidate in the policy's order (what vllm-plugin-FL would
    run), over the same bands. It exists so that the end-to-end A/B serves the baseline
    through the very same seams and custom ops as the calibrated arm — the two arms then
    differ only in which implementation each band calls.

    ``stale_out``, a dict, receives ``(model key, op) -> why`` for each route decision left
    out as stale (``fltune report`` marks those rows: the DB still holds them).

    ``db``, an open :class:`CalibrationDB` of ``db_path``, is read instead of opening the
    file again (``fltune report`` has it open already) and is left open."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    policy = policy or SelectionPolicy()
    owned = db is None
    if owned:
        db = CalibrationDB(db_path, create=False)
    try:
        dev = resolve_device(db, device)
        winners = db.winners(dev["device_key"], dev["driver"])
        # a device measured only for engine-wide picks (``fltune adjudicate --engine-choice``
        # on a machine no op was raced on) freezes to a manifest that routes no op and
        # serves those picks: what was measured is served, and every op stays vLLM's
        if not winners and not (order == "measured"
                                and db.engine_picks(dev["device_key"], dev["driver"])):
            raise DBError(f"{db_path} has no winners for {dev['name']} [{dev['device_key']}] "
                          f"driver {dev['driver']}; run "
                          f"`{calibrate_hint(db, dev['device_key'], dev['driver'], force=True)}`")
        stacks = db.stacks_of_winners(dev["device_key"], dev["driver"])
        # winners measured on a stack no run of the DB describes (their run is gone): not
        # this stack, and nothing says which, so they are as stale as an older one's
        warnings = []
        if check_stack:
            now_key = devmod.stack_key(devmod.stack())
            unknown = [w for w in winners if w.get("stack_key")
                       and w["stack_key"] not in stacks and w["stack_key"] != now_key]
            warnings = _stack_warnings(stacks, db_path, strict,
                                       workload_commands(db, dev["device_key"], dev["driver"],
                                                         models_for=profiles_running),
                                       unknown)
        # one read of the device's measurements serves the FL picks, the native compiled
        # times and the launch floor below
        by_band = db.measurements_by_band(dev["device_key"], dev["driver"])
        if order == "fl":
            winners = _fl_rows(by_band, winners, policy, registry)
        rows, overrides = _apply_policy(db, dev, winners, policy)
        # measured with the software stack the winners were: an older stack's rows are not
        # evidence about this one
        stack_keys = set(stacks)
        timed = [m for ms in by_band.values() for m in ms
                 if m["outcome"] == "timed" and m.get("stack_key") in stack_keys]
        native = _native_times(timed)
        # refined edges (``fltune refine``) move the boundary between two measured winners;
        # the fixed FL order's bands are not what was refined, so they keep the band edges
        crossovers = ({(c["op"], c["signature"], c["dtype"], c["lower_hi"]): c
                       for c in db.crossovers(dev["device_key"], dev["driver"])}
                      if order == "measured" else {})
        entries = _op_entries(rows, registry, native, crossovers)
        manifest = Manifest(
            device={k: dev[k] for k in ("device_key", "device_type", "name", "capability",
                                        "sms", "memory_bytes")},
            driver=dev["driver"],
            stack=sorted(stacks.values(), key=lambda s: json.dumps(s, sort_keys=True)),
            policy=policy.to_dict(), order=order,
            # order "fl": bands where FL's pick could not be served (it failed parity or was
            # never timed), so the measured winner stands in: the baseline is not pure FL there
            fl_substitutions=[{"op": w["op"], "signature": w["signature"],
                               "band_hi": w["band_hi"], "reason": w["reason"]}
                              for w in rows if order == "fl" and str(w.get("reason", ""))
                              .endswith("measured winner kept")],
            band_rule=BAND_RULE,
            source_db={"path": str(db_path),
                       "runs": [r["id"] for r in db.runs(dev["device_key"])]},
            ops=entries,
            overrides=overrides,
            # model-step decisions hold for the measured picks they were measured with; the
            # fixed FL order's arm routes what vllm-plugin-FL would, undecided
            route_decisions=(_route_decisions(db, dev, entries, warnings, stale_out)
                             if order == "measured" else []),
            # engine-wide picks (evaluate/engine_pick.py): likewise the measured choice's;
            # the fixed-order baseline runs vLLM's own engine settings
            engine_picks=(_engine_picks(db, dev, warnings) if order == "measured" else []),
            launch_floor_us=min((m["median_us"] for m in timed if m["median_us"]),
                                default=None))
        return manifest.to_json(), warnings
    finally:
        if owned:
            db.close()


def _stack_warnings(stacks: dict, db_path: str, strict: bool,
                    recalibrate: list[str], unknown: Optional[list] = None) -> list[str]:
    """One warning per recorded stack that differs from the running one (``strict``:
    raise instead), naming the commands that re-measure: every model the DB holds, each
    with the ops its runs measured (``hints.workload_commands``), not only the newest
    run's — an older run's winners are as old. Bands already measured on this stack (with
    the command's timing switches) are skipped by those commands (``calibrate`` resumes per
    stack and switches), so covering the whole DB costs little more than what is stale.
    ``unknown``: winners whose stack no run of the DB records (their run is gone: an older
    or merged DB's) get one warning per stack key, as a changed stack, naming how many of
    them no built-in profile runs (no command can name their model: the user's config
    directory, or a rebuilt DB, is the way out for those)."""
    verify = f"`fltune verify --db {shlex.quote(str(db_path))}`"
    way_out = ("re-measure with " + " and ".join(f"`{c}`" for c in recalibrate)
               + f" (or check them with {verify})" if recalibrate
               else f"check them with {verify}")
    msgs = []
    now = devmod.stack()
    for st in stacks.values():
        diff = stack_differences(st, now)
        if diff:
            msgs.append(f"software stack changed since calibration ({'; '.join(diff)}): the "
                        f"measured winners may no longer be the fastest; {way_out}")
    by_key = defaultdict(list)
    for w in unknown or []:
        by_key[w["stack_key"]].append(w)
    for key, ws in sorted(by_key.items()):
        found = profiles_running({(w["op"], w["signature"], w["dtype"]) for w in ws})
        lost = sum(1 for w in ws if not found.get((w["op"], w["signature"], w["dtype"])))
        n = len(ws)
        msgs.append(f"software stack unknown for {n} winner{'s' if n != 1 else ''} (stack "
                    f"{key[:12]}, whose calibration run is gone from the DB): measured on "
                    f"another stack than this one, they may no longer be the fastest; "
                    f"{way_out}" + (
                        f"; no built-in profile runs {lost} of them: re-calibrate their model "
                        f"with `--model <its config directory>`, or rebuild the DB"
                        if lost else ""))
    if msgs and strict:
        raise StackMismatch(msgs[0])
    return msgs


def _apply_policy(db, dev, winners: list[dict], policy) -> tuple[list[dict], list[dict]]:
    """The winner rows with every policy-denied vendor replaced by the fastest permitted
    candidate measured in that band (or dropped when none was), and the overrides."""
    overrides, rows = [], []
    for w in winners:
        if not _permitted(w, policy):
            alt = _best_permitted(db, dev, w, policy)
            base = {"op": w["op"], "signature": w["signature"], "band_hi": w["band_hi"],
                    "denied": w["impl_id"]}
            if alt is None:
                overrides.append({**base, "replacement": None,
                                  "reason": "denied by policy; no permitted candidate "
                                            "was measured"})
                continue
            overrides.append({**base, "replacement": alt["impl_id"],
                              "reason": f"vendor {w['vendor']} denied by policy"})
            log.warning("fltune: %s %s band <=%s: %s denied by policy, using %s",
                        w["op"], w["signature"], w["band_hi"], w["impl_id"], alt["impl_id"])
            w = {**w, "impl_id": alt["impl_id"], "kind": alt["kind"],
                 "vendor": alt["vendor"], "median_us": alt["median_us"],
                 "runner_up": None, "runner_up_us": None, "gap": None,
                 "reason": "policy override"}
        rows.append(w)
    return rows, overrides


def _fl_rows(by_band: dict, winners, policy, registry) -> list[dict]:
    """The winner rows rewritten to the fixed FL order's pick in each band (kept as the
    measured winner where FL's pick was never timed, e.g. it failed parity, so that the
    baseline never serves an implementation known to be wrong)."""
    if registry is None:
        from ..dispatch.manager import get_default_manager
        registry = get_default_manager().registry
    out = []
    for w in winners:
        ms = by_band.get(band_key(w))
        fl = fl_pick_row(ms, policy, registry) if ms else None
        if fl is not None and fl["impl_id"] == w["impl_id"]:
            out.append(w)
            continue
        if fl is None or fl["outcome"] != "timed":
            # never serve a pick known to fail; say so in the band, so the arm is auditable
            why = (f"FL pick {fl['impl_id']} not usable ({fl['outcome']}); measured winner "
                   f"kept" if fl else "no FL pick measured; measured winner kept")
            out.append({**w, "reason": why})
            continue
        out.append({**w, "impl_id": fl["impl_id"], "kind": fl["kind"], "vendor": fl["vendor"],
                    "median_us": fl["median_us"], "runner_up": None, "runner_up_us": None,
                    "gap": None, "reason": "fixed FL order"})
    return out


def _permitted(w: dict, policy: SelectionPolicy) -> bool:
    v = w.get("vendor")
    if v is None:
        return True
    if v in policy.deny_vendors:
        return False
    return not policy.allow_vendors or v in policy.allow_vendors


def _best_permitted(db, dev, w, policy):
    rows = db.measurements(dev["device_key"], dev["driver"], op=w["op"],
                           signature=w["signature"], dtype=w["dtype"], band_hi=w["band_hi"],
                           outcome="timed")
    rows = [r for r in rows if _permitted(r, policy)]
    return min(rows, key=lambda r: r["median_us"]) if rows else None


def _callable(registry, op, impl_id):
    if registry is None:
        return None
    try:
        return registry.get(op, impl_id).callable_path
    except KeyError:
        return None


#: the candidates that stand for vLLM's own compiled path, best first: ``native.vllm`` (vLLM's
#: path compiled as vLLM compiles it) where it was measured, else ``inductor.standalone`` (the
#: reference compiled alone, dynamic tokens; ``reference.inductor`` before schema 4)
NATIVE_COMPILED_IDS = ("native.vllm", "inductor.standalone")
NATIVE_COMPILED = NATIVE_COMPILED_IDS[0]


def _native_times(timed: list[dict]) -> dict:
    """band key -> the native compiled path's time there (:data:`NATIVE_COMPILED_IDS`)."""
    out: dict = {}
    for impl_id in reversed(NATIVE_COMPILED_IDS):        # the preferred one overwrites
        out.update({band_key(m): m["median_us"] for m in timed if m["impl_id"] == impl_id})
    return out


def _route_decisions(db, dev: dict, entries: dict, warnings: list,
                     stale_out: Optional[dict] = None) -> list[RouteDecision]:
    """The device's model-step routing decisions (``evaluate/model_step.py``) that still
    hold: per (model, op) the newest adjudication's rows (one per token range it decided:
    ``--per-range``; one row for the whole range otherwise); dropped, with a warning, where
    the op's non-native picks are no longer the ones the decision's arm routed (a later
    calibration changed them) or the manifest no longer has the op."""
    newest: dict = {}
    for r in db.route_decisions(dev["device_key"], dev["driver"]):
        k = (r["model"], r["op"])                       # ordered by created_at
        stamp = (r.get("stack_key"), r.get("created_at"))
        if k not in newest or newest[k][0] != stamp:
            newest[k] = (stamp, [])
        newest[k][1].append(r)
    out = []
    for (model, op), (_, rows) in sorted(newest.items()):
        rows = sorted(rows, key=lambda x: x.get("min_tokens") or 1)
        routed = sorted({i for r in rows for i in ((r.get("evidence") or {})
                                                    .get("routed_impls") or [])})
        entry = entries.get(op)
        now = sorted({i for i in entry.impl_ids() if not is_native(i)}) if entry else []
        routes = any(r["decision"] == "route" for r in rows)
        if routed != now and (routes or now):
            why = (f"measured routing {', '.join(routed) or 'nothing'}, the manifest now "
                   f"picks {', '.join(now) or 'nothing'}")
            warnings.append(f"route decision for {op} on {rows[0].get('model_name') or model} "
                            f"is stale ({why}): left out; re-run the model-step adjudication")
            if stale_out is not None:
                stale_out[(model, op)] = why
            continue
        for r in rows:
            ev = r.get("evidence") or {}
            out.append(RouteDecision(
                model=model, op=op, decision=r["decision"], reason=r["reason"] or "",
                rule=r["rule"] or "", model_name=r.get("model_name"), routed_impls=routed,
                evidence=[{k: p.get(k) for k in EVIDENCE_KEYS}
                          for p in ev.get("points") or []],
                as_served=as_served_summary(ev.get("as_served")),
                min_tokens=r.get("min_tokens") or 1, max_tokens=r.get("max_tokens")))
    return out


def _engine_picks(db, dev: dict, warnings: list) -> list[EnginePick]:
    """The device's engine-wide picks (one per model and choice), each with a summary of
    its evidence; a pick measured with another vLLM version than the running one is kept
    with a warning (the running vLLM may rank its backends differently, or lack the value:
    ``fltune serve`` then says so)."""
    running = devmod.stack().get("vllm")
    out = []
    for r in db.engine_picks(dev["device_key"], dev["driver"]):
        ev = r.get("evidence") or {}
        if r["decision"] == "pick" and r.get("vllm") and running and r["vllm"] != running:
            warnings.append(f"engine pick {r['choice']}={r['value']} for "
                            f"{r.get('model_name') or r['model']} was measured with vLLM "
                            f"{r['vllm']}, this is {running}: re-run `fltune adjudicate "
                            f"--engine-choice {r['choice']}` to re-measure")
        values = {v: {"verdict": e.get("verdict"),
                      "points": [{k: p.get(k) for k in ("scenario", "ratio_median", "ci_low",
                                                        "ci_high")}
                                 for p in e.get("points") or []]}
                  for v, e in sorted((ev.get("values") or {}).items())}
        out.append(EnginePick(model=r["model"], choice=r["choice"], decision=r["decision"],
                              value=r["value"], reason=r["reason"] or "",
                              rule=r["rule"] or "", model_name=r.get("model_name"),
                              vllm=r.get("vllm"), evidence={"values": values}))
    return out


def _refined_edge(crossovers: dict, prev: Optional[dict], w: dict) -> Optional[dict]:
    """The stored crossover between the winner rows ``prev`` and ``w`` of two adjacent
    bands, if it still holds: the same two winners (after policy overrides), the same
    stack as both, the edge inside ``[prev.hi, w.hi)``."""
    if not crossovers or prev is None or prev["band_hi"] + 1 != w["band_lo"]:
        return None
    c = crossovers.get((w["op"], w["signature"], w["dtype"], prev["band_hi"]))
    return c if c is not None and crossover_valid(c, prev, w) else None


def _band_of_row(w: dict, registry) -> Band:
    return Band(lo=w["band_lo"], hi=w["band_hi"], impl_id=w["impl_id"], kind=w["kind"],
                vendor=w["vendor"], callable=_callable(registry, w["op"], w["impl_id"]),
                median_us=w["median_us"], runner_up=w["runner_up"],
                runner_up_us=w["runner_up_us"], gap=w["gap"])


def _merged_bands(ws: list[dict], registry, crossovers: Optional[dict]) -> list[Band]:
    """One table's winner rows (sorted by band) as bands: adjacent equal winners merged
    (times and runner-up of the top band), and where a valid refined crossover sits
    between two differing winners, the lower band's ``hi`` moved to the crossover's edge —
    tokens ``<= edge`` go to the lower winner, as the band rule reads ``(edge[i-1],
    edge[i]]`` and ``FrozenDispatch.select`` bisects — and the upper band's ``lo`` to edge
    + 1; the lower band records ``refined``, its ``coarse_hi`` and the probes."""
    bands: list[Band] = []
    prev_row = None
    for w in ws:
        b = _band_of_row(w, registry)
        last = bands[-1] if bands else None
        if last is not None and last.impl_id == b.impl_id and last.hi + 1 == b.lo:
            last.hi = b.hi
            last.merged += 1
            last.median_us = b.median_us          # time at the (new) top edge
            last.runner_up, last.runner_up_us, last.gap = b.runner_up, b.runner_up_us, b.gap
        else:
            c = _refined_edge(crossovers, prev_row, w) if last is not None else None
            if c is not None:
                last.hi, last.refined = c["edge_tokens"], True
                last.coarse_hi, last.crossover_probes = prev_row["band_hi"], c["probes"]
                b.lo = c["edge_tokens"] + 1
            bands.append(b)
        prev_row = w
    return bands


def _op_entries(rows: list[dict], registry, native: Optional[dict] = None,
                crossovers: Optional[dict] = None) -> dict:
    """Per op, its :class:`OpEntry`: tables of merged bands (:func:`_merged_bands`). Each
    table also keeps ``points``: every measured band before merging, with the winner's
    time and the native compiled path's. The vLLM plugin needs them to weigh a win against
    the fusion a routed op gives up (an opaque custom op cannot be fused by Inductor with
    its neighbours; see ``integrations/vllm/plugin.py``), and merged bands would hide the
    small-token end."""
    native = native or {}
    by_table = defaultdict(list)
    for w in rows:
        by_table[(w["op"], w["dtype"], w["signature"])].append(w)
    tables: dict = defaultdict(list)
    for (op, dtype, sig), ws in sorted(by_table.items()):
        ws.sort(key=lambda r: r["band_hi"])
        # the newest race's dims: bands of one signature can hold races for other context
        # dims (``OpSpec.context_dims``; a band a later run did not reach), and the table's
        # dims are what serving gives native.vllm (``dispatch/frozen.for_table``)
        dims = json.loads(max(ws, key=lambda r: r.get("created") or 0)["dims"])
        trailing, rpt = key_shape(op, dims)
        points = [Point(w["band_lo"], w["band_hi"], w["impl_id"], w["median_us"],
                        native.get((op, sig, dtype, w["band_hi"]))) for w in ws]
        tables[op].append(Table(dtype=dtype, signature=sig, dims=dims, trailing=trailing,
                                rows_per_token=rpt, weight=max(w["weight"] or 0 for w in ws),
                                bands=_merged_bands(ws, registry, crossovers), points=points))
    return {op: _op_entry(ts) for op, ts in tables.items()}


def _op_entry(tables: list[Table]) -> OpEntry:
    """Two signatures can share one runtime key (q_norm and k_norm: same head_dim and
    dtype, different rows per token). The runtime sees only (dtype, trailing shape), so the
    table of the more-called signature serves that key; the other is listed as shadowed.
    The fallback (arguments no table matches) is the implementation that serves the most
    calls per step over the kept tables."""
    keep: dict = {}
    shadowed = []
    for t in sorted(tables, key=lambda t: -t.weight):
        if t.key in keep:
            shadowed.append({"signature": t.signature, "dtype": t.dtype,
                             "served_by": keep[t.key].signature})
        else:
            keep[t.key] = t
    kept = sorted(keep.values(), key=lambda t: (t.dtype, t.signature))
    votes = defaultdict(int)
    for t in kept:
        for b in t.bands:
            votes[b.impl_id] += t.weight * b.merged
    return OpEntry(tables=kept, shadowed=shadowed,
                   fallback=max(sorted(votes), key=lambda i: votes[i]),
                   native_everywhere=all(b.kind == "reference" for t in kept for b in t.bands))


def _tables(rows: list[dict], registry, native: Optional[dict] = None,
            crossovers: Optional[dict] = None) -> dict:
    """:func:`_op_entries` as the manifest's JSON ``ops`` section."""
    return {op: e.to_json() for op, e in _op_entries(rows, registry, native, crossovers).items()}


def fl_pick_row(measured: list[dict], policy: SelectionPolicy, registry) -> Optional[dict]:
    """The measurement row of the candidate the fixed FL order runs in one band
    (``dispatch.policy.fl_pick`` over the band's rows). FL does not check parity, so its
    pick may be one that fails it — reported as such."""
    by_id = {m["impl_id"]: m for m in measured}
    known = {i.impl_id for i in registry.get_implementations(measured[0]["op"])}
    impls = [registry.get(m["op"], m["impl_id"]) for m in measured if m["impl_id"] in known]
    pick, _ = fl_pick(policy, measured[0]["op"], impls,
                      lambda iid: by_id[iid]["outcome"] if iid in by_id else None)
    return by_id[pick] if pick else None


def check_device(manifest: dict) -> Optional[str]:
    """None if the manifest was measured on this machine's device and driver, else why not
    (``dispatch.manifest.device_mismatch`` against ``store.device.current``)."""
    d = manifest.get("device", {})
    if d.get("device_type") == "cuda" and not torch.cuda.is_available():
        return device_mismatch(manifest, {}, False)
    me = devmod.current(d.get("device_type") if d.get("device_type") in ("cpu", "cuda") else None)
    return device_mismatch(manifest, {**me, "label": devmod.label(me)},
                           torch.cuda.is_available())


def manifest_for_this_device(db_path: str, *, strict: bool = False, policy=None,
                             registry=None) -> tuple[dict, list[str]]:
    """What serving uses with ``FLTUNE_DB``: freeze the DB for this machine's device."""
    return build_manifest(db_path, policy=policy, strict=strict, registry=registry)
