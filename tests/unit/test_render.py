"""`psgrad k8s` and `psgrad slurm`: rendered text equals the golden files, parses back, and runs `psgrad run` right."""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from psgrad.cli.main import main
from psgrad.errors import ConfigError
from psgrad.launch.env import resolve
from psgrad.launch.k8s import K8sJob, manifests, to_yaml
from psgrad.launch.slurm import SlurmJob

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(REPO) / "tests" / "golden"
JOB = ["--", "--task", "digits", "--mode", "sync", "--steps", "1000", "--lr", "0.1"]
CKPT = ["--checkpoint-dir", "/shared/ckpt", "--checkpoint-every-versions", "100"]
K8S = ["k8s", "--name", "digits", "--image", "ghcr.io/example/psgrad:0.1.0", "--num-servers", "2", "--num-workers", "3"]
SLURM = ["slurm", "--name", "digits", "--num-servers", "2", "--num-workers", "4"]
CASES = {
    "k8s-jobset.yaml": [*K8S, "--worker-cpu", "2", "--worker-memory", "4Gi", *JOB],
    "k8s-jobs.yaml": [*K8S, "--format", "jobs", "--namespace", "ml", "--worker-gpus", "1", "--tls-secret", "digits-tls",
                      *JOB],
    "slurm-multiprog.sbatch": [*SLURM, "--partition", "gpu", "--worker-gpus", "1", *JOB, *CKPT],
    "slurm-het.sbatch": [*SLURM, "--het", "--worker-cpus", "4", "--time", "2:00:00", "--psgrad",
                         "/shared/venv/bin/psgrad", "--tls-dir", "/shared/digits-tls", *JOB, *CKPT],
}


def render(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


# --------------------------------------------------------------------------- a reader for the YAML we write
def _scalar(text: str) -> Any:
    if text.startswith('"') or text.startswith("[") or text.startswith("{"):
        return json.loads(text)
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    """Parse the block of lines[i:] at `indent`; returns (value, next line)."""
    if lines[i][1].startswith("- "):
        items: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            rest = lines[i][1][2:]
            if ":" in rest and not rest.startswith('"'):  # a mapping item: its first key is on the dash line
                value, i = _block([*lines[:i], (indent + 2, rest), *lines[i + 1:]], i, indent + 2)
                items.append(value)
            else:
                items.append(_scalar(rest))
                i += 1
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        key, _, value = lines[i][1].partition(":")
        if value.strip():
            mapping[key] = _scalar(value.strip())
            i += 1
        else:
            mapping[key], i = _block(lines, i + 1, lines[i + 1][0])
    return mapping, i


def read_yaml(text: str) -> list[Any]:
    docs = []
    for doc in text.split("---\n"):
        lines = [(len(line) - len(line.lstrip(" ")), line.strip()) for line in doc.splitlines() if line.strip()]
        value, end = _block(lines, 0, 0)
        assert end == len(lines), f"unparsed line {lines[end]}"
        docs.append(value)
    return docs


# --------------------------------------------------------------------------- golden files
@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_files_equal_the_golden_ones(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert render(CASES[name], capsys) == (GOLDEN / name).read_text(), (
        f"{name} changed: if on purpose, write it again with `psgrad {shlex.join(CASES[name])} --out tests/golden/{name}`"
    )


@pytest.mark.parametrize("name", ["k8s-jobset.yaml", "k8s-jobs.yaml"])
def test_manifests_parse_back_to_the_objects(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    docs = read_yaml((GOLDEN / name).read_text())
    as_json = json.loads(render([*CASES[name][:-len(JOB)], "--output-format", "json", *JOB], capsys))
    assert docs == as_json
    assert [d["kind"] for d in docs] == (["JobSet"] if "jobset" in name else ["Service", "Job", "Job"])


@pytest.mark.parametrize("name", ["k8s-jobset.yaml", "k8s-jobs.yaml"])
def test_resource_quantities_are_quoted_strings(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """cpu, memory and nvidia.com/gpu are Kubernetes quantities: strings, as `kubectl` writes them
    (`nvidia.com/gpu: 1` was an int)."""
    text = render(CASES[name], capsys)
    assert "nvidia.com/gpu: 1" not in text
    for doc in read_yaml(text):
        for spec in _job_specs(doc):
            resources = spec["template"]["spec"]["containers"][0]["resources"]
            values = {**resources["requests"], **resources["limits"]}
            assert values and all(isinstance(v, str) for v in values.values()), values
    if name == "k8s-jobs.yaml":
        assert '              nvidia.com/gpu: "1"' in text.splitlines()


def _job_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The Job specs in one manifest (a JobSet's replicated Jobs, a Job, or none)."""
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"] for rj in doc["spec"]["replicatedJobs"]]
    return [doc["spec"]] if doc["kind"] == "Job" else []


def _commands(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """role -> the container command of its pods."""
    jobs = [rj["template"]["spec"] for rj in docs[0]["spec"]["replicatedJobs"]] if docs[0]["kind"] == "JobSet" \
        else [d["spec"] for d in docs if d["kind"] == "Job"]
    out = {}
    for spec in jobs:
        pod = spec["template"]
        out[pod["metadata"]["labels"]["psgrad/role"]] = pod["spec"]["containers"][0]["command"]
    return out


@pytest.mark.parametrize("name", ["k8s-jobset.yaml", "k8s-jobs.yaml"])
def test_the_pods_commands_resolve_to_the_job(name: str) -> None:
    """Each pod's `psgrad run` flags, with the index Kubernetes sets, give the right role and addresses."""
    from psgrad.cli.parser import build_parser
    from psgrad.cli.run import run_options

    docs = read_yaml((GOLDEN / name).read_text())
    commands = _commands(docs)
    middle = "server-0" if "jobset" in name else "server"
    for role, count in (("server", 2), ("worker", 3)):
        assert commands[role][:2] == ["psgrad", "run"]
        ns = build_parser().parse_args(commands[role][1:])
        if name == "k8s-jobs.yaml":  # --tls-secret: the Secret's files, mounted where the flags name them
            assert (ns.tls_cert, ns.tls_worker_cert, ns.tls_server_name, ns.insecure) == (
                "/etc/psgrad/tls/server.pem", "/etc/psgrad/tls/worker-{rank}.pem", "psgrad-server", False)
            pod = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == f"digits-{role}")
            spec = pod["spec"]["template"]["spec"]
            assert spec["volumes"][0]["secret"]["secretName"] == "digits-tls"
            assert spec["containers"][0]["volumeMounts"][0]["mountPath"] == "/etc/psgrad/tls"
            assert "readinessProbe" not in spec["containers"][0]  # the kubelet's gRPC probe has no TLS
        else:  # plaintext, said so: `psgrad run` binds every interface
            assert ns.insecure and ns.tls_cert is None
        for index in range(count):
            got = resolve({"JOB_COMPLETION_INDEX": str(index)}, run_options(ns), ns.engine)
            assert (got.kind, got.index, got.num_servers, got.num_workers) == (role, index, 2, 3)
            if role == "worker":
                assert got.servers == tuple(f"digits-{middle}-{i}.digits:7070" for i in range(2))


def test_slurm_conf_lines_resolve_to_the_job() -> None:
    """The multi-prog conf's command for each task range, with that task's SLURM variables, gives its role."""
    from psgrad.cli.parser import build_parser
    from psgrad.cli.run import run_options

    text = (GOLDEN / "slurm-multiprog.sbatch").read_text()
    conf = text.split("<<'EOF'\n")[1].split("EOF\n")[0].splitlines()
    assert [line.split()[0] for line in conf] == ["0-1", "2-5"]
    env = {"SLURM_NTASKS": "6", "SLURM_STEP_NODELIST": "gpu[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    for line in conf:
        first, last = (int(x) for x in line.split()[0].split("-"))
        ns = build_parser().parse_args(shlex.split(line)[2:])
        for task in range(first, last + 1):
            got = resolve({**env, "SLURM_PROCID": str(task)}, run_options(ns), ns.engine)
            assert got.servers == ("gpu1:7070", "gpu1:7071") and got.num_workers == 4
            assert (got.kind, got.index) == (("server", task) if task < 2 else ("worker", task - 2))


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "argv, words",
    [
        ([*K8S, "--", "--role", "server"], ["--role", "rendered files"]),
        ([*K8S, "--", "--stepz", "3"], ["--stepz"]),
        ([*K8S, "--", "--mode", "async", "--staleness", "2"], ["staleness"]),
        ([*SLURM, "--", "--task", "nope"], ["unknown task 'nope'"]),
        ([*SLURM, "--time", "soon"], ["--time"]),
        (["k8s", "--name", "Digits_1", "--image", "x", "--num-servers", "1", "--num-workers", "1"], ["--name"]),
    ],
)
def test_bad_render_input_is_a_usage_error(argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_config_objects_validate() -> None:
    with pytest.raises(ConfigError, match="--server-cpu"):
        K8sJob(name="a", image="i", num_servers=1, num_workers=1, server_cpu="lots")
    with pytest.raises(ConfigError, match="%"):
        SlurmJob(name="a", num_servers=1, num_workers=1, job_args=("--metrics-dir", "m%t"))
    with pytest.raises(ConfigError, match="--port-base"):
        SlurmJob(name="a", num_servers=3, num_workers=1, port_base=65534)
    assert to_yaml([{"a": "yes", "b": "on", "c": "1.5", "d": [], "e": "x y"}]) == (
        'a: "yes"\nb: "on"\nc: "1.5"\nd: []\ne: "x y"\n')
    assert manifests(K8sJob(name="a", image="i", num_servers=1, num_workers=1))[0]["kind"] == "JobSet"
