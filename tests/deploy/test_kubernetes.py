"""deploy/: the Kubernetes manifests are valid objects of the Kubernetes versions docs/deploy/kubernetes.md
names, checked offline against Kubernetes' own schemas (kubernetes-validate ships them: no network,
no cluster), and the pieces that must agree do: names, labels, ports, paths, forkd's own flags. The
host image's entrypoint is run for real in a cgroup namespace of its own."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install 'forkd-jupyter[test]'")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "kubernetes")
# The oldest and the newest minor versions the manifests are checked against (the docs say the same).
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
# a kustomize file, Helm values files (zero-to-jupyterhub's)
NOT_OBJECTS = {"kustomization.yaml", "z2jh-values.yaml", "z2jh-shared-token-values.yaml"}
# a z2jh chart (its values.yaml and values.schema.json or .yaml) to check the values files against;
# the chart is not on PyPI or npm, so the check runs only where one is given
Z2JH_CHART = os.environ.get("FORKD_TEST_Z2JH_CHART")


def manifests() -> list[str]:
    return sorted(n for n in os.listdir(K8S) if n.endswith(".yaml") and n not in NOT_OBJECTS)


def load(name: str) -> list[dict]:
    with open(os.path.join(K8S, name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def objects() -> dict[tuple[str, str], dict]:
    """Every object the kustomization applies, by (kind, name)."""
    kustomization = load("kustomization.yaml")[0]
    out = {}
    for name in kustomization["resources"]:
        for obj in load(name):
            out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


def validate(obj: dict) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def container(obj: dict) -> dict:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


def mount_of(pod: dict, c: dict, path: str) -> tuple[dict, dict]:
    """The volume (and its mount) that ``path`` (a file or directory in container ``c``) lies in."""
    mounts = [m for m in c["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{path} is in {len(mounts)} mounts"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return volume, mounts[0]


def secret_key_of(pod: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of a file a secret volume puts at ``path``."""
    volume, mount = mount_of(pod, c, path)
    inside = os.path.relpath(path, mount["mountPath"])
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == inside]
    return volume["secret"]["secretName"], item["key"]


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- every object, as Kubernetes' schemas define it --------------------------------------------

def test_the_kustomization_lists_every_manifest():
    listed = load("kustomization.yaml")[0]["resources"]
    assert sorted(listed) == manifests()


@pytest.mark.parametrize("name", manifests())
def test_each_manifest_is_valid_for_the_stated_kubernetes_versions(name):
    docs = load(name)
    assert docs
    for obj in docs:
        validate(obj)


def test_the_validation_catches_a_misspelt_field():
    """The check above can fail: a field Kubernetes does not know is refused (strict schemas)."""
    ds = copy.deepcopy(objects()[("DaemonSet", "forkd-host")])
    ds["spec"]["template"]["spec"]["volumes"][0]["hostPth"] = ds["spec"]["template"]["spec"]["volumes"][0].pop("hostPath")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(ds)
    ds = copy.deepcopy(objects()[("DaemonSet", "forkd-host")])
    container(ds)["ports"][0]["containerPort"] = "8889"  # a string where an integer belongs
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(ds)


# --- the host DaemonSet -----------------------------------------------------------------------

def test_the_host_daemonset():
    objs = objects()
    ds = objs[("DaemonSet", "forkd-host")]
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert labels_match(ds["spec"]["selector"]["matchLabels"], ds["spec"]["template"]["metadata"]["labels"])
    assert pod["nodeSelector"] == {"forkd-host": "true"}
    assert c["securityContext"]["privileged"] is True
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0  # one server per data dir
    args = c["args"]
    assert args[:2] == ["forkd", "serve"]
    # the data dir on the node's disk
    data = flag(args, "--data-dir")
    volume, _ = mount_of(pod, c, data)
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    # guest RAM files on a memory-backed /dev/shm (a container's own is 64 MiB)
    volume, _ = mount_of(pod, c, "/dev/shm")
    assert volume["emptyDir"]["medium"] == "Memory"
    # probes on /healthz, at the port forkd serve listens on
    (port,) = c["ports"]
    assert port["containerPort"] == int(flag(args, "--port")) and flag(args, "--host") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert c["resources"]["requests"]
    # the hosts' token, from the Secret the kustomization applies
    secret, key = secret_key_of(pod, c, flag(args, "--token-file"))
    assert key in objs[("Secret", secret)]["stringData"]
    (cm,) = [e["configMapRef"]["name"] for e in c["envFrom"] if "configMapRef" in e]
    assert "FORKD_STORE" in objs[("ConfigMap", cm)]["data"]
    (optional,) = [e["secretRef"] for e in c["envFrom"] if "secretRef" in e]
    assert optional["optional"] is True  # store credentials: not applied here, the docs say how


def test_the_host_arguments_are_forkd_serves():
    """The DaemonSet's command line and environment, parsed by forkd's own CLI."""
    from forkd_server.cli import build_parser

    ds = objects()[("DaemonSet", "forkd-host")]
    c = container(ds)
    env = {e["name"]: e["value"] for e in c["env"]}
    store = objects()[("ConfigMap", "forkd-store")]["data"]
    old = {k: os.environ.get(k) for k in (*env, *store)}
    os.environ.update({**env, **store})
    try:
        args = build_parser().parse_args(c["args"][1:])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert args.func.__name__ == "cmd_serve"
    assert args.max_sandboxes == int(env["FORKD_MAX_SANDBOXES"]) > 0
    assert (args.port, args.data_dir, args.host) == (8889, "/var/lib/forkd", "0.0.0.0")


def test_the_placeholder_tokens_keep_the_hosts_from_starting(tmp_path):
    """As secret-tokens.yaml says: left as shipped, forkd serve refuses them."""
    from forkd_server.serve import ServeError, read_token_file

    for key, token in objects()[("Secret", "forkd-tokens")]["stringData"].items():
        path = tmp_path / key
        path.write_text(token)
        with pytest.raises(ServeError, match="placeholder"):
            read_token_file(str(path))


def test_the_headless_service_names_every_host_pod():
    objs = objects()
    svc = objs[("Service", "forkd-hosts")]
    ds = objs[("DaemonSet", "forkd-host")]
    assert svc["spec"]["clusterIP"] == "None"
    assert labels_match(svc["spec"]["selector"], ds["spec"]["template"]["metadata"]["labels"])
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] == container(ds)["ports"][0]["name"]


# --- the router -------------------------------------------------------------------------------

def test_the_router_finds_the_hosts_through_the_headless_service():
    objs = objects()
    namespace = load("kustomization.yaml")[0]["namespace"]
    dep = objs[("Deployment", "forkd-router")]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    args = c["args"]
    assert args[0] == "router"
    hosts = urlsplit(flag(args, "--hosts-dns"))
    svc = objs[("Service", "forkd-hosts")]
    assert hosts.hostname == f"{svc['metadata']['name']}.{namespace}.svc.cluster.local"
    assert hosts.port == svc["spec"]["ports"][0]["port"]
    secrets = objs[("Secret", "forkd-tokens")]["stringData"]
    assert secret_key_of(pod, c, flag(args, "--token-file")) == ("forkd-tokens", "token")
    assert secret_key_of(pod, c, flag(args, "--hosts-token-file")) == ("forkd-tokens", "hosts-token")
    assert set(secrets) == {"token", "hosts-token"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # its host table and pins outlive the pod: a claim, one pod at a time on it
    volume, _ = mount_of(pod, c, flag(args, "--data-dir"))
    claim = objs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and dep["spec"]["strategy"]["type"] == "Recreate"
    assert c["ports"][0]["containerPort"] == int(flag(args, "--port"))
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    router_svc = objs[("Service", "forkd")]
    assert labels_match(router_svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    assert router_svc["spec"]["ports"][0]["port"] == int(flag(args, "--port"))


def test_the_router_arguments_are_forkd_routers(capsys):
    """The Deployment's command line, parsed by forkd's own CLI."""
    from forkd_server.cli import build_parser

    parser = build_parser()
    args = container(objects()[("Deployment", "forkd-router")])["args"]
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        raise AssertionError(capsys.readouterr().err) from None
    assert parsed.command == "router" and parsed.port == 8890 and parsed.data_dir == "/var/lib/forkd-router"
    assert parsed.hosts_dns == flag(args, "--hosts-dns") and parsed.hosts is None


# --- zero-to-jupyterhub's values ---------------------------------------------------------------

def test_the_shared_token_values_reach_the_router():
    objs = objects()
    namespace = load("kustomization.yaml")[0]["namespace"]
    values = load("z2jh-shared-token-values.yaml")[0]["singleuser"]
    env = values["extraEnv"]
    router_svc = objs[("Service", "forkd")]
    url = urlsplit(env["FORKD_URL"])
    assert url.hostname == f"{router_svc['metadata']['name']}.{namespace}.svc.cluster.local"
    assert url.port == router_svc["spec"]["ports"][0]["port"]
    # z2jh turns a mapping value into an EnvVar: it must be one Kubernetes takes
    as_env = [{"name": k, "value": v} if isinstance(v, str) else {"name": k, **v} for k, v in env.items()]
    assert as_env[1]["valueFrom"]["secretKeyRef"]["key"] == "token"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "jupyter-alice"},
           "spec": {"containers": [{"name": "notebook", "image": "quay.io/jupyter/base-notebook", "env": as_env}]}}
    validate(pod)
    # the egress rule lets user pods reach the router pods, on the router's port
    (rule,) = values["networkPolicy"]["egress"]
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "singleuser"},
              "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [rule]}}
    validate(policy)
    (to,) = rule["to"]
    assert to["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}
    router = objs[("Deployment", "forkd-router")]
    assert labels_match(to["podSelector"]["matchLabels"], router["spec"]["template"]["metadata"]["labels"])
    assert rule["ports"][0]["port"] == int(flag(container(router)["args"], "--port"))


def merged_by_name(base: list[dict], patch: list[dict]) -> list[dict]:
    """A strategic merge of two lists whose merge key is ``name`` (containers, env), as kustomize
    applies a patch: an item of the patch replaces the fields it names of the base's item."""
    out = [dict(i) for i in base]
    for item in patch:
        same = [o for o in out if o["name"] == item["name"]]
        if same:
            same[0].update(item)
        else:
            out.append(dict(item))
    return out


def hub_router() -> dict:
    """The router Deployment as ``kubectl apply -k deploy/kubernetes/hub`` makes it."""
    kustomization = load(os.path.join("hub", "kustomization.yaml"))[0]
    assert kustomization["resources"] == [".."]
    ((patch,),) = [load(os.path.join("hub", p["path"])) for p in kustomization["patches"]]
    dep = copy.deepcopy(objects()[(patch["kind"], patch["metadata"]["name"])])
    for pc in patch["spec"]["template"]["spec"]["containers"]:
        (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == pc["name"]]
        c["env"] = merged_by_name(c.get("env", []), pc["env"])
    return dep


def test_the_hub_overlay_runs_the_router_as_the_hubs_service():
    """deploy/kubernetes/hub: the router with the environment JupyterHub gives a service, which
    turns forkd router's --hub on, under the prefix z2jh-values.yaml's service is reached at."""
    from forkd_server.hub import hub_settings, managed_by_hub, missing_environment

    dep = hub_router()
    validate(dep)
    c = container(dep)
    env = {e["name"]: e.get("value", "from a Secret") for e in c["env"]}
    assert env["HOME"] == "/home/forkd"  # the base's env is kept
    assert managed_by_hub(env) and missing_environment(env) == []
    (name,) = load("z2jh-values.yaml")[0]["hub"]["services"]
    assert env["JUPYTERHUB_SERVICE_NAME"] == name
    assert hub_settings(env) == {"base_url": f"/services/{name}/"}  # listens where --host/--port say
    (token,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "JUPYTERHUB_API_TOKEN"]
    assert token == {"name": "forkd-hub-service", "key": "api-token"}  # the docs' command makes it
    # the Hub's API: the chart's Service `hub` on its port, which the values let the router reach
    api = urlsplit(env["JUPYTERHUB_API_URL"])
    assert api.hostname.split(".")[0] == "hub" and api.hostname.endswith(".svc.cluster.local") and api.path == "/hub/api"
    (rule,) = load("z2jh-values.yaml")[0]["hub"]["networkPolicy"]["ingress"]
    assert rule["ports"] == [{"port": api.port, "protocol": "TCP"}]
    (source,) = rule["from"]
    assert labels_match(source["podSelector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": load("kustomization.yaml")[0]["namespace"]}
    validate({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "hub"},
              "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [rule]}})


def test_the_z2jh_values_point_the_hubs_service_and_the_user_servers_at_the_router():
    from traitlets.config import Config

    objs = objects()
    namespace = load("kustomization.yaml")[0]["namespace"]
    values = load("z2jh-values.yaml")[0]
    (name, service), = values["hub"]["services"].items()
    assert "command" not in service and "apiToken" not in service  # run apart; the chart makes the token
    router_svc = objs[("Service", "forkd")]
    url = urlsplit(service["url"])
    assert url.hostname == f"{router_svc['metadata']['name']}.{namespace}.svc.cluster.local"
    assert url.port == router_svc["spec"]["ports"][0]["port"] and url.path == ""
    # user servers: straight to that Service, under the service's prefix
    forkd_url = values["singleuser"]["extraEnv"]["FORKD_URL"]
    assert forkd_url == f"{service['url']}/services/{name}"
    # users and their servers' tokens may call the service
    scope = f"access:services!service={name}"
    assert scope in values["hub"]["loadRoles"]["user"]["scopes"] and "self" in values["hub"]["loadRoles"]["user"]["scopes"]
    assert scope in values["hub"]["config"]["KubeSpawner"]["server_token_scopes"]
    # the extra config, run as the chart runs it (after singleuser.extraEnv became the spawner's
    # environment): each server's FORKD_TOKEN is its own Hub token
    c = Config()
    c.KubeSpawner.environment = dict(values["singleuser"]["extraEnv"])
    for code in values["hub"]["extraConfig"].values():
        exec(compile(code, "extraConfig", "exec"), {"c": c})  # noqa: S102 - the snippet, as the chart runs it
    env = c.KubeSpawner.environment

    class Spawner:
        api_token = "token-of-alices-server"
    assert env["FORKD_URL"] == forkd_url and env["FORKD_TOKEN"](Spawner()) == "token-of-alices-server"
    # the egress rule lets user pods reach the router pods, on the router's port
    (rule,) = values["singleuser"]["networkPolicy"]["egress"]
    validate({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "singleuser"},
              "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [rule]}})
    router = objs[("Deployment", "forkd-router")]
    assert labels_match(rule["to"][0]["podSelector"]["matchLabels"], router["spec"]["template"]["metadata"]["labels"])
    assert rule["ports"][0]["port"] == url.port


def test_the_docs_show_the_values_as_shipped():
    """docs/deploy/jupyterhub.md's values.yaml block is z2jh-values.yaml (comments aside)."""
    with open(os.path.join(REPO, "docs", "deploy", "jupyterhub.md")) as f:
        text = f.read().split("## Kubernetes: zero-to-jupyterhub", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    assert yaml.safe_load(block) == load("z2jh-values.yaml")[0]


def test_the_sdk_reaches_the_service_under_its_prefix(monkeypatch):
    """What a user server's kernel makes of the values' FORKD_URL: calls under /services/forkd/v1."""
    from forkd_server.client import Controller

    monkeypatch.setenv("FORKD_URL", load("z2jh-values.yaml")[0]["singleuser"]["extraEnv"]["FORKD_URL"])
    monkeypatch.setenv("FORKD_TOKEN", "t" * 20)
    req = Controller().request("GET", "/v1/sandboxes")
    assert (req.url, req.target) == ("http://forkd.forkd.svc.cluster.local:8890/services/forkd/v1/sandboxes",
                                     "/services/forkd/v1/sandboxes")


@pytest.mark.skipif(not Z2JH_CHART, reason="set FORKD_TEST_Z2JH_CHART to a zero-to-jupyterhub chart directory "
                                           "(its values.yaml and values.schema.json); the chart is not on PyPI or npm")
@pytest.mark.parametrize("name", sorted(n for n in NOT_OBJECTS if n.startswith("z2jh")))
def test_the_values_pass_the_charts_own_schema(name):
    """As helm does before rendering: the chart's defaults with the snippet merged in, against the
    chart's values schema."""
    import jsonschema

    def merge(a: dict, b: dict) -> dict:
        out = copy.deepcopy(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    schema_path = next(p for p in (os.path.join(Z2JH_CHART, f"values.schema.{e}") for e in ("json", "yaml"))
                       if os.path.exists(p))
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    with open(os.path.join(Z2JH_CHART, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    validator = jsonschema.Draft7Validator(schema)
    assert [e.message for e in validator.iter_errors(merge(defaults, load(name)[0]))] == []
    misspelt = merge(defaults, {"hub": {"networkPolicy": {"ingres": []}}})  # the check can fail
    assert list(validator.iter_errors(misspelt))


# --- the image --------------------------------------------------------------------------------

def test_the_dockerfile_installs_what_the_engines_need():
    from forkd_server.host_packages import GROUPS

    with open(os.path.join(REPO, "deploy", "Dockerfile")) as f:
        text = f.read()
    final = text.rsplit("\nFROM ", 1)[1]  # the image's stage, not the wheel's
    installed = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", " ".join(re.findall(r"apt-get install ([^&]*)", final))))
    for group in ("process", "vm"):
        for package, _probe, _why in GROUPS[group]:
            assert package in installed, f"the image lacks {package} ({group})"
    for source in re.findall(r"^COPY (?!--from)(\S+) ", final, re.M):
        assert os.path.exists(os.path.join(REPO, source)), source
    assert "forkd-entrypoint" in final.rsplit("ENTRYPOINT", 1)[1]


def _cgroup2_root() -> str | None:
    for path in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if os.path.exists(os.path.join(path, "cgroup.controllers")):
            return path
    return None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_the_entrypoint_nests_the_containers_cgroup(tmp_path):
    """Under cgroup v2 with a cgroup namespace of its own, the entrypoint moves the container's
    processes into a child group and hands the controllers down, so forkd's groups can take them.
    Run for real: a group of this test's own, made the root of a new cgroup namespace."""
    v2 = _cgroup2_root()
    if v2 is None:
        pytest.skip("no cgroup v2 hierarchy on this host")
    with open(os.path.join(v2, "cgroup.controllers")) as f:
        controllers = f.read().split()
    with open(os.path.join(v2, "cgroup.subtree_control")) as f:
        handed = f.read().split()
    group = os.path.join(v2, f"forkd-entrypoint-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    # join the group, take a cgroup namespace rooted there, mount it where a container sees its
    # own, run the entrypoint, and report what the command it runs sees
    steps = {
        "join.sh": f"echo $$ > {group}/cgroup.procs\nexec unshare --cgroup --fork sh {tmp_path}/container.sh\n",
        "container.sh": f"mount -t cgroup2 none /sys/fs/cgroup\nexec sh {REPO}/deploy/forkd-entrypoint.sh sh {tmp_path}/report.sh\n",
        "report.sh": "cat /proc/self/cgroup\necho controllers: $(cat /sys/fs/cgroup/cgroup.subtree_control)\n",
    }
    for name, text in steps.items():
        (tmp_path / name).write_text(text)
    try:
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork", "sh", str(tmp_path / "join.sh")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "0::/init" in out.stdout.splitlines(), out.stdout
        given = out.stdout.split("controllers:", 1)[1].split()
        assert set(given) == {c for c in controllers if c in handed}, (given, controllers, handed)
        assert os.path.isdir(os.path.join(group, "init"))
    finally:
        for path in (os.path.join(group, "init"), group):
            if os.path.isdir(path):
                os.rmdir(path)  # empty: the test's processes have exited
