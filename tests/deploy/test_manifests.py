"""The deployment files in deploy/ have the shape KubeRay and the Ray cluster launcher expect,
carry the same Serve app as configs/, and give every replica room (no cluster, no GPU needed).

What is checked against what:
- deploy/rayservice-<name>.yaml (opt13b, opt13b-tp2): the fields the RayService / RayCluster
  CRDs (ray.io/v1) read, with their types; serveConfigV2 validated by Ray Serve's own schema
  (ServeDeploySchema) and equal to configs/<name>.yaml; the app builds; a GPU worker pod fits a
  replica's placement group and the worker group holds Serve's max_replicas.
- deploy/cluster-launcher-gpu.yaml: validated by the launcher's own JSON schema (ray-schema.json,
  shipped in the ray package) plus the launcher's semantic rules; the GPU node types fit
  configs/opt13b.yaml and configs/opt13b-tp2.yaml.
- deploy/rayjob-batch-qwen2.5-7b-instruct.yaml: the RayJob fields, its entrypoint parsed by the
  `rayserve-paged batch` command's own parser, its ConfigMap's engine equal to
  configs/qwen2.5-7b-instruct.yaml's, the data and config volumes where the command reads them,
  and GPU workers that hold the engine actor pool's largest size.
- deploy/Dockerfile: a CUDA base, `pip install .[gpu,batch]`, the same Ray version as the manifests.
- deploy/networkpolicy.yaml: selects every Ray pod of every RayService; from outside the Ray
  pods only the Serve port is open (the KubeRay operator: the dashboard and its agent only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RAYSERVICES = sorted(DEPLOY.glob("rayservice-*.yaml"))
LAUNCHER = DEPLOY / "cluster-launcher-gpu.yaml"
NETWORK_POLICY = DEPLOY / "networkpolicy.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOC = ROOT / "docs" / "DEPLOY.md"
IMPORT_PATH = "rayserve_paged.app:build_app"  # the flat args, one model
SERVE_LLM_IMPORT_PATH = "rayserve_paged.app:build_openai_app"  # Ray Serve LLM's llm_configs
GPU = "nvidia.com/gpu"


@cache
def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _source_config(path: Path) -> Path:
    """deploy/rayservice-<name>.yaml carries the app of configs/<name>.yaml."""
    return ROOT / "configs" / (path.name.removeprefix("rayservice-"))


def _cluster(path: Path) -> dict:
    return _yaml(path)["spec"]["rayClusterConfig"]


def _launcher() -> dict:
    return _yaml(LAUNCHER)


def _serve_config(path: Path) -> dict:
    return yaml.safe_load(_yaml(path)["spec"]["serveConfigV2"])


def _ray_version() -> str:
    (version,) = {_cluster(path)["rayVersion"] for path in RAYSERVICES}
    return version


def _config(name: str) -> dict:
    return _yaml(ROOT / "configs" / name)


def _args(serve_config: dict) -> dict:
    (app,) = serve_config["applications"]
    return app["args"]


def _models(serve_config: dict) -> list[dict]:
    """Each model's AppArgs fields, in either form (flat args: the one model's)."""
    from rayserve_paged.app import AppArgs, model_args_of
    from rayserve_paged.serve_llm import is_llm_configs, translate

    args = _args(serve_config)
    if not is_llm_configs(args):
        return [args]
    models = translate(args, frozenset(AppArgs.model_fields)).models
    return [model_args_of(m).model_dump(exclude_unset=True) | {"served_model_name": m.model_id} for m in models]


def _bundles(args: dict) -> list[dict[str, float]]:
    from rayserve_paged.app import AppArgs, placement_group_bundles

    return placement_group_bundles(AppArgs(**args))


def _pack(bundles: list[dict[str, float]]) -> dict[str, float]:
    """What a STRICT_PACK placement group needs from one node."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            total[resource] = total.get(resource, 0.0) + amount
    return total


def _per_node(node: dict[str, float], need: dict[str, float]) -> int:
    """How many placement groups of `need` one node of `node` holds."""
    return min(math.floor(node.get(resource, 0.0) / amount + 1e-9) for resource, amount in need.items() if amount)


# ---------------------------------------------------------------- Kubernetes quantities

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _cpu(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _bytes(quantity) -> float:
    text = str(quantity)
    for suffixes in (_BINARY, _DECIMAL):
        for suffix, factor in suffixes.items():
            if text.endswith(suffix):
                return float(text[: -len(suffix)]) * factor
    return float(text)


def _ray_resources(group: dict) -> dict[str, float]:
    """The CPU/GPU a Ray node started in this pod has: rayStartParams, else the container limits
    (how KubeRay and its autoscaler derive them)."""
    params = group["rayStartParams"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    cpus = float(params["num-cpus"]) if "num-cpus" in params else _cpu(limits["cpu"])
    gpus = float(params["num-gpus"]) if "num-gpus" in params else float(limits.get(GPU, 0))
    return {"CPU": cpus, "GPU": gpus}


# ---------------------------------------------------------------- RayService

each_rayservice = pytest.mark.parametrize("path", RAYSERVICES, ids=lambda p: p.name)


def test_rayservices_are_here():
    assert {p.name for p in RAYSERVICES} >= {"rayservice-opt13b.yaml", "rayservice-opt13b-tp2.yaml"}
    for path in RAYSERVICES:
        assert _source_config(path).is_file(), f"{path.name} has no configs/ counterpart"
    names = [_yaml(path)["metadata"]["name"] for path in RAYSERVICES]
    assert len(set(names)) == len(names)


@each_rayservice
def test_rayservice_header(path):
    service = _yaml(path)
    assert service["apiVersion"] == "ray.io/v1"
    assert service["kind"] == "RayService"
    name = service["metadata"]["name"]
    # A DNS-1035 label; KubeRay appends suffixes (-head-svc, -serve-svc, -raycluster-xxxxx).
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
    assert "namespace" not in service["metadata"], "namespace comes from kubectl -n"


@each_rayservice
def test_rayservice_spec_fields_and_types(path):
    spec = _yaml(path)["spec"]
    known = {
        "serveConfigV2",
        "rayClusterConfig",
        "serviceUnhealthySecondThreshold",
        "deploymentUnhealthySecondThreshold",
        "upgradeStrategy",
        "serveService",
        "excludeHeadPodFromServeSvc",
    }
    assert set(spec) <= known, set(spec) - known
    assert {"serveConfigV2", "rayClusterConfig"} <= set(spec)
    for field in ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"):
        assert type(spec[field]) is int and spec[field] > 0, field
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "None")


@each_rayservice
def test_serve_config_v2_is_a_valid_serve_config_string(path):
    from ray.serve.schema import ServeDeploySchema

    raw = _yaml(path)["spec"]["serveConfigV2"]
    assert isinstance(raw, str), "serveConfigV2 must be a YAML string, not a mapping"
    config = yaml.safe_load(raw)
    assert isinstance(config, dict) and config["applications"]
    ServeDeploySchema.model_validate(config)  # what `serve deploy` / the dashboard API accept
    http = config["http_options"]
    assert (http["host"], http["port"]) == ("0.0.0.0", 8000), "pods must listen on all interfaces"
    assert http["request_timeout_s"] > 0, "no request holds the proxy without bound"
    (app,) = config["applications"]
    assert app["import_path"] in (IMPORT_PATH, SERVE_LLM_IMPORT_PATH)


@each_rayservice
def test_serve_config_v2_equals_its_config(path):
    embedded, source = _serve_config(path), _yaml(_source_config(path))
    assert _args(embedded) == _args(source), f"{path.name} drifted from configs/{_source_config(path).name}"
    for key in ("name", "route_prefix", "import_path"):
        assert embedded["applications"][0][key] == source["applications"][0][key], key
    assert embedded["proxy_location"] == source["proxy_location"]
    assert embedded["http_options"] == source["http_options"]


@each_rayservice
def test_embedded_app_builds(path):
    from rayserve_paged.app import AppArgs, build_app

    assert build_app(_args(_serve_config(path))) is not None  # build_app takes llm_configs too
    for model in _models(_serve_config(path)):
        args = AppArgs(**model)
        assert args.device == "cuda" and not args.trust_remote_code


@each_rayservice
def test_ray_cluster_config(path):
    cluster = _cluster(path)
    assert isinstance(cluster["rayVersion"], str) and re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    assert cluster["enableInTreeAutoscaling"] is True
    options = cluster["autoscalerOptions"]
    assert isinstance(options, dict)
    assert set(options) <= {
        "upscalingMode",
        "idleTimeoutSeconds",
        "image",
        "imagePullPolicy",
        "resources",
        "env",
        "envFrom",
        "securityContext",
        "volumeMounts",
        "version",
    }, set(options)
    assert options["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    assert type(options["idleTimeoutSeconds"]) is int and options["idleTimeoutSeconds"] >= 0
    for key in ("limits", "requests"):
        assert {"cpu", "memory"} <= set(options["resources"][key])


def _check_ray_start_params(params):
    assert isinstance(params, dict)
    # map[string]string in the CRD: an unquoted number or boolean is rejected.
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()), params


def _container(group: dict) -> dict:
    containers = group["template"]["spec"]["containers"]
    assert isinstance(containers, list) and containers
    return containers[0]


@each_rayservice
def test_head_group(path):
    head = _cluster(path)["headGroupSpec"]
    params = head["rayStartParams"]
    _check_ray_start_params(params)
    assert params["num-gpus"] == "0"
    assert params["dashboard-host"] == "0.0.0.0", "the operator reaches the dashboard from outside the pod"
    container = _container(head)
    assert isinstance(container["image"], str) and container["image"]
    assert container["image"].split(":")[0].endswith("rayserve-paged")
    resources = container["resources"]
    for key in ("limits", "requests"):
        assert {"cpu", "memory"} <= set(resources[key]), key
        assert GPU not in resources[key], "the head takes no GPU"
        assert _cpu(resources[key]["cpu"]) > 0 and _bytes(resources[key]["memory"]) > 0
    ports = {p["containerPort"]: p.get("name") for p in container["ports"]}
    assert {6379, 8265, 8000} <= set(ports), ports
    assert ports[6379] == "gcs-server" and ports[8265] == "dashboard" and ports[8000] == "serve"


@each_rayservice
def test_worker_groups(path):
    groups = _cluster(path)["workerGroupSpecs"]
    assert isinstance(groups, list) and groups
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names) and all(isinstance(n, str) and n for n in names)
    head_image = _container(_cluster(path)["headGroupSpec"])["image"]
    for group in groups:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert type(group[key]) is int, key
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        _check_ray_start_params(group["rayStartParams"])
        container = _container(group)
        assert container["image"] == head_image, "every Ray node runs the same image"
        resources = container["resources"]
        limits, requests = resources["limits"], resources["requests"]
        assert int(limits[GPU]) >= 1, "GPU workers"
        assert str(requests.get(GPU, limits[GPU])) == str(limits[GPU]), "extended resources: requests == limits"
        if "num-gpus" in group["rayStartParams"]:
            assert float(group["rayStartParams"]["num-gpus"]) == float(limits[GPU])
        assert _bytes(limits["memory"]) > 0 and _cpu(limits["cpu"]) > 0
        ports = {p["containerPort"] for p in container.get("ports", [])}
        assert 8000 in ports, "proxy_location EveryNode: workers serve HTTP too"


@each_rayservice
def test_worker_shm_is_memory_backed(path):
    for group in _cluster(path)["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in _container(group)["volumeMounts"]}
        assert "/dev/shm" in mounts
        (volume,) = [v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        shm = _bytes(volume["emptyDir"]["sizeLimit"])
        assert shm < _bytes(_container(group)["resources"]["limits"]["memory"])
        store = group["rayStartParams"].get("object-store-memory")
        if store is not None:
            assert int(store) <= shm, "the object store lives in /dev/shm"


@each_rayservice
def test_replica_placement_group_fits_a_gpu_worker_and_the_group_covers_max_replicas(path):
    """Every model's replicas at their max_replicas at once (each GPU worker holds one
    replica; several models share the worker group)."""
    models = _models(_serve_config(path))
    capacity, wanted = 0, 0
    for args in models:
        need = _pack(_bundles(args))  # STRICT_PACK: all bundles on one node
        assert need.get("GPU", 0) >= 1
        per_node = [_per_node(_ray_resources(group), need) for group in _cluster(path)["workerGroupSpecs"]]
        assert max(per_node) >= 1, f"no worker group fits a replica's placement group {need}"
        wanted += args["autoscaling_config"]["max_replicas"]
    for group in _cluster(path)["workerGroupSpecs"]:
        per_node = min(_per_node(_ray_resources(group), _pack(_bundles(args))) for args in models)
        capacity += group["maxReplicas"] * per_node
    assert capacity >= wanted, f"worker groups hold {capacity} replicas, Serve may ask for {wanted}"


@each_rayservice
def test_the_head_holds_no_replica(path):
    head = _ray_resources(_cluster(path)["headGroupSpec"])
    assert head["GPU"] == 0  # every LLMServer bundle asks for a GPU: replicas land on GPU workers


# ---------------------------------------------------------------- cluster launcher


def test_launcher_matches_rays_own_schema():
    import jsonschema
    import ray.autoscaler

    schema_path = Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json"
    jsonschema.validate(_launcher(), json.loads(schema_path.read_text()))


def test_launcher_structure():
    config = _launcher()
    assert isinstance(config["cluster_name"], str) and config["cluster_name"]
    assert config["provider"]["type"] == "aws"
    assert isinstance(config["provider"]["region"], str)
    assert isinstance(config["idle_timeout_minutes"], (int, float)) and config["idle_timeout_minutes"] > 0
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    for name, node_type in types.items():
        for key in ("node_config", "resources", "min_workers", "max_workers"):
            assert key in node_type, f"{name}: {key}"
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name
        assert node_type["node_config"]["InstanceType"], name
        assert str(node_type["node_config"]["ImageId"]).startswith("ami-"), name
        assert all(type(v) is int for v in node_type["resources"].values()), name
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    gpu_types = [t for n, t in types.items() if n != config["head_node_type"] and t["resources"].get("GPU", 0) > 0]
    assert gpu_types, "a GPU worker type"
    workers = [t for n, t in types.items() if n != config["head_node_type"]]
    assert config["max_workers"] >= sum(t["min_workers"] for t in workers)
    assert config["max_workers"] <= sum(t["max_workers"] for t in workers)


def test_launcher_installs_the_project_and_starts_ray():
    config = _launcher()
    rayservice_version = _ray_version()
    assert "." in config["file_mounts"].values(), "the repository (ray up from its root) goes to the nodes"
    setup = " ".join(config["setup_commands"])
    assert "rayserve-paged[gpu]" in setup
    assert f"=={rayservice_version}" in setup, "same Ray as the RayService"
    head = " ".join(config["head_start_ray_commands"])
    assert "--head" in head and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head and "6379" in head
    worker = " ".join(config["worker_start_ray_commands"])
    assert "$RAY_HEAD_IP:6379" in worker
    assert any("boto3" in c for c in config["head_setup_commands"]), "the AWS node provider runs on the head"


@pytest.mark.parametrize("name", ["opt13b.yaml", "opt13b-tp2.yaml"])
def test_launcher_gpu_types_fit_the_config(name):
    config = _launcher()
    args = _args(_config(name))
    need = _pack(_bundles(args))
    head_name = config["head_node_type"]
    capacity = sum(
        t["max_workers"] * _per_node({k: float(v) for k, v in t["resources"].items()}, need)
        for n, t in config["available_node_types"].items()
        if n != head_name
    )
    assert capacity >= args["autoscaling_config"]["max_replicas"], (name, need, capacity)
    head = config["available_node_types"][head_name]["resources"]
    assert head["GPU"] == 0  # no replica on the head


# ---------------------------------------------------------------- image and docs


def test_dockerfile_installs_the_package_on_cuda_with_the_same_ray():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:"), "a CUDA base image"
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M)
    assert 'pip install ".[gpu,batch]"' in text  # serving and batch jobs
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)", text, re.M)
    assert ray_version and ray_version.group(1) == _ray_version()
    for path in ("pyproject.toml", "rayserve_paged"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path


def test_deploy_doc_covers_the_files_and_commands():
    text = DOC.read_text()
    for needle in (
        "deploy/Dockerfile",
        "deploy/rayservice-opt13b.yaml",
        "deploy/rayservice-opt13b-tp2.yaml",
        "deploy/rayservice-serve-llm-gpu.yaml",
        "deploy/cluster-launcher-gpu.yaml",
        "deploy/networkpolicy.yaml",
        "helm install",
        "get rayservice",
        "port-forward",
        "ray up",
        "serve deploy",
        "target_ongoing_requests",
        "STRICT_PACK",
        "api_key",
        "trust_remote_code",
    ):
        assert needle in text, needle


@each_rayservice
def test_api_key_comes_from_a_required_secret_into_the_replica_pods_only(path):
    """The key is never a Serve argument (Serve logs those): every pod that may run a replica
    (the GPU workers) gets RAYSERVE_PAGED_API_KEY from a Kubernetes Secret that is not
    optional (no Secret: the pod does not start), never as a literal value; the head, which
    runs no replica, does not get it; and the app requires it (a blank key stops a replica)."""
    from rayserve_paged.deployments.access import API_KEY_ENV, API_KEY_FILE_ENV

    cluster = _cluster(path)
    assert "api_key" not in _args(_serve_config(path))
    assert all(args["require_api_key"] is True for args in _models(_serve_config(path)))
    head_env = {e["name"] for e in _container(cluster["headGroupSpec"]).get("env", [])}
    assert not head_env & {API_KEY_ENV, API_KEY_FILE_ENV}, "the head runs no replica"
    for group in cluster["workerGroupSpecs"]:
        assert _ray_resources(group)["GPU"] > 0  # where the replicas run
        env = {e["name"]: e for e in _container(group).get("env", [])}
        assert API_KEY_ENV in env, group["groupName"]
        assert "value" not in env[API_KEY_ENV]
        ref = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("rayserve-paged-api-key", "key")
        assert ref.get("optional", False) is False, "an optional Secret fails open"


@each_rayservice
def test_an_ingress_that_checks_the_key_runs_beside_a_replica_on_a_worker(path):
    """llm_configs' OpenAIIngress reads the API key: the head (no key) takes no Serve actor
    (num-cpus 0), and a GPU worker holds the ingress beside a replica of every model."""
    args = _args(_serve_config(path))
    if "llm_configs" not in args:
        return  # the flat form: the HTTP app runs in the replicas
    cluster = _cluster(path)
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    ingress_cpus = args["ingress_deployment_config"]["ray_actor_options"]["num_cpus"]
    for model in _models(_serve_config(path)):
        need = _pack(_bundles(model))
        need["CPU"] += ingress_cpus
        assert any(_per_node(_ray_resources(g), need) >= 1 for g in cluster["workerGroupSpecs"]), need


@each_rayservice
def test_gpu_configs_scale_on_kv_pressure_and_drain_on_scale_down(path):
    for args in _models(_serve_config(path)):
        assert args["autoscaling_policy"] == "kv" and args["graceful_shutdown_timeout_s"] >= 300


# ---------------------------------------------------------------- NetworkPolicy

OPERATOR_PORTS = {8265, 52365}  # the dashboard (serveConfigV2, Serve status) and its agent


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels selectors are checked here"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _ray_pod_labels(path: Path) -> list[dict]:
    cluster = _cluster(path)
    return [g["template"]["metadata"]["labels"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def _ports(rule: dict) -> set[int]:
    assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
    return {p["port"] for p in rule["ports"]}


def test_network_policy_admits_only_the_serve_port_from_outside_the_ray_pods():
    policy = _yaml(NETWORK_POLICY)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selector = spec["podSelector"]
    for path in RAYSERVICES:  # every Ray pod (head and workers) of every RayService is covered
        assert all(_matches(selector, labels) for labels in _ray_pod_labels(path)), path.name
    serve_ports = {yaml.safe_load(_yaml(p)["spec"]["serveConfigV2"])["http_options"]["port"] for p in RAYSERVICES}
    open_to_all: set[int] = set()
    kinds = []
    for rule in spec["ingress"]:
        sources = rule.get("from")
        if sources is None:  # from anywhere: the Serve port and nothing else
            open_to_all |= _ports(rule)
            kinds.append("anyone")
            continue
        assert all("ipBlock" not in source for source in sources), "no address range is admitted"
        (source,) = sources
        if set(source) == {"podSelector"} and source["podSelector"] == selector:
            assert "ports" not in rule  # Ray pods talk to each other on every port
            kinds.append("ray pods")
        else:  # the operator, wherever it runs, to the dashboard and its agent only
            assert source["namespaceSelector"] == {}
            assert source["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
            assert _ports(rule) == OPERATOR_PORTS
            kinds.append("operator")
    assert sorted(kinds) == ["anyone", "operator", "ray pods"]
    assert open_to_all == serve_ports == {8000}
    # the dashboard, GCS and Ray client ports are open to no one outside the Ray pods
    assert not open_to_all & {6379, 8265, 10001, 52365}


# ---------------------------------------------------------------- RayJob (batch inference)

RAYJOB = DEPLOY / "rayjob-batch-qwen2.5-7b-instruct.yaml"


def _rayjob_documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(RAYJOB.read_text())}


def _rayjob_command():
    import shlex

    from rayserve_paged.cli import _parser

    words = shlex.split(_rayjob_documents()["RayJob"]["spec"]["entrypoint"])
    assert words[0] == "rayserve-paged"
    return _parser().parse_args(words[1:])


def _rayjob_config(command):
    """The ConfigMap's BatchConfig, read as the command reads its --config file."""
    from rayserve_paged.cli import batch_config

    config_file = command.config.rsplit("/", 1)[1]
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"rayjob-{os.getpid()}.yaml"
    path.write_text(_rayjob_documents()["ConfigMap"]["data"][config_file])
    try:
        return batch_config(argparse.Namespace(**{**vars(command), "config": str(path)}))
    finally:
        path.unlink()


def test_rayjob_documents_and_spec_fields():
    documents = _rayjob_documents()
    assert set(documents) == {"ConfigMap", "RayJob"}
    job = documents["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and documents["ConfigMap"]["apiVersion"] == "v1"
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
    spec = job["spec"]
    known = {"entrypoint", "rayClusterSpec", "submissionMode", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
             "activeDeadlineSeconds", "backoffLimit", "runtimeEnvYAML", "jobId", "metadata", "suspend",
             "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "submitterPodTemplate",
             "clusterSelector", "deletionStrategy", "managedBy"}  # fmt: skip
    assert set(spec) <= known, set(spec) - known
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    assert spec["shutdownAfterJobFinishes"] is True
    for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        assert type(spec[field]) is int and spec[field] >= 0, field
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == _ray_version() and cluster["enableInTreeAutoscaling"] is True


def test_rayjob_runs_the_batch_command_on_the_configmaps_engine():
    from rayserve_paged.config import EngineConfig

    command = _rayjob_command()
    assert command.command == "batch" and command.address == "auto"
    head = _cluster_of_rayjob()["headGroupSpec"]
    mounts = {m["mountPath"]: m["name"] for m in _container(head)["volumeMounts"]}
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    config_dir, config_file = command.config.rsplit("/", 1)
    config_map = _rayjob_documents()["ConfigMap"]
    assert volumes[mounts[config_dir]]["configMap"]["name"] == config_map["metadata"]["name"]
    data_dir = command.input.rsplit("/", 1)[0]
    assert command.output.rsplit("/", 1)[0] == data_dir and "persistentVolumeClaim" in volumes[mounts[data_dir]]
    assert config_file in config_map["data"]
    config = _rayjob_config(command)  # its engine is the served one
    served = _args(_config("qwen2.5-7b-instruct.yaml"))
    assert config.engine == EngineConfig(**{k: v for k, v in served.items() if k in EngineConfig.model_fields})
    assert config.batch_size * config.max_concurrent_batches >= config.engine.max_num_seqs, "engines kept full"


def _cluster_of_rayjob() -> dict:
    return _rayjob_documents()["RayJob"]["spec"]["rayClusterSpec"]


def test_rayjob_gpu_workers_hold_the_engine_actor_pool():
    from rayserve_paged.batch.processor import engine_placement

    command = _rayjob_command()
    cluster = _cluster_of_rayjob()
    head = cluster["headGroupSpec"]
    _check_ray_start_params(head["rayStartParams"])
    assert _ray_resources(head)["GPU"] == 0, "the driver's head runs no engine"
    config = _rayjob_config(command)
    actor = engine_placement(config.engine, config.worker_cpus, config.cpu_stage_cpus)
    need = {"CPU": actor["num_cpus"], "GPU": actor["num_gpus"]}
    assert need["GPU"] == 1
    capacity = 0
    for group in cluster["workerGroupSpecs"]:
        _check_ray_start_params(group["rayStartParams"])
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        capacity += group["maxReplicas"] * _per_node(_ray_resources(group), need)
        assert _container(group)["image"] == _container(head)["image"]
    assert capacity >= config.pool_size[1], f"workers hold {capacity} engine actors, the pool may ask {config.pool_size}"
