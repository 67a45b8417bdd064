"""Who a caller is: tokens derived from the job secret, roles in certificates, the bind rule, and the
flags that carry credentials (secrets from files and the environment only)."""
from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from psgrad.cli.parser import build_parser
from psgrad.cli.security import auth_config, tls_config
from psgrad.config import AuthConfig, ServerConfig, TlsConfig
from psgrad.core.credentials import (
    ADMIN,
    SERVER,
    WORKER,
    Identity,
    check_bind,
    check_secret,
    derive_token,
    is_loopback,
    parse_role,
    role_of_common_name,
    verify_token,
    worker_role,
)
from psgrad.errors import ConfigError
from psgrad.launch import jobkeys

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def test_a_token_proves_its_role_in_its_job_and_nothing_else() -> None:
    t1 = derive_token(SECRET, worker_role(1))
    assert t1.startswith("psgrad1:worker-1:") and t1 == derive_token(SECRET + b"\n", "worker-1")  # a file's newline
    assert verify_token(SECRET, t1) == Identity(WORKER, 1)
    assert verify_token(SECRET, derive_token(SECRET, ADMIN)) == Identity(ADMIN)
    assert verify_token(SECRET, derive_token(SECRET, SERVER)) == Identity(SERVER)
    assert len({derive_token(SECRET, r) for r in ("worker-0", "worker-1", "admin", "server")}) == 4
    # another job's token, a token whose role was edited, and garbage are refused, saying why
    assert "another job" in str(verify_token(OTHER, t1))
    forged = t1.replace("worker-1", "worker-0")
    assert "not derived from this job's secret" in str(verify_token(SECRET, forged))
    for bad in ("", "psgrad1:worker-1:", "psgrad2:worker-1:ab", "psgrad1:root:ab", "x" * 500):
        assert isinstance(verify_token(SECRET, bad), str)


def test_roles_and_certificate_names() -> None:
    assert parse_role("worker-12") == Identity(WORKER, 12) and parse_role("admin") == Identity(ADMIN)
    for bad in ("worker--1", "worker-01", "worker-", "Admin", "servers", "worker-1 "):
        assert parse_role(bad) is None
    assert role_of_common_name("psgrad-worker-3") == Identity(WORKER, 3)
    assert role_of_common_name("psgrad-server") == Identity(SERVER)
    assert role_of_common_name("worker-3") is None and role_of_common_name("psgrad-root") is None
    assert Identity(WORKER, 2).describe() == "worker 2" and Identity(ADMIN).role == "admin"
    with pytest.raises(ConfigError, match="at least 16"):
        check_secret(b"short\n")
    with pytest.raises(ConfigError, match="no such role"):
        derive_token(SECRET, "root")


@pytest.mark.parametrize(
    "host, tls, insecure, secret, problem",
    [
        ("127.0.0.1", False, False, True, None),
        ("::1", False, False, False, None),
        ("localhost", False, False, True, None),
        ("0.0.0.0", True, False, True, None),
        ("0.0.0.0", False, True, False, None),
        ("0.0.0.0", False, False, False, "--insecure"),
        ("10.1.2.3", False, False, False, "--tls-cert"),
        ("node-7", False, False, False, "--insecure"),  # names other than localhost count as not loopback
        ("0.0.0.0", False, True, True, "job secret without TLS"),
    ],
)
def test_the_bind_rule(host: str, tls: bool, insecure: bool, secret: bool, problem: str | None) -> None:
    if problem is None:
        check_bind(host, tls, insecure, secret)
    else:
        with pytest.raises(ConfigError, match=problem):
            check_bind(host, tls, insecure, secret)
    assert is_loopback("127.9.9.9") and is_loopback("[::1]") and not is_loopback("0.0.0.0")


def test_a_server_config_checks_it_and_hides_its_secret() -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        ServerConfig(host="0.0.0.0")
    config = ServerConfig(auth=AuthConfig(secret=SECRET))
    assert "0123" not in repr(config)
    with pytest.raises(ConfigError, match="go together"):
        TlsConfig(cert=__file__)
    with pytest.raises(ConfigError, match="is not a file"):
        TlsConfig(ca="/no/such/ca.pem")


def test_a_certificate_and_a_key_that_do_not_belong_together_are_named(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """gRPC only logs a mismatched pair, and a server then failed to bind as if its port were taken:
    the pair is checked where the flags are read, naming both files (a usage error, before binding)."""
    from psgrad.cli.main import main
    from psgrad.launch.certs import write_job_certs

    files = write_job_certs(tmp_path / "job", 1, ["psgrad-server"])
    cert, key = (str(p) for p in files.pair("server"))
    other_key = str(files.pair("worker-0")[1])
    assert TlsConfig(cert=cert, key=key).key == key
    for c, k in ((cert, other_key), (key, cert)):  # another certificate's key; the two swapped
        with pytest.raises(ConfigError, match="are not a certificate and its private key"):
            TlsConfig(cert=c, key=k)
    assert main(["server", "--port", "0", "--tls-cert", cert, "--tls-key", other_key]) == 2
    err = capsys.readouterr().err
    assert f"--tls-key {other_key!r} are not a certificate and its private key" in err and "bind" not in err
    assert err.startswith("usage: psgrad server [flags] (psgrad server --help: every flag)\n")
    assert main(["certs", str(tmp_path / "again"), "--num-workers", "1", "--names", "psgrad-server,node-1"]) == 0
    assert "(valid for psgrad-server, node-1)" in capsys.readouterr().out  # (each name once)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_secrets_come_from_files_or_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "s"
    secret.write_bytes(SECRET + b"\n")
    ns = _parse("worker", "--servers", "127.0.0.1:1", "--job-secret-file", str(secret))
    assert auth_config(ns, {}, client=True).secret == SECRET
    ns = _parse("worker", "--servers", "127.0.0.1:1")
    assert auth_config(ns, {"PSGRAD_JOB_SECRET": SECRET.decode()}, client=True).secret == SECRET
    assert auth_config(ns, {"PSGRAD_TOKEN": " t \n"}, client=True).token == "t"
    assert auth_config(ns, {"PSGRAD_TOKEN": "t"}, client=False).token is None  # servers take no token
    with pytest.raises(ConfigError, match="--job-secret-file"):
        auth_config(_parse("worker", "--servers", "127.0.0.1:1", "--job-secret-file", "/no/such"), {}, client=True)
    short = tmp_path / "short.secret"
    short.write_bytes(b"tooshort\n")  # (the message named no file: which one is short?)
    with pytest.raises(ConfigError) as info:
        auth_config(_parse("server", "--job-secret-file", str(short)), {}, client=False)
    assert str(info.value) == (f"the job secret in --job-secret-file {str(short)!r} has 8 bytes; use at least 16 random "
                               "ones, e.g. `head -c 32 /dev/urandom | base64 > job.secret`")
    with pytest.raises(ConfigError, match=r"^the job secret in \$PSGRAD_JOB_SECRET has 5 bytes"):
        auth_config(ns, {"PSGRAD_JOB_SECRET": "short"}, client=True)
    # no flag of any command takes a secret or token itself (`ps` would show it)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    named = {"--job-secret-file", "--token-file", "--tokens", "--tls-secret"}  # files, a switch, a Secret's name
    assert {f for f in flags if "secret" in f or "token" in f} == named


def test_run_gives_each_worker_its_own_certificate(tmp_path: Path) -> None:
    from psgrad.launch.certs import write_job_certs

    files = write_job_certs(tmp_path, 1, ["psgrad-server"])
    cert, key = (str(p) for p in files.pair("server"))
    ca = str(files.ca)
    ns = _parse("run", "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                "--tls-worker-cert", "/c/worker-{rank}.pem", "--tls-worker-key", "/c/worker-{rank}.key")
    server = tls_config(ns, client=False)
    assert server is not None and (server.cert, server.ca) == (cert, ca)
    with pytest.raises(ConfigError, match="worker-3.pem"):  # rank 3's file, which does not exist here
        tls_config(ns, client=True, rank=3)
    plain = _parse("run", "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca)
    server = tls_config(plain, client=False)
    assert server is not None and server.ca is None  # no worker certificates: none required
    client = tls_config(plain, client=True, rank=0)
    assert client is not None and (client.ca, client.cert) == (ca, None)  # TLS servers: TLS workers


def test_a_launched_job_hands_each_worker_its_token_and_never_the_secret(tmp_path: Path) -> None:
    assert jobkeys.create("off", 2) is None
    keys = jobkeys.create("tokens", 2, parent=str(tmp_path))
    assert keys is not None
    try:
        assert stat.S_IMODE(os.stat(keys.directory).st_mode) == 0o700
        token = (keys.directory / "worker-1.token").read_text().strip()
        assert verify_token(keys.secret, token) == Identity(WORKER, 1)
        argv = keys.worker_argv(1)
        assert argv == ["--token-file", str(keys.directory / "worker-1.token")]
        assert keys.secret.decode() not in " ".join([*argv, *keys.server_argv()])
        assert keys.admin().auth.secret == keys.secret and keys.admin().tls is None
    finally:
        keys.remove()
    assert not keys.directory.exists()
    assert jobkeys.cluster_argv(None, ()) == ["--insecure"]
    assert jobkeys.cluster_argv(None, ("--tls-cert", "x")) == []
    assert "/d/worker-{rank}.pem" in jobkeys.cluster_argv("/d/", ())
