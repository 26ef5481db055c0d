"""The in-context instrument with the IR route as an arm (issue 13).

    [ROUTE=ops:a,b] [REPS=8] [SCENARIOS=decode_b1,...] [ARMS=vanilla,aa,layer,ir] \
      [ENDPOINTS=auto|'[256,1024]'] python benchmarks/ir_e2e.py PROFILE DB|MANIFEST.json OUT

Arms: vanilla, aa (A/A), layer (FLTUNE_DB + FLTUNE_ROUTE: the layer classes) and ir (the same
plus FLTUNE_SEAM=ir). ``fltune bench --e2e --arm`` cannot express the last (its specs carry no
FLTUNE_SEAM, and every FLTUNE_* of the parent is stripped), so the arms are built here and
run through the same ``run_e2e``; the summary is written as the CLI writes it.

ENDPOINTS: vLLM's ``compile_ranges_endpoints`` for the ``ir`` arm alone (an engine overlay;
vanilla runs as vLLM runs), so each compiled range lowers one kind of winner (the IR
provider declines ranges whose bands are all vLLM's own path: Inductor fuses native there).
``auto`` (needs a manifest): the IR ops' native/other band edges
(``ir_provider.native_edges``, what the plugin logs for the served plan).
"""
import json, os, sys
from fltune.evaluate import e2e
from fltune.cli.render import render_e2e
prof, db, out = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
route = os.environ.get("ROUTE", "ops:fused_add_rms_norm,rms_norm")
src = "FLTUNE_MANIFEST" if db.endswith(".json") else "FLTUNE_DB"     # a manifest or a DB
ends = os.environ.get("ENDPOINTS")
if ends == "auto":
    from fltune.dispatch.manifest import Manifest
    from fltune.integrations.vllm.ir_provider import native_edges
    ends = native_edges(Manifest.from_json(json.load(open(db)), db))
elif ends:
    ends = json.loads(ends)
ir_engine = {"compilation_config": {"compile_ranges_endpoints": ends}} if ends else None
every = {"vanilla": e2e.Arm("vanilla"), "aa": e2e.Arm("aa"),
         "layer": e2e.Arm("layer", {src: db, "FLTUNE_ROUTE": route}),
         "ir": e2e.Arm("ir", {src: db, "FLTUNE_ROUTE": route, "FLTUNE_SEAM": "ir"},
                       engine=ir_engine or {})}
arms = [every[a] for a in os.environ.get("ARMS", "vanilla,aa,layer,ir").split(",")]
print("ir arm's compile_ranges_endpoints:", ends, flush=True)
dev = "cuda" if __import__("torch").cuda.is_available() else "cpu"
names = os.environ.get("SCENARIOS")
sc = e2e.scenarios_by_name(names.split(","), dev) if names else e2e.default_scenarios(dev)
res = e2e.run_e2e(prof, arms, sc, reps=int(os.environ.get("REPS", "8")), warmup=2,
                  out_dir=out, device_type=dev)
doc = res.to_summary(device=res.device_name or dev, model=prof, vllm=res.vllm_version or "?",
                     command=" ".join(["ir_e2e.py"] + sys.argv[1:]) + f" ROUTE={route} ENDPOINTS={ends}")
json.dump(doc, open(os.path.join(out, "e2e-summary.json"), "w"), indent=1, default=str)
render_e2e(doc)
