"""deploy/: the Kubernetes manifests are valid objects of the Kubernetes versions docs/deploy/kubernetes.md
names, checked offline against Kubernetes' own schemas (kubernetes-validate ships them: no network,
no cluster), and the pieces that must agree do: names, labels, ports, paths, forkd's own flags. The
host image's entrypoint is run for real in a cgroup namespace of its own."""

from __future__ import annotations

import copy
import glob
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
NOT_OBJECTS = {"kustomization.yaml", "jupyterhub-values.yaml"}  # a kustomize file, a Helm values file


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
    on_disk = sorted(os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml")))
    assert sorted(listed) == sorted(set(on_disk) - NOT_OBJECTS)


@pytest.mark.parametrize("name", sorted(set(os.listdir(K8S)) - NOT_OBJECTS))
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

def test_the_jupyterhub_values_reach_the_router():
    objs = objects()
    namespace = load("kustomization.yaml")[0]["namespace"]
    values = load("jupyterhub-values.yaml")[0]["singleuser"]
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
