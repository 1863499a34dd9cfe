"""deploy/render.py's Kubernetes manifests: every rendered object validates against the Kubernetes 1.37 schemas
offline and strictly (the `kubernetes-validate` wheel, no cluster), the fleet has what docs/deploy.md promises
(several stateless routers with a PodDisruptionBudget, probes on the gRPC health service and /health, resource
requests, `--join` through the Redis service, the Mooncake store on every LLM node), and every flag the manifests
pass to mimo-epd exists in docs/cli.md for that command (and every mooncake_master flag in the binary's --help)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))
import render  # noqa: E402 - deploy/render.py is a script, not a package module

kv = pytest.importorskip("kubernetes_validate", reason="the dev extra's kubernetes-validate")
K8S = "1.37.0"


def docs() -> list[dict]:
    return render.render(render.load_values())


def containers(objs, kind="Deployment"):
    for o in objs:
        if o["kind"] == kind:
            for c in o["spec"]["template"]["spec"]["containers"]:
                yield o, c


@pytest.mark.parametrize("variant", ["default", "gpu"])
def test_every_manifest_validates_strictly(variant):
    values = render.load_values()
    if variant == "gpu":
        values = copy.deepcopy(values)
        both = values["llm"]["roles"]["both"]
        both["gpus"], both["flags"]["llm-device"] = 1, "cuda"
    objs = render.render(values)
    assert len(objs) >= 10
    for o in objs:
        kv.validate(o, K8S, strict=True)  # raises ValidationError naming the field


def test_validation_really_refuses_a_bad_object():
    bad = copy.deepcopy(next(o for o in docs() if o["kind"] == "Deployment"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S, strict=True)
    bad = copy.deepcopy(next(o for o in docs() if o["kind"] == "Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S, strict=True)


def test_the_fleet_has_its_parts():
    objs = docs()
    by = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for name in ("redis", "mooncake", "router"):
        assert ("Service", f"mimo-epd-{name}") in by and ("Deployment", f"mimo-epd-{name}") in by
    for role in ("both", "pd"):
        assert ("Deployment", f"mimo-epd-llm-{role}") in by, role
    pd = next(c["args"] for _, c in containers(objs) if c["name"] == "llm-pd")
    assert "--pd-prefill-workers" in pd and "--pd-decode-workers" in pd
    assert ("Deployment", "mimo-epd-encoders") in by
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "mimo-epd-router")
    assert router["spec"]["replicas"] >= 2
    pdb = next(o for o in objs if o["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    for o, c in containers(objs):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], o["metadata"]["name"]
        assert "readinessProbe" in c and "livenessProbe" in c, o["metadata"]["name"]
        if c.get("args", [""])[0] in ("router", "serve"):
            assert c["livenessProbe"]["grpc"]["port"], o["metadata"]["name"]  # the gRPC health service
        if c.get("args", [""])[0] == "serve":
            a = c["args"]
            assert a[a.index("--join") + 1].startswith("redis://mimo-epd-redis.") and "$(POD_IP)" in a
    ((_, rc),) = [(o, c) for o, c in containers(objs) if c["args"][0] == "router"]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health"
    ((_, llm),) = [(o, c) for o, c in containers(objs) if c["name"] == "llm-both"]
    store = llm["args"][llm["args"].index("--llm-kv-store") + 1]
    assert store.startswith("mooncake://mimo-epd-mooncake.") and "local=$(POD_IP)" in store


def cli_flags() -> dict[str, set[str]]:
    """{command: its flags} from docs/cli.md's tables (both spellings of a --x / --no-x pair)."""
    out: dict[str, set[str]] = {}
    cmd = None
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        m = re.match(r"^## mimo-epd (.+)$", line)
        if m:
            cmd = m.group(1).strip()
            out[cmd] = set()
        elif cmd and line.startswith("| `--"):
            out[cmd] |= set(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return out


def test_every_flag_the_manifests_pass_is_documented():
    known = cli_flags()
    checked = 0
    for o, c in containers(docs()):
        if c.get("command"):  # not mimo-epd (the Mooncake master, Redis): below
            continue
        if c["image"].startswith("redis"):
            continue
        cmd, args = c["args"][0], c["args"][1:]
        assert cmd in known, f"{o['metadata']['name']}: mimo-epd {cmd} is not in docs/cli.md"
        for a in args:
            if a.startswith("--"):
                assert a in known[cmd], f"{o['metadata']['name']}: mimo-epd {cmd} {a} is not in docs/cli.md"
                checked += 1
    assert checked >= 20


def test_every_mooncake_master_flag_exists():
    from mimo_epd.testing.mooncake_master import master_binary

    exe = master_binary()
    if exe is None:
        pytest.skip("the mooncake-transfer-engine wheel is not installed")
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
    ((_, c),) = [(o, c) for o, c in containers(docs()) if c.get("command") == ["mooncake_master"]]
    for a in c["args"]:
        name = a.lstrip("-").split("=", 1)[0]
        assert re.search(rf"^\s+-{name} ", helptext, re.M), f"mooncake_master has no -{name}"


def test_the_renderer_prints_yaml(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "render.py")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.count("\n---\n") + 1 == len(docs())


def test_every_mimo_command_parses_and_validates():
    """The rendered commands go through the real CLI parser and the configs' own checks (no process starts)."""
    from encoder_server.config import EncoderServerConfig
    from mimo_epd.cli import build_parser
    from mimo_epd.cli.serve import plan_serve
    from mimo_epd.launcher import NodeConfig

    parser = build_parser()
    seen = set()
    for _, c in containers(docs()):
        if c.get("command") or c["image"].startswith("redis"):
            continue
        argv = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
        args = parser.parse_args(argv)  # SystemExit (exit 2) on an unknown flag or a bad value
        if argv[0] == "serve":
            plan_serve(args)
            EncoderServerConfig.from_args(args), NodeConfig.from_args(args)  # ValueError naming the flag
        seen.add(argv[0])
    assert seen == {"router", "serve"}


def test_the_multinode_replica_is_a_leader_worker_set_whose_pods_validate_and_whose_commands_parse():
    """`llm.multinode.enabled`: a LeaderWorkerSet (a CRD: its pod templates are validated as core Pods, strictly),
    the leader's serve and the other pods' `llm --node-rank` parse with the real CLI and agree on the replica."""
    from mimo_epd.cli import build_parser

    values = copy.deepcopy(render.load_values())
    values["llm"]["multinode"]["enabled"] = True
    (lws,) = [o for o in render.render(values) if o["kind"] == "LeaderWorkerSet"]
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    parser = build_parser()
    parsed = {}
    for which in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", "namespace": "y"}, "spec": t[which]["spec"]}
        kv.validate(pod, K8S, strict=True)
        argv = [
            a.replace("$(POD_IP)", "10.0.0.7")
            .replace("$(LWS_LEADER_ADDRESS)", "10.0.0.7")
            .replace("$(LWS_WORKER_INDEX)", "1")
            for a in t[which]["spec"]["containers"][0]["args"]
        ]
        parsed[which] = parser.parse_args(argv)
    lead, work = parsed["leaderTemplate"], parsed["workerTemplate"]
    assert lead.llm_tensor_parallel_size == work.tensor_parallel_size == 16
    assert lead.llm_nnodes == work.nnodes == 2 and lead.llm_node_rank == 0 and work.node_rank == 1
    assert lead.llm_dist_init_addr == work.dist_init_addr == "10.0.0.7:29500"
    assert lead.llm_model == work.model and lead.llm_enable_expert_parallel and work.enable_expert_parallel
    from llm_backend.config import LLMConfig
    from mimo_epd.common.flags import from_args

    from_args(LLMConfig, work).validate()  # ValueError naming the flag
    from_args(LLMConfig, lead, prefix="llm_").validate()
