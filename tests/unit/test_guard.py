"""The server's door, without a network: which caller may make which call as which rank (RULES,
permit), and the certificates `psgrad certs` writes."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from psgrad.core.credentials import ADMIN, SERVER, WORKER, Identity
from psgrad.errors import ConfigError, PermissionDeniedError
from psgrad.launch.certs import SERVER_NAME, write_job_certs
from psgrad.proto import ps_pb2 as pb
from psgrad.server.guard import RULES, permit

pytestmark = pytest.mark.timeout(60)

W0, W1, ADM, SRV = Identity(WORKER, 0), Identity(WORKER, 1), Identity(ADMIN), Identity(SERVER)


def request(method: str, rank: int, observe: bool = False) -> Any:
    """A request of `method` naming `rank` (for a client stream: its header)."""
    if method == "Init":
        return pb.InitHeader(join=pb.JoinRequest(rank=rank))
    if method in ("Push", "PushGated"):
        return pb.PushHeader(rank=rank)
    if method == "Step":
        return pb.StepRequest(push=pb.PushHeader(rank=rank))
    if method == "Pull":
        return pb.PullRequest(rank=rank, observe=observe)
    return {"Join": pb.JoinRequest, "Heartbeat": pb.HeartbeatRequest, "Leave": pb.LeaveRequest,
            "Rollback": pb.RollbackRequest}.get(method, lambda rank: None)(rank=rank)


def allowed(method: str, who: Identity, rank: int, observe: bool = False) -> bool:
    try:
        permit(method, RULES[method], who, request(method, rank, observe))
        return True
    except PermissionDeniedError:
        return False


WORKER_METHODS = ["Join", "Pull", "Push", "PushGated", "Step", "Heartbeat", "Leave", "Rollback"]


@pytest.mark.parametrize("method", WORKER_METHODS)
def test_a_worker_acts_only_as_its_own_rank(method: str) -> None:
    assert allowed(method, W1, 1)
    assert not allowed(method, W1, 0) and not allowed(method, W0, 1)
    assert not allowed(method, SRV, 1)
    assert not allowed(method, ADM, 0)  # (the admin's read-only pulls: below)


def test_only_the_chief_initializes_and_the_admin_only_reads() -> None:
    assert allowed("Init", W0, 0)
    assert not allowed("Init", W1, 1) and not allowed("Init", W1, 0) and not allowed("Init", ADM, 0)
    assert allowed("Pull", ADM, 0, observe=True) and allowed("Pull", ADM, 5, observe=True)
    assert not allowed("Pull", ADM, 0) and not allowed("Push", ADM, 0) and not allowed("Leave", ADM, 0)
    assert allowed("Pull", W1, 1, observe=True) and not allowed("Pull", W1, 0, observe=True)
    for who in (W0, W1, ADM):
        assert allowed("Status", who, 0)
    assert not allowed("Status", SRV, 0)


@pytest.mark.parametrize("method", ["ReplicaAttach", "ReplicaApply", "Fence"])
def test_only_servers_replicate(method: str) -> None:
    assert allowed(method, SRV, 0)
    for who in (W0, W1, ADM):
        assert not allowed(method, who, 0)
    with pytest.raises(PermissionDeniedError, match="for the job's servers; this credential is worker 0's"):
        permit(method, RULES[method], W0, None)


def test_every_method_of_the_service_has_a_rule() -> None:
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ParameterServer"].methods}
    assert methods == set(RULES)


def test_the_messages_name_the_credential() -> None:
    with pytest.raises(PermissionDeniedError, match="Push as worker rank 0 refused: this credential is worker 1's"):
        permit("Push", RULES["Push"], W1, request("Push", 0))
    with pytest.raises(PermissionDeniedError, match="only the chief"):
        permit("Init", RULES["Init"], W1, request("Init", 1))


def test_psgrad_certs_writes_a_job_ca_and_a_certificate_per_role(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    files = write_job_certs(tmp_path / "c", 2, ["node-1", "10.0.0.7"])
    names = sorted(p.name for p in files.directory.iterdir())
    assert names == ["admin.key", "admin.pem", "ca.pem", "server.key", "server.pem", "worker-0.key", "worker-0.pem",
                     "worker-1.key", "worker-1.pem"]
    for who in ("server", "admin", "worker-1"):
        cert, key = files.pair(who)
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        parsed = x509.load_pem_x509_certificate(cert.read_bytes())
        assert parsed.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"psgrad-{who}"
    server = x509.load_pem_x509_certificate(files.pair("server")[0].read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-1", SERVER_NAME]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    with pytest.raises(ConfigError, match="already holds"):
        write_job_certs(tmp_path / "c", 2)
