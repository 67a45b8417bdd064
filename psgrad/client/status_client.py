"""The shards' status without torch: one Status call per server (a first call: a refused connection
is reported after a short grace), for `psgrad status` (also --watch), which must start and exit
light (torch costs 1.6-1.9 s and 240 MB per call), and for export and the launchers."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from typing import Any

from psgrad.client import reconnect
from psgrad.config import ClientConfig
from psgrad.core.credentials import ADMIN
from psgrad.core.status import ShardStatus
from psgrad.errors import PsgradError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import serde
from psgrad.wire.protocol import CLIENT_CHANNEL_OPTIONS, METHOD_PREFIX
from psgrad.wire.security import client_channels


def credentials(client: ClientConfig | None) -> dict[str, Any]:
    """The credential fields of a client config (none: {}), to carry over into another one."""
    return {} if client is None else {"tls": client.tls, "auth": client.auth}


class StatusClient:
    """Status calls to one server (not a shard: a PRIMARY|BACKUP entry is two of these)."""

    def __init__(self, address: str, config: ClientConfig, role: str = ADMIN) -> None:
        """role: whose token to derive from config.auth's job secret (the admin's, by default)."""
        self.address = address
        self.config = config
        self._channel = client_channels(config, role)(address, CLIENT_CHANNEL_OPTIONS)
        self._status = self._channel.unary_unary(
            METHOD_PREFIX + "Status", pb.StatusRequest.SerializeToString, pb.StatusReply.FromString)

    def status(self, timeout_s: float, with_params: bool = False) -> pb.StatusReply:
        """The server's status (see reconnect.first_call for how long it waits, and the errors)."""
        req = pb.StatusRequest(with_params=with_params)

        def attempt(t: float, ready: bool) -> pb.StatusReply:
            reply: pb.StatusReply = self._status(req, timeout=t, wait_for_ready=ready)
            return reply

        return reconnect.first_call("the status request", attempt, timeout_s, self.address, self.config, self.diagnose)

    def diagnose(self) -> str:
        """After the call ran out of time: what a quick second status call finds."""
        return reconnect.diagnose(lambda t: self._status(pb.StatusRequest(), timeout=t), self._channel, self.address)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> StatusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shard_status(
    addresses: Sequence[str], timeout_s: float, with_params: bool = False, client: ClientConfig | None = None
) -> list[ShardStatus]:
    """Status of each shard (in the given order), every server asked concurrently; of a shard given
    as PRIMARY|BACKUP, the server that serves it (the primary, or the backup that took over).
    client: its credentials are used (the admin's token, from a job secret).

    Raises:
        PsgradError: no server of a shard answered (the first one's error).
    """
    config = ClientConfig(connect_timeout_s=timeout_s, rpc_timeout_s=timeout_s, reconnect_timeout_s=0,
                          **credentials(client))
    servers = [a for entry in addresses for a in entry.split("|")]
    clients = [StatusClient(a, config) for a in servers]

    def ask(c: StatusClient) -> ShardStatus | PsgradError:
        try:
            return serde.status_from_proto(c.status(timeout_s, with_params))
        except PsgradError as exc:
            return exc

    try:
        if len(clients) == 1:  # no pool (its threads would be waited for at exit: see cli/status.py fetch)
            answers = {servers[0]: ask(clients[0])}
        else:
            with futures.ThreadPoolExecutor(max_workers=len(clients)) as pool:
                answers = dict(zip(servers, pool.map(ask, clients)))
    finally:
        for c in clients:
            c.close()
    out = []
    for entry in addresses:
        got = [answers[a] for a in entry.split("|")]
        ok = [s for s in got if isinstance(s, ShardStatus)]
        if not ok:
            raise next(e for e in got if isinstance(e, PsgradError))
        out.append(next((s for s in ok if s.replica.role == "primary"), ok[0]))
    return out

