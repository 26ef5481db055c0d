"""Two kinds of device in one Ray cluster: each gets its own rows, and ``verify --ray`` checks
each node against its own.

A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: two raylets,
loopback only) where the second node's processes run with ``ATEN_CPU_CAPABILITY=default``:
torch there uses its baseline kernels instead of this CPU's vector ISA, so that node's device
record has another capability and so another device key — a different kind of device, as a
host with another GPU model would be. One CPU actor per node; each kind is measured whole by
its one actor, into its own ``devices``, ``runs``, ``winners`` and ``measurements`` rows of
the one DB; no spread is sampled (a kind with one actor has no second card).
"""
from __future__ import annotations

import os
import sqlite3

import pytest

from fltune.tune.race import Settings

if os.environ.get("CI"):
    import ray      # CI installs it (scripts/setup.sh)
else:
    ray = pytest.importorskip("ray", reason="pip install 'fltune[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402

from fltune.evaluate.ray_verify import verify_ray  # noqa: E402
from fltune.tune import ray_calibrate as rc  # noqa: E402

MODEL = "tiny-qwen3"
OPS = ["silu_and_mul"]
MAX_TOKENS = 4                          # bands 1, 2, 4


@pytest.fixture(scope="module")
def fleet():
    # every Ray process on the loopback address (Ray's own switch for single-machine use)
    old = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, env_vars={"ATEN_CPU_CAPABILITY": "default"})
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    if old is None:
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    else:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old


@pytest.fixture(scope="module")
def fleet_db(fleet, tmp_path_factory):
    db = tmp_path_factory.mktemp("fleet") / "fleet.db"
    res = rc.calibrate_ray(MODEL, str(db), max_tokens=MAX_TOKENS, ops=OPS,
                           settings=Settings(budget_s=0.003), isolate=False,
                           warn=lambda line: None)
    return db, res


def test_each_device_key_gets_its_own_rows(fleet_db):
    db, res = fleet_db
    assert not res.incomplete and len(res.actors) == 2          # one per node by default
    assert len(res.groups) == 2 and [g["measured"] for g in res.groups] == [3, 3]
    assert [g["spread_samples"] for g in res.groups] == [[], []]
    con = sqlite3.connect(db)
    devices = con.execute("select device_key, capability from devices").fetchall()
    assert len({k for k, _ in devices}) == 2
    assert "DEFAULT" in {cap for _, cap in devices}
    for key, _ in devices:
        # each kind holds the whole workload, once, measured by its own run
        assert sorted(r[0] for r in con.execute(
            "select band_hi from winners where device_key=?", [key])) == [1, 2, 4]
        runs = con.execute("select status, id from runs where device_key=?", [key]).fetchall()
        assert [s for s, _ in runs] == ["done"]
        assert {r[0] for r in con.execute("select distinct run_id from measurements where "
                                          "device_key=?", [key])} == {runs[0][1]}
    assert con.execute("select count(*) from winners").fetchone()[0] == 6


def test_verify_ray_checks_each_node_against_its_own_device(fleet_db):
    db, _ = fleet_db
    doc = verify_ray(str(db), noise_floor=10.0, budget_s=0.003, isolate=False)
    # which bands drift is timing on a shared 2-core machine (a close winner can flip): not
    # asserted; that each node re-timed its own kind's winners is
    assert len(doc["nodes"]) == 2 and doc["uncalibrated_nodes"] == []
    keys = {n["db_device"]["device_key"] for n in doc["nodes"]}
    assert len(keys) == 2                                       # each node its own kind
    assert [n["checked"] for n in doc["nodes"]] == [3, 3]
    assert all(n["device"]["device_key"] == n["db_device"]["device_key"]
               for n in doc["nodes"])
