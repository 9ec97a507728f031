"""Prometheus against a real cluster: scrape configs, rules, the dashboard's queries.

Uses Debian's ``prometheus`` package (``prometheus`` and ``promtool`` on PATH), which
``scripts/setup_prometheus.sh`` installs with apt-get (``scripts/test.sh`` runs it first);
nothing is installed here.  Without the binaries these tests FAIL, naming the package:
monitoring files that are never checked would pass silently.
``HYPERTRAIN_SKIP_PROMETHEUS=1`` skips them explicitly (listed by ``pytest -ra``) on a
machine without the package.

The live test starts ``hypertrain up --prometheus`` (five daemons on 127.0.0.1 and a
Prometheus on 127.0.0.1 scraping them every second with the rules loaded) and checks,
through Prometheus' HTTP API, that everything the dashboard and the alerts read is there.
"Returns data" means, for each:

- a dashboard query (Grafana's variables substituted: ``$region`` -> ``.*``,
  ``$__rate_interval`` -> 30s): a non-empty result with at least one finite value;
- a recording rule: its series exists with a finite value;
- an alert: its expression evaluates without error, and every series selector in it (a
  metric name with its label matchers, e.g. ``hypertrain_last_merge_step{job=
  "hypertrain-relay"}``) returns a finite value.  An alert's expression is empty while
  nothing is wrong, so the selectors are what show that it reads series that exist, with
  the labels it matches on.  Besides, ``/api/v1/rules`` must show every rule evaluated with
  health "ok" and no error; and one alert is made to fire for real: two bad deltas are
  pushed to relay-eu (another run's: invalid_argument; a step far ahead:
  failed_precondition), so the rejection counters exist as after any real refusal, and
  HypertrainRejectedInputsRising must fire for the invalid one and not for "not now".
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import yaml

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.schedule import Schedule
from hypertrain.procs import LISTEN_RE, child_env
from hypertrain.prom import prometheus_config, start_prometheus, write_config
from hypertrain.up import config_toml, write_scrape_targets
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import connect, push_delta, relay_stub
from hypertrain.wire.tls import Security
from tests.conftest import proc_state

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "rules" / "hypertrain.rules.yml"
RULE_TESTS = PROM_DIR / "rules" / "hypertrain.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "hypertrain.json"
K8S = ROOT / "deploy" / "k8s"

GRAFANA_VARS = {"$__rate_interval": "30s", "${region}": ".*", "$region": ".*"}
QUESTIONS = (
    "Is training progressing?",
    "Is any island or region behind?",
    "How much bandwidth does each level use?",
    "Is loss healthy?",
)
# A series selector in PromQL: a metric (or recorded) name with optional matchers; quoted
# strings are matched first so that names inside label values are skipped.
SELECTOR_RE = re.compile(
    r'"(?:[^"\\]|\\.)*"|(?<![\w:])(?P<sel>(?:[a-z_]+:)?hypertrain[\w:]*|up)(?![\w:])\s*'
    r"(?P<matchers>\{[^}]*\})?"
)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("HYPERTRAIN_SKIP_PROMETHEUS") == "1":
            pytest.skip(f"{name} not installed and HYPERTRAIN_SKIP_PROMETHEUS=1")
        pytest.fail(
            f"`{name}` is not on PATH. These tests use Debian's `prometheus` package "
            "(prometheus and promtool), which scripts/test.sh installs first "
            "(scripts/setup_prometheus.sh: apt-get install prometheus). "
            "Set HYPERTRAIN_SKIP_PROMETHEUS=1 to skip them explicitly."
        )
    return path


def _promtool(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(
        [_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{text}"
    return text


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for r in _rules() if "alert" in r}


def _records() -> list[str]:
    return [r["record"] for r in _rules() if "record" in r]


def _panels() -> list[dict[str, Any]]:
    dash = json.loads(DASHBOARD.read_text())
    return [p for p in dash["panels"] if p["type"] != "row"]


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana's variables substituted."""
    out = []
    for panel in _panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"panel {panel['title']!r}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression (name plus matchers), in order."""
    found = []
    for m in SELECTOR_RE.finditer(expr):
        if m.group("sel"):
            sel = m.group("sel") + (m.group("matchers") or "")
            if sel not in found:
                found.append(sel)
    return found


def test_selectors_finds_every_series_an_expression_reads() -> None:
    expr = _alerts()["HypertrainRegionMissingRound"]
    assert selectors(expr) == [
        'hypertrain_last_merge_step{job="hypertrain-relay"}',
        'hypertrain_last_merge_round{job="hypertrain-aggregator"}',
    ]
    assert selectors('up{job=~"hypertrain-(a|b)"} == 0 and on() group_right() x') == [
        'up{job=~"hypertrain-(a|b)"}'
    ]
    assert selectors("region:hypertrain_x:behind > 0") == ["region:hypertrain_x:behind"]


# -- static checks: promtool, files against each other ---------------------------------


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert "SUCCESS" in _promtool("check", "rules", str(RULES))
    assert "SUCCESS" in _promtool("test", "rules", str(RULE_TESTS))


def test_rule_unit_tests_show_every_alert_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    alerts = set(_alerts())
    assert alerts >= {
        "HypertrainRegionMissingRound",
        "HypertrainIslandStalled",
        "HypertrainLossDiverging",
        "HypertrainLossNotFinite",
        "HypertrainRejectedInputsRising",
        "HypertrainTapeNotAdvancing",
    }
    assert alerts - firing == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown not firing"
    assert (firing | quiet) - alerts == set(), "tests of alerts that do not exist"


def _local_targets(tmp: Path) -> Path:
    """scrape_targets.json as ``hypertrain up`` writes it, for one daemon of each kind."""
    children = [
        SimpleNamespace(
            name=name,
            metrics_url=f"http://127.0.0.1:{9100 + i}/metrics",
            proc=SimpleNamespace(poll=lambda: None),
        )
        for i, name in enumerate(["aggregator", "relay-eu", "island-eu-0", "island-eu-1"])
    ]
    path = tmp / "scrape_targets.json"
    assert write_scrape_targets(children, path) == 4  # type: ignore[arg-type]
    return path


def test_promtool_checks_the_local_config_and_the_one_up_writes(tmp_path: Path) -> None:
    # the file in deploy/, next to a run's scrape_targets.json as its header says
    shutil.copy(PROM_DIR / "prometheus.yml", tmp_path)
    shutil.copytree(PROM_DIR / "rules", tmp_path / "rules")
    _local_targets(tmp_path)
    text = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert "SUCCESS: 1 rule files found" in text and "WARNING" not in text, text
    # and the one `hypertrain up --prometheus` writes into the run folder
    run = tmp_path / "run"
    run.mkdir()
    _local_targets(run)
    text = _promtool("check", "config", str(write_config(run)))
    assert "SUCCESS: 1 rule files found" in text and "WARNING" not in text, text


def test_up_writes_the_local_config_of_deploy() -> None:
    in_deploy = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert in_deploy == prometheus_config("scrape_targets.json", ["rules/hypertrain.rules.yml"])


def test_promtool_checks_the_kubernetes_config(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery (its promtool rejects the
    ``kubernetes_sd_configs`` field), so the discovery block is checked here by hand and
    the rest of the file by promtool with a static target in its place."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus-k8s.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": ["hypertrain"]}}
    ]
    original = subprocess.run(
        [_tool("promtool"), "check", "config", str(PROM_DIR / "prometheus-k8s.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if original.returncode != 0:  # a promtool with Kubernetes discovery must accept it
        assert "field kubernetes_sd_configs not found" in original.stdout + original.stderr
    job["static_configs"] = [{"targets": ["127.0.0.1:9100"]}]
    del job["kubernetes_sd_configs"]
    shutil.copytree(PROM_DIR / "rules", tmp_path / "rules")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    assert "SUCCESS" in _promtool("check", "config", str(tmp_path / "prometheus.yml"))


def _expand(replacement: str, m: re.Match[str]) -> str:
    return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", replacement)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep, drop, replace) of one target; None if dropped."""
    labels = dict(labels)
    for c in configs:
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("source_labels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), value)
        action = c.get("action", "replace")
        if (action == "keep" and m is None) or (action == "drop" and m is not None):
            return None
        if action == "replace" and m is not None:
            new = _expand(c.get("replacement", "$1"), m)
            if new:
                labels[c["target_label"]] = new
            else:
                labels.pop(c["target_label"], None)
        assert action in ("keep", "drop", "replace"), action
    return labels


def _pod_targets(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The targets Prometheus' pod role discovers for a workload's pods (one per container
    port, one per container without ports), as meta labels."""
    spec = doc["spec"]
    template = spec["template"]
    meta, pod = template["metadata"], template["spec"]
    clean = lambda name: re.sub(r"[^a-zA-Z0-9_]", "_", name)  # noqa: E731
    indexes = [None]
    if doc["kind"] == "Job" and spec.get("completionMode") == "Indexed":
        indexes = list(range(spec["completions"]))
    targets = []
    for index in indexes:
        annotations = dict(meta.get("annotations", {}))
        if index is not None:
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
        base = {
            "__meta_kubernetes_namespace": doc["metadata"]["namespace"],
            "__meta_kubernetes_pod_name": f"{doc['metadata']['name']}-{index or 0}-abcde",
            "__meta_kubernetes_pod_phase": "Running",
        }
        base |= {f"__meta_kubernetes_pod_label_{clean(k)}": v for k, v in meta["labels"].items()}
        base |= {f"__meta_kubernetes_pod_annotation_{clean(k)}": v for k, v in annotations.items()}
        for container in pod.get("initContainers", []) + pod["containers"]:
            for port in container.get("ports") or [None]:
                t = dict(base, __address__="10.1.2.3")
                if port is not None:
                    t["__address__"] += f":{port['containerPort']}"
                    t["__meta_kubernetes_pod_container_port_name"] = port.get("name", "")
                targets.append(t)
    return targets


def test_kubernetes_relabelling_gives_the_labels_of_a_local_cluster(tmp_path: Path) -> None:
    cfg = yaml.safe_load((PROM_DIR / "prometheus-k8s.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["honor_labels"] is True  # as in the local config: the daemons' labels win
    local = {
        g["labels"]["daemon"]: g["labels"] for g in json.loads(_local_targets(tmp_path).read_text())
    }
    scraped: dict[str, dict[str, str]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("StatefulSet", "Deployment", "Job"):
                continue
            for target in _pod_targets(doc):
                out = relabel(target, job["relabel_configs"])
                if out is not None:
                    daemon = out["daemon"]
                    assert daemon not in scraped, f"two targets for {daemon}"
                    port = {"aggregator": 9100, "relay": 9101, "island": 9102}[daemon.split("-")[0]]
                    assert out["__address__"] == f"10.1.2.3:{port}", out
                    assert out.get("__metrics_path__") == "/metrics", out
                    scraped[daemon] = {k: v for k, v in out.items() if not k.startswith("__")}
    # every daemon of the manifests (regions eu, us, ap; two islands each) is one target
    assert set(scraped) == {"aggregator"} | {
        f"{kind}-{r}{i}"
        for r in ("eu", "us", "ap")
        for kind, i in (("relay", ""), ("island", "-0"), ("island", "-1"))
    }
    for daemon, labels in local.items():  # ... with the labels `hypertrain up` gives it
        got = {k: v for k, v in scraped[daemon].items() if k not in ("namespace", "pod")}
        assert got == labels, daemon


def test_dashboard_has_a_panel_per_operator_question() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert set(QUESTIONS) <= set(rows), rows
    panels = _panels()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), titles
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["region"]["allValue"] == ".*"
    exprs = " ".join(e for _, e in _panel_queries())
    for metric in (
        "hypertrain_inner_steps_total",
        "hypertrain_tokens_per_second",
        "hypertrain_rounds_total",
        "hypertrain_last_merge_step",
        "hypertrain_sync_blocked_seconds",
        "hypertrain_sent_bytes_total",
        "hypertrain_received_bytes_total",
        "hypertrain_compression_ratio",
        "hypertrain_train_loss",
        "hypertrain_heldout_loss",
        "hypertrain_pseudo_gradient_norm",
        "hypertrain_rejected_inputs_total",
        "hypertrain_round_absent_members",
        "hypertrain_quorum_waiting",
        "hypertrain_pushes_waiting",
        "hypertrain_tape_entries_total",
        "hypertrain_tape_last_checkpoint_size",
        "process_resident_memory_bytes",
    ):
        assert metric in exprs, metric


def test_without_a_prometheus_binary_up_says_so_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HYPERTRAIN_PROMETHEUS", str(tmp_path / "no-such-prometheus"))
    assert start_prometheus(tmp_path) is None
    err = capsys.readouterr().err
    assert "no `prometheus` binary found" in err and "apt-get install prometheus" in err, err
    assert not (tmp_path / "prometheus").exists()


# -- live: a real cluster, a real Prometheus --------------------------------------------

LIVE_CFG = RunConfig.from_dict(
    {
        "steps": 50_000,  # far more than the test needs on any machine: it stops the run
        "batch_per_island": 8,
        "holdout_windows": 16,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 1, "h_r": 5, "h_g": 10},
    }
)
PROM_URL_RE = re.compile(r"prometheus on (http://127\.0\.0\.1:\d+) ")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    try:
        body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    except urllib.error.HTTPError as e:  # 400/422: the expression is wrong
        raise AssertionError(f"{expr}: {e.read().decode(errors='replace')}") from e
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def _has_finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _push_bad_deltas(run_dir: Path) -> None:
    """Two refused deltas at relay-eu: another run's, and one for a step far ahead."""
    log = (run_dir / "logs" / "relay-eu.log").read_text().splitlines()
    (address,) = [m.group("address") for line in log if (m := LISTEN_RE.match(line))]
    keys = run_dir / "keys"  # as island eu-0, which the relay lets push as eu-0
    security = Security.of(keys, "island-eu-0")
    channel = connect(address, security=security, peer="relay-eu")
    stub = relay_stub(channel)
    data = b"\0" * 64
    step = LIVE_CFG.steps
    base = dict(
        run_id=LIVE_CFG.run_id,
        round=Schedule.of(LIVE_CFG).round_of(step),
        sync_step=step,
        sender="eu-0",
        digest=blob_digest(data),
        size=len(data),
        codec="int8",
    )
    cases = [({"run_id": "another-run"}, grpc.StatusCode.INVALID_ARGUMENT), ({}, None)]
    for changes, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            push_delta(stub.PushDelta, pb.TransferHeader(**(base | changes)), data, timeout=30)
        assert err.value.code() == (code or grpc.StatusCode.FAILED_PRECONDITION)
    channel.close()


def _missing(base: str) -> list[str]:
    """What the dashboard and the rules read that Prometheus has no finite value for yet."""
    missing = []
    for title, expr in _panel_queries():
        if not _has_finite(_query(base, expr)):
            missing.append(f"panel {title!r}: {expr}")
    for record in _records():
        if not _has_finite(_query(base, record)):
            missing.append(f"recording rule {record}")
    for alert, expr in _alerts().items():
        _query(base, expr)  # evaluates; empty while nothing is wrong
        for sel in selectors(expr):
            if not _has_finite(_query(base, sel)):
                missing.append(f"alert {alert}: {sel}")
    rules = _get(f"{base}/api/v1/rules")["data"]["groups"]
    evaluated = {r["name"]: r for g in rules for r in g["rules"]}
    for name in [*_records(), *_alerts()]:
        r = evaluated.get(name)
        if r is None or r["health"] != "ok" or r.get("lastError"):
            missing.append(
                f"rule {name} not evaluated fine: {r and (r['health'], r.get('lastError'))}"
            )
    return missing


def test_every_panel_and_alert_returns_data_from_a_live_cluster(tmp_path: Path) -> None:
    _tool("prometheus")
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(config_toml(LIVE_CFG))
    argv = [sys.executable, "-m", "hypertrain", "up", "--config", str(config)]
    argv += ["--run-dir", str(run_dir), "--quiet", "--prometheus"]
    up = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        # A shell's background job ignores SIGINT, and a child inherits that: `up` would
        # then never see the Ctrl-C this test sends (found running the suite with `&`).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            output.append(line)
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    base = None
    try:
        deadline = time.monotonic() + 180
        while base is None and time.monotonic() < deadline and up.poll() is None:
            try:
                m = PROM_URL_RE.search(lines.get(timeout=1))
            except queue.Empty:
                continue
            base = m.group(1) if m else None
        assert base is not None, "no Prometheus URL from `hypertrain up --prometheus`:\n" + "".join(
            output
        )
        _push_bad_deltas(run_dir)

        deadline = time.monotonic() + 120
        while (missing := _missing(base)) and time.monotonic() < deadline and up.poll() is None:
            time.sleep(2)
        assert up.poll() is None, "the run ended before Prometheus had every series:\n" + (
            "".join(output)
        )
        assert not missing, "no data for:\n  " + "\n  ".join(missing)

        # every daemon is a healthy target on loopback, labelled as scrape_targets.json says
        targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
        listed = json.loads((run_dir / "scrape_targets.json").read_text())
        assert len(targets) == len(listed) == 5
        for t in targets:
            assert t["health"] == "up" and t["scrapeUrl"].startswith("http://127.0.0.1:"), t
        want = sorted(json.dumps(g["labels"], sort_keys=True) for g in listed)
        got = sorted(
            json.dumps({k: t["labels"][k] for k in g}, sort_keys=True)
            for t in targets
            for g in [next(x["labels"] for x in listed if x["targets"][0] in t["scrapeUrl"])]
        )
        assert got == want
        # held-out loss comes from the aggregator alone (no zeros from other daemons)
        series = _get(f"{base}/api/v1/query?query=hypertrain_heldout_loss")["data"]["result"]
        assert [s["metric"]["job"] for s in series] == ["hypertrain-aggregator"], series

        # the refused deltas make HypertrainRejectedInputsRising fire, "not now" excepted
        firing = [
            a["labels"]
            for a in _get(f"{base}/api/v1/alerts")["data"]["alerts"]
            if a["state"] == "firing"
            and a["labels"]["alertname"] == "HypertrainRejectedInputsRising"
        ]
        assert [(a["daemon"], a["reason"]) for a in firing] == [("relay-eu", "invalid_argument")]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # `up` stops Prometheus and every daemon
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        reader.join(timeout=10)
    assert up.returncode == 130, "".join(output)
    text = "".join(output)
    assert "prometheus stopped; reopen its data:" in text, text
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/-/ready", timeout=2)
    pids = [int(ln.split()[1]) for ln in (run_dir / "processes.txt").read_text().splitlines()]
    for pid in pids:
        assert proc_state(pid) in (None, "Z"), f"pid {pid} still runs"
