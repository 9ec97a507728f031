"""Deployment files under deploy/: Kubernetes schemas (offline), structure and agreement
with the run config, the container image definition, its entry point, systemd units.

Kubernetes manifests are validated against the JSON schemas that the
``kubernetes-validate`` package ships (no network), in strict mode (unknown fields
fail), and a deliberately broken copy must fail the same check.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from hypertrain import sim_cmd
from hypertrain.common.config import RunConfig, TopologyConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.common.settings import IslandSettings, RelaySettings
from hypertrain.common.trust.certs import CA_CERT, CA_KEY, TlsFiles, init_daemons
from hypertrain.common.trust.keys import daemon_key_names, load_signing_key

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
RUN_TOML = DEPLOY / "configs" / "run.toml"
K8S_VERSION = "1.30"  # the oldest Kubernetes these manifests are written for
IMAGE_UID = 10001
ENTRYPOINT = DEPLOY / "container" / "entrypoint.sh"
# The downward-API source of a relay pod's shard index (its StatefulSet ordinal).
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
# Flags the deploy files pass that the daemons do not take yet (none at present).
PENDING_FLAGS: set[str] = set()
# The Secret of the run CA's certificate, which every pod mounts (--tls-ca).
CA_SECRET = "hypertrain-tls-ca"
# What the image's `relay-key FROM TO ...` installs in the folder TO, by the relay flag
# that reads it (deploy/container/entrypoint.sh).
RELAY_KEY_FILES = {"--signing-key": "signing.key", "--tls-cert": "tls.crt", "--tls-key": "tls.key"}


# -- helpers --------------------------------------------------------------------------------


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


GRID = "parity-grid.yaml"
"""The parity grid's Job: not part of the training cluster (test_the_parity_grid_job_*)."""


def manifests() -> dict[str, list[dict[str, Any]]]:
    """The training cluster's manifests (every file of deploy/k8s but the kustomization and
    the parity grid's Job)."""
    return {
        p.name: load_docs(p)
        for p in sorted(K8S.glob("*.yaml"))
        if p.name not in ("kustomization.yaml", GRID)
    }


def all_resources() -> list[dict[str, Any]]:
    return [d for docs in manifests().values() for d in docs]


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Problems of one resource against the offline strict schema ([] if valid)."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"]
    except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as e:
        return [f"{name}: {e.message}"]
    return []


def file_errors(path: Path) -> list[str]:
    try:
        docs = load_docs(path)
    except yaml.YAMLError as e:
        return [f"{path.name}: not YAML: {e}"]
    return [f"{path.name}: {err}" for d in docs for err in schema_errors(d)]


def pod_specs() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every workload."""
    for doc in all_resources():
        if doc["kind"] in ("StatefulSet", "Deployment", "Job"):
            yield doc, doc["spec"]["template"]


def flag(args: list[str], name: str) -> str:
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def region_relay_keys(topology: TopologyConfig, region: str) -> list[str]:
    """The key names of ``region``'s relay shards, in shard order, as daemon_key_names
    (and so ``hypertrain keys init``) gives them."""
    one = dataclasses.replace(topology, regions=(region,))
    return [n for n in daemon_key_names(one) if n.startswith("relay-")]


def relay_files(name: str) -> list[str]:
    """The files ``hypertrain keys init`` writes for daemon ``name`` that it needs: its
    signing key, its TLS certificate and its TLS key."""
    return [f"{name}.key", f"{name}.crt", f"{name}.tls.key"]


def secret_source(secret: str, key: str) -> str:
    """The file of ``hypertrain keys init``'s folder that goes under ``key`` in the Secret
    ``secret``, as the commands of secrets.yaml and docs/operations.md make them
    (test_secret_commands_agree checks those): a daemon's Secret holds its files as
    ``signing.key``, ``tls.crt`` and ``tls.key``, a region's relay Secret every shard's
    files under their own names, the CA's Secret ``ca.crt``."""
    name = secret.removeprefix("hypertrain-key-")
    if secret == CA_SECRET or name.startswith("relay-"):
        return key
    return dict(zip(["signing.key", "tls.crt", "tls.key"], relay_files(name), strict=True))[key]


def relay_addresses(sts: dict[str, Any], resources: list[dict[str, Any]]) -> list[str]:
    """Every shard's HOST:PORT of a relay StatefulSet, in shard order: pod i's name in
    the StatefulSet's headless Service, at the Service's gRPC port."""
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    (svc,) = [d for d in resources if d["kind"] == "Service" and d["metadata"]["name"] == service]
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    return [f"{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]


def env_value(container: dict[str, Any], name: str) -> Any:
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value", e.get("valueFrom"))
    return None


@pytest.fixture(scope="module")
def run_config() -> RunConfig:
    return RunConfig.from_toml(RUN_TOML)


# -- run config -----------------------------------------------------------------------------


def test_example_run_config_loads_and_plans(run_config: RunConfig) -> None:
    from hypertrain.common.model import PRESETS
    from hypertrain.common.planner.plan import PlanInput, make_plan, parameter_count

    topo = run_config.topology
    assert topo.regions == ("eu", "us", "ap")
    assert run_config.steps % topo.h_g == 0
    # The example is not starved of outer steps (docs/design.md §5.1): no planner warning.
    seq = PRESETS[run_config.model].seq_len
    plan = make_plan(
        PlanInput(
            params=parameter_count(PRESETS[run_config.model]), seq_len=seq,
            islands=topo.n_islands, regions=len(topo.regions), h_r=topo.h_r, h_g=topo.h_g,
            batch_per_island=run_config.batch_per_island,
            tokens=run_config.steps * run_config.global_batch * seq, step_seconds=1.0,
        )
    )  # fmt: skip
    assert plan.outer_steps >= 1000 and plan.warnings == ()


def test_configmap_is_the_example_run_config() -> None:
    (cm,) = manifests()["configmap.yaml"]
    assert cm["metadata"]["name"] == "hypertrain-config"
    assert cm["data"]["run.toml"] == RUN_TOML.read_text()


# -- Kubernetes: schemas --------------------------------------------------------------------


def test_manifests_validate_offline_against_kubernetes_schemas() -> None:
    errors = [
        e
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for e in file_errors(p)
    ]
    assert errors == []
    kinds = {d["kind"] for d in all_resources()}
    assert {"Namespace", "ConfigMap", "Secret", "StatefulSet", "Job", "Service",
            "PersistentVolumeClaim"} <= kinds  # fmt: skip


def test_broken_manifests_fail_validation(tmp_path: Path) -> None:
    (svc, sts) = manifests()["aggregator.yaml"]
    breakages = [
        ("containerPort as a name", ["spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"], "grpc"),
        ("misspelled field", ["spec", "template", "spec", "contianers"], []),
        ("replicas as text", ["spec", "replicas"], "one"),
        ("unknown probe handler", ["spec", "template", "spec", "containers", 0, "livenessProbe", "tcp"], {"port": 1}),
    ]  # fmt: skip
    for what, path, value in breakages:
        doc = copy.deepcopy(sts)
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert schema_errors(doc), what
    # ... and through the same file check the test above uses, on a broken copy of a file.
    text = (K8S / "relay-eu.yaml").read_text()
    broken = tmp_path / "relay-eu.yaml"
    broken.write_text(text.replace("containerPort: 7071", 'containerPort: "grpc"', 1))
    assert any("containerPort" in e for e in file_errors(broken))
    broken.write_text(text.replace("kind: StatefulSet", "kind: StatefulSte"))
    assert any("StatefulSte" in e for e in file_errors(broken))
    assert schema_errors(copy.deepcopy(svc)) == []


def test_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert listed == set(manifests()) - {"secrets.yaml"}
    if shutil.which("kubectl") is None:
        return
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:  # a kubectl without kustomize: nothing more to check here
        return
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert [e for d in rendered for e in schema_errors(d)] == []
    images = {c["image"] for d in rendered if d["kind"] in ("StatefulSet", "Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert all(i.startswith("registry.example.com/hypertrain:") for i in images), images


# -- Kubernetes: structure and agreement with run.toml ------------------------------------


def test_one_relay_and_one_island_job_per_region(run_config: RunConfig) -> None:
    topo = run_config.topology
    res = all_resources()
    by = {(d["kind"], d["metadata"]["name"]): d for d in res}
    assert all(
        d["metadata"].get("namespace") == "hypertrain" for d in res if d["kind"] != "Namespace"
    )
    sts = by[("StatefulSet", "hypertrain-aggregator")]
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == "hypertrain-aggregator"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    agg = sts["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in agg["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag(agg["args"], "--state-dir")
    for region in topo.regions:
        # A StatefulSet of relay shards (replicas and shard wiring: test_relay_shard_*).
        relay_sts = by[("StatefulSet", f"hypertrain-relay-{region}")]
        relay = relay_sts["spec"]["template"]["spec"]["containers"][0]
        assert flag(relay["args"], "--region") == region
        assert flag(relay["args"], "--aggregator") == "hypertrain-aggregator:7070"
        (claim,) = relay_sts["spec"]["volumeClaimTemplates"]
        mounts = {m["name"]: m["mountPath"] for m in relay["volumeMounts"]}
        assert mounts[claim["metadata"]["name"]] == flag(relay["args"], "--state-dir")
        assert ("Service", relay_sts["spec"]["serviceName"]) in by
        job = by[("Job", f"hypertrain-islands-{region}")]
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == topo.islands_per_region == job["spec"]["parallelism"]
        pod = job["spec"]["template"]["spec"]
        island = pod["containers"][0]
        args = island["args"]
        assert args[0] == "torchrun" and args[args.index("-m") + 1] == "hypertrain.island"
        gpus = int(island["resources"]["limits"]["nvidia.com/gpu"])
        assert int(flag(args, "--nproc-per-node")) == gpus
        assert flag(args, "--region") == region and flag(args, "--index") == "$(ISLAND_INDEX)"
        assert flag(args, "--relay") == ",".join(relay_addresses(relay_sts, res))
        assert "ISLAND_INDEX" in {e["name"] for e in island["env"]}  # needed for $(ISLAND_INDEX)
        assert pod["nodeSelector"] == {"hypertrain/region": region}
        assert pod["restartPolicy"] == "Never"
    assert not any(d["kind"] == "Deployment" for d in res)
    workloads = {d["metadata"]["name"] for d in res if d["kind"] == "StatefulSet"}
    assert workloads == {"hypertrain-aggregator"} | {f"hypertrain-relay-{r}" for r in topo.regions}


def test_pods_are_probed_limited_hardened_and_scraped() -> None:
    for workload, template in pod_specs():
        name = workload["metadata"]["name"]
        spec = template["spec"]
        sec = spec["securityContext"]
        assert sec["runAsNonRoot"] and sec["runAsUser"] == IMAGE_UID and sec["fsGroup"] == IMAGE_UID
        assert spec["automountServiceAccountToken"] is False
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"] and c["resources"]["limits"], name
        (main,) = spec["containers"]
        assert "livenessProbe" in main and "startupProbe" in main, name
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        assert 9100 <= ports["metrics"] <= 9199, name
        ann = template["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(
            ports["metrics"]
        )
        assert flag(main["args"], "--metrics-port") == str(ports["metrics"])
        assert flag(main["args"], "--metrics-host") == "0.0.0.0"  # the default is loopback only
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in main:
                assert main[probe]["tcpSocket"]["port"] in ports, (name, probe)
        if "--listen" in " ".join(main["args"]):
            assert flag(main["args"], "--listen").endswith(f":{ports['grpc']}")
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert flag(main["args"], "--config") == "/etc/hypertrain/run.toml"
        assert mounts["/etc/hypertrain"] == "config"
        assert flag(main["args"], "--signing-key").startswith(
            next(p for p, n in mounts.items() if n == "keys")
        )


def test_references_resolve() -> None:
    """Every Service selects a pod and names its ports; every volume source exists."""
    res = all_resources()
    names = {(d["kind"], d["metadata"]["name"]) for d in res}
    pods = [(t["metadata"]["labels"], t["spec"]) for _, t in pod_specs()]
    for svc in (d for d in res if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        matched = [spec for labels, spec in pods if sel.items() <= labels.items()]
        assert len(matched) == 1, svc["metadata"]["name"]
        ports = {p["name"] for p in matched[0]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
        assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
    secrets: set[str] = set()
    for _, spec in pods:
        for vol in spec["volumes"]:
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names
            if "persistentVolumeClaim" in vol:
                assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in names
            if "secret" in vol:
                secrets.add(vol["secret"]["secretName"])
            for src in vol.get("projected", {}).get("sources", []):
                secrets.add(src["secret"]["name"])
    template = {d["metadata"]["name"] for d in manifests()["secrets.yaml"] if d["kind"] == "Secret"}
    assert secrets == template


def test_every_daemon_pins_the_trusted_keys_config_map() -> None:
    """Daemons verify signatures against pinned public keys: each pod mounts the
    hypertrain-trusted-keys ConfigMap (a template in secrets.yaml, like the keys) and
    passes the file in it as --trusted-keys; islands train on their GPUs."""
    maps = [d for d in manifests()["secrets.yaml"] if d["kind"] == "ConfigMap"]
    assert [m["metadata"]["name"] for m in maps] == ["hypertrain-trusted-keys"]
    assert list(maps[0]["data"]) == ["trusted_keys.json"]
    for _, template in pod_specs():
        spec = template["spec"]
        main = spec["containers"][0]
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        path = flag(main["args"], "--trusted-keys")
        folder, _, name = path.rpartition("/")
        assert name == "trusted_keys.json"
        assert vols[mounts[folder]]["configMap"]["name"] == "hypertrain-trusted-keys"
        if main["args"][0] == "torchrun":
            assert flag(main["args"], "--device") == "cuda"


def test_one_secret_per_daemon_named_like_keys_init(run_config: RunConfig) -> None:
    """One Secret per daemon (``signing.key``, ``tls.crt``, ``tls.key``), but one per
    region for the relay, holding every relay shard's signing key, certificate and TLS key
    under the names ``hypertrain keys init`` gives them; and one for the run CA's
    certificate alone (never its private key)."""
    topo = run_config.topology
    secrets = {
        d["metadata"]["name"]: d for d in manifests()["secrets.yaml"] if d["kind"] == "Secret"
    }
    relay_keys = {r: region_relay_keys(topo, r) for r in topo.regions}
    want = {f"hypertrain-key-{n}" for n in daemon_key_names(topo) if not n.startswith("relay-")}
    assert set(secrets) == want | {f"hypertrain-key-relay-{r}" for r in topo.regions} | {CA_SECRET}
    for name, s in secrets.items():
        region = name.removeprefix("hypertrain-key-relay-")
        if name == CA_SECRET:
            files = [CA_CERT]
        elif region in relay_keys:
            files = [f for k in relay_keys[region] for f in relay_files(k)]
        else:
            files = ["signing.key", "tls.crt", "tls.key"]
        assert list(s["stringData"]) == files, name
        for value in s["stringData"].values():
            assert "BEGIN PRIVATE KEY" not in value  # placeholders only
    assert [k for r in topo.regions for k in relay_keys[r]] == [
        n for n in daemon_key_names(topo) if n.startswith("relay-")
    ]


# -- Kubernetes: relay shards -------------------------------------------------------------


def shard_wiring_errors(resources: list[dict[str, Any]]) -> list[str]:
    """Where the relay-shard wiring of ``resources`` (every manifest, the secrets.yaml
    template included) disagrees with itself or with the run config the pods read (the
    ConfigMap's run.toml); [] if nowhere.  S is that run.toml's relay_shards, which the
    file must say; per region it must be the relay StatefulSet's replicas, the number of
    the islands' --relay addresses (each shard's pod name in the headless Service, in shard
    order) and of the key files in the region's relay Secret, named as daemon_key_names
    names them.  Shard index and key are chosen by the entry point
    (test_relay_shard_entrypoint): the pods must give it the pod-index label, and no
    --shard of their own."""
    errors: list[str] = []
    by = {(d["kind"], d["metadata"]["name"]): d for d in resources}
    run_toml = by[("ConfigMap", "hypertrain-config")]["data"]["run.toml"]
    topology_table = tomllib.loads(run_toml)["run"]["topology"]
    if "relay_shards" not in topology_table:
        errors.append("run.toml: [run.topology] does not say relay_shards")
    topo = RunConfig.from_dict(tomllib.loads(run_toml)["run"]).topology
    shards = topo.relay_shards
    for region in topo.regions:
        where = f"relay-{region}"
        sts = by.get(("StatefulSet", f"hypertrain-relay-{region}"))
        if sts is None:
            errors.append(f"{where}: no StatefulSet hypertrain-relay-{region}")
            continue
        replicas = sts["spec"].get("replicas")
        if replicas != shards:
            errors.append(f"{where}: replicas {replicas}, but run.toml's relay_shards is {shards}")
        svc = by.get(("Service", sts["spec"]["serviceName"]))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            errors.append(f"{where}: serviceName is no headless Service (no DNS name per shard)")
            continue
        spec = sts["spec"]["template"]["spec"]
        main = spec["containers"][0]
        for c in [*spec.get("initContainers", []), main]:
            if env_value(c, "HYPERTRAIN_SHARD_INDEX") != {"fieldRef": {"fieldPath": POD_INDEX}}:
                errors.append(f"{where}: {c['name']}: HYPERTRAIN_SHARD_INDEX is not the pod index")
        own = [a for a in main["args"] if a.split("=")[0] in ("--shard", "--relay-shards")]
        if own:
            errors.append(f"{where}: {own}: the entry point passes --shard, from run.toml")
        # The keys: the init container's relay-key FROM TO ... installs this shard's files
        # from the region's Secret into the folder TO, as the relay's --signing-key
        # (TO/signing.key), --tls-cert (TO/tls.crt) and --tls-key (TO/tls.key).
        inits = [c for c in spec.get("initContainers", []) if c["args"][:1] == ["relay-key"]]
        secret = next(
            (v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == f"hypertrain-key-relay-{region}"),
            None,
        )  # fmt: skip
        if len(inits) != 1 or secret is None:
            errors.append(
                f"{where}: no relay-key init container with the Secret hypertrain-key-relay-{region}"
            )
        else:
            args = inits[0]["args"]
            mounts = {m["name"]: m["mountPath"] for m in inits[0]["volumeMounts"]}
            if args[1] != mounts.get(secret["name"]) or "items" in secret["secret"]:
                errors.append(f"{where}: relay-key does not read every file of the key Secret")
            for name, file in RELAY_KEY_FILES.items():
                if f"{args[2]}/{file}" != flag(main["args"], name):
                    errors.append(
                        f"{where}: relay-key installs {args[2]}/{file}, the relay's {name} is "
                        f"{flag(main['args'], name)}"
                    )
            for name in ("--config", "--region"):
                if flag(args[3:], name) != flag(main["args"], name):
                    errors.append(f"{where}: relay-key {name} is not the relay's")
        key_secret = by.get(("Secret", f"hypertrain-key-relay-{region}"), {})
        files = list(key_secret.get("stringData", {}))
        want = [f for k in region_relay_keys(topo, region) for f in relay_files(k)]
        if files != want:
            errors.append(f"{where}: Secret holds {files}, the shards' files are {want}")
        # The islands: every shard's address, in shard order.
        job = by[("Job", f"hypertrain-islands-{region}")]
        island = job["spec"]["template"]["spec"]["containers"][0]
        relay = flag(island["args"], "--relay")
        if relay.split(",") != relay_addresses(sts, resources):
            errors.append(
                f"islands-{region}: --relay={relay}, not the {replicas} shard(s) in order"
            )
        try:
            IslandSettings(region=region, relay=relay).relays(topo)
        except ValueError as e:
            errors.append(f"islands-{region}: {e}")
    return errors


def scaled(resources: list[dict[str, Any]], shards: int) -> list[dict[str, Any]]:
    """A copy of the manifests edited to S = ``shards`` as deploy/README.md says to:
    run.toml's relay_shards, each relay's replicas, the islands' --relay, the key Secrets."""
    out = copy.deepcopy(resources)
    by = {(d["kind"], d["metadata"]["name"]): d for d in out}
    cm = by[("ConfigMap", "hypertrain-config")]
    cm["data"]["run.toml"] = re.sub(
        r"(?m)^relay_shards = \d+$", f"relay_shards = {shards}", cm["data"]["run.toml"]
    )
    topo = RunConfig.from_dict(tomllib.loads(cm["data"]["run.toml"])["run"]).topology
    assert topo.relay_shards == shards
    for region in topo.regions:
        sts = by[("StatefulSet", f"hypertrain-relay-{region}")]
        sts["spec"]["replicas"] = shards
        island = by[("Job", f"hypertrain-islands-{region}")]["spec"]["template"]["spec"][
            "containers"
        ][0]
        island["args"] = [
            f"--relay={','.join(relay_addresses(sts, out))}" if a.startswith("--relay=") else a
            for a in island["args"]
        ]
        secret = by[("Secret", f"hypertrain-key-relay-{region}")]
        secret["stringData"] = {
            f: "REPLACE" for k in region_relay_keys(topo, region) for f in relay_files(k)
        }
    return out


def test_relay_shard_wiring_agrees_with_the_run_config() -> None:
    resources = all_resources()
    assert shard_wiring_errors(resources) == []
    # ... and so it does at other S, after the edits deploy/README.md lists (and only then).
    for shards in (1, 2, 3):
        assert shard_wiring_errors(scaled(resources, shards)) == [], shards


def test_relay_shard_wiring_check_catches_breakage() -> None:
    good = all_resources()

    def broken(edit: Any, shards: int = 1) -> list[str]:
        res = scaled(good, shards)
        by = {(d["kind"], d["metadata"]["name"]): d for d in res}
        edit(by)
        return shard_wiring_errors(res)

    def relay(by: dict[Any, Any], region: str = "eu") -> dict[str, Any]:
        return by[("StatefulSet", f"hypertrain-relay-{region}")]  # type: ignore[no-any-return]

    def island_args(by: dict[Any, Any], region: str = "eu") -> list[str]:
        job = by[("Job", f"hypertrain-islands-{region}")]
        return job["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]

    def set_relay(by: dict[Any, Any], value: str) -> None:
        args = island_args(by)
        args[:] = [f"--relay={value}" if a.startswith("--relay=") else a for a in args]

    def rename(by: dict[Any, Any], old: str, new: str) -> None:
        data = by[("Secret", "hypertrain-key-relay-eu")]["stringData"]
        data[new] = data.pop(old)

    def set_relay_arg(by: dict[Any, Any], name: str, value: str) -> None:
        args = relay(by)["spec"]["template"]["spec"]["containers"][0]["args"]
        args[:] = [f"{name}={value}" if a.startswith(f"{name}=") else a for a in args]

    def drop_index(by: dict[Any, Any]) -> None:
        main = relay(by)["spec"]["template"]["spec"]["containers"][0]
        main["env"] = [e for e in main["env"] if e["name"] != "HYPERTRAIN_SHARD_INDEX"]

    def config_only(by: dict[Any, Any]) -> None:
        cm = by[("ConfigMap", "hypertrain-config")]["data"]
        cm["run.toml"] = cm["run.toml"].replace("relay_shards = 2", "relay_shards = 1")

    def unsaid(by: dict[Any, Any]) -> None:
        cm = by[("ConfigMap", "hypertrain-config")]["data"]
        cm["run.toml"] = re.sub(r"(?m)^relay_shards = 1\n", "", cm["run.toml"])

    cases = [
        ("replicas above relay_shards", 1, lambda by: relay(by)["spec"].update(replicas=2)),
        ("replicas below relay_shards", 2, lambda by: relay(by, "ap")["spec"].update(replicas=1)),
        ("run.toml alone changed back", 2, config_only),
        ("run.toml does not say S", 1, unsaid),
        ("the pre-shard island address", 1, lambda by: set_relay(by, "hypertrain-relay-eu:7071")),
        ("a shard missing", 2, lambda by: set_relay(by, "hypertrain-relay-eu-0.hypertrain-relay-eu:7071")),
        ("shards out of order", 2, lambda by: set_relay(by, ",".join(reversed(flag(island_args(by), "--relay").split(","))))),
        ("a shard key named for S = 1", 2, lambda by: rename(by, "relay-eu-0.key", "relay-eu.key")),
        ("the S > 1 key name at S = 1", 1, lambda by: rename(by, "relay-eu.key", "relay-eu-0.key")),
        ("the old signing.key", 1, lambda by: rename(by, "relay-eu.key", "signing.key")),
        ("a shard's certificate missing", 2, lambda by: by[("Secret", "hypertrain-key-relay-eu")]["stringData"].pop("relay-eu-1.crt")),
        ("a certificate named for S = 1", 2, lambda by: rename(by, "relay-eu-0.crt", "relay-eu.crt")),
        ("--tls-cert not the installed one", 1, lambda by: set_relay_arg(by, "--tls-cert", "/run/hypertrain/keys/relay-eu.crt")),
        ("--tls-key not the installed one", 2, lambda by: set_relay_arg(by, "--tls-key", "/var/run/secrets/hypertrain/relay-eu-0.tls.key")),
        ("a --shard in the args", 2, lambda by: relay(by)["spec"]["template"]["spec"]["containers"][0]["args"].append("--shard=0/2")),
        ("no pod index", 1, drop_index),
        ("not headless", 1, lambda by: by[("Service", "hypertrain-relay-eu")]["spec"].pop("clusterIP")),
    ]  # fmt: skip
    for what, shards, edit in cases:
        assert broken(edit, shards), what


def run_entrypoint(
    script: Path, args: list[str], index: int | None, bin_dir: Path
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("HYPERTRAIN_SHARD_INDEX", None)
    if index is not None:
        env["HYPERTRAIN_SHARD_INDEX"] = str(index)
    return subprocess.run(
        ["sh", str(script), *args], env=env, capture_output=True, text=True, timeout=60
    )


def entrypoint_shard_errors(script: Path, shards: int, tmp_path: Path) -> list[str]:
    """What the entry point ``script`` gets wrong for every relay pod of the manifests
    when the run has ``shards`` relay shards ([] if nothing): pod i's relay must get
    exactly its arguments plus --shard=i/S when S > 1 (no --shard when S = 1), and its
    init container must install the signing key, TLS key (both mode 0400) and certificate
    (0444) of the name daemon_key_names gives shard i; pod S (a replica too many) must be
    refused by both."""
    errors: list[str] = []
    bin_dir = tmp_path / f"bin-{shards}"
    bin_dir.mkdir()
    (bin_dir / "hypertrain-relay").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bin_dir / "hypertrain-relay").chmod(0o755)
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    config = tmp_path / f"run-{shards}.toml"
    config.write_text(
        re.sub(r"(?m)^relay_shards = \d+$", f"relay_shards = {shards}", RUN_TOML.read_text())
    )
    topo = RunConfig.from_toml(config).topology
    assert topo.relay_shards == shards
    by = {(d["kind"], d["metadata"]["name"]): d for d in all_resources()}
    for region in topo.regions:
        spec = by[("StatefulSet", f"hypertrain-relay-{region}")]["spec"]["template"]["spec"]
        local = {"--config=/etc/hypertrain/run.toml": f"--config={config}"}
        main = [local.get(a, a) for a in spec["containers"][0]["args"]]
        (init,) = [c for c in spec["initContainers"] if c["args"][0] == "relay-key"]
        keys = region_relay_keys(topo, region)
        secret = tmp_path / f"secret-{shards}-{region}"
        secret.mkdir()
        for k in keys:
            for f in relay_files(k):
                (secret / f).write_text(f)
        for i in range(shards + 1):
            where = f"{region} pod {i} of S = {shards}"
            out = run_entrypoint(script, main, i, bin_dir)
            if i == shards:
                if out.returncode != 2:
                    errors.append(f"{where}: a pod too many started: {out.stdout!r}")
                continue
            got = out.stdout.splitlines()
            want = main[1:] + ([f"--shard={i}/{shards}"] if shards > 1 else [])
            if out.returncode != 0 or got != want:
                errors.append(f"{where}: relay got {got} ({out.stderr.strip()}), want {want}")
                continue
            shard = next((a.split("=", 1)[1] for a in got if a.startswith("--shard=")), None)
            settings = RelaySettings(region=region, aggregator="a:1", shard=shard)
            if settings.shard_index(topo) != i:
                errors.append(f"{where}: the relay would be shard {settings.shard_index(topo)}")
            dest = tmp_path / f"key-{shards}-{region}-{i}"
            dest.mkdir()
            key_args = [str(secret), str(dest), *[local.get(a, a) for a in init["args"][3:]]]
            out = run_entrypoint(script, ["relay-key", *key_args], i, bin_dir)
            if out.returncode != 0:
                errors.append(f"{where}: relay-key failed: {out.stderr.strip()}")
                continue
            want_files = dict(zip(RELAY_KEY_FILES.values(), relay_files(keys[i]), strict=True))
            got_files = {f.name: (f.read_text(), f.stat().st_mode & 0o777) for f in dest.iterdir()}
            modes = {"signing.key": 0o400, "tls.key": 0o400, "tls.crt": 0o444}
            if got_files != {f: (src, modes[f]) for f, src in want_files.items()}:
                errors.append(f"{where}: installed {got_files}, want {want_files}")
        out = run_entrypoint(
            script, ["relay-key", str(secret), str(tmp_path / "x"), *main[1:]], shards, bin_dir
        )
        if out.returncode != 2:
            errors.append(f"{region}: relay-key installed a key for a pod too many")
    return errors


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_relay_shard_entrypoint(shards: int, tmp_path: Path) -> None:
    assert entrypoint_shard_errors(ENTRYPOINT, shards, tmp_path) == []


def test_relay_shard_entrypoint_check_catches_breakage(tmp_path: Path) -> None:
    text = ENTRYPOINT.read_text()
    breakages = [
        ("always --shard", 1, '[ "$shards" -gt 1 ]; then\n                set --', '[ "$shards" -ge 1 ]; then\n                set --'),
        ("index from 1", 2, '"--shard=$index/$shards"', '"--shard=$((index + 1))/$shards"'),
        ("shard key name at S = 1", 1, 'else name="relay-$region"; fi', 'else name="relay-$region-$index"; fi'),
        ("the TLS key readable", 2, 'install -m 0400 "$from/$name.tls.key"', 'install -m 0444 "$from/$name.tls.key"'),
        ("no certificate", 1, 'exec install -m 0444 "$from/$name.crt" "$to/tls.crt"', "exit 0"),
        ("shard 0's certificate", 2, '"$from/$name.crt" "$to/tls.crt"', '"$from/relay-$region-0.crt" "$to/tls.crt"'),
        ("no upper bound", 1, 'if [ "$index" -ge "$shards" ]; then', 'if false; then'),
    ]  # fmt: skip
    for what, shards, old, new in breakages:
        assert text.count(old) == 1, what
        script = tmp_path / f"entrypoint-{len(what)}.sh"
        script.write_text(text.replace(old, new))
        work = tmp_path / what.replace(" ", "-").replace("=", "")
        work.mkdir()
        assert entrypoint_shard_errors(script, shards, work), what
    # Without HYPERTRAIN_SHARD_INDEX (docker run, bare metal) relay passes its args through.
    bin_dir = tmp_path / "plain"
    bin_dir.mkdir()
    (bin_dir / "hypertrain-relay").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bin_dir / "hypertrain-relay").chmod(0o755)
    args = ["relay", f"--config={RUN_TOML}", "--region=eu", "--shard=1/2"]
    assert run_entrypoint(ENTRYPOINT, args, None, bin_dir).stdout.splitlines() == args[1:]
    # ... and with it, a --shard of its own is refused rather than silently overridden.
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    assert run_entrypoint(ENTRYPOINT, args, 1, bin_dir).returncode == 2


# -- Kubernetes: mutual TLS ----------------------------------------------------------------


def daemon_name(workload: dict[str, Any], index: int, topo: TopologyConfig) -> str:
    """The name daemon ``index`` of ``workload`` (pod ordinal or Job completion index)
    has in ``hypertrain keys init``'s folder: its key's and its certificate's."""
    component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
    region = workload["metadata"]["labels"].get("hypertrain/region", "")
    if component == "relay":
        return region_relay_keys(topo, region)[index]
    return {"aggregator": "aggregator", "island": f"island-{region}-{index}"}[component]


def pod_tls_errors(
    workload: dict[str, Any], resources: list[dict[str, Any]], index: int, keys: Path, root: Path
) -> list[str]:
    """What goes wrong when pod ``index`` of ``workload`` starts with the Secrets made from
    the real files of ``keys`` (``hypertrain keys init``) as secrets.yaml says
    (``secret_source``) ([] if nothing): its volumes are laid out under ``root``, Secret
    files with the volume's mode, its init containers run on them, and the main container's
    --signing-key, --tls-cert, --tls-key and --tls-ca must then load (the daemon's checks:
    keys mode 0600 or less, the key the certificate's, signed by the CA, valid now) as its
    own name.  A mounted file missing from its Secret, or the CA's key anywhere in the pod,
    is an error."""
    name = workload["metadata"]["name"]
    spec = workload["spec"]["template"]["spec"]
    by = {(d["kind"], d["metadata"]["name"]): d for d in resources}
    topo = RunConfig.from_dict(
        tomllib.loads(by[("ConfigMap", "hypertrain-config")]["data"]["run.toml"])["run"]
    ).topology
    own = daemon_name(workload, index, topo)
    errors: list[str] = []

    def put(folder: Path, secret: str, key: str, path: str, mode: int) -> None:
        data = by.get(("Secret", secret), {}).get("stringData", {})
        if key not in data:
            errors.append(f"{name}: mounts {key} of Secret {secret}, which has {list(data)}")
            return
        (folder / path).write_bytes((keys / secret_source(secret, key)).read_bytes())
        (folder / path).chmod(mode)

    for vol in spec["volumes"]:
        folder = root / vol["name"]
        folder.mkdir()
        if "secret" in vol:
            s = vol["secret"]
            items = s.get("items") or [
                {"key": k, "path": k}
                for k in by.get(("Secret", s["secretName"]), {}).get("stringData", {})
            ]
            for item in items:
                put(folder, s["secretName"], item["key"], item["path"], s.get("defaultMode", 0o644))
        for src in vol.get("projected", {}).get("sources", []):
            for item in src["secret"]["items"]:
                mode = vol["projected"].get("defaultMode", 0o644)
                put(folder, src["secret"]["name"], item["key"], item["path"], mode)
        if "configMap" in vol:
            for file, text in by[("ConfigMap", vol["configMap"]["name"])]["data"].items():
                (folder / file).write_text(text)

    def local(container: dict[str, Any]) -> Any:
        """Paths in the container -> paths under root, in one pass (mounts nest: /tmp)."""
        mounts = {m["mountPath"]: str(root / m["name"]) for m in container["volumeMounts"]}
        alternatives = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w./-])({alternatives})(?=/|$|\s)")
        return lambda text: pattern.sub(lambda m: mounts[m.group(1)], text)

    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for c in spec.get("initContainers", []):
        path = local(c)
        env |= {e["name"]: str(index) for e in c.get("env", []) if "valueFrom" in e}
        args = [path(a) for a in c["args"]]
        argv = args if args[0] == "sh" else ["sh", str(ENTRYPOINT), *args]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            errors.append(f"{name} {index}: init container {c['name']}: {out.stderr.strip()}")
    main = spec["containers"][0]
    path = local(main)
    try:
        files = TlsFiles.load(
            *(Path(path(flag(main["args"], f))) for f in ("--tls-cert", "--tls-key", "--tls-ca"))
        )
        key = load_signing_key(path(flag(main["args"], "--signing-key")))
    except (HypertrainError, AssertionError) as e:
        return [*errors, f"{name} {index}: {e}"]
    if files.name != own:
        errors.append(f"{name} {index}: its certificate names {files.name}, not {own}")
    if key.key_id != load_signing_key(keys / f"{own}.key").key_id:
        errors.append(f"{name} {index}: its signing key is not {own}'s")
    if any(p.name == CA_KEY or p.read_bytes() == (keys / CA_KEY).read_bytes()
           for p in root.rglob("*") if p.is_file()):  # fmt: skip
        errors.append(f"{name} {index}: the CA's private key is in the pod")
    return errors


def cluster_tls_errors(resources: list[dict[str, Any]], tmp_path: Path) -> list[str]:
    """pod_tls_errors for every pod of every workload of ``resources``, with keys made by
    ``hypertrain keys init`` for the run config of its ConfigMap."""
    by = {(d["kind"], d["metadata"]["name"]): d for d in resources}
    run = RunConfig.from_dict(
        tomllib.loads(by[("ConfigMap", "hypertrain-config")]["data"]["run.toml"])["run"]
    )
    keys = tmp_path / "keys"
    init_daemons(keys, daemon_key_names(run.topology))
    errors: list[str] = []
    for d in resources:
        if d["kind"] not in ("StatefulSet", "Job"):
            continue
        pods = d["spec"]["replicas"] if d["kind"] == "StatefulSet" else d["spec"]["completions"]
        for i in range(pods):
            root = tmp_path / f"{d['metadata']['name']}-{i}"
            root.mkdir()
            errors += pod_tls_errors(d, resources, i, keys, root)
    return errors


@pytest.mark.parametrize("shards", [1, 2])
def test_every_pod_serves_and_calls_with_its_own_certificate(shards: int, tmp_path: Path) -> None:
    """Every daemon runs mutual TLS with the certificate naming it (the name its peers
    check: aggregator, relay-<region> or relay-<region>-<i>, island-<region>-<i>), its key
    and the run CA, from its Secrets the way its signing key comes; the CA's key reaches
    no pod."""
    assert cluster_tls_errors(scaled(all_resources(), shards), tmp_path) == []


def test_pod_tls_check_catches_breakage(tmp_path: Path) -> None:
    def main_args(by: dict[Any, Any], kind: str, name: str) -> list[str]:
        return by[(kind, name)]["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]

    def set_arg(args: list[str], name: str, value: str) -> None:
        args[:] = [f"{name}={value}" if a.startswith(f"{name}=") else a for a in args]

    def key_from_the_secret(by: dict[Any, Any]) -> None:
        args = main_args(by, "StatefulSet", "hypertrain-aggregator")
        set_arg(args, "--tls-key", "/var/run/secrets/hypertrain/tls.key")  # mode 0440
        spec = by[("StatefulSet", "hypertrain-aggregator")]["spec"]["template"]["spec"]
        spec["containers"][0]["volumeMounts"].append(
            {"name": "key-secret", "mountPath": "/var/run/secrets/hypertrain"}
        )

    def swap_islands(by: dict[Any, Any]) -> None:
        vol = next(
            v for v in by[("Job", "hypertrain-islands-us")]["spec"]["template"]["spec"]["volumes"]
            if v["name"] == "key-secret"
        )  # fmt: skip
        a, b = vol["projected"]["sources"]
        a["secret"]["name"], b["secret"]["name"] = b["secret"]["name"], a["secret"]["name"]

    def ca_key_shipped(by: dict[Any, Any]) -> None:
        by[("Secret", CA_SECRET)]["stringData"][CA_KEY] = "REPLACE"

    cases = [
        ("the CA's key in its Secret", ca_key_shipped),
        ("an island's certificate from another's Secret", swap_islands),
        ("the TLS key read from the Secret volume", key_from_the_secret),
        ("its own certificate as the CA", lambda by: set_arg(
            main_args(by, "StatefulSet", "hypertrain-aggregator"), "--tls-ca", "/run/hypertrain/keys/tls.crt")),
        ("a Secret without the certificate", lambda by: by[("Secret", "hypertrain-key-island-ap-1")]["stringData"].pop("tls.crt")),
        ("the relay's key file as its TLS key", lambda by: set_arg(
            main_args(by, "StatefulSet", "hypertrain-relay-eu"), "--tls-key", "/run/hypertrain/keys/signing.key")),
    ]  # fmt: skip
    for i, (what, edit) in enumerate(cases):
        resources = copy.deepcopy(all_resources())
        edit({(d["kind"], d["metadata"]["name"]): d for d in resources})
        work = tmp_path / str(i)
        work.mkdir()
        assert cluster_tls_errors(resources, work), what


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def test_no_plaintext_and_no_ca_key_in_the_deploy_files() -> None:
    """No daemon is started without TLS (the word is in no deploy file, so neither is the
    flag nor the config key), and no deploy file ships the CA's private key: no Secret
    entry, no volume item, no argument names ca.key."""
    for p in deploy_files():
        assert "insecure" not in p.read_text().lower(), p
    for _, template in pod_specs():
        spec = template["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert not any(CA_KEY in a for a in c["args"]), c["name"]
        for vol in spec["volumes"]:
            items = [*vol.get("secret", {}).get("items", [])] + [
                i for s in vol.get("projected", {}).get("sources", []) for i in s["secret"]["items"]
            ]
            assert not any(CA_KEY in (i["key"], i["path"]) for i in items), vol["name"]
        main = spec["containers"][0]
        for name in ("--tls-cert", "--tls-key", "--tls-ca"):
            flag(main["args"], name)  # present
    for s in manifests()["secrets.yaml"]:
        assert CA_KEY not in s.get("stringData", {}) and CA_KEY not in s.get("data", {})


def from_files(text: str) -> list[tuple[str, str]]:
    """(Secret key, file under keys/) of every --from-file in ``text``'s commands, with
    the shell loops' $name and $r as the aggregator's and region eu's."""
    text = text.replace("$name", "aggregator").replace("$r", "eu")
    return [
        (m.group(1) or m.group(2).rpartition("/")[2], m.group(2).rpartition("/")[2])
        for m in re.finditer(r'--from-file="?(?:([\w.-]+)=)?"?keys/([\w./$-]+)"?', text)
    ]


def test_secret_commands_agree() -> None:
    """The kubectl commands that make the Secrets (secrets.yaml's comments, docs/operations.md)
    put the files where secret_source (and so the pods) expects them, and never ca.key."""
    for doc in (K8S / "secrets.yaml", REPO / "docs" / "operations.md"):
        pairs = from_files(doc.read_text())
        assert pairs, doc
        for key, file in pairs:
            assert file != CA_KEY, doc
            if key == "trusted_keys.json":
                continue
            stem = file.split(".")[0]
            secret = (
                CA_SECRET
                if file == CA_CERT
                else f"hypertrain-key-{'relay-eu' if stem.startswith('relay-eu') else stem}"
            )
            assert secret_source(secret, key) == file, (doc, key, file)
        assert {k for k, _ in pairs} >= {"signing.key", "tls.crt", "tls.key", CA_CERT}, doc


def test_daemons_take_the_flags_the_deploy_files_pass(capsys: pytest.CaptureFixture[str]) -> None:
    from hypertrain.aggregator.__main__ import main as aggregator
    from hypertrain.island.__main__ import main as island
    from hypertrain.relay.__main__ import main as relay

    known: dict[str, set[str]] = {}
    for role, main in (("aggregator", aggregator), ("relay", relay), ("island", island)):
        with pytest.raises(SystemExit):
            main(["--help"])
        known[role] = set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
    used: dict[str, set[str]] = {"aggregator": set(), "relay": set(), "island": set()}
    for _, template in pod_specs():
        args = template["spec"]["containers"][0]["args"]
        role = "island" if args[0] == "torchrun" else args[0]
        tail = args[args.index("hypertrain.island") + 1 :] if role == "island" else args[1:]
        used[role] |= {a.split("=")[0] for a in tail}
    used["relay"].add("--shard")  # added by the image's entry point (relay shards)
    for unit in (DEPLOY / "systemd").glob("*.service"):
        exec_start = parse_unit(unit)["Service"]["ExecStart"]
        role = next(
            r for r in used if f"hypertrain-{r}" in exec_start or f"hypertrain.{r}" in exec_start
        )
        tail = exec_start.split("hypertrain.island", 1)[1] if role == "island" else exec_start
        used[role] |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", tail))
    for role in used:
        assert used[role] - known[role] <= PENDING_FLAGS, role


# -- container image ------------------------------------------------------------------------

DOCKER_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}  # fmt: skip


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DEPLOY / "container" / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word, " ".join(rest.split())))
        pending = ""
    assert not pending, "dangling line continuation"
    return out


def test_dockerfile_structure() -> None:
    ins = dockerfile()
    assert {w for w, _ in ins} <= DOCKER_INSTRUCTIONS
    froms = [a for w, a in ins if w == "FROM"]
    assert froms == [
        "${PYTHON_IMAGE} AS base-cpu",
        "${CUDA_IMAGE} AS base-cuda",
        "base-${VARIANT} AS runtime",
    ]
    args = {a.split("=")[0]: a.split("=", 1)[1] for w, a in ins if w == "ARG" and "=" in a}
    assert args["VARIANT"] == "cpu" and args["PYTHON_IMAGE"].startswith("python:3.11")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    assert args["TORCH_CPU_INDEX"].endswith("/cpu") and "/cu" in args["TORCH_CUDA_INDEX"]
    # torch first, at the project's pin, then the project under the constraints.
    pins = dict(
        line.split("==") for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )  # fmt: skip
    runs = [a for w, a in ins if w == "RUN"]
    torch_at = next(i for i, a in enumerate(runs) if "torch==" in a)
    assert (
        f'"torch=={pins["torch"]}"' in runs[torch_at]
        and '--index-url "${TORCH_INDEX}"' in runs[torch_at]
    )
    project_at = next(i for i, a in enumerate(runs) if "-c requirements/constraints.txt ." in a)
    assert torch_at < project_at
    # non-root, tini as PID 1, exec-form entry point, the ports the manifests use
    users = [a for w, a in ins if w == "USER"]
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"]
    (entry,) = [a for w, a in ins if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["tini", "--", "hypertrain-entrypoint"]
    exposed = {int(p) for w, a in ins if w == "EXPOSE" for p in a.split()}
    used = {
        p["containerPort"]
        for _, t in pod_specs()
        for c in t["spec"]["containers"]
        for p in c["ports"]
    }
    assert used <= exposed
    # every COPY source exists and is let through the .dockerignore
    allowed = [
        line[1:] for line in (DEPLOY / "container" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]  # fmt: skip
    for w, a in ins:
        if w == "COPY":
            src = a.split()[0]
            assert (REPO / src).exists(), src
            assert any(src == p or p.startswith(src + "/") for p in allowed), src


def test_every_package_folder_is_copied_into_the_image() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = {a.split()[0] for w, a in dockerfile() if w == "COPY"}
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
        assert any(folder == c or folder.startswith(c + "/") for c in copied), folder


def test_entrypoint_dispatches(tmp_path: Path) -> None:
    script = DEPLOY / "container" / "entrypoint.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    for name in ("hypertrain-aggregator", "hypertrain-relay", "hypertrain-island", "torchrun"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*"\n')
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.pop("HYPERTRAIN_SHARD_INDEX", None)  # set: a relay shard pod (test_relay_shard_entrypoint)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), *args], env=env, capture_output=True, text=True)

    assert run("relay", "--region", "eu").stdout == "hypertrain-relay --region eu\n"
    assert run("aggregator").stdout == "hypertrain-aggregator \n"
    assert run("torchrun", "-m", "hypertrain.island").stdout == "torchrun -m hypertrain.island\n"
    assert run("--help").returncode == 0
    bad = run("trainer")
    assert bad.returncode == 2 and "unknown command 'trainer'" in bad.stderr
    assert run().returncode == 2


# -- systemd --------------------------------------------------------------------------------

UNITS = ("hypertrain-aggregator.service", "hypertrain-relay@.service", "hypertrain-island@.service")


def parse_unit(path: Path) -> dict[str, dict[str, str]]:
    """Sections of a unit file; repeated keys keep the last value; continuations joined."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), line
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}: {line}"
        key, _, value = line.partition("=")
        current[key.strip()] = " ".join(value.split())
    assert not pending
    return sections


@pytest.mark.parametrize("name", UNITS)
def test_systemd_unit_structure(name: str) -> None:
    unit = parse_unit(DEPLOY / "systemd" / name)
    assert set(unit) == {"Unit", "Service", "Install"}
    svc = unit["Service"]
    assert svc["User"] == svc["Group"] == "hypertrain"
    assert svc["Restart"] == "on-failure" and svc["RestartPreventExitStatus"] == "2"
    assert svc["ExecStart"].startswith("/opt/hypertrain/venv/bin/")
    for hardening in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictNamespaces"):
        assert svc[hardening] == "yes", hardening
    assert svc["ProtectSystem"] == "strict" and svc["CapabilityBoundingSet"] == ""
    state = svc["StateDirectory"]
    assert state.startswith("hypertrain/") and f"--state-dir /var/lib/{state}" in svc["ExecStart"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "--metrics-port" in svc["ExecStart"]
    instance = name.endswith("@.service")
    assert ("%i" in svc["ExecStart"]) == instance
    # The key file is the one `hypertrain keys init` writes for this daemon.
    key = re.search(r"--signing-key /etc/hypertrain/keys/(\S+)\.key", svc["ExecStart"])
    assert key is not None
    role = name.removeprefix("hypertrain-").split("@")[0].split(".")[0]
    assert key.group(1) == (f"{role}-%i" if instance else role)
    # ... and so is its TLS certificate, with its key and the CA beside it (the defaults).
    cert = re.search(r"--tls-cert /etc/hypertrain/keys/(\S+)\.crt", svc["ExecStart"])
    assert cert is not None and cert.group(1) == key.group(1)
    assert "--tls-key" not in svc["ExecStart"] and "--tls-ca" not in svc["ExecStart"]


def test_systemd_env_examples_and_sysusers(run_config: RunConfig) -> None:
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / "env" / "island-eu-0.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert f"{env['HYPERTRAIN_REGION']}-{env['HYPERTRAIN_INDEX']}" == "eu-0"
    assert "eu-0" in run_config.topology.island_ids()
    assert int(env["HYPERTRAIN_NPROC"]) >= 1
    relay = (DEPLOY / "systemd" / "env" / "relay-eu.env").read_text()
    assert re.search(r"^HYPERTRAIN_AGGREGATOR=\S+:\d+$", relay, re.M)
    sysusers = (DEPLOY / "systemd" / "hypertrain.sysusers").read_text()
    assert re.search(r"^u hypertrain ", sysusers, re.M)


def env_file(path: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if line and not line.startswith("#")
    )


def unit_argv(command: str, instance: str, env: dict[str, str]) -> list[str]:
    """An Exec line as systemd runs it for ``instance`` with ``env`` (the subset of the
    rules these units use): specifiers %i and %%, then ${VAR} (one word) and a word that
    is $VAR alone (split into words, quotes respected: none when empty), $$ for a $."""

    def specifiers(m: re.Match[str]) -> str:
        return {"%": "%", "i": instance}[m.group(1)]

    def variables(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), "")

    argv: list[str] = []
    for word in shlex.split(command):
        word = re.sub(r"%(.)", specifiers, word)
        if re.fullmatch(r"\$\w+", word):
            argv += shlex.split(env.get(word[1:], ""))
        else:
            argv.append(re.sub(r"\$\$|\$\{(\w+)\}", variables, word))
    return argv


def relay_unit_errors(unit: dict[str, dict[str, str]], topology: TopologyConfig) -> list[str]:
    """What hypertrain-relay@.service gets wrong about relay shards ([] if nothing): with
    deploy/systemd/env's example files, instance eu is the region's one relay (no --shard,
    key relay-eu) and eu-1 is shard 1 of 2 (--shard 1/2, key and state relay-eu-1, the
    names daemon_key_names and `hypertrain up` use); an instance that disagrees with its
    env file's region or shard is refused before the relay starts."""
    errors: list[str] = []
    svc = unit["Service"]
    defaults = dict(kv.split("=", 1) for kv in svc["Environment"].split())
    examples = DEPLOY / "systemd" / "env"
    for instance, file, shards in (("eu", "relay-eu.env", 1), ("eu-1", "relay-eu-1.env", 2)):
        topo = dataclasses.replace(topology, relay_shards=shards)
        env = {k: unit_argv(v, instance, {})[0] if v else "" for k, v in defaults.items()}
        env |= env_file(examples / file)
        check = subprocess.run(unit_argv(svc["ExecStartPre"], instance, env), timeout=30)
        if check.returncode != 0:
            errors.append(f"{instance}: ExecStartPre refuses {file}")
        argv = unit_argv(svc["ExecStart"], instance, env)
        shard = argv[argv.index("--shard") + 1] if "--shard" in argv else None
        region = argv[argv.index("--region") + 1]
        if region not in topo.regions:
            errors.append(f"{instance}: --region {region!r}")
            continue
        try:
            index = RelaySettings(region=region, aggregator="a:1", shard=shard).shard_index(topo)
        except ValueError as e:
            errors.append(f"{instance}: {e}")
            continue
        key = argv[argv.index("--signing-key") + 1].rpartition("/")[2].removesuffix(".key")
        if key != region_relay_keys(topo, region)[index] or (shard is None) != (shards == 1):
            errors.append(f"{instance}: key {key}, --shard {shard} for S = {shards}")
        if argv[argv.index("--state-dir") + 1] != f"/var/lib/hypertrain/{key}":
            errors.append(f"{instance}: state dir is not named like the key")
        cert = argv[argv.index("--tls-cert") + 1] if "--tls-cert" in argv else None
        if cert != f"/etc/hypertrain/keys/{key}.crt":
            errors.append(f"{instance}: --tls-cert {cert} is not the certificate of {key}")
    # Instances that disagree with their env file.
    shard_env = {**env_file(examples / "relay-eu-1.env"), "HYPERTRAIN_REGION": "eu"}
    for instance, args in (("eu-0", "--shard 1/2"), ("eu", "--shard 1/2"), ("eu-1", ""),
                           ("eu-1", "--shard=1/2"), ("us-1", "--shard 1/2")):  # fmt: skip
        env = {**shard_env, "HYPERTRAIN_SHARD_ARGS": args}
        if (
            subprocess.run(unit_argv(svc["ExecStartPre"], instance, env), timeout=30).returncode
            == 0
        ):
            errors.append(f"{instance} started with HYPERTRAIN_SHARD_ARGS={args!r}")
    return errors


def test_systemd_relay_instances_are_regions_or_shards(run_config: RunConfig) -> None:
    path = DEPLOY / "systemd" / "hypertrain-relay@.service"
    assert relay_unit_errors(parse_unit(path), run_config.topology) == []
    # ... and the check fails on units that get it wrong.
    broken = [
        ("no check", "ExecStartPre", lambda v: "/bin/true"),
        ("shard args dropped", "ExecStart", lambda v: v.replace(" $HYPERTRAIN_SHARD_ARGS", "")),
        ("region from the instance", "ExecStart", lambda v: v.replace("${HYPERTRAIN_REGION}", "%i")),
        ("shard args as one word", "ExecStart", lambda v: v.replace("$HYPERTRAIN_SHARD_ARGS", "${HYPERTRAIN_SHARD_ARGS}")),
        ("the region's certificate for a shard", "ExecStart", lambda v: v.replace("relay-%i.crt", "relay-${HYPERTRAIN_REGION}.crt")),
    ]  # fmt: skip
    for what, key, edit in broken:
        unit = parse_unit(path)
        unit["Service"][key] = edit(unit["Service"][key])
        assert relay_unit_errors(unit, run_config.topology), what


def arg_path(argv: list[str], name: str) -> Path | None:
    """The path after flag ``name`` in ``argv`` (None without it)."""
    return Path(argv[argv.index(name) + 1]) if name in argv else None


def unit_tls_errors(units: dict[str, dict[str, dict[str, str]]], tmp_path: Path) -> list[str]:
    """What goes wrong when the units (file name -> parse_unit) start the aggregator, relay
    eu (relay_shards = 1), relay shard eu-1 (relay_shards = 2) and island eu-0 with the
    example env files, on hosts whose /etc/hypertrain/keys holds what docs/operations.md
    installs there from `hypertrain keys init`: the daemon's signing key, certificate and
    TLS key (mode 0600), ca.crt and trusted_keys.json, never ca.key.  Each must load its
    signing key and its TLS files (as the daemon checks them: valid, signed by the CA,
    the key the certificate's) under its own name, and be given no plaintext flag."""
    errors: list[str] = []
    examples = DEPLOY / "systemd" / "env"
    cases = [  # (unit, instance, env file, relay_shards, the daemon's name)
        ("hypertrain-aggregator.service", "", "aggregator.env", 1, "aggregator"),
        ("hypertrain-relay@.service", "eu", "relay-eu.env", 1, "relay-eu"),
        ("hypertrain-relay@.service", "eu-1", "relay-eu-1.env", 2, "relay-eu-1"),
        ("hypertrain-island@.service", "eu-0", "island-eu-0.env", 1, "island-eu-0"),
    ]
    for i, (unit, instance, file, shards, own) in enumerate(cases):
        topo = dataclasses.replace(TopologyConfig(regions=("eu", "us")), relay_shards=shards)
        made = tmp_path / f"made-{i}"
        init_daemons(made, daemon_key_names(topo))
        host = tmp_path / f"host-{i}"
        host.mkdir(mode=0o700)
        for f in [*relay_files(own), CA_CERT, "trusted_keys.json"]:
            shutil.copy2(made / f, host / f)
        svc = units[unit]["Service"]
        defaults = dict(kv.split("=", 1) for kv in svc["Environment"].split())
        env = {k: unit_argv(v, instance, {})[0] if v else "" for k, v in defaults.items()}
        env |= env_file(examples / file)
        argv = [
            a.replace("/etc/hypertrain/keys/", f"{host}/")
            for a in unit_argv(svc["ExecStart"], instance, env)
        ]
        if any("insecure" in a for a in argv):
            errors.append(f"{unit} {instance}: plaintext ({argv})")
        try:
            cert = arg_path(argv, "--tls-cert")
            if cert is None:
                errors.append(f"{unit} {instance}: no --tls-cert")
                continue
            files = TlsFiles.load(cert, arg_path(argv, "--tls-key"), arg_path(argv, "--tls-ca"))
            signing = arg_path(argv, "--signing-key")
            key = load_signing_key(signing) if signing else None
        except HypertrainError as e:
            errors.append(f"{unit} {instance}: {e}")
            continue
        if files.name != own:
            errors.append(f"{unit} {instance}: its certificate names {files.name}, not {own}")
        if key is None or key.key_id != load_signing_key(made / f"{own}.key").key_id:
            errors.append(f"{unit} {instance}: its signing key is not {own}'s")
    return errors


def test_systemd_units_run_mutual_tls_with_their_own_certificate(tmp_path: Path) -> None:
    units = {n: parse_unit(DEPLOY / "systemd" / n) for n in UNITS}
    assert unit_tls_errors(units, tmp_path / "good") == []
    # ... and the check fails on units that get it wrong.
    broken = [
        ("no certificate", "hypertrain-aggregator.service", lambda v: re.sub(r" --tls-cert \S+", "", v)),
        ("plaintext", "hypertrain-island@.service", lambda v: re.sub(r"--tls-cert \S+", "--insecure", v)),
        ("a CA key path", "hypertrain-relay@.service", lambda v: v + " --tls-ca /etc/hypertrain/keys/ca.key"),
        ("the region's certificate for a shard", "hypertrain-relay@.service", lambda v: v.replace("relay-%i.crt", "relay-${HYPERTRAIN_REGION}.crt")),
    ]  # fmt: skip
    for i, (what, name, edit) in enumerate(broken):
        units = {n: parse_unit(DEPLOY / "systemd" / n) for n in UNITS}
        units[name]["Service"]["ExecStart"] = edit(units[name]["Service"]["ExecStart"])
        assert unit_tls_errors(units, tmp_path / str(i)), what


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart binaries exist: point them at stubs, change nothing else.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for b in ("hypertrain-aggregator", "hypertrain-relay", "torchrun"):
        (bin_dir / b).write_text("#!/bin/sh\n")
        (bin_dir / b).chmod(0o755)
    for name in UNITS:
        text = (DEPLOY / "systemd" / name).read_text()
        (tmp_path / name).write_text(text.replace("/opt/hypertrain/venv/bin/", f"{bin_dir}/"))
    targets = [tmp_path / "hypertrain-aggregator.service", tmp_path / "hypertrain-relay@eu.service",
               tmp_path / "hypertrain-relay@eu-1.service",
               tmp_path / "hypertrain-island@eu-0.service"]  # fmt: skip
    out = subprocess.run(
        ["systemd-analyze", "verify", *map(str, targets)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys or unparsable values and only warns: any output fails.
    assert out.returncode == 0 and out.stderr == "" and out.stdout == "", out.stderr + out.stdout
    # ... and it does catch a broken unit.
    broken = tmp_path / "hypertrain-aggregator.service"
    broken.write_text(broken.read_text().replace("ProtectSystem=strict", "ProtectSystem=sometimes"))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert "sometimes" in out.stderr


def test_component_labels_match_the_start_order_of_the_docs() -> None:
    """docs/operations.md applies the rendered manifests by component label, in order;
    every resource must fall in exactly one of those groups."""
    docs = (REPO / "docs" / "operations.md").read_text()
    groups = ["data", "aggregator", "relay", "island"]
    for name, resources in manifests().items():
        if name == "secrets.yaml":
            continue
        for d in resources:
            comp = d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            if comp is None:
                assert d["kind"] in ("Namespace", "ConfigMap"), d["metadata"]["name"]
            else:
                assert comp in groups, (name, comp)
    assert "-l '!app.kubernetes.io/component'" in docs
    at = [docs.index(f"-l app.kubernetes.io/component={g}\n") for g in groups]
    assert at == sorted(at)


# -- the parity grid's Job ------------------------------------------------------------------


def test_the_parity_grid_job_runs_every_shard_once_on_a_gpu_into_one_shared_folder() -> None:
    """deploy/k8s/parity-grid.yaml: an Indexed Job whose pod i runs `hypertrain sim grid
    --shard i/N` with N = its completions (so the N pods together run every registered job
    once), on one GPU, writing to the ReadWriteMany claim of the same file, hardened like
    the daemons' pods; its arguments parse with the real CLI for every index."""
    from hypertrain.sim.study.grid import parse_shard, plan_jobs, shard_jobs
    from hypertrain.sim.study.prereg import registered_design

    docs = load_docs(K8S / GRID)
    assert [e for d in docs for e in schema_errors(d)] == []
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = job["spec"]
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == n
    assert spec["maxFailedIndexes"] == 0  # a missing shard fails the Job
    pod = job["spec"]["template"]["spec"]
    sec = pod["securityContext"]
    assert sec["runAsNonRoot"] and sec["runAsUser"] == IMAGE_UID and sec["fsGroup"] == IMAGE_UID
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    (main,) = pod["containers"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    index = env_value(main, "SHARD_INDEX")
    completion = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert index == {"fieldRef": {"fieldPath": completion}}
    args = main["args"]
    assert args[:3] == ["hypertrain", "sim", "grid"]
    assert flag(args, "--shard") == f"$(SHARD_INDEX)/{n}" and flag(args, "--device") == "cuda"
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    out = flag(args, "--out")
    (root,) = [p for p in mounts if out.startswith(p + "/")]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mounts[root]]
    assert vol["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    ap = argparse.ArgumentParser(prog="hypertrain")
    sub = ap.add_subparsers(dest="command", required=True)
    sim_cmd.register(sub)
    design = registered_design()
    scale = flag(args, "--scale")
    plan = plan_jobs(design, scale)
    seen: list[str] = []
    for i in range(n):
        parsed = ap.parse_args([a.replace("$(SHARD_INDEX)", str(i)) for a in args[1:]])
        assert parsed.device == "cuda" and parsed.scale == scale
        seen += [j.job_id for j in shard_jobs(plan, parse_shard(parsed.shard))]
    assert sorted(seen) == sorted(j.job_id for j in plan)  # every job in exactly one pod
