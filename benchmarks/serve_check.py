"""On the GPU machine: the H100's picks-only DB frozen, and what `fltune serve` and the
e2e instrument's db arm make of it (session 36)."""
import io
import sys

from fltune.dispatch.manifest import model_key
from fltune.evaluate import e2e, engine_pick
from fltune.integrations.vllm import serve

db = sys.argv[1]
d = e2e.stable_model_dir("Qwen3-0.6B")
buf = io.StringIO()
argv, env, plan = serve.prepare(db, False, [d], out=buf)
print("serve says:\n" + buf.getvalue())
print("vllm argv tail:", argv[-6:])
print("routed ops:", None if plan is None else plan.routed)
key = model_key(e2e.config_of(d))
print("db arm overlay:", engine_pick.served_engine_overlay(e2e.parse_arm(f"calibrated=db:{db}"), key))
