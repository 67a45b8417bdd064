"""Security end to end: attacks on a TLS + token server (each refused or harmless, the shard unchanged),
secured jobs training as before in every mode, the bind rule, and credential errors at the command line."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, Proc, child_env, cli_in_process as cli, run_benchmark, run_cli, spawn

pytestmark = pytest.mark.timeout(240)

FINAL = re.compile(r"^\[worker(\d)\] worker \d/2: final test_loss (\S+) test_accuracy (\S+)", re.M)


def test_every_attack_is_refused_or_harmless_and_leaves_the_shard_unchanged() -> None:
    doc = run_benchmark("attacks.py", timeout_s=180)
    rows = {(r["attack"], r["call"]): r for r in doc["rows"]}
    for row in doc["rows"]:
        assert row["code"] == row["expected"], row
        assert row["state_unchanged"], row
    assert doc["serves_after"]  # and the job goes on: worker 0's next step is applied
    expected = {
        "no credential (TLS, no client certificate, no token)": "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        "plaintext against the TLS port": "WRONG_VERSION_NUMBER",
        "another CA's certificate (another job's worker 0)": "unable to get local issuer certificate",
        "an expired certificate of the job's CA (worker 1)": "certificate has expired",
    }
    for attack, reason in expected.items():  # refused at the handshake, for the right reason
        assert reason in rows[(attack, "Status")]["message"]
    assert "no token" in rows[("the job's certificate without a token: read the weights", "Pull (observe)")]["message"]
    assert "another job" in rows[("another job's token (with worker 1's certificate)", "Push as rank 1")]["message"]
    assert "duplicate" in rows[("a replayed push (worker 1's last Step, sent again)", "Step")]["message"]
    assert len(doc["rows"]) >= 18



def _triple(res: subprocess.CompletedProcess[str]) -> tuple[int, str, str]:
    return res.returncode, res.stdout, res.stderr

@pytest.mark.slow
@pytest.mark.parametrize("mode, security", [("sync", "--tls"), ("async", "--tls"), ("ssp", "--tokens")])
def test_a_secured_job_trains_as_before(mode: str, security: str) -> None:
    job = ["launch", "--num-servers", "2", "--num-workers", "2", "--mode", mode, "--steps", "150", "--eval-every", "150"]
    res = run_cli([*job, security], timeout_s=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "mutual TLS" in res.stdout if security == "--tls" else "a token per worker" in res.stdout
    finals = {rank: (loss, float(acc)) for rank, loss, acc in FINAL.findall(res.stdout)}
    assert set(finals) == {"0", "1"}, res.stdout[-3000:]
    assert all(acc >= 0.85 for _, acc in finals.values()), finals
    versions = re.findall(r"^\s+\d+ 127\.0\.0\.1:\d+\s+\[\d+, \d+\)\s+(\d+)", res.stdout, re.M)
    assert versions == (["150", "150"] if mode == "sync" else ["300", "300"]), res.stdout  # the final status, as admin
    if mode == "sync":  # sync repeats bit for bit: the same job in plaintext ends with the same loss
        plain = run_cli(job, timeout_s=200)
        assert plain.returncode == 0
        assert {rank: (loss, float(acc)) for rank, loss, acc in FINAL.findall(plain.stdout)} == finals


def test_a_server_binds_beyond_loopback_only_with_tls_or_insecure(tmp_path: Path) -> None:
    res = run_cli(["server", "--host", "0.0.0.0", "--port", "0"], timeout_s=60)
    assert res.returncode == 2 and "--insecure" in res.stderr and "--tls-cert" in res.stderr
    proc = spawn(["server", "--host", "0.0.0.0", "--port", "0", "--insecure"])
    try:
        proc.wait_for_line("without TLS (--insecure): anyone who can reach it can read the weights")
        proc.wait_for_line("psgrad server listening on 0.0.0.0:")
    finally:
        assert proc.stop() == 0


@pytest.mark.slow
def test_credential_errors_say_which_credential_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server and the worker given another job's secret are real processes; the short commands
    that only read files and ask a status (certs, status, a worker refused before it connects) run
    the command line in this process."""
    assert cli(["certs", str(tmp_path / "c"), "--num-workers", "1"], capsys).returncode == 0
    c = tmp_path / "c"
    proc = spawn(["server", "--port", "0", "--job-secret-file", str(c / "job.secret")])
    try:
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
        code, _, err = _triple(cli(["status", "--servers", address], capsys))
        assert code == 1 and "no token: this server requires a token derived from the job secret" in err, err
        code, out, err = _triple(cli(["status", "--servers", address, "--job-secret-file", str(c / "job.secret")], capsys))
        assert code == 0 and "not initialized" in out, err  # the admin's token, over local credentials
        (tmp_path / "other").write_text("another job's secret, 32 bytes...")
        res = run_cli(["worker", "--servers", address, "--steps", "1", "--job-secret-file", str(tmp_path / "other")],
                      timeout_s=90)
        assert res.returncode == 1 and "not derived from this job's secret" in res.stderr
    finally:
        proc.stop()
    code, _, err = _triple(cli(["worker", "--servers", "127.0.0.1:1", "--tls-ca", str(tmp_path / "missing.pem")], capsys))
    assert code == 2 and "missing.pem" in err, err
    assert cli(["certs", str(c), "--num-workers", "1"], capsys).returncode == 2  # never overwrites a job's keys


def test_a_server_says_why_a_peers_handshake_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server's console keeps gRPC's own lines (the CLI mutes them for client commands only):
    they are the only record of why a peer's TLS handshake failed, which the client's message
    points to."""
    import sys

    assert cli(["certs", str(tmp_path / "c"), "--num-workers", "1"], capsys).returncode == 0
    c = tmp_path / "c"
    env = {k: v for k, v in child_env().items() if k != "GRPC_VERBOSITY"}  # (as a user's shell)
    # a cold interpreter: it reads GRPC_VERBOSITY as it imports grpc (the tests' template has)
    proc = Proc([sys.executable, "-m", "psgrad", "server", "--port", "0", "--tls-cert", str(c / "server.pem"),
                 "--tls-key", str(c / "server.key"), "--tls-ca", str(c / "ca.pem"),
                 "--job-secret-file", str(c / "job.secret")],
                name="server", cwd=REPO, new_session=False, env=env, preload=False)
    try:
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
        started = time.monotonic()
        res = cli(["status", "--servers", address, "--timeout-s", "60"], capsys)  # plaintext against TLS
        assert res.returncode == 1 and "The server logs why" in res.stderr, res.stderr
        # The server closed the connection at once, an answer: reported after the short grace a
        # refused connection gets, not at the end of the call's timeout (60 s).
        assert time.monotonic() - started < 30, f"reported after {time.monotonic() - started:.0f} s"
        assert "WRONG_VERSION_NUMBER" in proc.wait_for_line("Handshake failed")
    finally:
        proc.stop()


@pytest.mark.slow
def test_the_cost_benchmark_measures_every_side() -> None:
    out = run_benchmark("feature_cost.py", "--feature", "tls", "--preset", "tiny", timeout_s=180)
    assert out["payload_mb"] == pytest.approx(4.0)
    assert set(out["median"]["step_s"]) == {"plain", "tokens", "tls"}
    for name in ("push_throughput_ratio_tls_plain", "pull_throughput_ratio_tls_plain", "step_latency_ratio_tls_plain",
                 "step_latency_ratio_tokens_plain"):
        assert out[name] > 0
    assert all(len(v) == 2 for v in out["per_round"].values())  # rounds measured, warm-up left out
