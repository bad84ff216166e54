"""deploy/: the manifests are what `redsock plan --emit k8s` writes, they validate against the
Kubernetes schemas (kubernetes-validate, offline) and the PyTorchJob against the training
operator's generated types (kubeflow-training), and their container command lines work here:
the reducer starts and a torchrun job with the manifest's environment gets a right all-reduce."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import kubernetes_validate
import pytest
import yaml
from kubeflow.training import models as kf

from redsock.cli import main
from redsock.plan import k8s as manifests

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
FILES = ("reducers.yaml", "pytorchjob.yaml", "torchrun-job.yaml")
#: The command in deploy/README.md that wrote deploy/.
EMIT = ("plan --hosts 5 --ranks-per-host 8 --link 100gbit --reducers 16 --reducer-link 32gbit "
        "--reducer-cores 16 --emit k8s --emit-dir")
#: The oldest Kubernetes still supported upstream and the newest the validator knows.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def find(kind: str) -> dict[str, Any]:
    for name in FILES:
        for obj in load(name):
            if obj["kind"] == kind:
                return obj
    raise AssertionError(f"no {kind} in deploy/")


def test_deploy_is_what_plan_emits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EMIT.split(), str(tmp_path)]) == 0
    for name in FILES:
        assert (tmp_path / name).read_text() == (DEPLOY / name).read_text(), f"deploy/{name} is stale: rerun {EMIT}"
    assert EMIT in (DEPLOY / "README.md").read_text()


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_strictly(version: str) -> None:
    kinds = []
    for name in FILES:
        for obj in load(name):
            if obj["apiVersion"].startswith("kubeflow.org/"):
                continue
            kubernetes_validate.validate(obj, version, strict=True)  # raises on any error
            kinds.append(obj["kind"])
    assert sorted(kinds) == ["Job", "Service", "Service", "StatefulSet"]


def test_validator_rejects_a_broken_manifest() -> None:
    sts = find("StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


# The PyTorchJob is a CRD, which kubernetes-validate has no schema for.  The training
# operator's SDK (kubeflow-training) is generated from the operator's OpenAPI spec: walk the
# manifest through those types, refusing unknown fields and wrong types; the models' own
# constructors refuse missing required fields.  Each replica's pod template is core v1, so it
# also goes through kubernetes-validate as a PodTemplate.

def _model(name: str) -> Any:
    return getattr(kf, name, None) or getattr(k8s, name)


def check_typed(value: Any, typ: str, path: str) -> Any:
    if typ.startswith("list["):
        assert isinstance(value, list), f"{path}: expected a list"
        return [check_typed(v, typ[5:-1], f"{path}[{i}]") for i, v in enumerate(value)]
    if typ.startswith("dict("):
        assert isinstance(value, dict), f"{path}: expected a mapping"
        inner = typ[typ.index(",") + 1:-1].strip()
        return {k: check_typed(v, inner, f"{path}.{k}") for k, v in value.items()}
    primitives = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str}
    if typ in primitives:
        assert isinstance(value, primitives[typ]) and not (typ == "int" and isinstance(value, bool)), \
            f"{path}: expected {typ}, got {value!r}"
        return value
    if typ == "object":
        return value
    cls = _model(typ)
    assert isinstance(value, dict), f"{path}: expected a {typ} mapping"
    by_json = {v: k for k, v in cls.attribute_map.items()}
    unknown = set(value) - set(by_json)
    assert not unknown, f"{path}: unknown field(s) {sorted(unknown)} in {typ}"
    kwargs = {by_json[k]: check_typed(v, cls.openapi_types[by_json[k]], f"{path}.{k}") for k, v in value.items()}
    return cls(**kwargs)  # raises ValueError for a missing required field or a bad enum


def check_pytorchjob(obj: dict[str, Any], version: str) -> None:
    assert obj["apiVersion"] == "kubeflow.org/v1" and obj["kind"] == "PyTorchJob"
    check_typed(obj, "KubeflowOrgV1PyTorchJob", "PyTorchJob")
    for role, spec in obj["spec"]["pytorchReplicaSpecs"].items():
        assert role in ("Master", "Worker"), role
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": f"{obj['metadata']['name']}-{role.lower()}"},
                                      "template": spec["template"]}, version, strict=True)
        names = [c["name"] for c in spec["template"]["spec"]["containers"]]
        assert "pytorch" in names  # the operator finds the training container by this name


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pytorchjob_validates_against_the_operator_types(version: str) -> None:
    job = find("PyTorchJob")
    check_pytorchjob(job, version)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4  # 5 hosts: a master + 4
    assert job["spec"]["nprocPerNode"] == "8"


def test_pytorchjob_check_rejects_unknown_and_missing_fields() -> None:
    job = find("PyTorchJob")
    job["spec"]["pytorchReplicaSpec"] = job["spec"].pop("pytorchReplicaSpecs")  # a typo
    with pytest.raises(AssertionError, match="unknown field"):
        check_pytorchjob(job, K8S_VERSIONS[-1])
    job = find("PyTorchJob")
    del job["spec"]["runPolicy"]
    with pytest.raises(ValueError, match="run_policy"):
        check_typed(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob")


def test_manifests_wire_reducers_token_probes_and_metrics() -> None:
    sts = find("StatefulSet")
    pod = sts["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert sts["spec"]["replicas"] == 16 and c["resources"]["requests"]["cpu"] == "16"
    assert c["readinessProbe"]["tcpSocket"]["port"] == "reduce"
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"reduce": 7700, "metrics": 9100}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    assert pod["spec"]["terminationGracePeriodSeconds"] > 0
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    svc = [o for o in load("reducers.yaml") if o["kind"] == "Service"][0]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    token = c["args"][c["args"].index("--token-file") + 1]
    mount = c["volumeMounts"][0]
    assert token.startswith(mount["mountPath"] + "/")
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == manifests.TOKEN_SECRET
    for job in (find("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"],
                find("Job")["spec"]["template"]):
        env = {e["name"]: e.get("value") for e in job["spec"]["containers"][0]["env"]}
        servers = env["REDSOCK_SERVERS"].split(",")
        assert servers == [f"redsock-reducer-{i}.redsock-reducer:7700" for i in range(16)]
        assert env["REDSOCK_TOKEN_FILE"] == token and env["REDSOCK_ALGO"] == "server"


def _dockerfile_json(instruction: str) -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    m = re.search(rf"^{instruction}\s+(\[.*\])\s*$", text, re.M)
    assert m, f"Dockerfile has no exec-form {instruction}"
    return yaml.safe_load(m.group(1))


def test_dockerfile_runs_what_the_manifest_runs() -> None:
    c = find("StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert _dockerfile_json("ENTRYPOINT") == c["command"] == ["redsock", "serve"]
    assert _dockerfile_json("CMD") == c["args"]
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.M)  # the manifests' runAsUser
    assert "python:3.11-slim" in text and "redsock[server]" in text
    # Every option the manifest passes is one `redsock serve` has.
    from redsock.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    known = {s for a in serve._actions for s in a.option_strings}  # noqa: SLF001
    assert {a for a in c["args"] if a.startswith("--")} <= known


def _local(args: list[str], **swap: str) -> list[str]:
    """The manifest's args with some option values replaced (ports, paths) for this machine."""
    out = list(args)
    for opt, value in swap.items():
        out[out.index("--" + opt.replace("_", "-")) + 1] = value
    return out


def test_container_command_lines_run_locally(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-from-the-secret\n")
    c = find("StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    # Port 0 (the kernel picks; metrics off at 0) instead of fixed ports; the secret's file here.
    argv = [sys.executable, "-m", "redsock", *c["command"][1:],
            *_local(c["args"], host="127.0.0.1", port="0", metrics_port="0", token_file=str(token))]
    reducer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL)
    try:
        line = reducer.stdout.readline()
        assert "reduction server on" in line, line
        address = line.rsplit(" ", 1)[1].strip()
        job = find("Job")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in job["env"] if "value" in e}
        env.update(REDSOCK_SERVERS=address, REDSOCK_TOKEN_FILE=str(token))
        cmd = job["command"]
        assert cmd[0] == "torchrun" and cmd[-1] == "/workspace/train.py"
        # One node of 2 ranks, standalone rendezvous (a free port) instead of rank 0's pod.
        run_argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                    "--nproc-per-node=2", f"--log-dir={tmp_path / 'torchrun'}",  # (else a dir in /tmp per run)
                    str(ROOT / "tests" / "deploy_job.py")]
        done = subprocess.run(run_argv, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=240, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("all-reduce through") == 2, done.stdout
    finally:
        reducer.terminate()  # SIGTERM, as Kubernetes stops the pod
        out, err = reducer.communicate(timeout=30)
    assert reducer.returncode == 0, err  # a clean stop on SIGTERM
    assert "joined" in err, err  # the job reached this reducer (with the token)


def test_emit_with_a_namespace_and_sized_reducers(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --reducers the plan sizes the pool; a namespace reaches every object and the
    reducers' DNS names; the output validates like deploy/."""
    assert main(["plan", "--hosts", "3", "--ranks-per-host", "2", "--link", "25gbit", "--reducer-link", "10gbit",
                 "--reducer-cores", "8", "--namespace", "team-a", "--emit", "k8s"]) == 0
    objs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert all(o["metadata"]["namespace"] == "team-a" for o in objs)
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    m = sts["spec"]["replicas"]
    assert m == 8  # 3 hosts x 25 Gbit/s of S each way over 10 Gbit/s reducers: ceil(7.5)
    job = next(o for o in objs if o["kind"] == "Job")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REDSOCK_SERVERS"].split(",")[-1] == f"redsock-reducer-{m - 1}.redsock-reducer.team-a.svc:7700"
    for o in objs:
        if o["kind"] == "PyTorchJob":
            check_pytorchjob(o, K8S_VERSIONS[-1])
        else:
            kubernetes_validate.validate(o, K8S_VERSIONS[-1], strict=True)
