"""All of fltune's screen output: rich tables and progress bars, in one module.

Why here: the commands (``evaluate/``, ``freeze``, ``tune``) return documents — plain dicts
that ``--json`` prints as they are — and this module is the only place that turns one into
something for a person to read. Nothing below the CLI imports rich, so a library user (a
notebook, the vLLM plugin) never pays for it, and a change of layout touches one file.
"""
from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from ..evaluate import bench
from ..evaluate.verify import fmt_ratio
from ..tune.noise import fmt_noise
from ..util import SHORT, fmt_us  # noqa: F401
from ..util import short_name as short



def wide_console(width: int = 150):
    """A rich console for tables: the terminal's width when there is one, else ``width``
    (rich falls back to 80 columns when stdout is a pipe, which wraps every table)."""
    console = Console()
    return console if console.is_terminal else Console(width=width)


def err_console(quiet: bool = False) -> Console:
    """Messages and progress go to stderr, so stdout carries only the document."""
    return Console(stderr=True, quiet=quiet)


def _x(v, good_above=None):
    if v is None:
        return "—"
    s = f"{v:.2f}x"
    if good_above is not None and v > good_above:
        return f"[green]{s}[/]"
    return s


def progress_bar(con, title: str, disabled: bool) -> Progress:
    return Progress(TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=con, disable=disabled)


def render_candidates(doc: dict, prefer: str) -> None:
    t = Table(title=f"fltune candidates on {doc['device']} ({doc['dtype']}); FL order = policy "
                    f"prefer={prefer}")
    for c in ("op", "candidate (FL order)", "kind/prio", "qualified", "why not", ""):
        t.add_column(c)
    for o in doc["ops"]:
        for k, c in enumerate(o["candidates"]):
            t.add_row(o["op"] if k == 0 else "", c["impl_id"], f"{c['kind']}/{c['priority']}",
                      "[green]yes[/]" if c["qualified"] else "[red]no[/]", c["reason"] or "",
                      "[bold]← FL pick[/]" if c["impl_id"] == o["fl_pick"] else "")
        t.add_section()
    wide_console().print(t)
    for src, name, err in doc["discovery"]["failed"]:
        Console(stderr=True).print(f"[yellow]backend {name} ({src}) failed to load: {err}[/]")


def render_devices(rows: list, db: str) -> None:
    t = Table(title=f"devices in {db}")
    for c in ("device key", "name", "capability", "SMs/cores", "memory GiB", "driver",
              "winners", "measurements"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["device_key"], r["name"], r["capability"], str(r["sms"]),
                  f"{r['memory_bytes'] / 2**30:.0f}", r["driver"], str(r["winners"]),
                  str(r["measurements"]))
    Console().print(t)


def render_report(rep: dict, console=None) -> None:
    if console is None:
        console = wide_console(150)
    d = rep["device"]
    run = rep["run"]
    st = rep["stack"]
    console.print(f"[bold]fltune report[/] — {d['name']} [{d['device_key']}] cc {d['capability']}, "
                  f"{d['sms']} {'SMs' if d['device_type'] == 'cuda' else 'cores'}, driver {d['driver']}")
    console.print(f"run {run.get('id')}: model {run.get('model')} {run.get('dtype')} tp={run.get('tp')} "
                  f"({run.get('status')}); stack: " + ", ".join(f"{k} {v}" for k, v in st.items() if v))
    models = rep.get("models", [])
    if len(models) > 1:
        console.print("models calibrated in this DB for this device: " + ", ".join(
            f"{m['model']} {m['dtype']} tp={m['tp']}" for m in models))
    groups = defaultdict(list)
    for r in rep["rows"]:
        groups[(r["op"], r["signature"], r["dtype"])].append(r)
    for (op, sig, dt), rows in groups.items():
        # escape: rich would read "[eps=1e-06,hidden=64]" as markup and drop it
        t = Table(title=escape(f"{op}  [{sig}]  {dt}  ×{rows[0]['weight']}/step"),
                  title_justify="left")
        for col, just in (("tokens", "right"), ("winner", "left"), ("µs", "right"),
                          ("runner-up", "left"), ("gap", "right"), ("noise", "right"),
                          ("FL pick", "left"),
                          ("FL µs", "right"), ("vs FL", "right"), ("parity", "right"),
                          ("GB/s", "right")):
            t.add_column(col, justify=just)
        for r in rows:
            fl = short(r["fl_pick"])
            if r["fl_outcome"] and r["fl_outcome"] != "timed":
                fl += f" ({r['fl_outcome']})"
            sp = r["speedup_vs_fl"]
            sp_s = "—" if sp is None else (f"[green]{sp:.2f}x[/]" if sp > 1.03 else f"{sp:.2f}x")
            t.add_row(f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"] else str(r["band_hi"]),
                      short(r["winner"]) + (" [yellow]?[/]" if r.get("undecided") else ""),
                      fmt_us(r["winner_us"]), short(r["runner_up"]),
                      "—" if r["gap"] is None else f"{r['gap']:+.1%}",
                      ("—" if r.get("band_noise") is None else
                       f"[yellow]{fmt_noise(r['band_noise'])}[/]" if r.get("undecided")
                       else fmt_noise(r["band_noise"])), fl, fmt_us(r["fl_us"]), sp_s,
                      "—" if r["parity"] is None else f"{r['parity']:.4f}",
                      "—" if r["gbps"] is None else f"{r['gbps']:.1f}")
        console.print(t)
    s = rep["summary"]
    ws = s["weighted_speedup_vs_fl"]
    console.print(f"[bold]summary[/]: {s['bands']} bands; measured pick differs from the fixed FL "
                  f"order in {s['bands_where_measured_differs_from_fl']}; FL's pick fails parity or "
                  f"raises in {s['bands_where_fl_pick_fails']}; workload-weighted speedup over the "
                  f"fixed FL order: " + ("—" if ws is None else f"[bold]{ws:.2f}x[/]") +
                  ("" if s["max_speedup_vs_fl"] is None else f" (max {s['max_speedup_vs_fl']:.2f}x)") +
                  f"; undecided (noise above the win margin): {s.get('bands_undecided', 0)}")
    _noise_warning(console, rep)


def _noise_warning(console, rep: dict) -> None:
    """The report's last lines: the undecided bands by name, and the way out."""
    und = rep.get("undecided") or []
    if not und:
        return
    names = defaultdict(list)
    for u in und:
        names[(u["op"], u["signature"], u["dtype"])].append(
            f"{u['band_lo']}–{u['band_hi']}" if u["band_lo"] != u["band_hi"] else str(u["band_hi"]))
    console.print(f"[bold yellow]warning[/]: {len(und)} of {rep['summary']['bands']} bands are "
                  f"undecided — their timing noise exceeds the win margin, so the winner there "
                  f"was picked by precision, then FL order, not by speed:")
    for (op, sig, dt), bands in names.items():
        console.print(escape(f"  {op} [{sig}] {dt}: tokens {', '.join(bands)}"))
    probes = rep.get("noise_probes") or []
    loaded = [p for p in probes if p.get("loaded")]
    if loaded:
        console.print(escape(f"  the machine was loaded during the newest run ({len(loaded)} of "
                             f"{len(probes)} noise probes: {loaded[-1]['loaded']})"))
    console.print(escape(f"  way out: {rep['way_out']}"))



def render_bench(doc: dict, console=None) -> None:

    if console is None:
        console = wide_console(170)
    d = doc["device"]
    console.print(f"[bold]fltune bench[/] — {doc['model']} {doc['dtype']} tp={doc['tp']} on "
                  f"{d['name']} [{d['device_key']}], manifest {doc['manifest_fingerprint'][:12]}; "
                  f"copy bandwidth {doc['copy']['gbps']:.1f} GB/s "
                  f"({doc['copy']['runs'][0]['mib']} MiB, same timer)")
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    impl_ids = sorted({k for r in doc["records"] for k, c in r["candidates"].items()
                       if c.get("median_us")})
    groups: dict = {}
    for r in doc["records"]:
        groups.setdefault((r["op"], r["signature"], r["dtype"]), []).append(r)
    for (op, sig, dt), rows in groups.items():
        t = Table(title=escape(f"{op}  [{sig}]  {dt}  ×{rows[0]['weight']}/step (µs per call)"),
                  title_justify="left")
        t.add_column("tokens", justify="right")
        t.add_column("manifest", justify="left")
        t.add_column("FL", justify="left")
        t.add_column("oracle", justify="left")
        t.add_column("man/orc", justify="right")
        t.add_column("FL/man", justify="right")
        for i in impl_ids:
            t.add_column(short(i), justify="right")
        t.add_column("man GB/s", justify="right")
        t.add_column("% copy", justify="right")
        for r in rows:
            def pk(p):
                return "—" if not p else f"{short(p['impl_id'])} {fmt_us(p['us'])}" + (
                    "" if p.get("parity_ok", True) else " [red](parity)[/]")
            mor = r["ratios"]["manifest_vs_oracle"]
            mor_s = _x(mor)
            if r["ratios"]["manifest_slower_beyond_noise"]:
                mor_s = f"[red]{mor_s}[/]"
            cells = []
            for i in impl_ids:
                c = r["candidates"].get(i, {})
                # · does not qualify here, ✗ raised, blank: the backend has no such op
                cells.append(fmt_us(c.get("median_us")) if c.get("median_us") else
                             {"unqualified": "·", None: ""}.get(c.get("outcome"), "✗"))
            m = r["manifest"] or {}
            t.add_row(str(r["band_hi"]), pk(r["manifest"]), pk(r["fl"]), pk(r["oracle"]),
                      mor_s, _x(r["ratios"]["speedup_vs_fl"], 1.03), *cells,
                      "—" if not m.get("gbps") else f"{m['gbps']:.1f}",
                      "—" if not m.get("copy_share") else f"{m['copy_share']:.0%}")
        console.print(t)
    console.print("(µs per call; man/orc = manifest / oracle, red: slower than some candidate "
                  "beyond the measured noise; FL/man = speedup over the fixed FL order; "
                  "· = does not qualify here, ✗ = raised)")
    t = Table(title="workload-weighted per-step totals (µs; calls per step x per-call time)",
              title_justify="left")
    for c in ("mix", "tokens", "manifest", "FL", "oracle", "man/orc", "FL/man",
              *(f"{short(i)}/man" for i in impl_ids), "% copy"):
        t.add_column(c, justify="right" if c not in ("mix",) else "left")
    for name, m in doc["mixes"].items():
        tot = m["total_us"]
        t.add_row(name, ",".join(map(str, m["tokens"])), fmt_us(tot["manifest"]),
                  fmt_us(tot["fl"]), fmt_us(tot["oracle"]), _x(m["manifest_vs_oracle"]),
                  _x(m["speedup_vs_fl"], 1.03),
                  *(_x(m["backend_vs_manifest"].get(i)) for i in impl_ids),
                  "—" if m["manifest_copy_share"] is None else f"{m['manifest_copy_share']:.0%}")
    console.print(t)
    g = doc["goals"]
    a = g["manifest_never_slower_beyond_noise"]
    b = g["workload_within_2pct_of_oracle"]
    c = g["share_of_copy_from_4096_tokens"]

    def ok(v):
        return "[green]met[/]" if v else ("—" if v is None else "[red]missed[/]")
    console.print(f"[bold]goals[/]: manifest never slower than FL / any backend beyond the noise: "
                  f"{ok(a['met'])} ({len(a['violations'])} of {a['bands_checked']} bands, "
                  f"{a['violations_vs_fl']} against FL)")
    console.print("       workload within 2 % of the oracle: " + ok(b["met"]) + " (" + ", ".join(
        f"{k} {('—' if v is None else f'{(v - 1):+.1%}')}" for k, v in b["manifest_vs_oracle"].items()) + ")")
    console.print(f"       ≥{bench.GOAL_SHARE:.0%} of copy bandwidth from {bench.GOAL_SHARE_FROM_TOKENS} tokens: "
                  f"{ok(c['met'])}" + ("" if c["min"] is None else f" (min {c['min']:.0%} over "
                                                                    f"{c['bands_checked']} bands)"))


def render_verify(doc: dict, console=None, all_bands: bool = False) -> None:

    if console is None:
        console = wide_console(160)
    d = doc["db_device"]
    console.print(f"[bold]fltune verify[/] — {doc['db']}: {d['name']} [{d['device_key']}] driver "
                  f"{d['driver']}; noise floor {doc['noise_floor']:.0%}")
    for n in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(n)}")
    rows = doc["bands"] if all_bands else [b for b in doc["bands"] if b["status"] != "ok"]
    if rows:
        t = Table(title="drifted bands" if not all_bands else "bands", title_justify="left")
        for c in ("op", "signature", "tokens", "status", "winner", "DB µs", "now µs", "now/DB",
                  "runner-up", "now µs ", "noise", "why"):
            t.add_column(c, justify="right" if "µs" in c or c in ("tokens", "now/DB", "noise")
                         else "left")
        for b in rows:
            st = b["status"]
            t.add_row(b["op"], b["signature"], str(b["band_hi"]),
                      st if st == "ok" else f"[red]{st}[/]", short(b["winner"]),
                      fmt_us(b["winner_db_us"]), fmt_us(b["winner_us"]),
                      "—" if b["ratio"] is None else fmt_ratio(b["ratio"]),
                      short(b["runner_up"]), fmt_us(b["runner_up_us"]),
                      "—" if b["noise"] is None else f"{b['noise']:.0%}",
                      escape("; ".join(b["reasons"])))
        console.print(t)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(doc["counts"].items()))
    if doc["stale"]:
        console.print(f"[bold red]stale[/]: {doc['stale_bands']} of {doc['checked']} bands drifted "
                      f"({counts}); re-measure with `fltune calibrate --model "
                      f"{(doc.get('models') or ['MODEL'])[-1]} --db {doc['db']} --force`")
    else:
        console.print(f"[bold green]ok[/]: {doc['checked']} bands re-measured, none drifted "
                      f"({counts}), {doc['wall_s']:.1f} s")


def render_diff(doc: dict, console=None, all_bands: bool = False) -> None:

    if console is None:
        console = wide_console(160)

    def lab(s):
        d = s["device"]
        return f"{s['db']}: {d['name']} [{d['device_key']}] driver {d['driver']}"
    console.print(f"[bold]fltune diff[/]\n  A = {lab(doc['a'])}\n  B = {lab(doc['b'])}")
    rows = doc["rows"] if all_bands else [r for r in doc["rows"]
                                          if r["status"] != "same" or r["time_moved"]]
    if rows:
        t = Table(title="all bands" if all_bands else "bands that differ", title_justify="left")
        for c in ("op", "signature", "dtype", "tokens", "status", "A winner", "A µs", "B winner",
                  "B µs", "B/A", "A's pick on B", "B's pick on A"):
            t.add_column(c, justify="right" if ("µs" in c or c in ("tokens", "B/A") or
                                                "pick on" in c) else "left")
        for r in rows:
            st = r["status"]
            a, b = r["a"] or {}, r["b"] or {}
            ratio = r.get("time_ratio")
            t.add_row(r["op"], r["signature"], r["dtype"],
                      f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"] else str(r["band_hi"]),
                      f"[yellow]{st}[/]" if st != "same" else ("moved" if r["time_moved"] else st),
                      short(a.get("impl_id")), fmt_us(a.get("us")), short(b.get("impl_id")),
                      fmt_us(b.get("us")), _x(ratio), _x(r.get("a_pick_on_b")),
                      _x(r.get("b_pick_on_a")))
        console.print(t)
    s = doc["summary"]
    w = s["weighted_time_ratio_b_over_a"]
    console.print(f"[bold]summary[/]: {s['common']} bands in both; winner changed in "
                  f"[bold]{s['changed']}[/]; winner time moved beyond "
                  f"{doc['threshold']:.0%} in {s['time_moved']}; only in A {s['only_a']}, only "
                  f"in B {s['only_b']}; workload-weighted winner time B/A "
                  + ("—" if w is None else f"{w:.2f}x"))


def render_refine(doc: dict, console=None) -> None:

    console = console or wide_console(170)
    d = doc["device"]
    console.print(f"[bold]fltune refine[/] — {d['name']} [{d['device_key']}] driver "
                  f"{d['driver']}, {doc['db']}")
    for n in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(n)}")
    t = Table(title="crossovers between adjacent bands with different winners "
                    "(tokens ≤ edge → below, > edge → above)", title_justify="left")
    for c in ("op", "signature", "dtype", "bands", "below", "above", "old edge", "new edge",
              "probes", "gap before", "gap after", "status"):
        t.add_column(c, justify="right" if c in ("old edge", "new edge", "probes", "gap before",
                                                 "gap after") else "left")

    def pct(v):
        return "—" if v is None else f"{v:+.1%}"
    for r in doc["pairs"]:
        st = r["status"] + ("" if r.get("converged") in (None, True) else " (probe cap)")
        if r.get("reason") and r["status"] in ("failed", "skipped"):
            st += f": {r['reason'][:60]}"
        t.add_row(r["op"], escape(r["signature"]), r["dtype"],
                  f"{r['lower_lo']}-{r['lower_hi']} | {r['upper_lo']}-{r['upper_hi']}",
                  short(r["impl_below"]), short(r["impl_above"]), str(r["old_edge"]),
                  "—" if r["new_edge"] is None else str(r["new_edge"]),
                  str(len(r["probes"])), pct(r["gap_before"]), pct(r["gap_after"]),
                  escape(st))
    console.print(t)
    s = doc["summary"]
    console.print(f"{s['pairs']} pairs ({', '.join(f'{k} {v}' for k, v in sorted(s['status'].items()))}); "
                  f"{s['edges_moved']} edges moved; oracle gap over the probe points, "
                  f"workload-weighted: before {pct(s['gap_before'])} → after "
                  f"{pct(s['gap_after'])}; {doc['wall_s']:.1f} s")
