"""Kubernetes manifests for a reducer pool and a training job that uses it, sized by a plan.

``redsock plan ... --emit k8s`` prints them; ``deploy/`` holds the output for an example
layout (``tests/test_deploy.py`` checks that the files equal this module's output, validates
them against the Kubernetes schemas, and runs their container command lines locally).

* Reducers: a StatefulSet of ``redsock serve`` (stable names ``redsock-reducer-<i>.<service>``
  for ``REDSOCK_SERVERS``) behind a headless Service; the token comes from the Secret
  ``redsock-token`` (key ``token``), mounted read-only; readiness on the reducer port,
  liveness on the metrics endpoint; SIGTERM stops the daemon cleanly within the grace period; Prometheus scrape
  annotations point at ``--metrics-port``.  One redsock pod per node (anti-affinity), because
  reducers must not share NICs with workers or each other.
* Training: a Kubeflow PyTorchJob (training operator v1) and, for clusters without the
  operator, an Indexed batch Job running torchrun with a headless Service for the rendezvous.
  Both set ``REDSOCK_SERVERS``, ``REDSOCK_TOKEN_FILE`` and ``REDSOCK_ALGO=server``.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from .model import Cluster

__all__ = ["REDUCER_ARGS", "add_arguments", "manifests", "reducer_args", "to_yaml"]

REDUCER_PORT = 7700
METRICS_PORT = 9100
TOKEN_DIR = "/var/run/redsock"
TOKEN_SECRET = "redsock-token"
RDZV_PORT = 29500
#: The reducer container's command; the Dockerfile's ENTRYPOINT/CMD say the same (tested).
REDUCER_COMMAND = ["redsock", "serve"]
PART_OF = {"app.kubernetes.io/part-of": "redsock"}


def reducer_args(port: int = REDUCER_PORT, metrics_port: int = METRICS_PORT) -> list[str]:
    return ["--host", "0.0.0.0", "--port", str(port), "--token-file", f"{TOKEN_DIR}/token",
            "--metrics-port", str(metrics_port)]


REDUCER_ARGS = reducer_args()


def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--namespace", help="with --emit k8s: namespace of every object (default: none set)")
    g.add_argument("--image", default="redsock-reducer:0.1.0", help="with --emit k8s: the reducer image")
    g.add_argument("--trainer-image", default="redsock-trainer:0.1.0",
                   help="with --emit k8s: the training image (torch + redsock + your script)")
    g.add_argument("--train-script", default="/workspace/train.py",
                   help="with --emit k8s: the script torchrun runs in the training image")
    g.add_argument("--job-name", default="redsock-train", help="with --emit k8s: name of the training job")
    g.add_argument("--emit-dir", metavar="DIR", help="with --emit k8s: write one file per manifest into DIR")


def _meta(name: str, ns: str | None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name}
    if ns:
        m["namespace"] = ns
    if labels:
        m["labels"] = labels
    return m


def _one_per_node() -> dict[str, Any]:
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": dict(PART_OF)}, "topologyKey": "kubernetes.io/hostname"}]}}


def _token_volume() -> dict[str, Any]:
    return {"name": "token", "secret": {"secretName": TOKEN_SECRET, "defaultMode": 0o440,
                                        "items": [{"key": "token", "path": "token"}]}}


_TOKEN_MOUNT = {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}
_NON_ROOT = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
_LOCKED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
           "capabilities": {"drop": ["ALL"]}}


def reducer_service(ns: str | None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "redsock-reducer", **PART_OF}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta("redsock-reducer", ns, labels),
            "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/name": "redsock-reducer"},
                     "ports": [{"name": "reduce", "port": REDUCER_PORT, "targetPort": "reduce"},
                               {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]}}


def reducer_statefulset(replicas: int, cores: int, image: str, ns: str | None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "redsock-reducer", **PART_OF}
    container = {
        "name": "reducer", "image": image, "command": list(REDUCER_COMMAND), "args": list(REDUCER_ARGS),
        "ports": [{"name": "reduce", "containerPort": REDUCER_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT}],
        # Ready once the reducer port accepts (each probe logs one refused handshake on the
        # daemon, hence every 10 s); alive while the metrics endpoint answers (no log line).
        "readinessProbe": {"tcpSocket": {"port": "reduce"}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 20,
                          "failureThreshold": 3},
        "resources": {"requests": {"cpu": str(cores), "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [dict(_TOKEN_MOUNT)],
        "securityContext": dict(_LOCKED),
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta("redsock-reducer", ns, labels),
            "spec": {
                "serviceName": "redsock-reducer", "replicas": replicas, "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": {"app.kubernetes.io/name": "redsock-reducer"}},
                "template": {
                    "metadata": {"labels": labels, "annotations": {
                        "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                        "prometheus.io/path": "/metrics"}},
                    "spec": {"terminationGracePeriodSeconds": 30, "securityContext": dict(_NON_ROOT),
                             "affinity": _one_per_node(), "containers": [container],
                             "volumes": [_token_volume()]}}}}


def servers_env(replicas: int, ns: str | None) -> str:
    domain = f"redsock-reducer.{ns}.svc" if ns else "redsock-reducer"
    return ",".join(f"redsock-reducer-{i}.{domain}:{REDUCER_PORT}" for i in range(replicas))


def _trainer_env(replicas: int, ns: str | None) -> list[dict[str, Any]]:
    return [{"name": "REDSOCK_SERVERS", "value": servers_env(replicas, ns)},
            {"name": "REDSOCK_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
            {"name": "REDSOCK_ALGO", "value": "server"}]


def _trainer_pod(name: str, image: str, command: list[str], env: list[dict[str, Any]], cpus: int,
                 labels: dict[str, str], extra_spec: dict[str, Any] | None = None,
                 restart: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        **(extra_spec or {}),
        "securityContext": dict(_NON_ROOT), "affinity": _one_per_node(),
        "containers": [{"name": name, "image": image, "command": command, "env": env,
                        "resources": {"requests": {"cpu": str(cpus)}},
                        "volumeMounts": [dict(_TOKEN_MOUNT)],
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        "volumes": [_token_volume()]}
    if restart:
        spec["restartPolicy"] = restart
    return {"metadata": {"labels": labels}, "spec": spec}


def pytorchjob(name: str, hosts: int, per_host: int, reducers: int, image: str, script: str,
               ns: str | None) -> dict[str, Any]:
    """Kubeflow training operator v1: it sets torchrun's PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR/PORT on every pod, which torchrun reads by itself."""
    labels = {"app.kubernetes.io/name": name, **PART_OF}
    pod = _trainer_pod("pytorch", image, ["torchrun", script], _trainer_env(reducers, ns), per_host, labels)
    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if hosts > 1:
        replicas["Worker"] = {"replicas": hosts - 1, "restartPolicy": "OnFailure", "template": pod}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(name, ns, labels),
            "spec": {"nprocPerNode": str(per_host), "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 3},
                     "pytorchReplicaSpecs": replicas}}


def torchrun_command(job: str, hosts: int, per_host: int, script: str) -> list[str]:
    """The Indexed Job's command: node rank from the completion index, rank 0's pod as master."""
    return ["torchrun", f"--nnodes={hosts}", f"--nproc-per-node={per_host}", "--node-rank=$(NODE_RANK)",
            f"--master-addr={job}-0.{job}", f"--master-port={RDZV_PORT}", script]


def torchrun_job(name: str, hosts: int, per_host: int, reducers: int, image: str, script: str,
                 ns: str | None) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": name, **PART_OF}
    env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        *_trainer_env(reducers, ns)]
    pod = _trainer_pod("trainer", image, torchrun_command(name, hosts, per_host, script), env, per_host, labels,
                       extra_spec={"subdomain": name}, restart="Never")
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, ns, labels),
           "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/name": name},
                    "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, ns, labels),
           "spec": {"completionMode": "Indexed", "completions": hosts, "parallelism": hosts,
                    "backoffLimit": 0, "template": pod}}
    return [svc, job]


def manifests(hosts: int, per_host: int, reducers: int, reducer_cores: int = 1, *,
              image: str = "redsock-reducer:0.1.0", trainer_image: str = "redsock-trainer:0.1.0",
              script: str = "/workspace/train.py", job: str = "redsock-train",
              namespace: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """File name -> objects: ``reducers.yaml``, ``pytorchjob.yaml``, ``torchrun-job.yaml``."""
    if reducers < 1:
        raise ConfigError("manifests need at least one reducer")
    return {
        "reducers.yaml": [reducer_service(namespace),
                          reducer_statefulset(reducers, reducer_cores, image, namespace)],
        "pytorchjob.yaml": [pytorchjob(job, hosts, per_host, reducers, trainer_image, script, namespace)],
        "torchrun-job.yaml": torchrun_job(job, hosts, per_host, reducers, trainer_image, script, namespace),
    }


def manifests_from_args(c: Cluster, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The manifests of ``--emit k8s`` for the plan's cluster ``c``."""
    return manifests(c.hosts, c.ranks_per_host, c.reducers, c.reducer_cores, image=args.image,
                     trainer_image=args.trainer_image, script=args.train_script, job=args.job_name,
                     namespace=args.namespace)


def _dump(obj: dict[str, Any]) -> str:
    import yaml

    class NoAliases(yaml.SafeDumper):  # labels shared by two fields print twice, not as &id001
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(obj, Dumper=NoAliases, sort_keys=False)


def to_yaml(files: dict[str, list[dict[str, Any]]]) -> str:
    """Every object as one YAML stream, each after a comment naming its file."""
    return "---\n".join(f"# {name}\n" + _dump(obj) for name, objs in files.items() for obj in objs)


def file_yaml(objs: list[dict[str, Any]], header: str = "") -> str:
    return header + "---\n".join(_dump(o) for o in objs)
