"""A short fault campaign on the fleet topology: `mimo-epd chaos` starts redis-server, `serve --join` (two
encoders, no LLM) and two `mimo-epd router` on that Redis, drives them with Locust (users failing over
between the routers), SIGKILLs an encoder, a decode worker and a router, and reports. Asserted: the JSON
shape, that no request failed beyond those in flight on the killed path, that every fault recovered (a
success on the affected path, a serving replacement, the routers SERVING) and that everything stopped
cleanly with nothing left behind."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the fleet topology needs redis-server")
def test_chaos_encoder_decode_worker_and_router_on_a_fleet():
    # No LLM worker and one decode process per encoder: the node starts and restarts quickly on 2 cores.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mimo_epd",
            "chaos",
            "--topology",
            "fleet",
            "--duration-s",
            "21",
            "--soak-s",
            "0",
            "--faults",
            "router,encoder,decode_worker",
            "--users",
            "3",
            "--recover-timeout-s",
            "60",
            "--serve-args=--no-llm --decode-workers 1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"faults", "skipped", "load", "soak", "failures_outside_fault_windows", "serve_exit_code"} <= set(out)
    assert out["topology"] == "fleet" and len(out["routers"]) == 2
    assert [f["fault"] for f in out["faults"]][:3] == ["router", "encoder", "decode_worker"], out["faults"]
    assert out["load"]["faults"]["requests"] > 0
    for f in out["faults"]:
        assert {
            "pid",
            "t_kill_s",
            "inflight_at_kill",
            "inflight_on_killed_path",
            "failed",
            "failed_started_after_kill",
            "first_success_s",
            "replaced_s",
            "health_serving_s",
        } <= set(f), f
        # only requests in flight on the killed path may fail; none that started after the kill
        assert f["failed_started_after_kill"] == 0 and f["failed_beyond_inflight_on_killed_path"] == 0, f
        assert f["first_success_s"] is not None and f["replaced_s"] is not None and f["health_serving_s"] is not None, f
    router = out["faults"][0]
    assert router["endpoint"] in out["routers"] and router["restart_s"] is not None, router
    enc = out["faults"][1]
    assert enc["new_pid"] != enc["pid"] and enc["rejoined_ring_s"] is not None, enc
    dec = out["faults"][2]
    assert dec["pid"] not in dec["new_pids"] and dec["pool_replaced_s"] is not None, dec
    assert out["failures_outside_fault_windows"] == 0
    assert out["serve_exit_code"] == 0 and out["router_exit_codes"] == [0, 0]
    assert out["processes_left_after_stop"] == 0, out["processes_left_roles"]
