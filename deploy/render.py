"""Renders the fleet's Kubernetes manifests from values (a Helm-free chart): `python deploy/render.py
[--values deploy/values.yaml] > mimo-epd.yaml`, then `kubectl apply -f mimo-epd.yaml`. docs/deploy.md.

What it renders (one namespace): Redis (routing state, the registry `serve --join` writes, KV events) and the
Mooncake master (the shared KV tier's metadata), each a Deployment with a Service; the routers (a Deployment of
`values.router.replicas`, a Service for gRPC and the OpenAI HTTP API, a PodDisruptionBudget); the encoder nodes and
the LLM nodes by role, `mimo-epd serve --join redis://...` with `--node-host` the pod IP (the routers reach the
pods directly, found in the registry). Probes: the gRPC health service (`grpc` probes) everywhere mimo-epd runs,
and the router's `/health` (proxied to a worker) for readiness. Role flags come from `values.*.flags`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
APP = "mimo-epd"


def flag_args(flags: dict) -> list[str]:
    """{name: value} -> ["--name", "value"]; true -> --name, false -> --no-name."""
    out: list[str] = []
    for name, value in flags.items():
        if value is True:
            out.append(f"--{name}")
        elif value is False:
            out.append(f"--no-{name}")
        else:
            out += [f"--{name}", str(value)]
    return out


def meta(name: str, ns: str, component: str) -> dict:
    return {"name": name, "namespace": ns, "labels": labels(component)}


def labels(component: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def deployment(name, ns, component, replicas, container, volumes=None) -> dict:
    spec = {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001}, "containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, ns, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels(component)},
            "template": {"metadata": {"labels": labels(component)}, "spec": spec},
        },
    }


def service(name, ns, component, ports: dict, headless=False) -> dict:
    spec = {
        "selector": labels(component),
        "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports.items()],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, ns, component), "spec": spec}


def grpc_probe(port: int, period: int = 10, initial: int = 5) -> dict:
    return {"grpc": {"port": port}, "periodSeconds": period, "initialDelaySeconds": initial, "timeoutSeconds": 5}


POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def mimo_container(v, name, args, ports: dict, resources, health_port, extra_env=None) -> dict:
    c = {
        "name": name,
        "image": v["image"],
        "imagePullPolicy": v["imagePullPolicy"],
        "args": args,
        "env": [POD_IP, {"name": "MIMO_HEALTH_ADDR", "value": f"127.0.0.1:{health_port}"}, *(extra_env or [])],
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": resources,
        "startupProbe": {**grpc_probe(health_port, 10, 5), "failureThreshold": 60},
        "livenessProbe": grpc_probe(health_port, 15),
        "readinessProbe": grpc_probe(health_port, 5),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False},
    }
    return c


def shm_volume(size: int) -> tuple[list, list]:
    """/dev/shm as memory of the node cache's size (the shm embedding cache lives there)."""
    return [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(size + (64 << 20))}}], [
        {"name": "shm", "mountPath": "/dev/shm"}
    ]


def redis_url(v) -> str:
    return f"redis://{APP}-redis.{v['namespace']}.svc:6379/0"


def mooncake_url(v) -> str:
    host, m = f"{APP}-mooncake.{v['namespace']}.svc", v["mooncake"]
    return f"mooncake://{host}:{m['rpcPort']}?metadata=http://{host}:{m['metadataPort']}/metadata&local=$(POD_IP)"


def render_redis(v) -> list[dict]:
    ns, r = v["namespace"], v["redis"]
    c = {
        "name": "redis",
        "image": r["image"],
        "args": [
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            r["maxmemory"],
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "resources": r["resources"],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 10},
    }
    d = deployment(f"{APP}-redis", ns, "redis", 1, c)
    d["spec"]["template"]["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 999}
    return [d, service(f"{APP}-redis", ns, "redis", {"redis": 6379})]


def render_mooncake(v) -> list[dict]:
    ns, m = v["namespace"], v["mooncake"]
    args = [
        f"--rpc_port={m['rpcPort']}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={m['metadataPort']}",
        f"--metrics_port={m['metricsPort']}",
        "--logtostderr",
        *[f"--{k}={v_}" for k, v_ in m["flags"].items()],
    ]
    c = {
        "name": "mooncake-master",
        "image": v["image"],
        "imagePullPolicy": v["imagePullPolicy"],
        "command": ["mooncake_master"],
        "args": args,
        "ports": [
            {"name": "rpc", "containerPort": m["rpcPort"]},
            {"name": "metadata", "containerPort": m["metadataPort"]},
            {"name": "metrics", "containerPort": m["metricsPort"]},
        ],
        "resources": m["resources"],
        "readinessProbe": {"tcpSocket": {"port": m["rpcPort"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": m["rpcPort"]}, "periodSeconds": 10},
    }
    ports = {"rpc": m["rpcPort"], "metadata": m["metadataPort"], "metrics": m["metricsPort"]}
    return [
        deployment(f"{APP}-mooncake", ns, "mooncake-master", 1, c),
        service(f"{APP}-mooncake", ns, "mooncake-master", ports),
    ]


def render_router(v) -> list[dict]:
    ns, r = v["namespace"], v["router"]
    args = ["router", "--host", "0.0.0.0", "--port", str(r["grpcPort"]), "--http-port", str(r["httpPort"])]
    args += ["--metrics-port", str(r["metricsPort"]), "--router-state", redis_url(v), *flag_args(r["flags"])]
    ports = {"grpc": r["grpcPort"], "http": r["httpPort"], "metrics": r["metricsPort"]}
    c = mimo_container(v, "router", args, ports, r["resources"], r["grpcPort"])
    # Ready = a worker answers through it (the HTTP front proxies /health); alive = its gRPC health service.
    c["readinessProbe"] = {"httpGet": {"path": "/health", "port": r["httpPort"]}, "periodSeconds": 5}
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(f"{APP}-router", ns, "router"),
        "spec": {"minAvailable": r["minAvailable"], "selector": {"matchLabels": labels("router")}},
    }
    return [
        deployment(f"{APP}-router", ns, "router", r["replicas"], c),
        service(f"{APP}-router", ns, "router", ports),
        pdb,
    ]


def node_args(v, health_port: int, shm_bytes: int, flags: dict) -> list[str]:
    return [
        "serve",
        "--join",
        redis_url(v),
        "--node-host",
        "$(POD_IP)",
        "--host",
        "0.0.0.0",
        "--port",
        str(health_port),
        "--shm-cache-bytes",
        str(shm_bytes),
        *flag_args(flags),
    ]


def render_encoders(v) -> list[dict]:
    ns, e = v["namespace"], v["encoders"]
    args = node_args(v, e["healthPort"], e["shmBytes"], {**e["flags"], "llm": False})
    volumes, mounts = shm_volume(e["shmBytes"])
    c = mimo_container(v, "encoder-node", args, {"health": e["healthPort"]}, e["resources"], e["healthPort"])
    c["volumeMounts"] = mounts
    return [deployment(f"{APP}-encoders", ns, "encoders", e["replicas"], c, volumes)]


def render_llm(v) -> list[dict]:
    ns, out = v["namespace"], []
    for role, r in v["llm"]["roles"].items():
        flags = {**r["flags"], "llm-kv-store": mooncake_url(v), "llm-kv-store-segment-bytes": r["storeSegmentBytes"]}
        args = node_args(v, r["healthPort"], r["shmBytes"], flags)
        volumes, mounts = shm_volume(r["shmBytes"])
        resources = {k: dict(x) for k, x in r["resources"].items()}
        if r.get("gpus"):
            resources.setdefault("limits", {})["nvidia.com/gpu"] = r["gpus"]
        c = mimo_container(v, f"llm-{role}", args, {"health": r["healthPort"]}, resources, r["healthPort"])
        c["volumeMounts"] = mounts
        out.append(deployment(f"{APP}-llm-{role}", ns, f"llm-{role}", r["replicas"], c, volumes))
    return out


def render_multinode(v) -> list[dict]:
    """One replica over `nodes` pods (a LeaderWorkerSet): the leader is a node (`serve --join`, its LLM worker rank 0
    with the API), every other pod runs `mimo-epd llm --node-rank $(LWS_WORKER_INDEX)`, its ranks only. All meet at
    the leader's torch.distributed store; the group is recreated when any pod restarts (a replica with a rank gone
    cannot serve, docs/parallel.md)."""
    m = v["llm"].get("multinode") or {}
    if not m.get("enabled"):
        return []
    ns, name = v["namespace"], f"{APP}-llm-multinode"
    addr = f"$(LWS_LEADER_ADDRESS):{m['distPort']}"
    par = {"tensor-parallel-size": m["tensorParallelSize"], "nnodes": m["nodes"], "dist-init-addr": addr}
    engine = {**m["llmFlags"], **par}
    leader_flags = {**m["serveFlags"], **{f"llm-{k}": x for k, x in engine.items()}, "llm-node-rank": 0}
    resources = {k: dict(x) for k, x in m["resources"].items()}
    if m.get("gpus"):
        resources.setdefault("limits", {})["nvidia.com/gpu"] = m["gpus"]
    ports = {"health": m["healthPort"], "dist": m["distPort"]}
    leader = mimo_container(
        v, "llm-leader", node_args(v, m["healthPort"], m["shmBytes"], leader_flags), ports, resources, m["healthPort"]
    )
    volumes, mounts = shm_volume(m["shmBytes"])
    leader["volumeMounts"] = mounts
    worker = {
        "name": "llm-ranks",
        "image": v["image"],
        "imagePullPolicy": v["imagePullPolicy"],
        "args": ["llm", *flag_args({**engine, "node-rank": "$(LWS_WORKER_INDEX)"})],
        "resources": resources,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False},
    }
    return [
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": meta(name, ns, "llm-multinode"),
            "spec": {
                "replicas": m["replicas"],
                "leaderWorkerTemplate": {
                    "size": m["nodes"],
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": {"labels": labels("llm-multinode")},
                        "spec": {"containers": [leader], "volumes": volumes},
                    },
                    "workerTemplate": {
                        "metadata": {"labels": labels("llm-multinode")},
                        "spec": {"containers": [worker]},
                    },
                },
            },
        }
    ]


def render(values: dict) -> list[dict]:
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": values["namespace"]}}
    return [
        ns,
        *render_redis(values),
        *render_mooncake(values),
        *render_router(values),
        *render_encoders(values),
        *render_llm(values),
        *render_multinode(values),
    ]


def load_values(path: str | Path = HERE / "values.yaml") -> dict:
    return yaml.safe_load(Path(path).read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", default=str(HERE / "values.yaml"), help="values file (default: deploy/values.yaml)")
    a = p.parse_args(argv)
    yaml.safe_dump_all(render(load_values(a.values)), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
