"""The shipped cluster configs start nodes the way the code expects: every `raykv`
command in them parses with the real CLI, the namespace is raykv's, each node installs
Mooncake's libraries and raykv, and every pod has a memory-backed /dev/shm."""

import shlex
from pathlib import Path

import click
import pytest
import yaml
from raykv.clusters.cli import main as raykv_cli
from raykv.controllers import NAMESPACE

CONFIGS = Path(__file__).parents[2] / "clusters" / "configs"


def raykv_commands(text: str) -> list[list[str]]:
    """Every `raykv ...` invocation in a shell string."""
    found = []
    for part in text.replace("&&", ";").replace("\n", " ").split(";"):
        words = shlex.split(part)
        if words and words[0] == "raykv":
            found.append(words[1:])
    return found


def check_raykv_up(commands: list[list[str]]) -> None:
    ups = [c for c in commands if c and c[0] == "up"]
    assert len(ups) == 1, commands
    ctx = raykv_cli.make_context("raykv", list(ups[0]))  # raises on an unknown option
    sub = raykv_cli.get_command(ctx, "up")
    params = sub.make_context("up", ups[0][1:]).params
    assert params["namespace"] == NAMESPACE
    assert params["address"] == "auto"


CPU_TORCH_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def check_installs(commands: str, clone: str) -> None:
    """The shell ``commands`` install torch's CPU build before raykv (a bare torch
    requirement pulls the multi-GB CUDA build) and constrain every pip install to the
    clone's ``constraints.txt`` (the verified versions)."""
    pips = [part.strip() for part in commands.replace("&&", ";").replace("\n", ";").split(";")
            if part.strip().startswith("pip install")]
    assert pips, commands
    assert all(" -c " in p and f"{clone}/constraints.txt" in p for p in pips), pips
    torch = next(i for i, p in enumerate(pips) if " torch " in f"{p} ")
    raykv = next(i for i, p in enumerate(pips) if "raykv[cpu]" in p)
    assert torch < raykv and CPU_TORCH_INDEX in pips[torch], pips


def test_check_installs_catches_a_raykv_install_without_cpu_torch_or_constraints():
    """CONTROL for the config tests' install check (the shipped configs' old command)."""
    with pytest.raises(StopIteration):
        check_installs("pip install -c x/constraints.txt 'x/raykv[cpu]'", "x")
    with pytest.raises(AssertionError):
        check_installs(f"pip install torch {CPU_TORCH_INDEX} && pip install 'x/raykv[cpu]'", "x")


def test_no_config_recommends_the_unverified_gpu_extra():
    for name in ("ray-autoscaler.yaml", "kuberay-raycluster.yaml"):
        text = " ".join((CONFIGS / name).read_text().replace("#", " ").split())
        assert "raykv[gpu]" not in text and "not verified" in text, name


def test_autoscaler_yaml():
    cfg = yaml.safe_load((CONFIGS / "ray-autoscaler.yaml").read_text())
    setup = " ".join(cfg["setup_commands"])
    assert "libibverbs1" in setup and "librdmacm1" in setup and "raykv[cpu]" in setup
    check_installs(";".join(cfg["setup_commands"]), "$HOME/raykv")
    head = cfg["head_start_ray_commands"]
    assert any(c.startswith("ray start --head --port=6379") for c in head)
    check_raykv_up([c for line in head for c in raykv_commands(line)])
    workers = cfg["worker_start_ray_commands"]
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in workers)
    assert not any("raykv" in c for c in workers), \
        "workers get their node actor from the reconciler, not from a command"
    assert cfg["head_node_type"] in cfg["available_node_types"]


def test_kuberay_manifest():
    rc = yaml.safe_load((CONFIGS / "kuberay-raycluster.yaml").read_text())
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    groups = [head] + [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]
    for pod in groups:
        (container,) = pod["containers"]
        start = " ".join(container["args"])
        assert "libibverbs1" in start and "raykv[cpu]" in start
        check_installs(start, "/home/ray/raykv")
        assert "$KUBERAY_GEN_RAY_START_CMD" in start
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
        assert shm["emptyDir"]["medium"] == "Memory"
    hook = " ".join(head["containers"][0]["lifecycle"]["postStart"]["exec"]["command"])
    check_raykv_up(raykv_commands(hook))
    for g in rc["spec"]["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        # a deleted worker pod drains: `ray start --block` gets SIGTERM (exec'd, not the
        # shell's child), and Ray's drain deadline ends before Kubernetes kills the pod
        pod = g["template"]["spec"]
        (worker,) = pod["containers"]
        assert "exec $KUBERAY_GEN_RAY_START_CMD" in " ".join(worker["args"])
        env = {e["name"]: e["value"] for e in worker["env"]}
        drain_s = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert 0 < drain_s < pod["terminationGracePeriodSeconds"]
        assert "raykv" not in " ".join(g["template"]["spec"]["containers"][0]["args"]).replace(
            "raykv[cpu]", "").replace("/home/ray/raykv/constraints.txt", "")


@pytest.mark.parametrize("name", ["ray-autoscaler.yaml", "kuberay-raycluster.yaml"])
def test_commented_transport_examples_parse(name):
    """Every `raykv up` example in each config's comments (RDMA, tenant quotas) is one
    the CLI accepts, and one of them picks RDMA devices."""
    lines = [line.lstrip("# ").strip() for line in (CONFIGS / name).read_text().splitlines()
             if line.lstrip().startswith("#") and "raykv up " in line]
    commands = [c for line in lines for c in raykv_commands(line)]
    for command in commands:
        check_raykv_up([command])
    assert any("--protocol=rdma" in c and any(w.startswith("--rdma-devices=") for w in c)
               for c in commands)


def test_sizes_in_configs_parse():
    from raykv.clusters.cli import parse_size

    assert parse_size("16GB") == 16 << 30 and parse_size("512M") == 512 << 20
    try:
        parse_size("lots")
    except click.BadParameter as e:
        assert "not a size" in str(e)
    else:
        raise AssertionError("parse_size accepted 'lots'")


def network_policy_admits(policy: dict, pod_labels: dict) -> bool:
    """Whether ``policy`` lets a pod labelled ``pod_labels`` in (same namespace)."""
    return any(all(pod_labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
               for rule in policy["spec"]["ingress"] for peer in rule["from"]
               if set(peer) == {"podSelector"})


def test_network_policy_keeps_other_clusters_off_the_raycluster():
    """The shipped NetworkPolicy (the recipe docs/deploy.md gives for keeping another
    party's code off Mooncake's ports) selects every pod of the shipped RayCluster and
    admits its own pods only; deploy.md quotes it as shipped."""
    rc = yaml.safe_load((CONFIGS / "kuberay-raycluster.yaml").read_text())
    text = (CONFIGS / "kuberay-networkpolicy.yaml").read_text()
    policy = yaml.safe_load(text)
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    own = {"ray.io/cluster": rc["metadata"]["name"]}   # KubeRay's label on every pod
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    assert network_policy_admits(policy, own)
    # CONTROL: a pod of another RayCluster (another party's engines) is not admitted
    assert not network_policy_admits(policy, {"ray.io/cluster": "other"})
    deploy = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    quoted = deploy.split("kuberay-networkpolicy.yaml", 1)[1].split("```yaml", 1)[1]
    assert yaml.safe_load(quoted.split("```", 1)[0]) == policy
