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



def wide_console(width: int = 150, wide: bool = False, fit: bool = False):
    """A rich console for tables: the terminal's width when there is one, else ``width``
    (rich falls back to 80 columns when stdout is a pipe, which wraps every table).
    ``fit``: the renderer has a narrow layout (report, diff, candidates), so ``COLUMNS``,
    when set, is the width even on a pipe. ``wide`` (``--wide``): no width limit, so the
    full tables print unwrapped."""
    import os
    if wide:
        return Console(width=WIDE, soft_wrap=True)
    cols = os.environ.get("COLUMNS", "")
    if fit and cols.isdigit() and int(cols) > 0:
        return Console(width=int(cols))
    console = Console()
    return console if console.is_terminal else Console(width=width)


#: the console width ``--wide`` prints at (wide enough that no table shrinks)
WIDE = 1000


def err_console(quiet: bool = False) -> Console:
    """Messages and progress go to stderr, so stdout carries only the document. Lines are
    not cut at the width (a log file gets each message whole)."""
    return Console(stderr=True, quiet=quiet, soft_wrap=True)


def _x(v, good_above=None):
    if v is None:
        return "—"
    s = f"{v:.2f}x"
    if good_above is not None and v > good_above:
        return f"[green]{s}[/]"
    return s


def _fmt_s(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class PlainProgress:
    """Progress for a log file or a pipe: one plain line per finished group (an op's table
    in calibrate, an op in bench/verify, a pair in refine) with the counts, the elapsed
    time and an ETA, instead of a live bar that a pipe cannot redraw.

    Same calls as rich's ``Progress`` (``add_task``, ``update(advance=, description=)``);
    ``update`` also takes ``group`` (what the line is about) and ``group_done`` (the group
    just finished: print its line now; otherwise a line is printed when the group changes
    and at the end)."""

    def __init__(self, con, title: str, disabled: bool, unit: str = "bands"):
        self.con, self.title, self.disabled, self.unit = con, title, disabled, unit
        self.total = self.done = 0
        self.group = None
        self.group_n = 0
        self.t0 = None

    def __enter__(self):
        import time
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self._line()
        return False

    def add_task(self, description, total=None, **kw):
        self.total = total or 0
        return 0

    def _line(self):
        import time
        if self.disabled or self.group is None or not self.group_n:
            return
        el = time.perf_counter() - (self.t0 or time.perf_counter())
        eta = el / self.done * (self.total - self.done) if self.done else 0.0
        print(f"{self.title} {self.group}: {self.group_n} {self.unit}; {self.done}/"
              f"{self.total} {self.unit} done, {_fmt_s(el)} elapsed, ETA {_fmt_s(eta)}",
              file=self.con.file, flush=True)
        self.group_n = 0

    def update(self, task, advance=0, description=None, group=None, group_done=False, **kw):
        if group is not None and group != self.group:
            self._line()
            self.group = group
        self.done += advance
        self.group_n += advance
        if group_done:
            self._line()


def progress_bar(con, title: str, disabled: bool, unit: str = "bands"):
    """A live rich bar on a terminal; :class:`PlainProgress` lines when stderr is a pipe or a
    file; nothing when ``disabled`` (``--quiet``, ``--json``)."""
    if not disabled and not con.is_terminal:
        return PlainProgress(con, title, disabled, unit)
    return _RichProgress(TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(),
                         MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                         TimeRemainingColumn(), console=con, disable=disabled)


class _RichProgress(Progress):
    """rich's Progress that ignores the :class:`PlainProgress` grouping arguments."""

    def update(self, task_id, *, group=None, group_done=False, **kw):
        super().update(task_id, **kw)


def _legend(console, entries: dict, shown) -> None:
    """One line per column shown: what it means (wrapped to the console's width)."""
    console.print("[dim]columns:[/]")
    for c in shown:
        if entries.get(c):
            console.print(f"  [bold]{escape(c)}[/]: {escape(entries[c])}")


def _narrow_table(**kw) -> Table:
    """A table for 80 columns: no outer edges, no vertical rules, one space of padding."""
    from rich import box
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
                 collapse_padding=True, **kw)


def _fits(console, tables) -> bool:
    """Every table fits the console at its natural width (no column shrunk or cut)."""
    free = Console(width=WIDE)
    return all(free.measure(t).maximum <= console.width for t in tables)


CANDIDATES_LEGEND = {
    "op": "the op (fltune/ops); candidates listed in the fixed FL order's order",
    "candidate (FL order)": "implementation id (backend.kind), in the fixed FL order",
    "candidate": "implementation id (backend.kind), in the fixed FL order",
    "kind/prio": "FL kind (default, vendor, reference) and priority within it",
    "qualified": "yes: it can run on this device and dtype",
    "ok": "yes: it can run on this device and dtype",
    "why not": "the reason a candidate does not qualify here",
    "FL pick": "← marks what the fixed FL order (vllm-plugin-FL) runs for the op",
}


def render_candidates(doc: dict, prefer: str, wide: bool = False) -> None:
    console = wide_console(wide=wide, fit=True)
    title = (f"fltune candidates on {doc['device']} ({doc['dtype']}); FL order = policy "
             f"prefer={prefer}")
    full = Table(title=title)
    cols = ("op", "candidate (FL order)", "kind/prio", "qualified", "why not", "FL pick")
    for c in cols:
        full.add_column(c)
    for o in doc["ops"]:
        for k, c in enumerate(o["candidates"]):
            full.add_row(o["op"] if k == 0 else "", c["impl_id"], f"{c['kind']}/{c['priority']}",
                         "[green]yes[/]" if c["qualified"] else "[red]no[/]", c["reason"] or "",
                         "[bold]← FL pick[/]" if c["impl_id"] == o["fl_pick"] else "")
        full.add_section()
    if wide or _fits(console, [full]):
        console.print(full)
        shown = cols
    else:
        # 80 columns: the op as a heading row, its candidates under it; reasons wrap
        width = max(len(c["impl_id"]) for o in doc["ops"] for c in o["candidates"])
        t = _narrow_table(title=title, title_justify="left")
        shown = ("candidate", "kind/prio", "ok", "FL pick", "why not")
        t.add_column("candidate", min_width=width, no_wrap=True)
        t.add_column("kind/prio", no_wrap=True)
        t.add_column("ok", no_wrap=True)
        t.add_column("FL pick", no_wrap=True)
        t.add_column("why not", overflow="fold", ratio=1)
        for o in doc["ops"]:
            t.add_row(f"[bold]{o['op']}[/]", "", "", "", "")
            for c in o["candidates"]:
                t.add_row("  " + c["impl_id"], f"{c['kind']}/{c['priority']}",
                          "[green]yes[/]" if c["qualified"] else "[red]no[/]",
                          "[bold]←[/]" if c["impl_id"] == o["fl_pick"] else "",
                          escape(c["reason"] or ""))
        console.print(t)
        shown = ("op",) + shown
    _legend(console, CANDIDATES_LEGEND, shown)
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


#: the report's columns (name, justify); REPORT_NARROW: those kept at 80 columns
REPORT_COLUMNS = (("tokens", "right"), ("winner", "left"), ("µs", "right"),
                  ("runner-up", "left"), ("gap", "right"), ("noise", "right"),
                  ("FL pick", "left"), ("FL µs", "right"), ("vs FL", "right"),
                  ("parity", "right"), ("GB/s", "right"))
REPORT_NARROW = ("tokens", "winner", "µs", "runner-up", "gap", "noise", "FL pick", "vs FL")
REPORT_LEGEND = {
    "tokens": "the band: the token counts it covers (measured at its top edge)",
    "winner": "the measured pick (fastest; within the win margin, the most precise)",
    "µs": "the winner's median time per call, in microseconds",
    "runner-up": "the next candidate in the race",
    "gap": "how much slower the runner-up is than the winner",
    "noise": "the band's timing spread, (p90 - p10) / median, largest of the winner and the "
             "two fastest; yellow, and ? after the winner: undecided (the noise exceeds the "
             "gap and the win margin, so the pick rests on precision, then FL order)",
    "FL pick": "what the fixed FL order (vllm-plugin-FL's priorities) runs; ✗ or "
               "(outcome): it fails parity or raises there",
    "FL µs": "the FL pick's median time per call",
    "vs FL": "FL pick's time / winner's time: the speedup of the measured pick",
    "parity": "fraction of the winner's output within tolerance of the fp64/fp32 reference",
    "GB/s": "bytes the op moves per call / the winner's time",
}


def _report_cells(r: dict) -> dict:
    """One report row's cells by column (``col/narrow``: the 80-column form)."""
    fl = short(r["fl_pick"])
    bad_fl = r["fl_outcome"] and r["fl_outcome"] != "timed"
    sp = r["speedup_vs_fl"]
    return {
        "tokens": (f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"]
                   else str(r["band_hi"])),
        "winner": short(r["winner"]) + (" [yellow]?[/]" if r.get("undecided") else ""),
        "noise": ("—" if r.get("band_noise") is None else
                  f"[yellow]{fmt_noise(r['band_noise'])}[/]" if r.get("undecided")
                  else fmt_noise(r["band_noise"])),
        "µs": fmt_us(r["winner_us"]),
        "runner-up": short(r["runner_up"]),
        "gap": "—" if r["gap"] is None else f"{r['gap']:+.1%}",
        "FL pick": fl + (f" ({r['fl_outcome']})" if bad_fl else ""),
        "FL pick/narrow": fl + (" [red]✗[/]" if bad_fl else ""),
        "FL µs": fmt_us(r["fl_us"]),
        "vs FL": "—" if sp is None else (f"[green]{sp:.2f}x[/]" if sp > 1.03 else f"{sp:.2f}x"),
        "parity": "—" if r["parity"] is None else f"{r['parity']:.4f}",
        "GB/s": "—" if r["gbps"] is None else f"{r['gbps']:.1f}",
    }


def render_report(rep: dict, console=None, wide: bool = False) -> None:
    if console is None:
        console = wide_console(150, wide=wide, fit=True)
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
    full, narrow = [], []
    for (op, sig, dt), rows in groups.items():
        # escape: rich would read "[eps=1e-06,hidden=64]" as markup and drop it
        title = escape(f"{op}  [{sig}]  {dt}  ×{rows[0]['weight']}/step")
        cells = [_report_cells(r) for r in rows]
        t = Table(title=title, title_justify="left")
        for col, just in REPORT_COLUMNS:
            t.add_column(col, justify=just)
        for c in cells:
            t.add_row(*(c[col] for col, _ in REPORT_COLUMNS))
        full.append(t)
        n = _narrow_table(title=title, title_justify="left")
        for col, just in REPORT_COLUMNS:
            if col in REPORT_NARROW:
                n.add_column(col, justify=just, no_wrap=True)
        for c in cells:
            n.add_row(*(c.get(col + "/narrow", c[col]) for col, _ in REPORT_COLUMNS
                        if col in REPORT_NARROW))
        narrow.append(n)
    use_full = wide or _fits(console, full)
    for t in (full if use_full else narrow):
        console.print(t)
    shown = [c for c, _ in REPORT_COLUMNS if use_full or c in REPORT_NARROW]
    _legend(console, REPORT_LEGEND, shown)
    if not use_full:
        console.print("  [dim](--wide adds " + ", ".join(
            c for c, _ in REPORT_COLUMNS if c not in REPORT_NARROW) + ")[/]")
    s = rep["summary"]
    ws = s["weighted_speedup_vs_fl"]
    console.print(f"[bold]summary[/]: {s['bands']} bands; measured pick differs from the fixed FL "
                  f"order in {s['bands_where_measured_differs_from_fl']}; FL's pick fails parity or "
                  f"raises in {s['bands_where_fl_pick_fails']}; workload-weighted speedup over the "
                  f"fixed FL order: " + ("—" if ws is None else f"[bold]{ws:.2f}x[/]") +
                  ("" if s["max_speedup_vs_fl"] is None else f" (max {s['max_speedup_vs_fl']:.2f}x)") +
                  f"; undecided (noise above the win margin): {s.get('bands_undecided', 0)}")
    _noise_warning(console, rep)
    render_route_decisions(rep.get("route_decisions") or [], console)
    render_engine_picks(rep.get("engine_picks") or [], console)


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
    if doc.get("unconfirmed"):
        n = doc["unconfirmed"]
        console.print(f"[yellow]note:[/] {n} band{'s' if n != 1 else ''} read ok only inside "
                      f"their own race's spread (raced again, still too noisy to tell): "
                      f"unconfirmed; `--all` shows them. Re-run on a quieter machine or with a "
                      f"larger --budget")
    if doc["stale"]:
        from ..store.hints import calibrate_command
        cmds = doc.get("recalibrate") or [calibrate_command(doc["db"], force=True)]
        console.print(f"[bold red]stale[/]: {doc['stale_bands']} of {doc['checked']} bands drifted "
                      f"({counts}); re-measure with " + " and ".join(
                          f"`{escape(c)}`" for c in cmds))
    else:
        console.print(f"[bold green]ok[/]: {doc['checked']} bands re-measured, none drifted "
                      f"({counts}), {doc['wall_s']:.1f} s")


DIFF_LEGEND = {
    "op": "the op", "signature": "the op's shape signature (the table's key)",
    "dtype": "the table's dtype",
    "tokens": "the band: the token counts it covers",
    "status": "same / changed (winner differs) / moved (same winner, its time moved "
              "beyond the threshold) / only_a, only_b (band in one side only)",
    "A winner": "A's measured pick", "A µs": "its median time per call on A",
    "B winner": "B's measured pick", "B µs": "its median time per call on B",
    "B/A": "B's winner time / A's winner time",
    "A's pick on B": "where the winner changed: A's pick timed on B / B's winner "
                     "(what keeping A's choice would cost on B)",
    "A on B": "where the winner changed: A's pick timed on B / B's winner "
              "(what keeping A's choice would cost on B)",
    "B's pick on A": "where the winner changed: B's pick timed on A / A's winner",
    "B on A": "where the winner changed: B's pick timed on A / A's winner",
}
DIFF_COLUMNS = ("op", "signature", "dtype", "tokens", "status", "A winner", "A µs",
                "B winner", "B µs", "B/A", "A's pick on B", "B's pick on A")
DIFF_NARROW = {"A's pick on B": "A on B", "B's pick on A": "B on A"}


def _diff_cells(r: dict) -> dict:
    st = r["status"]
    a, b = r["a"] or {}, r["b"] or {}
    return {"op": r["op"], "signature": escape(r["signature"]), "dtype": r["dtype"],
            "tokens": (f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"]
                       else str(r["band_hi"])),
            "status": f"[yellow]{st}[/]" if st != "same" else ("moved" if r["time_moved"] else st),
            "A winner": short(a.get("impl_id")), "A µs": fmt_us(a.get("us")),
            "B winner": short(b.get("impl_id")), "B µs": fmt_us(b.get("us")),
            "B/A": _x(r.get("time_ratio")), "A's pick on B": _x(r.get("a_pick_on_b")),
            "B's pick on A": _x(r.get("b_pick_on_a"))}


def _diff_justify(c: str) -> str:
    return "right" if ("µs" in c or c in ("tokens", "B/A") or " on " in c) else "left"


def render_diff(doc: dict, console=None, all_bands: bool = False, wide: bool = False) -> None:

    if console is None:
        console = wide_console(160, wide=wide, fit=True)

    def lab(s):
        d = s["device"]
        return escape(f"{s['db']}: {d['name']} [{d['device_key']}] driver {d['driver']}")
    console.print(f"[bold]fltune diff[/]\n  A = {lab(doc['a'])}\n  B = {lab(doc['b'])}")
    rows = doc["rows"] if all_bands else [r for r in doc["rows"]
                                          if r["status"] != "same" or r["time_moved"]]
    if rows:
        title = "all bands" if all_bands else "bands that differ"
        full = Table(title=title, title_justify="left")
        for c in DIFF_COLUMNS:
            full.add_column(c, justify=_diff_justify(c), no_wrap=True)
        groups: dict = {}
        for r in rows:
            cells = _diff_cells(r)
            full.add_row(*(cells[c] for c in DIFF_COLUMNS))
            groups.setdefault((r["op"], r["signature"], r["dtype"]), []).append(cells)
        if wide or _fits(console, [full]):
            console.print(full)
            shown = DIFF_COLUMNS
        else:
            # 80 columns: one table per (op, signature, dtype), the signature whole in its
            # title (a cut signature made two tables read the same)
            console.print(f"[bold]{title}[/]")
            shown = [DIFF_NARROW.get(c, c) for c in DIFF_COLUMNS[3:]]
            for (op, sig, dt), cells in groups.items():
                t = _narrow_table(title=escape(f"{op}  [{sig}]  {dt}"), title_justify="left")
                for c in shown:
                    t.add_column(c, justify=_diff_justify(c), no_wrap=True)
                for cl in cells:
                    t.add_row(*(cl[c] for c in DIFF_COLUMNS[3:]))
                console.print(t)
        _legend(console, DIFF_LEGEND, shown)
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
            st += " (why: below)"
        t.add_row(r["op"], escape(r["signature"]), r["dtype"],
                  f"{r['lower_lo']}-{r['lower_hi']} | {r['upper_lo']}-{r['upper_hi']}",
                  short(r["impl_below"]), short(r["impl_above"]), str(r["old_edge"]),
                  "—" if r["new_edge"] is None else str(r["new_edge"]),
                  str(len(r["probes"])), pct(r["gap_before"]), pct(r["gap_after"]),
                  escape(st))
    console.print(t)
    # the reasons whole, below the table: they name the command that fixes them
    for r in doc["pairs"]:
        if r.get("reason") and r["status"] in ("failed", "skipped"):
            console.print(f"{r['status']}: {escape(r['op'])} ≤{r['lower_hi']}|≤{r['upper_hi']}: "
                          f"{escape(r['reason'])}")
    s = doc["summary"]
    console.print(f"{s['pairs']} pairs ({', '.join(f'{k} {v}' for k, v in sorted(s['status'].items()))}); "
                  f"{s['edges_moved']} edges moved; oracle gap over the probe points, "
                  f"workload-weighted: before {pct(s['gap_before'])} → after "
                  f"{pct(s['gap_after'])}; {doc['wall_s']:.1f} s")


def against_aa_lines(reading) -> list:
    """(scenario, arm, verdicts, floors) as plain text, one per arm of an ``against_aa``
    reading (``model_step.read_against_aa``): verdicts "kernel faster, wall tie" ("" where
    the arm had no usable CI), floors "(floors kernel ±1.0%, wall ±7.4% from aa, caa2)";
    the table and ``benchmarks/against_aa.py`` print the same words."""
    out = []
    for sc, r in (reading or {}).items():
        floors = ", ".join(f"{k} ±{r[k + '_floor']:.1%}" for k in ("kernel", "wall")
                           if r.get(k + "_floor") is not None)
        for name, v in r["arms"].items():
            out.append((sc, name, ", ".join(f"{k} {w}" for k, w in v.items()),
                        f"(floors {floors} from {', '.join(r['aa_arms'])})"))
    return out


def host_speed_line(speed: dict | None) -> str | None:
    """One line on how fast the host ran during the timed runs (the summary's
    ``engine.host_speed``: ``e2e_stats.host_speed``), before the table: the wall figures
    below are only as steady as it was. On session 44's H100s the probe read ~2x its
    fastest for 70 % of the runs and the wall A/A spread ±5-15 %; on session 35's it read
    1.06x and the A/A ±0.9-1.0 %. None where the run recorded no probes."""
    if not speed or not speed.get("runs"):
        return None
    from ..evaluate.e2e_stats import SLOW_HOST_FACTOR
    slow = (speed.get("median_over_floor") or 0) > SLOW_HOST_FACTOR
    return (f"{'[yellow]' if slow else ''}host: its probe read "
            f"{speed['median_over_floor']:.2f}x its fastest at the median, "
            f"{speed['p90_over_floor']:.2f}x at the 90th percentile, "
            f"{100 * speed['slow_share']:.0f} % of {speed['runs']} runs above "
            f"{SLOW_HOST_FACTOR}x{'[/]' if slow else ''} ("
            + ("slow: the wall CIs measure the host as much as the arms; read the kernel "
               "figures" if slow else "the wall CIs measure the arms") + ")")


def render_e2e(doc: dict, console=None) -> None:
    """`fltune bench --e2e`: per scenario x arm, the throughput ratio to the baseline (median
    [95% CI]) and GPU kernel µs per step (arm / baseline); then each arm's state."""
    from ..evaluate.e2e import is_fltune_arm

    if console is None:
        console = wide_console(170)
    eng = doc.get("engine") or {}
    base = eng.get("baseline", "vanilla")
    console.print(f"[bold]fltune bench --e2e[/] — {escape(str(doc['model']))} on "
                  f"{escape(str(doc['device']))}, vLLM {doc['vllm']}; {eng.get('reps')} reps "
                  f"after {eng.get('warmup')} warm-up, arms alternated; ratio = {base} time / "
                  f"arm time")
    from ..evaluate.e2e_stats import SLOW_HOST_NOTE_START
    line = host_speed_line(eng.get("host_speed"))
    for n in eng.get("notes") or []:
        if line and n.startswith(SLOW_HOST_NOTE_START):    # the host line says it
            continue
        console.print(f"[yellow]note:[/] {escape(n)}")
    if line:
        console.print(line)
    arms = [a for a in dict.fromkeys(p["arm"] for p in doc["points"])]
    scen = list(dict.fromkeys(p["scenario"] for p in doc["points"]))
    by = {(p["scenario"], p["arm"]): p for p in doc["points"]}
    t = Table(title=f"throughput ratio to {base}: median [95% CI], at the host's fast "
                    f"level [95% CI] · kernel µs/step arm/{base}",
              title_justify="left")
    t.add_column("scenario")
    t.add_column(f"{base} µs/step", justify="right")
    for a in arms:
        t.add_column(a, justify="right")
    for s in scen:
        cells = []
        base_us = None
        for a in arms:
            p = by.get((s, a))
            if p is None:
                cells.append("—")
                continue
            base_us = base_us or p.get("step_us_vanilla")
            lo, hi, med = p["ci_low"], p["ci_high"], p["ratio_median"]
            txt = f"{med:.3f} [{lo:.3f}, {hi:.3f}]"
            if lo > 1.0:
                txt = f"[green]{txt}[/]"
            elif hi < 1.0:
                txt = f"[red]{txt}[/]"
            if p.get("fast_ratio_median") is not None:
                txt += (f" fast {p['fast_ratio_median']:.3f} "
                        f"[{p['fast_ci_low']:.3f}, {p['fast_ci_high']:.3f}]")
            if p.get("kernel_us_arm") is not None and p.get("kernel_us_vanilla") is not None:
                txt += f" · {p['kernel_us_arm']:.1f}/{p['kernel_us_vanilla']:.1f}"
                if (p.get("kernel_n") or 0) > 1:
                    txt += (f" (kernel {p['kernel_ratio_median']:.3f} "
                            f"[{p['kernel_ci_low']:.3f}, {p['kernel_ci_high']:.3f}])")
            cells.append(txt)
        t.add_row(s, "—" if base_us is None else f"{base_us:.1f}", *cells)
    if doc["points"]:
        console.print(t)
    else:
        console.print(f"[red]no points[/]: the baseline arm {escape(base)} or every other arm "
                      f"failed (below; each worker's log is in the --out directory)")
    console.print(f"(n = reps; green: CI above 1.00 (faster than {base}), red: CI below 1.00; "
                  f"A/A arms show the instrument's noise: their CI half-width is the smallest "
                  f"effect that can be read)")
    # each arm read against the A/A arms (vanilla again, fresh compiles): what clears them
    for sc, name, verdict, floors in against_aa_lines(doc.get("against_aa")):
        if verdict:
            console.print(f"against the A/A {sc} {escape(name)}: {verdict} {escape(floors)}")
    # several processes per arm: how far each process sat from its arm's mean
    for p in doc["points"]:
        offs = p.get("process_offsets_pct") or {}
        if offs:
            def fmt(xs):
                return ", ".join("—" if x is None else f"{x:+.1f}%" for x in xs)
            console.print(f"processes {p['scenario']} {escape(p['arm'])}: "
                          f"{fmt(offs.get('arm') or [])} · {base}: "
                          f"{fmt(offs.get('vanilla') or [])} (each process's time against "
                          f"its arm's mean, median over reps)")
    # where a step's kernel time moved by 1 % or more: the kernels that moved it most
    for p in doc["points"]:
        deltas, base_us = p.get("kernel_top_deltas") or [], p.get("kernel_us_vanilla")
        if not deltas or not base_us or abs(
                (p.get("kernel_us_arm") or base_us) - base_us) < 0.01 * base_us:
            continue
        moved = ", ".join(f"{escape(d['name'][:48])} {d['delta_us']:+.1f}" for d in deltas[:3])
        console.print(f"kernel time moved {p['scenario']} {escape(p['arm'])}: "
                      f"{p['kernel_us_arm'] - base_us:+.1f} µs/step (median of the rounds); "
                      f"most (first round): {moved}")
    for name, a in (doc.get("arms") or {}).items():
        if not a.get("started"):
            console.print(f"[red]arm {escape(name)} did not start[/]: "
                          f"{escape(str(a.get('error')))}")
            continue
        bits = []
        if a.get("tokens_equal_baseline") is not None and name != base:
            bits.append("greedy tokens " + ("= " if a["tokens_equal_baseline"] else "≠ ") + base)
        if a.get("routed_calls"):
            bits.append("routed calls " + ", ".join(f"{k} {v}" for k, v in
                                                    sorted(a["routed_calls"].items())))
        elif is_fltune_arm(a.get("env")):
            bits.append("routed nothing")
        if a.get("error"):
            bits.append(f"[red]failed: {escape(str(a['error']))}[/]")
        console.print(f"arm {escape(name)}: {escape(str(a.get('env') or 'vanilla'))}; "
                      + "; ".join(bits))
    for sc, per in (doc.get("host_extra") or {}).items():
        for name, x in per.items():
            if "functions" not in x or x.get("why"):
                console.print(f"host profile {sc} {escape(name)}: {escape(str(x.get('why')))}")
                continue
            top = ", ".join(f"{escape(f['func'])} {f['extra_us']:+.0f} µs"
                            for f in x["functions"][:3])
            console.print(f"host profile {sc} (cProfile, per run): {escape(name)} "
                          f"{x['run_s_arm'] * 1e3:.1f} ms vs {base} {x['run_s_baseline'] * 1e3:.1f}"
                          f" ms; own time {x['own_time_extra_us']:+.0f} µs; most beyond "
                          f"{base}: {top}")


def _points_cell(points: list) -> str:
    """Each scenario's ratio to vanilla, median [95% CI], coloured when the CI excludes 1."""
    out = []
    for p in points or []:
        if p.get("ci_low") is None:
            out.append(f"{p['scenario']} —")
            continue
        txt = f"{p['scenario']} {p['ratio_median']:.3f} [{p['ci_low']:.3f}, {p['ci_high']:.3f}]"
        if p["ci_low"] > 1.0:
            txt = f"[green]{txt}[/]"
        elif p["ci_high"] < 1.0:
            txt = f"[red]{txt}[/]"
        out.append(txt)
    return "\n".join(out) or "no run: nothing to route"


def render_route_decisions(rows: list, console=None, title: str = None) -> None:
    """Per model and op: route or native, why, and the model-step evidence it rests on."""
    if not rows:
        return
    if console is None:
        console = wide_console(170)
    t = Table(title=title or "routing decided by model-step measurement (fltune adjudicate)",
              title_justify="left")
    for col in ("model", "op", "tokens", "decision", "reason", "ratio to vanilla per scenario"):
        t.add_column(col, overflow="fold")          # fold, never cut: 80 columns stay whole
    for r in rows:
        ev = r.get("evidence") or {}
        points = r.get("points", ev.get("points"))
        dec = r["decision"]
        lo, hi = r.get("min_tokens") or 1, r.get("max_tokens")
        # the token range the decision covers (--per-range); "all" for the whole range
        tokens = "all" if lo <= 1 and hi is None else (f"{lo}+" if hi is None else f"{lo}-{hi}")
        reason = escape(str(r.get("reason") or ""))
        if r.get("stale"):          # freeze leaves it out: the op is on vLLM's path
            dec, reason = (f"[dim]{dec}[/] [bold yellow]stale[/]",
                           f"[yellow]stale, not in force ({escape(r['stale'])}): re-run "
                           f"fltune adjudicate[/]; was: {reason}")
        elif dec == "route":
            dec = f"[bold green]{dec}[/]"
        cell = _points_cell(points)
        served = r.get("as_served") or ev.get("as_served")
        if isinstance(served, dict) and served.get("verdict"):
            # the split as served (adjudicate --confirm), which it was kept or undone on
            cell += (f"\nas served, {escape(str(served['verdict']))}:\n"
                     + _points_cell(served.get("evidence", served.get("points"))))
        t.add_row(escape(str(r.get("model") or "")), r["op"], tokens, dec, reason, cell)
    console.print(t)


def render_adjudication(doc: dict, console=None) -> None:
    """`fltune adjudicate`: the decisions just measured and stored."""
    if console is None:
        console = wide_console(170)
    console.print(f"[bold]fltune adjudicate[/] — {escape(str(doc.get('model')))} on "
                  f"{escape(str(doc.get('device')))}; rule {doc.get('rule')}; "
                  f"{doc.get('reps')} reps after {doc.get('warmup')} warm-up")
    for w in doc.get("warnings") or []:
        console.print(f"[yellow]warning:[/] {escape(str(w))}")
    rows = [{**d, "model": doc.get("model")} for d in doc.get("decisions") or []]
    render_route_decisions(rows, console, title="decisions (stored in the DB; freeze and "
                                                "`fltune serve --db` follow them)")


def render_engine_picks(rows: list, console=None, title: str = None) -> None:
    """Per model and engine-wide choice: the value picked or vLLM's default kept, why, and
    per value measured its verdict and ratio to vanilla per scenario."""
    if not rows:
        return
    if console is None:
        console = wide_console(170)
    t = Table(title=title or "engine-wide picks measured by model step (fltune adjudicate "
                             "--engine-choice)", title_justify="left")
    for col in ("model", "choice", "pick", "reason", "value: ratio to vanilla per scenario"):
        t.add_column(col, overflow="fold")
    for r in rows:
        pick = (f"[bold green]{escape(str(r['value']))}[/]" if r["decision"] == "pick"
                else "vLLM's default")
        cells = [f"{escape(str(v))} ({e.get('verdict')}{_carried(e)}):\n"
                 f"{_points_cell(e.get('points'))}" for v, e in (r.get("values") or {}).items()]
        t.add_row(escape(str(r.get("model") or "")), r["choice"], pick,
                  escape(str(r.get("reason") or "")), "\n".join(cells) or "—")
    console.print(t)


def _carried(e: dict) -> str:
    """', earlier run DATE' for a value an earlier adjudication measured."""
    from ..evaluate.engine_pick import carried_date

    when = carried_date(e)
    return f", earlier run {when}" if when else ""


def render_engine_adjudication(doc: dict, console=None) -> None:
    """`fltune adjudicate --engine-choice`: the values offered, measured and the pick."""
    if console is None:
        console = wide_console(170)
    dev = doc.get("device") or {}
    console.print(f"[bold]fltune adjudicate --engine-choice {doc.get('choice')}[/] — "
                  f"{escape(str(doc.get('model')))} on {escape(str(dev.get('name')))}; rule "
                  f"{doc.get('rule')}; {doc.get('reps')} reps after {doc.get('warmup')} "
                  f"warm-up; values {', '.join(doc.get('values') or [])} against vLLM's default")
    ev = doc.get("evidence") or {}
    row = {"model": doc.get("model"), "choice": doc.get("choice"),
           "decision": doc.get("decision"), "value": doc.get("value"),
           "reason": doc.get("reason"), "values": ev.get("values") or {}}
    render_engine_picks([row], console, title="pick (stored in the DB; freeze and `fltune "
                                              "serve --db` apply it)")


def render_engine_listing(listings: list, console=None) -> None:
    """`fltune adjudicate --engine-choice NAME --list`: what this vLLM offers here."""
    if console is None:
        console = wide_console(170)
    t = Table(title="engine-wide choices on this vLLM and device", title_justify="left")
    for col in ("choice", "values", "vLLM's default", "excluded", "notes"):
        t.add_column(col, overflow="fold")
    for d in listings:
        t.add_row(d["choice"], ", ".join(d["values"]) or "—", str(d.get("default") or "—"),
                  "\n".join(f"{k}: {escape(str(v))}" for k, v in d["excluded"].items()) or "—",
                  escape("; ".join(d.get("notes") or [])) or "—")
    console.print(t)


def _merge_key(c: dict) -> str:
    """A conflict's key in one short line: the band (or run, decision) it is about."""
    k = dict(c["key"])
    dev = k.pop("device_key", None)
    drv = k.pop("driver", None)
    head = f"{(dev or '')[:8]}@{drv}" if dev or drv else ""
    return " ".join([head] + [str(v) for v in k.values()]).strip()


def render_merge(doc: dict, console=None) -> None:
    """`fltune merge`: rows taken per table, then every conflict with the rule that decided
    it (the whole sides are in ``--json``)."""
    if console is None:
        console = wide_console(150)
    console.print(f"[bold]fltune merge[/] — {len(doc['inputs'])} DBs → {escape(doc['out'])}")
    t = Table(title="rows per table (inputs together → merged)", title_justify="left")
    t.add_column("table")
    for i, _ in enumerate(doc["inputs"]):
        t.add_column(f"in {i + 1}", justify="right")
    t.add_column("merged", justify="right")
    for name, r in doc["rows"].items():
        if not r["in"] and not r["out"]:
            continue
        t.add_row(name, *(str(d["rows"].get(name, 0)) for d in doc["inputs"]), str(r["out"]))
    console.print(t)
    for i, d in enumerate(doc["inputs"]):
        mig = f" (schema {d['schema_version']}, migrated in a copy)" if d["migrated"] else ""
        console.print(f"in {i + 1}: {escape(d['path'])}{mig}")
    # a band's measurements follow its winner: those conflicts are counted, not repeated
    followed = [c for c in doc["conflicts"]
                if c["table"] == "measurements" and c["rule"] == "with the winner"]
    shown = [c for c in doc["conflicts"] if c not in followed]
    if shown:
        t = Table(title="conflicts (same key, different rows): kept by the rule",
                  title_justify="left")
        for c in ("table", "key", "kept from", "rule", "why"):
            t.add_column(c, overflow="fold")
        for c in shown:
            t.add_row(c["table"], escape(_merge_key(c)), escape(", ".join(c["kept"])),
                      c["rule"], escape(c["why"]))
        console.print(t)
    if followed:
        console.print(f"measurements of {len(followed)} band(s) followed their kept "
                      f"winner (both sides of each in --json)")
    for n in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(n)}")
    s = doc["summary"]
    rules = ", ".join(f"{k} {v}" for k, v in sorted(s["rules"].items())) or "none"
    console.print(f"{s['conflicts']} conflicts ({rules}); integrity {doc['integrity']}; "
                  f"{s['rows_out']} rows in {doc['wall_s']:.1f} s → {escape(doc['out'])}")
