"""The deployment assets under ops/ and docker-compose.yml agree with the code: every file they
reference exists, every flag and INFERQ_* variable they use is one the CLI has, every port
matches the code's default, and every metric the dashboard and the alerts query is declared.

The Kubernetes manifests are rendered from their kustomizations (tests/ops/kustomize.py, or
kubectl where installed, compared with it) and validated against Kubernetes' own schemas
(kubernetes-validate, a dev dependency, ships them: no cluster, no network). promtool (Debian:
apt-get install prometheus) checks and unit-tests the alert rules and the dashboard's queries;
without it those tests skip, except in CI (CI=true), where they fail: `make test` installs it.
The Compose stack itself runs in tests/ops/test_compose.py (`make test-deploy`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest

from consumer.metrics import WorkerMetrics
from consumer.settings import DEFAULT_METRICS_PORT, WorkerSettings
from inferq.cli import build_parser
from producer.app import routes
from producer.metrics import GatewayMetrics
from producer.settings import GatewaySettings
from protocol.keys import GROUP, LANES_BY_PRIORITY, Keys
from tests.ops import kustomize
from tests.support import missing

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
DASHBOARD = OPS / "grafana" / "dashboards" / "inferq.json"
ALERTS = OPS / "prometheus" / "alerts.yml"
K8S = OPS / "k8s"

METRIC = re.compile(r"\binferq_[a-z0-9_]*[a-z0-9]\b")


# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def yaml() -> Any:
    import yaml

    return yaml


def load_all(yaml: Any, path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def cli_help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser({}).parse_args([command, "--help"])
    return out.getvalue()


def cli_env_names() -> set[str]:
    return {
        name
        for command in ("up", "gateway", "worker")
        for name in re.findall(r"\[env\s+(INFERQ_[A-Z0-9_]+)\]", cli_help(command))
    }


def parse_command(argv: list[str]) -> argparse.Namespace:
    """Parse an ``inferq ...`` command line with the real CLI (every flag must be one it has),
    also one that a shell runs (``sh -c "exec inferq ..."``)."""
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2].replace("$$", "$"))  # Compose's escape of a literal $
        assert argv[0] == "exec", argv  # the worker is the container's main process
        argv = argv[1:]
    assert argv[0] == "inferq", argv
    return build_parser({}).parse_args(argv[1:])


def compose_default(value: str) -> str:
    """A Compose value with its variables at their defaults: ``${GATEWAY_PORT:-8000}``."""
    assert "$" not in re.sub(r"\$\{\w+:-[^}]*\}", "", value), value
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port, at the defaults."""
    found = []
    for mapping in service.get("ports", []):
        address, host, container = port_mapping(compose_default(mapping))
        found.append((address, int(host), int(container)))
    return found


def port_mapping(mapping: str) -> tuple[str, str, str]:
    """``address:host:container``, each part possibly a ``${VARIABLE:-default}``."""
    part = r"(\$\{[^}]*\}|[^:$]+)"
    match = re.fullmatch(f"{part}:{part}:{part}", mapping)
    assert match is not None, mapping
    address, host, container = match.groups()
    return address, host, container


def declared_sample_names() -> set[str]:
    """Every sample name a gateway or a worker can expose (histograms' _bucket/_sum/_count...)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    names = set()
    for registry in (GatewayMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[str]:
    queries = [
        target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])
    ]
    for variable in dashboard()["templating"]["list"]:
        queries.append(variable["query"]["query"])
    return queries


def alert_text_without_comments() -> str:
    return "\n".join(
        line for line in ALERTS.read_text().splitlines() if not line.lstrip().startswith("#")
    )


def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (OPS / "Dockerfile").read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def image_layout() -> dict[str, Any]:
    """What the runtime stage of the Dockerfile sets: workdir, user, env, exposed ports."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in dockerfile():
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, rest))
    runtime = stages[-1]
    env: dict[str, str] = {}
    for keyword, rest in runtime:
        if keyword == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", rest))
    (workdir,) = [rest for keyword, rest in runtime if keyword == "WORKDIR"]
    (user,) = [rest for keyword, rest in runtime if keyword == "USER"]
    (cmd,) = [json.loads(rest) for keyword, rest in runtime if keyword == "CMD"]
    exposed = {int(p) for k, rest in runtime if k == "EXPOSE" for p in rest.split()}
    return {
        "stages": len(stages),
        "workdir": PurePosixPath(workdir),
        "user": user,
        "env": env,
        "cmd": cmd,
        "exposed": exposed,
    }


def k8s_objects(yaml: Any, variant: Path = K8S) -> dict[tuple[str, str], dict[str, Any]]:
    """What ``kubectl apply -k`` of the variant (ops/k8s, ops/k8s/cluster) creates."""
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize.build(variant)}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = only
    return result


def container_env(objects: dict[tuple[str, str], dict[str, Any]], c: dict[str, Any]) -> dict:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(objects[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for e in c.get("env", []):
        # A value from the Downward API shows as the field it reads ("metadata.name").
        env[e["name"]] = e["value"] if "value" in e else e["valueFrom"]["fieldRef"]["fieldPath"]
    return env


def route_methods() -> dict[str, set[str]]:
    methods: dict[str, set[str]] = {}
    for route in routes():
        methods.setdefault(route.path, set()).update(route.methods or ())
    return methods


# -- metric names ------------------------------------------------------------------------------


def test_every_metric_the_dashboard_queries_is_declared():
    used = {name for query in dashboard_queries() for name in METRIC.findall(query)}
    assert len(used) > 15
    assert used - declared_sample_names() == set()


def test_every_metric_the_alert_rules_use_is_declared():
    used = set(METRIC.findall(alert_text_without_comments()))
    assert {"inferq_stream_lag", "inferq_dlq_length", "inferq_gateway_requests_total"} <= used
    assert used - declared_sample_names() == set()


def test_the_dashboard_covers_the_documented_panels_with_descriptions():
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "prometheus"
    titles = " ".join(p["title"].lower() for p in panels)
    for subject in ("throughput", "latency", "stage", "batch", "lag", "cache hit", "error"):
        assert subject in titles, subject
    readme = (OPS / "README.md").read_text()
    for panel in panels:
        assert panel["title"] in readme, f"panel {panel['title']!r} is not described in README"


def test_every_alert_is_described_in_the_readme_and_unit_tested(yaml):
    rules = [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]
    tests = yaml.safe_load((OPS / "prometheus" / "alerts_test.yml").read_text())
    tested = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"]}
    readme = (OPS / "README.md").read_text()
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
        assert rule["alert"] in tested, rule["alert"]
        assert rule["alert"] in readme, rule["alert"]


# -- promtool ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing("promtool (Debian: apt-get install prometheus)")
    return path


def run_promtool(promtool: str, *args: str) -> None:
    done = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_pass_promtool_check(promtool):
    run_promtool(promtool, "check", "rules", str(ALERTS))


def test_alert_rules_pass_their_promtool_unit_tests(promtool):
    run_promtool(promtool, "test", "rules", str(OPS / "prometheus" / "alerts_test.yml"))


def test_the_prometheus_config_passes_promtool_check(promtool):
    run_promtool(promtool, "check", "config", str(OPS / "prometheus" / "prometheus.yml"))


def test_every_dashboard_query_is_valid_promql(promtool, tmp_path):
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, query in enumerate(dashboard_queries()):
        if query.startswith("label_values("):
            query = query.removeprefix("label_values(").split(",")[0]
        expr = query.replace("$__rate_interval", "5m").replace("$model", ".*")
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(expr)}"]
    rules = tmp_path / "dashboard.yml"
    rules.write_text("\n".join(lines) + "\n")
    run_promtool(promtool, "check", "rules", str(rules))


# -- the image ---------------------------------------------------------------------------------


def test_the_image_installs_inferq_from_the_wheelhouse_with_no_network():
    # Built on the host (scripts/wheelhouse), installed offline: nothing in the build reaches
    # an index, which a container on a machine like CI's cannot (its certificates).
    copies = [rest.split() for keyword, rest in dockerfile() if keyword == "COPY"]
    assert ["build/wheels/", "/wheels/"] in copies
    (install,) = [rest for keyword, rest in dockerfile() if keyword == "RUN" and "pip" in rest]
    assert "--no-index" in install and "--find-links /wheels" in install
    assert '"inferq${EXTRAS:+[$EXTRAS]}"' in install
    assert "build/wheels" in (REPO / "scripts" / "wheelhouse").read_text()
    assert image_layout()["stages"] >= 2
    assert dockerfile()[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")
    # The build context is an allow-list: the wheelhouse and the models, nothing else.
    context = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert context[0] == "*"
    assert {"!build/wheels/", "!models/"} <= set(context)
    for parts in copies:
        if not parts[0].startswith("--"):
            assert f"!{parts[0]}" in context, parts


def test_the_package_declares_its_license_as_an_spdx_expression():
    # setuptools 77+ reads `license = "..."` (PEP 639); the older table form makes every
    # install print a deprecation banner.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)", setuptools)
    assert floor is not None and int(floor.group(1)) >= 77


def test_the_image_runs_the_gateway_as_a_non_root_user_on_the_default_port():
    image = image_layout()
    args = parse_command(image["cmd"])
    assert (args.command, args.host) == ("gateway", "0.0.0.0")
    assert args.port == GatewaySettings().port == 8000
    settings = GatewaySettings()
    assert image["exposed"] == {settings.port, settings.grpc_port, DEFAULT_METRICS_PORT}
    # Listeners in a container serve its own network namespace: the metrics on all of it.
    assert image["env"]["INFERQ_METRICS_HOST"] == "0.0.0.0"
    uid = image["user"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    models = PurePosixPath(image["env"]["INFERQ_MODEL_REPOSITORY"])
    assert models == image["workdir"] / "models"
    assert ("COPY", "models/ models/") in dockerfile()


# -- docker compose ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose(yaml) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return data


def test_compose_runs_redis_7_with_aof_a_gateway_workers_prometheus_and_grafana(compose):
    services = compose["services"]
    assert set(services) == {"redis", "gateway", "worker", "prometheus", "grafana"}
    assert compose_default(services["redis"]["image"]).startswith("redis:7")
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    # Reachable from the gateway and workers without a password (Redis publishes no port).
    assert command[command.index("--protected-mode") + 1] == "no"
    assert "ports" not in services["redis"]
    for name in ("gateway", "worker"):
        build = services[name]["build"]
        assert (REPO / build["context"] / build["dockerfile"]).is_file()
        assert compose_default(services[name]["image"]) == "inferq:latest"


def test_compose_starts_without_grafana_unless_its_profile_is_asked_for(compose):
    # Grafana is in no registry some machines reach: the stack must come up without it.
    profiled = {name for name, s in compose["services"].items() if "profiles" in s}
    assert profiled == {"grafana"}
    assert compose["services"]["grafana"]["profiles"] == ["grafana"]


def test_compose_restarts_every_service_that_exits_unasked(compose):
    for name, service in compose["services"].items():
        assert service.get("restart") == "unless-stopped", name


def test_compose_commands_flags_and_variables_exist_in_the_cli(compose):
    known = cli_env_names()
    for name in ("gateway", "worker"):
        service = compose["services"][name]
        args = parse_command(service["command"])
        assert args.command == name
        assert set(service["environment"]) <= known, set(service["environment"]) - known
    gateway = parse_command(compose["services"]["gateway"]["command"])
    assert gateway.port == GatewaySettings().port
    assert published(compose["services"]["gateway"]) == [
        ("127.0.0.1", gateway.port, gateway.port),
        ("127.0.0.1", GatewaySettings().grpc_port, GatewaySettings().grpc_port),
    ]


def test_compose_publishes_every_port_on_this_machine_only_and_movable(compose):
    for name, service in compose["services"].items():
        for mapping in service.get("ports", []):
            address, host, _ = port_mapping(mapping)
            assert address == "${PUBLISH_ADDRESS:-127.0.0.1}", (name, mapping)
            assert re.fullmatch(r"\$\{[A-Z_]+_PORT:-\d+\}", host), (name, mapping)


def test_compose_workers_are_named_after_their_containers(compose):
    # A restarted container is the same consumer: it runs what it held at once.
    args = parse_command(compose["services"]["worker"]["command"])
    assert args.worker_id == "$HOSTNAME"


def test_compose_workers_scale_without_port_clashes_and_drain_before_sigkill(compose):
    worker = compose["services"]["worker"]
    assert "ports" not in worker
    assert parse_command(worker["command"]).metrics_port == DEFAULT_METRICS_PORT
    assert worker["expose"] == [str(DEFAULT_METRICS_PORT)]
    assert worker["deploy"] == {"mode": "replicated", "replicas": 3}
    assert int(worker["stop_grace_period"].rstrip("s")) > WorkerSettings().drain_timeout_s
    assert "INFERQ_MODEL_REPOSITORY" not in worker["environment"]  # the image's own


def test_compose_mounts_only_files_that_exist(compose):
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), volume
            else:
                assert source in compose["volumes"], volume


def test_prometheus_scrapes_the_gateway_and_every_worker_on_their_ports(yaml, compose):
    config = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway = jobs["inferq-gateway"]
    (targets,) = [c["targets"] for c in gateway["static_configs"]]
    port = parse_command(compose["services"]["gateway"]["command"]).port
    assert targets == [f"gateway:{port}"]
    assert gateway["metrics_path"] == "/metrics"
    (dns,) = jobs["inferq-worker"]["dns_sd_configs"]
    assert dns["names"] == ["worker"] and dns["type"] == "A"
    assert dns["port"] == DEFAULT_METRICS_PORT
    for rule_file in config["rule_files"]:
        assert (OPS / "prometheus" / rule_file).is_file()
    mount = compose["services"]["prometheus"]["volumes"][0]
    assert mount == "./ops/prometheus:/etc/prometheus:ro"


def test_grafana_is_provisioned_with_the_prometheus_datasource_and_the_dashboard(yaml, compose):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in grafana["volumes"])
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = OPS / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["uid"] == "prometheus" and source["type"] == "prometheus"
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus"
    assert ("127.0.0.1", url.port, url.port) in published(compose["services"]["prometheus"])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "inferq.yml").read_text())[
        "providers"
    ]
    dashboards_dir = provider["options"]["path"]
    assert mounts["./ops/grafana/dashboards"] == dashboards_dir
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (
        REPO / "ops/grafana/dashboards" / PurePosixPath(home).relative_to(dashboards_dir)
    ).is_file()


# -- kubernetes --------------------------------------------------------------------------------


K8S_VARIANTS = {"one Redis": K8S, "Redis Cluster": K8S / "cluster"}
K8S_ALTERNATIVES = {K8S / "cluster" / "keda-prometheus.yaml"}
"""Manifests no kustomization lists: swapped in by hand (ops/k8s/cluster/kustomization.yaml)."""


def test_every_k8s_manifest_is_in_a_kustomization_and_none_sets_a_namespace(yaml):
    listed = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        assert "namespace" not in spec, kustomization
        listed |= {(kustomization.parent / r).resolve() for r in spec["resources"]}
    manifests = {p.resolve() for p in K8S.rglob("*.yaml")} - {
        p.resolve() for p in K8S.rglob("kustomization.yaml")
    }
    assert manifests - listed == {p.resolve() for p in K8S_ALTERNATIVES}
    for variant in K8S_VARIANTS.values():
        objects = k8s_objects(yaml, variant)
        assert {kind for kind, _ in objects} == {
            "ConfigMap",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "ScaledObject",
        }
        for obj in objects.values():
            assert "namespace" not in obj["metadata"], obj["metadata"]["name"]


def test_k8s_containers_run_real_commands_with_real_settings(yaml):
    objects = k8s_objects(yaml)
    known = cli_env_names()
    image = image_layout()
    for name, command in (("inferq-gateway", "gateway"), ("inferq-worker", "worker")):
        deployment = objects[("Deployment", name)]
        c = container(deployment)
        assert parse_command(c["args"]).command == command
        env = container_env(objects, c)
        inferq_vars = {k for k in env if k.startswith("INFERQ_")}
        assert inferq_vars <= known, inferq_vars - known
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) == image["user"].split(":")[0]
    worker = container(objects[("Deployment", "inferq-worker")])
    worker_env = container_env(objects, worker)
    assert worker_env["INFERQ_MODEL_REPOSITORY"] == image["env"]["INFERQ_MODEL_REPOSITORY"]
    assert int(worker_env["INFERQ_METRICS_PORT"]) == DEFAULT_METRICS_PORT
    assert worker["ports"] == [{"name": "metrics", "containerPort": DEFAULT_METRICS_PORT}]
    grace = objects[("Deployment", "inferq-worker")]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace > float(worker_env.get("INFERQ_DRAIN_TIMEOUT_S", WorkerSettings().drain_timeout_s))
    assert "replicas" not in objects[("Deployment", "inferq-worker")]["spec"]  # KEDA owns it


def test_k8s_gateway_probes_hit_real_health_routes_on_the_default_port(yaml):
    objects = k8s_objects(yaml)
    gateway = container(objects[("Deployment", "inferq-gateway")])
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": GatewaySettings().port, "grpc": GatewaySettings().grpc_port}
    assert parse_command(gateway["args"]).port == GatewaySettings().port
    methods = route_methods()
    probes = {kind: gateway[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    for probe in probes.values():
        assert "GET" in methods[probe["path"]]
        assert probe["port"] in ports


def test_k8s_services_and_budgets_select_the_pods_they_mean(yaml):
    objects = k8s_objects(yaml)
    pods = {
        name: obj["spec"]["template"]["metadata"]["labels"]
        for (kind, name), obj in objects.items()
        if kind == "Deployment"
    }
    for (kind, name), obj in objects.items():
        if kind == "Deployment":
            assert obj["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
        if kind in ("Service", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [d for d, labels in pods.items() if selector.items() <= labels.items()]
            assert len(matched) == 1, (kind, name, matched)
        if kind == "Service":
            (deployment,) = matched
            ports = {p["name"] for p in container(objects[("Deployment", deployment)])["ports"]}
            for port in obj["spec"]["ports"]:
                assert port["targetPort"] in ports, (name, port)
    budgets = [name for kind, name in objects if kind == "PodDisruptionBudget"]
    assert sorted(budgets) == ["inferq-gateway", "inferq-worker"]


def test_keda_scales_workers_on_lag_and_pending_of_every_lane_of_each_model(yaml):
    objects = k8s_objects(yaml)
    scaled = objects[("ScaledObject", "inferq-worker")]["spec"]
    assert ("Deployment", scaled["scaleTargetRef"]["name"]) in objects
    # Scale to zero: the gateways queue what arrives meanwhile, which activates the workers.
    assert scaled["minReplicaCount"] == 0
    worker = container(objects[("Deployment", scaled["scaleTargetRef"]["name"])])
    env = container_env(objects, worker)
    gateway = container_env(objects, container(objects[("Deployment", "inferq-gateway")]))
    assert gateway["INFERQ_WORKERS_ON_DEMAND"] == "1"
    keys = Keys(env["INFERQ_NAMESPACE"])
    triggers = scaled["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    by_stream: dict[str, set[str]] = {}
    models: set[str] = set()
    for trigger in triggers:
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == GROUP
        assert meta["addressFromEnv"] in env
        parsed = keys.parse_stream(meta["stream"])
        assert parsed is not None, meta["stream"]
        models.add(parsed[0])
        kinds = {"lagCount", "pendingEntriesCount"} & set(meta)
        assert len(kinds) == 1, meta
        if "lagCount" in kinds:
            assert "activationLagCount" in meta
        else:
            # A busy worker holds up to two batches (one running, one forming): a lower target
            # would make the pending trigger alone ask for more workers than hold work.
            config = tomllib.loads((REPO / "models" / parsed[0] / "config.toml").read_text())
            assert int(meta["pendingEntriesCount"]) >= 2 * config["max_batch"]
        by_stream.setdefault(meta["stream"], set()).update(kinds)
    for model in models:
        assert (REPO / "models" / model / "config.toml").is_file(), model
        for lane in LANES_BY_PRIORITY:
            assert by_stream.get(keys.stream(model, lane)) == {"lagCount", "pendingEntriesCount"}
    redis_url = urlsplit(env["INFERQ_REDIS_URL"])
    address = env[triggers[0]["metadata"]["addressFromEnv"]]
    assert address == f"{redis_url.hostname}:{redis_url.port}"


def cluster_objects(yaml: Any) -> dict[str, dict[str, Any]]:
    """The Redis Cluster variants (ops/k8s/cluster/*.yaml), by file name."""
    return {p.name: load_all(yaml, p)[0] for p in sorted((K8S / "cluster").glob("*.yaml"))}


def model_partitions(model: str) -> int:
    config = tomllib.loads((REPO / "models" / model / "config.toml").read_text())
    return int(config.get("partitions", 1))


def test_keda_on_a_redis_cluster_scales_on_every_partition_and_lane_of_each_model(yaml):
    files = cluster_objects(yaml)
    config = files["config-cluster.yaml"]["data"]
    scaled = files["keda-cluster-streams.yaml"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "inferq-worker" and scaled["minReplicaCount"] == 0
    assert config["INFERQ_WORKERS_ON_DEMAND"] == "1"
    keys = Keys(config["INFERQ_NAMESPACE"])
    by_stream: dict[str, set[str]] = {}
    models: set[str] = set()
    for trigger in scaled["triggers"]:
        assert trigger["type"] == "redis-cluster-streams"
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == GROUP and meta["addressesFromEnv"] in config
        parsed = keys.parse_stream_key(meta["stream"])
        assert parsed is not None, meta["stream"]
        models.add(parsed.model)
        by_stream.setdefault(meta["stream"], set()).update(
            {"lagCount", "pendingEntriesCount"} & set(meta)
        )
    for model in models:
        for p in range(model_partitions(model)):
            for lane in LANES_BY_PRIORITY:
                assert by_stream.get(keys.stream(model, lane, p)) == {
                    "lagCount",
                    "pendingEntriesCount",
                }
    # Every master for KEDA, the same nodes as seeds for inferq.
    seeds = {urlsplit(f"redis://{hp}").netloc for hp in config["REDIS_ADDRESSES"].split(",")}
    url = config["INFERQ_REDIS_URL"].removeprefix("redis://").split("/")[0]
    assert set(url.split(",")) == seeds


def test_keda_on_inferqs_own_backlog_sums_partitions_lanes_and_models(yaml):
    scaled = cluster_objects(yaml)["keda-prometheus.yaml"]["spec"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert set(METRIC.findall(query)) == {"inferq_model_backlog"}
    assert set(METRIC.findall(query)) <= declared_sample_names()
    # Each gateway exports the same figure: max by model first, then the sum over models.
    assert query.startswith("sum(max by (model) (")
    assert int(trigger["metadata"]["threshold"]) >= 2 * 64
    assert scaled["minReplicaCount"] == 0 and trigger["metadata"]["activationThreshold"] == "0"


def test_the_cluster_config_sets_only_real_variables(yaml):
    config = cluster_objects(yaml)["config-cluster.yaml"]["data"]
    inferq_vars = {k for k in config if k.startswith("INFERQ_")}
    assert inferq_vars <= cli_env_names()
    assert config["INFERQ_JOB_DURABILITY"] in ("async", "replicated")


KUBERNETES_VERSIONS = ("1.25", "1.37")
"""The oldest and the newest release whose schemas kubernetes-validate bundles."""
CRD_GROUPS = {"keda.sh"}
"""No schema of these is bundled: the ScaledObjects are checked by the KEDA tests above."""


@pytest.mark.parametrize("variant", K8S_VARIANTS.values(), ids=K8S_VARIANTS)
def test_each_kustomization_renders_objects_valid_against_kubernetes_schemas(yaml, variant):
    import kubernetes_validate

    objects = kustomize.build(variant)
    checked = [o for o in objects if o["apiVersion"].split("/")[0] not in CRD_GROUPS]
    assert len(checked) == len(objects) - 1  # all but the ScaledObject
    for obj in checked:
        for version in KUBERNETES_VERSIONS:
            # strict: a field the schema does not have is an error too (a typo, a misplaced key)
            kubernetes_validate.validate(obj, version, strict=True)
    # Not a validator that accepts anything: a misplaced field fails.
    broken = json.loads(json.dumps(checked[0]))
    broken["spec" if "spec" in broken else "metadata"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
    # Where kubectl is installed (not in CI), its kustomize renders the same objects.
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        done = subprocess.run(
            [kubectl, "kustomize", str(variant)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        rendered = [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]

        def by_id(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
            return {(d["kind"], d["metadata"]["name"]): d for d in docs}

        assert by_id(rendered) == by_id(objects)


def test_the_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize.KustomizeError, match="namePrefix"):
        kustomize.build(tmp_path)


# -- flags and routes --------------------------------------------------------------------------


def test_the_worker_metrics_port_flag_has_its_default_and_variable():
    help_text = cli_help("worker")
    assert "--metrics-port" in help_text and "INFERQ_METRICS_PORT" in help_text
    assert "--metrics-host" in help_text and "INFERQ_METRICS_HOST" in help_text
    args = build_parser({}).parse_args(["worker"])
    assert args.metrics_port == DEFAULT_METRICS_PORT


def test_the_gateway_serves_metrics_at_the_scraped_path():
    assert "GET" in route_methods()["/metrics"]
