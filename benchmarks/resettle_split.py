"""Re-settle one op's per-range split from a later as-served run, by the current rule.

Why this exists. ``fltune adjudicate --per-range`` splits an op by token range and then
measures the split once more as it will be served (``model_step.confirm_split``); a split
that reads measurably slower anywhere is undone (native at every size). That confirmation
is one run, and on the H200 one run's wall time can sit 10-20 % off an A/A: session 15
undid Qwen3-0.6B's ``linear`` split from a prefill-2048 wall CI of [0.739, 0.882] (n=3)
while the same run's A/A read [0.952, 1.153]; session 18 served the same split against
vanilla again (``PHASE=linbench DBSRC=s14.db``, n=10) and read 0.9955 [0.974, 1.040], its
A/A 1.166 [1.093, 1.226]. Rule ``model-step/5`` reads a wall CI against the A/A's reach
(``model_step.wall_floors``); this script applies it to such a later run without a GPU:

1. the split rows (every range, with the adjudication's per-range evidence) from
   ``--rows-from``, a DB the adjudication wrote before the split was undone;
2. the as-served points: ``--served``'s e2e summary, arm ``--arm`` (the DB serving exactly
   that split) against vanilla, with the A/A arm ``--aa`` of the same run setting the wall
   floors and the adjudication's compile A/A the kernel floors;
3. ``model_step.settle_split``, the same code ``confirm_split`` ends with; earlier
   as-served runs (``--earlier``) are judged by the same rule and kept in the evidence;
4. the rows replace that op's rows in ``--db`` (one transaction), when the device and
   driver match; ``--dry-run`` prints and writes nothing.

    python3 benchmarks/resettle_split.py --db db/NVIDIA-H200_driver-580.159.04.db \\
        --rows-from s14.db --model Qwen3-0.6B --op linear \\
        --served benchmarks/results/h200-2026-12-02-s18/split-e2e-summary-Qwen3-0.6B.json \\
        --earlier benchmarks/results/h200-2026-12-02-s15/linbench-Qwen3-0.6B/e2e-summary.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from fltune.evaluate import model_step as ms
from fltune.store import CalibrationDB


def split_rows(db_path: str, model_name: str, op: str) -> list:
    """The op's rows for the model (by its profile name) in a DB, every range, through the
    store's own reader (evidence decoded, every device of the DB)."""
    db = CalibrationDB(db_path, create=False)
    try:
        rows = [r for d in db.devices()
                for r in db.route_decisions(d["device_key"], d["driver"])
                if r["model_name"] == model_name and r["op"] == op]
    finally:
        db.close()
    return sorted(rows, key=lambda r: r["min_tokens"])


def judged(summary_path: str, arm: str, aa: str, kernel_floors: dict) -> dict:
    """One as-served run judged by the current rule: its arm's points, the A/A's wall
    floors, the adjudication's kernel floors; with the run's command as its source."""
    doc = json.load(open(summary_path))
    pts = [p for p in doc["points"] if p.get("arm") == arm]
    aa_pts = [p for p in doc["points"] if p.get("arm") == aa]
    if not pts:
        sys.exit(f"{summary_path}: no point of arm {arm!r} (arms: "
                 f"{sorted({p.get('arm') for p in doc['points']})})")
    if not aa_pts:
        sys.exit(f"{summary_path}: no point of the A/A arm {aa!r}: without it the wall "
                 f"floors are unknown (give --aa)")
    floors = ms.Floors(kernel_floors, ms.wall_floors(aa_pts))
    out = ms.served_verdict(pts, floors)
    out["aa_points"] = aa_pts
    out["source"] = f"{doc.get('command')} ({summary_path}, {doc.get('date')})"
    out["rule"] = ms.RULE
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", required=True, help="the DB whose rows for the op are replaced")
    ap.add_argument("--rows-from", required=True, help="a DB holding the op's split rows")
    ap.add_argument("--model", required=True, help="the model's profile name (model_name)")
    ap.add_argument("--op", required=True)
    ap.add_argument("--served", required=True, help="the as-served run's e2e summary")
    ap.add_argument("--arm", default="calibrated")
    ap.add_argument("--aa", default="aa")
    ap.add_argument("--earlier", action="append", default=[],
                    help="an earlier as-served run's summary (same --arm/--aa names)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)

    rows = split_rows(a.rows_from, a.model, a.op)
    if len(rows) < 2:
        sys.exit(f"{a.rows_from}: {a.model}'s {a.op} has {len(rows)} row(s), not a split by "
                 f"token range; nothing to re-settle")
    kfloors = (rows[0]["evidence"].get("compile_aa") or {}).get("floors") or {}
    result = judged(a.served, a.arm, a.aa, kfloors)
    result["earlier"] = [judged(p, a.arm, a.aa, kfloors) for p in a.earlier]
    now = time.time()
    new = [{**r, "rule": ms.RULE, "created_at": now}
           for r in ms.settle_split(rows, {a.op: result})]
    for r in new:
        print(f"{r['model_name']} {r['op']} {r['min_tokens']}-{r['max_tokens'] or ''}: "
              f"{r['decision']} ({r['reason'][:110]})")
    print(f"as served: {result['verdict']}; wall floors {result.get('wall_floors')}; earlier: "
          + ", ".join(e["verdict"] for e in result["earlier"]))
    if a.dry_run:
        return 0
    db = CalibrationDB(a.db, create=False, write=True)
    try:
        missing = sorted({(r["device_key"], r["driver"]) for r in new
                          if db.device(r["device_key"], r["driver"]) is None})
        if missing:
            sys.exit(f"{a.db} holds no device {missing}: the rows belong to another "
                     f"device's DB")
        db.record_route_decisions(new)
    finally:
        db.close()
    print(f"wrote {len(new)} row(s) for {a.model}'s {a.op} into {a.db}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
