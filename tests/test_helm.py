"""The Helm chart (helm/tutti): lint, render, schema and Kubernetes 1.30 validation, offline.

Runs the official helm binary (helm/install-helm.sh puts it in the virtualenv's bin directory) and
kubernetes-validate (the `helm` extra). Where either is missing the module is skipped with the
reason, except under CI=true, where a missing tool is an error.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "tutti"
EXAMPLE = CHART / "examples" / "vllm-values.yaml"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str | None:
    cand = BIN / name
    return str(cand) if cand.exists() else shutil.which(name)


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI installs it: .ci/run)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


HELM = _tool("helm")
if HELM is None:
    _missing("no helm binary: run `bash helm/install-helm.sh .venv/bin`")
KUBE_VALIDATE = _tool("kubernetes-validate")
if KUBE_VALIDATE is None:
    _missing("no kubernetes-validate: pip install -e '.[helm]'")
try:
    import yaml
except ImportError:
    _missing("no PyYAML: pip install -e '.[helm]'")
    raise

NS = "tutti"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{p.stderr}")
    return p


KUBE = "1.30.0"  # the version the manifests are validated for


def render_text(*args: str) -> str:
    return helm("template", "t", str(CHART), "--namespace", NS, "--kube-version", KUBE, *args).stdout


def render(*args: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(*args)) if d]


def render_fails(*args: str) -> str:
    p = helm("template", "t", str(CHART), "--namespace", NS, "--kube-version", KUBE, *args, check=False)
    assert p.returncode != 0, f"rendered although it should not: {args}"
    return p.stderr


def one(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind
             and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"{len(found)} {kind} objects of component {component}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    cs = pod_spec(obj)["containers"]
    assert len(cs) == 1
    return cs[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    env = {}
    for e in c["env"]:
        assert e["name"] not in env, f"{e['name']} set twice"
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def write_values(tmp_path: Path, values: dict[str, Any], name: str = "values.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(values))
    return str(p)


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render()


@pytest.fixture(scope="module")
def example_docs() -> list[dict[str, Any]]:
    return render("-f", str(EXAMPLE))


# -- lint and Kubernetes validation ---------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE)]], ids=["default", "example"])
def test_lint_strict(values: list[str]) -> None:
    p = helm("lint", "--strict", str(CHART), "--namespace", NS, "--kube-version", KUBE, *values)
    assert "0 chart(s) failed" in p.stdout


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE)]], ids=["default", "example"])
def test_notes(values: list[str]) -> None:
    p = helm("install", "t", str(CHART), "--dry-run=client", "--namespace", NS, *values)
    notes = p.stdout[p.stdout.index("NOTES:"):]
    assert f"secret t-tutti-admin-token -o jsonpath='{{.data.token}}'" in notes
    assert f"directory at t-tutti-etcd.{NS}.svc:2379" in notes
    assert "No ServiceMonitor was rendered" in notes
    assert ("Deployment t-tutti-vllm" in notes) == bool(values)


def _kube_validate(text: str, tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    p = subprocess.run([KUBE_VALIDATE, "--strict", "-k", KUBE, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


@pytest.mark.parametrize("args", [
    [],
    ["-f", str(EXAMPLE)],
    ["-f", str(EXAMPLE), "--set", "node.rdma.enabled=true", "--set", "mooncake.enabled=true", "--set", "etcd.replicas=3",
     "--set", "admin.ingress.enabled=true", "--set", "admin.ingress.className=nginx",
     "--set", "node.rdma.resources.rdma/rdma_shared_device_a=1", "--set", "networkPolicy.nodeCIDRs={10.0.0.0/16}"],
    ["--set", "etcd.enabled=false", "--set", "admin.enabled=false", "--set", "config.paths={/mnt/nvme0}"],
    ["-f", str(EXAMPLE), "--set", "etcd.tls.existingSecret=etcd-server",
     "--set", "etcdClient.existingSecret=etcd-client", "--set", "etcdClient.user=tutti", "--set", "etcdClient.passwordKey=password", "--set", "config.file_group=2000",
     "--set", "clusterSecret.existingSecret=cluster-key", "--set", "metrics.token.existingSecret=scrape",
     "--set-json", 'networkPolicy.clients=[{"namespace":"inference","podLabels":{"tutti.io/client":"true"}}]',
     "--set-json", 'networkPolicy.adminClients=[{"namespace":"ingress-nginx","podLabels":{"app":"ingress"}}]'],
    ["-f", str(EXAMPLE), "--set", "memoryTier.enabled=true", "--set-json", "memoryTier.capacityGb=1.5"],
], ids=["default", "example", "rdma-mooncake-ingress", "single-node", "credentials", "memory-tier"])
def test_rendered_manifests_validate_for_kubernetes_1_30(args: list[str], tmp_path: Path) -> None:
    text = render_text(*args)
    docs = [d for d in yaml.safe_load_all(text) if d]
    out = _kube_validate(text, tmp_path, "rendered.yaml")
    assert out.count("passed for resource") == len(docs), out


def test_service_monitor_only_with_its_crd(default_docs: list[dict[str, Any]], tmp_path: Path) -> None:
    assert "ServiceMonitor" not in kinds(default_docs)
    text = render_text("--api-versions", "monitoring.coreos.com/v1")
    docs = [d for d in yaml.safe_load_all(text) if d]
    sm = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(sm) == 1 and sm[0]["apiVersion"] == "monitoring.coreos.com/v1"
    # kubernetes-validate has no schema for a CRD: everything else still validates.
    out = _kube_validate(text, tmp_path, "with-sm.yaml")
    assert out.count("passed for resource") == len(docs) - 1

    # It scrapes exactly the admin plane's Service (which answers for every node), on its admin port.
    sel = sm[0]["spec"]["selector"]["matchLabels"]
    scraped = [d for d in docs if d["kind"] == "Service"
               and all(d["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    assert [s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped] == ["admin"]
    ep = sm[0]["spec"]["endpoints"][0]
    assert ep["path"] == "/metrics"
    assert ep["port"] in [p["name"] for p in scraped[0]["spec"]["ports"]]

    # Without the admin plane, the nodes' Service is scraped instead.
    docs = render("--api-versions", "monitoring.coreos.com/v1", "--set", "admin.enabled=false")
    sm = [d for d in docs if d["kind"] == "ServiceMonitor"][0]
    sel = sm["spec"]["selector"]["matchLabels"]
    scraped = [d for d in docs if d["kind"] == "Service"
               and all(d["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    assert [s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped] == ["node"]


# -- the store DaemonSet --------------------------------------------------------------------------


def test_store_nodes_on_gpu_nodes_without_a_gpu(default_docs: list[dict[str, Any]]) -> None:
    ds = one(default_docs, "DaemonSet", "node")
    spec = pod_spec(ds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    res = container(ds)["resources"]
    for part in ("requests", "limits"):
        assert not any("nvidia.com" in k for k in res.get(part, {})), res
    # No added capability: Kubernetes gives none to a non-root process (no ambient capabilities).
    assert container(ds)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container(ds)["command"] == ["tutti", "up"]
    assert "hostNetwork" not in spec


def test_store_volumes_are_host_paths_at_the_same_path(tmp_path: Path) -> None:
    docs = render("--set", "config.paths={/mnt/nvme0/tutti,/mnt/nvme1/tutti}", "--set", "config.capacity_gb={100,200}",
                  "--set", "node.pathType=Directory")
    ds = one(docs, "DaemonSet", "node")
    vols = {v["name"]: v for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    assert all(set(v) == {"name", "hostPath"} for v in vols.values()), vols
    mounts = {m["name"]: m["mountPath"] for m in container(ds)["volumeMounts"] if m["name"] in vols}
    assert {n: v["hostPath"]["path"] for n, v in vols.items()} == mounts
    assert sorted(mounts.values()) == ["/mnt/nvme0/tutti", "/mnt/nvme1/tutti", "/var/lib/tutti"]
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in vols.values()}
    assert types == {"/mnt/nvme0/tutti": "Directory", "/mnt/nvme1/tutti": "Directory",
                     "/var/lib/tutti": "DirectoryOrCreate"}
    env = env_of(container(ds))
    assert env["TUTTI_PATHS"] == "/mnt/nvme0/tutti,/mnt/nvme1/tutti"
    assert env["TUTTI_CAPACITY_GB"] == "100,200"
    assert env["TUTTI_DATA_DIR"] == "/var/lib/tutti"


def test_store_volumes_are_never_empty_dirs(example_docs: list[dict[str, Any]]) -> None:
    # The store's directories are host paths (never emptyDir, never a claim); the only emptyDirs are
    # /tmp under a read-only root file system and the in-memory credential copies.
    for d in example_docs:
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            spec = pod_spec(d)
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                for m in c.get("volumeMounts", []):
                    if m["mountPath"] == "/var/lib/tutti" or m["mountPath"].startswith("/mnt/"):
                        assert "hostPath" in vols[m["name"]], (d["metadata"]["name"], m)
            for v in vols.values():
                if "emptyDir" in v:
                    assert v["name"] in ("tmp", "credentials"), (d["metadata"]["name"], v)
                    assert v["name"] != "credentials" or v["emptyDir"]["medium"] == "Memory"


def test_probes_on_the_health_port(default_docs: list[dict[str, Any]]) -> None:
    # The probes go to the health listener, apart from the API's connections: held API connections
    # cannot make the kubelet restart a healthy daemon.
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "admin")):
        c = container(one(default_docs, kind, comp))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(env_of(c)["TUTTI_ADMIN_PORT"]) == ports["admin"] == 9480
        assert int(env_of(c)["TUTTI_HEALTH_PORT"]) == ports["health"] == 9481
        assert env_of(c)["TUTTI_ADMIN_HOST"] == "0.0.0.0"
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    node = container(one(default_docs, "DaemonSet", "node"))
    assert node["startupProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    docs = render("--set", "node.admin.healthPort=7001", "--set", "admin.healthPort=7002")
    assert env_of(container(one(docs, "DaemonSet", "node")))["TUTTI_HEALTH_PORT"] == "7001"
    assert env_of(container(one(docs, "Deployment", "admin")))["TUTTI_HEALTH_PORT"] == "7002"
    # etcd's readiness (/health) on its own plain listener, which no NetworkPolicy opens.
    etcd = container(one(default_docs, "StatefulSet", "etcd"))
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in etcd["command"]
    assert etcd["readinessProbe"]["httpGet"] == {"path": "/health", "port": "health"}
    assert container(one(default_docs, "Deployment", "admin"))["command"] == ["tutti", "admin", "serve"]


RDMA = ["--set", "node.rdma.enabled=true", "--set", "networkPolicy.nodeCIDRs={10.0.0.0/16}"]


def test_rdma_uses_the_host_network_and_infiniband_devices() -> None:
    ds = one(render(*RDMA, "--set", "node.rdma.resources.rdma/hca=1"), "DaemonSet", "node")
    spec = pod_spec(ds)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    ib = [v for v in spec["volumes"] if v["name"] == "infiniband"]
    assert ib == [{"name": "infiniband", "hostPath": {"path": "/dev/infiniband", "type": "Directory"}}]
    assert {"name": "infiniband", "mountPath": "/dev/infiniband"} in container(ds)["volumeMounts"]
    res = container(ds)["resources"]
    assert res["requests"]["rdma/hca"] == 1 and res["limits"]["rdma/hca"] == 1
    assert res["requests"]["cpu"] == "500m"  # the node's own resources are kept
    assert "rdma_shared" not in json.dumps(one(render(), "DaemonSet", "node"))
    # The engines fetch remote units over the same devices.
    eng = one(render("-f", str(EXAMPLE), *RDMA, "--set", "node.rdma.resources.rdma/hca=1"), "Deployment", "vllm")
    assert pod_spec(eng)["hostNetwork"] is True
    assert {"name": "infiniband", "mountPath": "/dev/infiniband"} in container(eng)["volumeMounts"]
    assert container(eng)["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/hca": 1}
    assert "config.protocol" in render_fails(*RDMA, "--set", "config.protocol=tcp")
    # On the host network the admin API listens on the node's address, not on every interface.
    assert env_of(container(ds))["TUTTI_ADMIN_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # NetworkPolicies see host-network pods by address: the nodes' CIDRs are required.
    assert "networkPolicy.nodeCIDRs" in render_fails("--set", "node.rdma.enabled=true")
    etcd_pol = [d for d in render(*RDMA) if d["kind"] == "NetworkPolicy"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == "etcd"][0]
    assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in etcd_pol["spec"]["ingress"][0]["from"]


# -- settings: values map one to one onto TuttiConfig ---------------------------------------------


def _chart_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# Settings the chart makes from its own sections, not from config: the credentials' files (copies
# of Secrets), the health port (node.admin.healthPort, admin.healthPort), the etcd user and the
# memory tier's path and size (memoryTier).
CHART_MANAGED = {"cluster_secret_file", "metrics_token_file", "health_port", "etcd_ca_file", "etcd_cert_file",
                 "etcd_key_file", "etcd_user", "etcd_password_file", "memory_paths", "memory_capacity_gb"}


def test_config_keys_are_the_fields_of_tutti_config() -> None:
    from tutti_cluster.config import TuttiConfig

    # admin_* settings come from the chart's node.admin/admin sections (admin_docs stays off).
    fields = {f for f in TuttiConfig.model_fields if not f.startswith("admin_") and f not in CHART_MANAGED}
    assert set(_chart_values()["config"]) == fields
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["config"]["properties"]) == fields
    readme = (CHART / "README.md").read_text()
    for f in fields:
        assert f"`TUTTI_{f.upper()}`" in readme, f"README.md does not document config.{f}"


def test_config_schema_and_table_are_generated_from_tutti_config() -> None:
    """The `config` part of values.schema.json and the README's settings table are the generator's
    output for today's TuttiConfig (as docs/openapi.json is the admin app's)."""
    spec = importlib.util.spec_from_file_location("helm_config", ROOT / "tools" / "helm_config.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert set(gen.chart_fields()) == set(_chart_values()["config"])
    for path, text in gen.generated().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run {gen.COMMAND}"


# Every setting away from its default; 1048576 and 1.5 check how numbers are written.
SETTINGS: dict[str, Any] = {
    "paths": ["/mnt/a", "/mnt/b"], "capacity_gb": [1.5, 2], "data_dir": "/srv/tutti", "instance": "inst-1",
    "direct_io": "off", "pool_files": 3, "prewrite_pool": False, "map_memory_paths": False,
    "write_policy": "write_through", "promote_hits": 3, "promote_window_s": 2.5, "unit_tokens": 512,
    "min_io_bytes": 1048576, "backend": "cpu", "device": 1, "queue_depth": 32, "iocb_depth": 2048,
    "staging_mb": 256, "max_requests": 64, "io_sms": 16, "cuda_pair": True, "cuda_trace": True, "copy_engine_mb": 1024,
    "etcd": ["etcd-a:2379", "etcd-b:2379"], "mooncake_master": "mc.example:50051", "node_id": "n1",
    "protocol": "rdma", "lease_ttl_s": 30, "advertise_host": "10.1.2.3", "stage_port": 7070,
    "transfer_ports": "20000-20100", "file_group": 2000,
}


def test_rendered_environment_is_the_same_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tutti_cluster.config import TuttiConfig

    assert set(SETTINGS) == set(_chart_values()["config"])
    f = write_values(tmp_path, {"config": SETTINGS, "etcd": {"enabled": False}})
    docs = render("-f", f)
    node_env = env_of(container(one(docs, "DaemonSet", "node")))
    admin_env = env_of(container(one(docs, "Deployment", "admin")))
    managed = {f"TUTTI_{k.upper()}" for k in CHART_MANAGED}
    tutti = {k: v for k, v in node_env.items()
             if k.startswith("TUTTI_") and not k.startswith("TUTTI_ADMIN_") and k not in managed}
    assert {k: v for k, v in admin_env.items() if k in tutti} == tutti
    assert set(tutti) == {f"TUTTI_{k.upper()}" for k in SETTINGS}
    assert tutti["TUTTI_MIN_IO_BYTES"] == "1048576" and tutti["TUTTI_CAPACITY_GB"] == "1.5,2"

    for k in list(os.environ):
        if k.startswith("TUTTI_"):
            monkeypatch.delenv(k)
    for k, v in tutti.items():
        monkeypatch.setenv(k, v)
    assert TuttiConfig().model_dump() == TuttiConfig(**SETTINGS).model_dump()


def test_unset_settings_are_left_to_their_defaults(default_docs: list[dict[str, Any]]) -> None:
    env = env_of(container(one(default_docs, "DaemonSet", "node")))
    assert sorted(k for k in env if k.startswith("TUTTI_")) == [
        "TUTTI_ADMIN_HOST", "TUTTI_ADMIN_PORT", "TUTTI_ADMIN_TOKEN", "TUTTI_CAPACITY_GB", "TUTTI_CLUSTER_SECRET_FILE",
        "TUTTI_DATA_DIR", "TUTTI_ETCD", "TUTTI_HEALTH_PORT", "TUTTI_METRICS_TOKEN_FILE", "TUTTI_NODE_ID",
        "TUTTI_STAGE_PORT"]
    assert env["TUTTI_NODE_ID"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["TUTTI_ETCD"] == f"t-tutti-etcd.{NS}.svc:2379"


# -- the admin token ------------------------------------------------------------------------------


def _token_refs(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    refs = []
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "admin")):
        refs.append(env_of(container(one(docs, kind, comp)))["TUTTI_ADMIN_TOKEN"]["secretKeyRef"])
    return refs


def test_admin_token_secret_generated_and_referenced(default_docs: list[dict[str, Any]]) -> None:
    secrets = [d for d in default_docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-tutti-admin-token"]
    assert len(secrets) == 1
    for ref in _token_refs(default_docs):
        assert ref == {"name": secrets[0]["metadata"]["name"], "key": "token"}
    token = base64.b64decode(secrets[0]["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)


def test_admin_token_given_or_from_an_existing_secret() -> None:
    docs = render("--set", "admin.token=s3cret-token")
    secret = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-tutti-admin-token"][0]
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"

    docs = render("--set", "admin.existingSecret=ops-token", "--set", "admin.existingSecretKey=admin")
    assert "t-tutti-admin-token" not in [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert _token_refs(docs) == [{"name": "ops-token", "key": "admin"}] * 2


# -- cluster parts --------------------------------------------------------------------------------


def test_etcd_statefulset_or_an_external_etcd() -> None:
    docs = render("--set", "etcd.replicas=3")
    sts = one(docs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    cmd = container(sts)["command"]
    cluster = [a for a in cmd if a.startswith("--initial-cluster=")][0]
    assert cluster.count("=http://") == 3
    assert "--max-txn-ops=1024" in cmd
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    svc = one([d for d in docs if d["metadata"]["name"] == "t-tutti-etcd"], "Service", "etcd")
    assert env_of(container(one(docs, "DaemonSet", "node")))["TUTTI_ETCD"] == \
        f"{svc['metadata']['name']}.{NS}.svc:{svc['spec']['ports'][0]['port']}"

    docs = render("--set", "etcd.enabled=false", "--set", "config.etcd={10.0.0.5:2379,10.0.0.6:2379}")
    assert "StatefulSet" not in kinds(docs)
    assert env_of(container(one(docs, "DaemonSet", "node")))["TUTTI_ETCD"] == "10.0.0.5:2379,10.0.0.6:2379"

    assert "etcd.enabled=false" in render_fails("--set", "config.etcd={10.0.0.5:2379}")
    assert "cluster directory" in render_fails("--set", "etcd.enabled=false")
    docs = render("--set", "etcd.enabled=false", "--set", "admin.enabled=false")
    assert "TUTTI_ETCD" not in env_of(container(one(docs, "DaemonSet", "node")))
    assert "Deployment" not in kinds(docs)


def test_mooncake_master_optional() -> None:
    docs = render("--set", "mooncake.enabled=true")
    dep = one(docs, "Deployment", "mooncake-master")
    assert container(dep)["command"][0] == "mooncake_master"
    svc = one(docs, "Service", "mooncake-master")
    addr = env_of(container(one(docs, "DaemonSet", "node")))["TUTTI_MOONCAKE_MASTER"]
    assert addr == f"{svc['metadata']['name']}.{NS}.svc:50051"
    assert "mooncake-master" not in json.dumps(render())


def test_ingress_optional() -> None:
    assert "Ingress" not in kinds(render())
    docs = render("--set", "admin.ingress.enabled=true", "--set", "admin.ingress.host=tutti.internal")
    ing = [d for d in docs if d["kind"] == "Ingress"][0]
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    svc = one(docs, "Service", "admin")
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "admin"}}
    assert ing["spec"]["rules"][0]["host"] == "tutti.internal"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_network_policy_and_disruption_budgets(example_docs: list[dict[str, Any]]) -> None:
    pods = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["metadata"]["labels"]
            for d in example_docs if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")}
    assert set(pods) == {"node", "admin", "etcd", "vllm"}
    pols = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d
            for d in example_docs if d["kind"] == "NetworkPolicy"}
    assert set(pols) == {"node", "admin", "etcd", "vllm"}
    for comp, pol in pols.items():
        assert _selects(pol["spec"]["podSelector"]["matchLabels"], pods[comp])
    # The engines reach the store nodes and etcd; the nodes reach each other.
    for comp in ("node", "etcd"):
        peers = pols[comp]["spec"]["ingress"][0]["from"]
        for src in ("vllm", "node"):
            assert any(_selects(p["podSelector"]["matchLabels"], pods[src]) for p in peers), (comp, src)
    admin_rule = pols["admin"]["spec"]["ingress"][0]
    assert admin_rule["ports"] == [{"port": "admin", "protocol": "TCP"}]
    # The admin plane reaches the nodes' admin ports.
    node_admin = [r for r in pols["node"]["spec"]["ingress"] if r["ports"] == [{"port": "admin", "protocol": "TCP"}]]
    assert any(_selects(p["podSelector"]["matchLabels"], pods["admin"]) for p in node_admin[0]["from"])

    pdbs = [d for d in example_docs if d["kind"] == "PodDisruptionBudget"]
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pdbs) == ["admin", "etcd"]
    for p in pdbs:
        comp = p["metadata"]["labels"]["app.kubernetes.io/component"]
        assert _selects(p["spec"]["selector"]["matchLabels"], pods[comp])


def test_grafana_dashboard_reads_tutti_metrics(default_docs: list[dict[str, Any]]) -> None:
    cm = [d for d in default_docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")][0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["tutti.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for e in exprs:
        assert re.search(r"\btutti_[a-z_]+", e), e
    names = {m for e in exprs for m in re.findall(r"\btutti_[a-z_]+", e)}
    assert {"tutti_hits_total", "tutti_misses_total", "tutti_path_used_bytes", "tutti_checksum_failures_total",
            "tutti_remote_fetch_bytes_total", "tutti_directory_errors_total"} <= names
    # Each series is one the admin plane exports (counters gain _total, histograms _bucket).
    control = ROOT / "control" / "tutti_control"
    exported = set(re.findall(r'"(tutti_[a-z_]+)"', "".join(p.read_text() for p in control.rglob("*.py"))))
    for n in names:
        base = re.sub(r"_(total|bucket|sum|count)$", "", n)
        assert base in exported, f"the dashboard reads {n}, which control/tutti_control does not export"


# -- the example: vLLM on the node-local store ----------------------------------------------------


def test_example_wires_vllm_to_the_node_local_store(example_docs: list[dict[str, Any]]) -> None:
    ds = one(example_docs, "DaemonSet", "node")
    eng = one(example_docs, "Deployment", "vllm")
    c = container(eng)
    i = c["args"].index("--kv-transfer-config")
    kv = json.loads(c["args"][i + 1])
    assert kv["kv_connector"] == "TuttiConnector"
    assert kv["kv_connector_module_path"] == "tutti_cluster.vllm"
    assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
    assert "--enable-prefix-caching" in c["args"]

    # The same host directories, mounted at the same paths, as the store nodes'.
    def host_dirs(obj: dict[str, Any]) -> dict[str, str]:
        vols = {v["name"]: v["hostPath"]["path"] for v in pod_spec(obj)["volumes"] if "hostPath" in v}
        return {m["mountPath"]: vols[m["name"]] for m in container(obj)["volumeMounts"] if m["name"] in vols}

    store_dirs = {k: v for k, v in host_dirs(ds).items() if k != "/dev/infiniband"}
    assert host_dirs(eng) == store_dirs
    assert all(k == v for k, v in store_dirs.items())
    node_env, eng_env = env_of(container(ds)), env_of(c)
    for k in ("TUTTI_DATA_DIR", "TUTTI_PATHS", "TUTTI_CAPACITY_GB", "TUTTI_UNIT_TOKENS", "TUTTI_ETCD", "TUTTI_NODE_ID"):
        assert eng_env[k] == node_env[k], k
    # The daemon's socket, <data_dir>/tutti.sock, is on the shared host directory.
    assert node_env["TUTTI_DATA_DIR"] in store_dirs
    assert eng_env["TUTTI_INSTANCE"] == "vllm" and "TUTTI_INSTANCE" not in node_env
    assert node_env["TUTTI_PATHS"] == "/mnt/nvme0/tutti,/mnt/nvme1/tutti"

    # The engines take the GPU; the store nodes do not, and run on the same nodes.
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any("nvidia.com" in k for part in container(ds)["resources"].values() for k in part)
    assert pod_spec(eng)["nodeSelector"] == pod_spec(ds)["nodeSelector"]
    assert pod_spec(eng)["tolerations"] == pod_spec(ds)["tolerations"]
    anti = pod_spec(eng)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"


# -- the memory tier ------------------------------------------------------------------------------


def _memory_tier(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, dict[str, Any]]:
    """A pod's memory-tier volume, where its container mounts it, and the container's environment."""
    vols = [v for v in pod_spec(obj)["volumes"] if v["name"] == "memory-tier"]
    mounts = [m["mountPath"] for m in container(obj)["volumeMounts"] if m["name"] == "memory-tier"]
    return (vols[0] if vols else None), (mounts[0] if mounts else None), env_of(container(obj))


def test_the_memory_tier_is_off_by_default_and_an_engines_memory_backed_empty_dir_when_on(
        example_docs: list[dict[str, Any]], tmp_path: Path) -> None:
    for d in example_docs:
        if d["kind"] in ("DaemonSet", "Deployment"):
            vol, mount, env = _memory_tier(d)
            assert vol is None and mount is None and not {"TUTTI_MEMORY_PATHS", "TUTTI_MEMORY_CAPACITY_GB"} & env.keys()
    f = write_values(tmp_path, {"memoryTier": {"enabled": True, "capacityGb": 1.5, "path": "/run/tutti-memory"},
                                "config": {"write_policy": "write_through"}})
    docs = render("-f", str(EXAMPLE), "-f", f)
    vol, mount, env = _memory_tier(one(docs, "Deployment", "vllm"))
    assert vol == {"name": "memory-tier", "emptyDir": {"medium": "Memory", "sizeLimit": "1.5Gi"}}
    assert mount == env["TUTTI_MEMORY_PATHS"] == "/run/tutti-memory" and env["TUTTI_MEMORY_CAPACITY_GB"] == "1.5"
    assert env["TUTTI_WRITE_POLICY"] == "write_through"
    # The engine's own: the store nodes have no memory tier (the daemon sees units once on storage).
    vol, mount, env = _memory_tier(one(docs, "DaemonSet", "node"))
    assert vol is None and mount is None and "TUTTI_MEMORY_PATHS" not in env
    assert env["TUTTI_WRITE_POLICY"] == "write_through"


def test_a_memory_tier_on_huge_pages_requests_them() -> None:
    docs = render("-f", str(EXAMPLE), "--set", "memoryTier.enabled=true", "--set", "memoryTier.volume=hugePages",
                  "--set-json", "memoryTier.capacityGb=2")
    eng = one(docs, "Deployment", "vllm")
    vol, mount, env = _memory_tier(eng)
    assert vol == {"name": "memory-tier", "emptyDir": {"medium": "HugePages", "sizeLimit": "2Gi"}}
    res = container(eng)["resources"]
    assert res["requests"]["hugepages-2Mi"] == res["limits"]["hugepages-2Mi"] == "2Gi"
    assert res["limits"]["nvidia.com/gpu"] == 1  # the values' own resources are kept
    assert _memory_tier(one(docs, "DaemonSet", "node"))[0] is None


def test_a_host_memory_tier_is_shared_by_the_store_nodes_and_the_engines() -> None:
    docs = render("-f", str(EXAMPLE), "--set", "memoryTier.enabled=true", "--set", "memoryTier.volume=hostPath")
    ds, eng = one(docs, "DaemonSet", "node"), one(docs, "Deployment", "vllm")
    for obj in (ds, eng):
        vol, mount, env = _memory_tier(obj)
        assert vol == {"name": "memory-tier", "hostPath": {"path": "/dev/shm/tutti", "type": "DirectoryOrCreate"}}
        assert mount == env["TUTTI_MEMORY_PATHS"] == "/dev/shm/tutti" and env["TUTTI_MEMORY_CAPACITY_GB"] == "8"
    prepare = [c for c in pod_spec(ds)["initContainers"] if c["name"] == "prepare-paths"][0]
    assert "/dev/shm/tutti" in prepare["command"]
    assert {"name": "memory-tier", "mountPath": "/dev/shm/tutti"} in prepare["volumeMounts"]


def test_the_memory_tier_needs_its_own_directory_and_an_engine_to_live_in() -> None:
    on = ["--set", "memoryTier.enabled=true"]
    assert "set vllm.enabled=true, or memoryTier.volume=hostPath" in render_fails(*on)
    host = [*on, "--set", "memoryTier.volume=hostPath"]
    for path in ("/var/lib/tutti/", "/var/lib/tutti/store"):
        assert "needs a directory of its own" in render_fails(*host, "--set", f"memoryTier.path={path}")
    err = render_fails("-f", str(EXAMPLE), *on, "--set", "memoryTier.path=/mnt/nvme1/tutti")
    assert "memoryTier.path /mnt/nvme1/tutti is also a storage path" in err
    for args, where in ((["--set", "memoryTier.capacityGb=0"], "/memoryTier/capacityGb"),
                        (["--set", "memoryTier.volume=pvc"], "/memoryTier/volume"),
                        (["--set", "memoryTier.path=shm"], "/memoryTier/path"),
                        (["--set", "config.memory_paths={/dev/shm/x}"], "memory_paths"),
                        (["--set", "config.write_policy=sometimes"], "/config/write_policy")):
        err = render_fails(*args)
        assert "schema" in err and where in err, err


# -- the schema rejects bad values ----------------------------------------------------------------


@pytest.mark.parametrize("args, where", [
    (["--set", "config.capacity_gb={-1}"], "/config/capacity_gb/0"),
    (["--set", "config.capacity_gb={0}"], "/config/capacity_gb/0"),
    (["--set", "config.capacity_gb={4,-2}", "--set", "config.paths={/a,/b}"], "/config/capacity_gb/1"),
    (["--set-string", "config.capacity_gb={four}"], "/config/capacity_gb/0"),
    (["--set", "config.queue_depth=abc"], "/config/queue_depth"),
    (["--set", "config.prewrite_pool=maybe"], "/config/prewrite_pool"),
    (["--set", "config.pool_files=65"], "/config/pool_files"),
    (["--set", "config.paths=/mnt/nvme0"], "/config/paths"),
    (["--set", "config.data_dir=null"], "data_dir"),
    (["--set", "config.paths=null"], "paths"),
    (["--set", "config.paths={relative/dir}"], "/config/paths/0"),
    (["--set", "config.data_dir=var/lib/tutti"], "/config/data_dir"),
    (["--set", "config.direct_io=sometimes"], "/config/direct_io"),
    (["--set", "config.instance=../up"], "/config/instance"),
    (["--set", "config.etcd={http://etcd}", "--set", "etcd.enabled=false"], "/config/etcd/0"),
    (["--set", "config.capacityGb={4}"], "capacityGb"),
    (["--set", "node.resources.limits.nvidia\\.com/gpu=1"], "/node/resources/limits"),
    (["--set", "node.resources.requests.nvidia\\.com/gpu=1"], "/node/resources/requests"),
    (["--set", "node.admin.port=70000"], "/node/admin/port"),
    (["--set", "etcd.replicas=2"], "/etcd/replicas"),
    (["--set", "vllm.enabled=yes"], "/vllm/enabled"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_schema_rejects_bad_values(args: list[str], where: str) -> None:
    err = render_fails(*args)
    assert "schema" in err and where in err, err


def test_template_checks_what_the_schema_cannot() -> None:
    err = render_fails("--set", "config.paths={/a,/b}", "--set", "config.capacity_gb={1,2,3}")
    assert "3 values for 2 paths" in err
    assert "vllm.model is required" in render_fails("--set", "vllm.enabled=true")


# -- the fence: NetworkPolicies -------------------------------------------------------------------

CLIENTS = ["--set-json", 'networkPolicy.clients=[{"namespace":"inference","podLabels":{"tutti.io/client":"true"}}]',
           "--set-json", 'networkPolicy.adminClients=[{"namespace":"ingress-nginx","podLabels":{"app":"ingress"}}]']


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "NetworkPolicy"}


def _peer_namespace(peer: dict[str, Any]) -> str:
    """The one namespace a peer admits from, or a failure saying why it admits more."""
    assert set(peer) == {"namespaceSelector", "podSelector"}, f"a peer not limited to a namespace and labels: {peer}"
    ns = peer["namespaceSelector"]
    assert set(ns) == {"matchLabels"} and list(ns["matchLabels"]) == ["kubernetes.io/metadata.name"], \
        f"a namespace selector other than one namespace by name: {peer}"
    pods = peer["podSelector"]
    assert set(pods) == {"matchLabels"} and pods["matchLabels"], f"a peer without pod labels: {peer}"
    return str(ns["matchLabels"]["kubernetes.io/metadata.name"])


@pytest.mark.parametrize("args", [
    [], ["-f", str(EXAMPLE), "--set", "mooncake.enabled=true", *CLIENTS],
    ["--set", "admin.enabled=false", "--set", "etcd.enabled=false", "--set", "config.etcd={10.0.0.5:2379}"],
    ["-f", str(EXAMPLE), *RDMA],
], ids=["default", "example-clients-mooncake", "external-etcd", "rdma"])
def test_no_network_policy_admits_any_namespace(args: list[str]) -> None:
    docs = render(*args)
    pols = _policies(docs)
    assert pols
    rdma = "node.rdma.enabled=true" in args
    for comp, pol in pols.items():
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        for rule in pol["spec"]["ingress"]:
            if "from" not in rule:
                # Only the engines' inference API is open to all (their own front door).
                assert comp == "vllm" and rule["ports"] == [{"port": "http", "protocol": "TCP"}], (comp, rule)
                continue
            assert rule["from"], (comp, rule)
            assert rule.get("ports"), f"{comp}: a rule for every port: {rule}"
            for peer in rule["from"]:
                if "ipBlock" in peer:
                    # Host-network pods, by the nodes' addresses, and only then.
                    assert rdma and peer == {"ipBlock": {"cidr": "10.0.0.0/16"}}, (comp, peer)
                    continue
                assert _peer_namespace(peer) in (NS, "inference", "ingress-nginx", "monitoring"), (comp, peer)


def test_network_policy_ports_and_peers_per_listener() -> None:
    docs = render("-f", str(EXAMPLE), "--set", "mooncake.enabled=true", "--set", "config.transfer_ports=20000-20100",
                  *CLIENTS)
    pols = _policies(docs)
    ds = one(docs, "DaemonSet", "node")

    def admitted(comp: str) -> dict[str, set[tuple[str, str]]]:
        """port -> {(namespace, labels)} of a component's policy."""
        out: dict[str, set[tuple[str, str]]] = {}
        for rule in pols[comp]["spec"]["ingress"]:
            for port in rule["ports"]:
                key = f"{port['port']}-{port['endPort']}" if "endPort" in port else str(port["port"])
                out[key] = {(_peer_namespace(p), json.dumps(p["podSelector"]["matchLabels"], sort_keys=True))
                            for p in rule.get("from", [])}
        return out

    def own(comp: str) -> tuple[str, str]:
        return NS, json.dumps({"app.kubernetes.io/component": comp, "app.kubernetes.io/instance": "t",
                               "app.kubernetes.io/name": "tutti"}, sort_keys=True)

    label = '{"tutti.io/client": "true"}'
    clients = {own("node"), own("vllm"), (NS, label), ("inference", label)}
    scrapers = {("monitoring", '{"app.kubernetes.io/name": "prometheus"}')}
    admins = {("ingress-nginx", '{"app": "ingress"}')}
    node = admitted("node")
    # Stage endpoint and Transfer Engine: the data path's peers. The admin port: the admin plane,
    # admin clients, Prometheus. The health port: nobody (the kubelet probes from the node).
    assert node == {"stage": clients, "20000-20100": clients, "admin": {own("admin")} | admins | scrapers}
    ports = {p["name"]: p["containerPort"] for p in container(ds)["ports"]}
    assert ports == {"admin": 9480, "health": 9481, "stage": 9482}
    assert env_of(container(ds))["TUTTI_STAGE_PORT"] == "9482"
    assert admitted("vllm") == {"20000-20100": clients, "http": set()}
    assert admitted("admin") == {"admin": admins | scrapers}
    assert admitted("etcd") == {"client": clients | {own("admin")}, "peer": {own("etcd")}}
    assert admitted("mooncake-master") == {"rpc": clients, "metrics": scrapers}
    # Without any admin client or scraper, the admin plane admits no one.
    docs = render("--set-json", "networkPolicy.scrapers=[]")
    assert _policies(docs)["admin"]["spec"]["ingress"] == []
    # The policy names the stage port: it must be fixed.
    assert "config.stage_port" in render_fails("--set", "config.stage_port=0")


# -- credentials: Secrets, copied owner-only ------------------------------------------------------

CREDS = "/run/tutti/credentials"


def _credentials(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The credential settings of a pod's main container: TUTTI_* -> (Secret, key) it is copied from,
    checked along the way: the copy is made owner-only (install -m 0400) by the init container from a
    read-only Secret mount into an in-memory volume that the main container mounts read-only."""
    spec = pod_spec(obj)
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    inits = {c["name"]: c for c in spec.get("initContainers", [])}
    main = container(obj)
    env = env_of(main)
    files = {k: v for k, v in env.items() if k.endswith("_FILE") and isinstance(v, str) and v.startswith(CREDS)}
    if not files:
        assert "credentials" not in inits and "credentials" not in vols
        return {}
    assert vols["credentials"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "credentials", "mountPath": CREDS, "readOnly": True} in main["volumeMounts"]
    # The main container sees no Secret volume: only the owner-only copies.
    assert not any("secret" in vols[m["name"]] for m in main["volumeMounts"] if m["name"] in vols)
    init = inits["credentials"]
    script = init["command"][-1]
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    out = {}
    for var, path in files.items():
        m = re.search(rf"^install -m 0400 /etc/tutti/secrets/([^/]+)/(\S+) {re.escape(path)}$", script, re.M)
        assert m, (var, path, script)
        secret, key = m.groups()
        mount = mounts[f"/etc/tutti/secrets/{secret}"]
        assert mount["readOnly"] is True
        vol = vols[mount["name"]]["secret"]
        assert vol["secretName"] == secret and {"key": key, "path": key} in vol["items"]
        # What the kubelet makes of a Secret with an fsGroup: the pod's group may read it (only the
        # init container needs to); nobody else.
        assert vol["defaultMode"] == 0o440
        out[var] = (secret, key)
    return out


def test_cluster_credential_generated_once_and_given_to_nodes_engines_and_admin(example_docs: list[dict[str, Any]]) -> None:
    found = [d for d in example_docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-tutti-cluster-secret"]
    assert len(found) == 1
    value = base64.b64decode(found[0]["data"]["cluster.key"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}\n", value), value  # what `tutti cluster-key` writes: 32 bytes in hex
    # The admin plane holds it too: it verifies the signed node records before it sends a request
    # (and the admin token) to an address.
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "vllm"), ("Deployment", "admin")):
        creds = _credentials(one(example_docs, kind, comp))
        assert creds["TUTTI_CLUSTER_SECRET_FILE"] == ("t-tutti-cluster-secret", "cluster.key"), comp

    key = "ab" * 40
    docs = render("--set", f"clusterSecret.value={key}")
    secret = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-tutti-cluster-secret"][0]
    assert base64.b64decode(secret["data"]["cluster.key"]).decode() == key
    docs = render("-f", str(EXAMPLE), "--set", "clusterSecret.existingSecret=ops-cluster",
                  "--set", "clusterSecret.existingSecretKey=key")
    assert "t-tutti-cluster-secret" not in [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "vllm")):
        assert _credentials(one(docs, kind, comp))["TUTTI_CLUSTER_SECRET_FILE"] == ("ops-cluster", "key")
    # A single node makes its own credential: none is rendered or passed.
    docs = render("--set", "etcd.enabled=false", "--set", "admin.enabled=false")
    assert "t-tutti-cluster-secret" not in json.dumps(docs)
    assert "TUTTI_CLUSTER_SECRET_FILE" not in env_of(container(one(docs, "DaemonSet", "node")))
    assert "value or existingSecret" in render_fails("--set", f"clusterSecret.value={key}",
                                                     "--set", "clusterSecret.existingSecret=x")


ETCD_CLIENT = ["--set", "etcdClient.existingSecret=etcd-client", "--set", "etcdClient.user=tutti",
               "--set", "etcdClient.passwordKey=password"]


def test_etcd_client_credentials_from_a_secret() -> None:
    docs = render("-f", str(EXAMPLE), *ETCD_CLIENT)
    want = {"TUTTI_ETCD_CA_FILE": ("etcd-client", "ca.crt"), "TUTTI_ETCD_CERT_FILE": ("etcd-client", "tls.crt"),
            "TUTTI_ETCD_KEY_FILE": ("etcd-client", "tls.key"), "TUTTI_ETCD_PASSWORD_FILE": ("etcd-client", "password")}
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "admin"), ("Deployment", "vllm")):
        obj = one(docs, kind, comp)
        creds = _credentials(obj)
        assert {k: v for k, v in creds.items() if k.startswith("TUTTI_ETCD_")} == want, comp
        assert env_of(container(obj))["TUTTI_ETCD_USER"] == "tutti"
    # Without etcdClient nothing of it is set.
    env = env_of(container(one(render(), "DaemonSet", "node")))
    assert not any(k.startswith("TUTTI_ETCD_") for k in env)
    # Only the CA (server verification, no client certificate).
    docs = render("--set", "etcdClient.existingSecret=ca-only", "--set", "etcdClient.certKey=",
                  "--set", "etcdClient.keyKey=")
    assert {k for k in _credentials(one(docs, "DaemonSet", "node")) if k.startswith("TUTTI_ETCD")} == \
        {"TUTTI_ETCD_CA_FILE"}
    assert "certKey and keyKey" in render_fails("--set", "etcdClient.existingSecret=x", "--set", "etcdClient.keyKey=")
    assert "user and passwordKey" in render_fails("--set", "etcdClient.existingSecret=x", "--set", "etcdClient.user=u")
    assert "etcdClient.existingSecret" in render_fails("--set", "etcdClient.user=u",
                                                       "--set", "etcdClient.passwordKey=p")
    assert "clients of a cluster" in render_fails("--set", "etcd.enabled=false", "--set", "admin.enabled=false",
                                                  "--set", "etcdClient.existingSecret=x")


def test_chart_etcd_with_tls_and_client_certificates() -> None:
    docs = render("--set", "etcd.tls.existingSecret=etcd-server", "--set", "etcdClient.existingSecret=etcd-client",
                  "--set", "etcd.replicas=3")
    sts = one(docs, "StatefulSet", "etcd")
    cmd = container(sts)["command"]
    assert "--listen-client-urls=https://0.0.0.0:2379" in cmd and "--client-cert-auth" in cmd
    assert "--peer-client-cert-auth" in cmd and "--trusted-ca-file=/etc/etcd/tls/ca.crt" in cmd
    assert [a for a in cmd if a.startswith("--initial-cluster=")][0].count("=https://") == 3
    tls = [v for v in pod_spec(sts)["volumes"] if v["name"] == "tls"][0]["secret"]
    assert tls["secretName"] == "etcd-server" and tls["defaultMode"] == 0o440
    assert {"name": "tls", "mountPath": "/etc/etcd/tls", "readOnly": True} in container(sts)["volumeMounts"]
    assert "http://" not in " ".join(a for a in cmd if "metrics" not in a)
    # A TLS etcd that asks for client certificates needs them on the clients.
    assert "client certificate" in render_fails("--set", "etcd.tls.existingSecret=etcd-server")
    assert "--client-cert-auth" not in container(one(render(), "StatefulSet", "etcd"))["command"]


def test_metrics_scrape_token_and_the_service_monitor() -> None:
    docs = render("--api-versions", "monitoring.coreos.com/v1")
    secret = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-tutti-metrics-token"][0]
    assert re.fullmatch(r"[A-Za-z0-9]{48}", base64.b64decode(secret["data"]["token"]).decode())
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "admin")):
        assert _credentials(one(docs, kind, comp))["TUTTI_METRICS_TOKEN_FILE"] == ("t-tutti-metrics-token", "token")
    sm = [d for d in docs if d["kind"] == "ServiceMonitor"][0]
    assert sm["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "t-tutti-metrics-token", "key": "token"}}
    # The scrape token is a Secret of its own: Prometheus reads it, and never the cluster credential.
    assert secret["metadata"]["name"] != "t-tutti-cluster-secret"

    docs = render("--api-versions", "monitoring.coreos.com/v1", "--set", "metrics.token.existingSecret=scrape",
                  "--set", "metrics.token.existingSecretKey=bearer")
    sm = [d for d in docs if d["kind"] == "ServiceMonitor"][0]
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "scrape", "key": "bearer"}
    assert "t-tutti-metrics-token" not in json.dumps(docs)

    docs = render("--api-versions", "monitoring.coreos.com/v1", "--set", "metrics.token.enabled=false")
    assert "authorization" not in [d for d in docs if d["kind"] == "ServiceMonitor"][0]["spec"]["endpoints"][0]
    assert "TUTTI_METRICS_TOKEN_FILE" not in env_of(container(one(docs, "DaemonSet", "node")))


# -- pod security ---------------------------------------------------------------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What a pod does beyond the restricted Pod Security Standard (Kubernetes 1.30), by container."""
    out = []
    pod = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        kind = (set(v) - {"name"}).pop()
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {kind}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{c['name']}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: adds {caps['add']}")
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", pod.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccomp {seccomp}")
        if any("hostPort" in p for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
    return out


def test_pods_meet_the_restricted_standard_but_for_the_data_path(example_docs: list[dict[str, Any]]) -> None:
    docs = render("-f", str(EXAMPLE), "--set", "mooncake.enabled=true")
    pods = {d["metadata"]["labels"]["app.kubernetes.io/component"]: pod_spec(d)
            for d in docs if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")}
    assert set(pods) == {"node", "admin", "etcd", "mooncake-master", "vllm"}
    for comp in ("admin", "etcd", "mooncake-master"):
        assert _restricted_violations(pods[comp]) == [], comp
    # The data path: host paths for the store (forbidden from the baseline level up), and the one
    # init container that hands the kubelet-made host directories to the pods' user (root, CHOWN).
    assert _restricted_violations(pods["node"]) == [
        "volume data-dir: hostPath", "volume store-0: hostPath", "volume store-1: hostPath",
        "prepare-paths: adds ['CHOWN']", "prepare-paths: runAsNonRoot", "prepare-paths: runAsUser 0"]
    assert _restricted_violations(pods["vllm"]) == [
        "volume data-dir: hostPath", "volume store-0: hostPath", "volume store-1: hostPath"]
    # The store's processes and the engines run as the same non-root user (owner-only pool files).
    for comp, spec in pods.items():
        sc = spec["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (10001, 10001, 10001), comp
        for c in spec.get("initContainers", []) + spec["containers"]:
            # A read-only root file system everywhere but in vLLM (its caches); /tmp where needed.
            assert c["securityContext"]["readOnlyRootFilesystem"] is (c["name"] != "vllm"), (comp, c["name"])
    prepare = pods["node"]["initContainers"][0]
    assert prepare["name"] == "prepare-paths" and prepare["securityContext"]["capabilities"]["add"] == ["CHOWN"]
    assert prepare["command"][4:] == ["/var/lib/tutti", "/mnt/nvme0/tutti", "/mnt/nvme1/tutti"]
    assert "chown 10001:10001" in prepare["command"][2]
    # Operators who prepare the directories themselves turn it off; the node is then at its minimum.
    ds = pod_spec(one(render("--set", "node.preparePaths=false"), "DaemonSet", "node"))
    assert _restricted_violations(ds) == ["volume data-dir: hostPath"]
    # Another user and group for all.
    docs = render("-f", str(EXAMPLE), "--set", "podSecurity.runAsUser=2001", "--set", "podSecurity.runAsGroup=2002")
    for d in docs:
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            sc = pod_spec(d)["securityContext"]
            assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (2001, 2002, 2002)
    # RDMA without a device plugin: privileged, as root, on the nodes and the engines only.
    docs = render("-f", str(EXAMPLE), *RDMA, "--set", "node.rdma.privileged=true")
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "vllm")):
        obj = one(docs, kind, comp)
        assert pod_spec(obj)["securityContext"]["runAsUser"] == 0
        assert container(obj)["securityContext"]["privileged"] is True
    assert _restricted_violations(pod_spec(one(docs, "Deployment", "admin"))) == []


def test_file_group_joins_the_data_path_pods() -> None:
    docs = render("-f", str(EXAMPLE), "--set", "config.file_group=2000")
    for kind, comp in (("DaemonSet", "node"), ("Deployment", "vllm")):
        obj = one(docs, kind, comp)
        assert pod_spec(obj)["securityContext"]["supplementalGroups"] == [2000], comp
        assert env_of(container(obj))["TUTTI_FILE_GROUP"] == "2000"
    assert "supplementalGroups" not in pod_spec(one(docs, "Deployment", "admin"))["securityContext"]
    prepare = pod_spec(one(docs, "DaemonSet", "node"))["initContainers"][0]["command"][2]
    assert "chown 10001:2000" in prepare and "chmod 0750" in prepare
    # A group name is passed on; the image must know it, and no supplementalGroups are set.
    docs = render("--set", "config.file_group=tutti-share")
    ds = one(docs, "DaemonSet", "node")
    assert env_of(container(ds))["TUTTI_FILE_GROUP"] == "tutti-share"
    assert "supplementalGroups" not in pod_spec(ds)["securityContext"]


@pytest.mark.parametrize("args, where", [
    (["--set-json", 'networkPolicy.clients=[{"namespace":"inference"}]'], "/networkPolicy/clients/0"),
    (["--set-json", 'networkPolicy.clients=[{"namespace":"inference","podLabels":{}}]'], "/networkPolicy/clients/0"),
    (["--set-json", 'networkPolicy.clients=[{"podLabels":{"a":"b"}}]'], "/networkPolicy/clients/0"),
    (["--set-json", 'networkPolicy.adminClients=[{"namespaceSelector":{},"podLabels":{"a":"b"}}]'],
     "/networkPolicy/adminClients/0"),
    (["--set-json", 'networkPolicy.scrapers=[{"namespace":"Not_A_Name","podLabels":{"a":"b"}}]'],
     "/networkPolicy/scrapers/0"),
    (["--set-json", 'networkPolicy.adminFrom=[{"namespaceSelector":{}}]'], "adminFrom"),
    (["--set", "networkPolicy.nodeCIDRs={10.0.0.0}"], "/networkPolicy/nodeCIDRs/0"),
    (["--set", "clusterSecret.value=tooshort"], "/clusterSecret/value"),
    (["--set", "clusterSecret.existingSecretKey=a/b"], "/clusterSecret/existingSecretKey"),
    (["--set", "metrics.token.value=short"], "/metrics/token/value"),
    (["--set", "etcdClient.caKey=../ca"], "/etcdClient/caKey"),
    (["--set", "etcd.tls.existingSecret=Bad_Name"], "/etcd/tls/existingSecret"),
    (["--set", "podSecurity.runAsUser=0"], "/podSecurity/runAsUser"),
    (["--set", "podSecurity.runAsGroup=0"], "/podSecurity/runAsGroup"),
    (["--set", "node.admin.healthPort=0"], "/node/admin/healthPort"),
    (["--set", "admin.healthPort=70000"], "/admin/healthPort"),
    (["--set", "config.file_group=-1"], "/config/file_group"),
    (["--set", "node.preparePaths=yes"], "/node/preparePaths"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_schema_rejects_bad_security_values(args: list[str], where: str) -> None:
    err = render_fails(*args)
    assert "schema" in err and where in err, err
