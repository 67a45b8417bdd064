"""Server addresses (psgrad/core/addresses.py): the torch-free check a worker makes of its servers
before it imports torch, so that a wrong port is reported in about the refusal grace period."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, held_address, hold_port

from psgrad.config import REFUSED_GRACE_S
from psgrad.core.addresses import REFUSED, refusing_shard


@pytest.mark.timeout(30)
def test_a_shard_refuses_only_where_every_server_of_it_refuses() -> None:
    with hold_port() as held, socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        down = held_address(held)
        assert refusing_shard([up], 0.2) is None
        assert refusing_shard([f"{down}|{up}"], 0.2) is None  # the backup answers
        start = time.monotonic()
        found = refusing_shard([up, down], 0.3)
        assert found is not None and found[0] == down and 0.3 <= found[1] < 5
        assert time.monotonic() - start >= 0.3  # the grace period is waited (a server just starting)


# The worker's command line with torch made unimportable: it must answer before it would import it.
_NO_TORCH = """
import sys
sys.modules["torch"] = None
from psgrad.cli.main import main
sys.exit(main(["worker", "--servers", sys.argv[1], "--rank", "0", "--num-workers", "1", "--steps", "1"]))
"""


@pytest.mark.timeout(60)
def test_a_worker_reports_a_refused_port_before_it_imports_torch() -> None:
    """A fresh worker took 4.6-9.2 s to report a refused port, most of it importing torch; it now
    checks its servers first (0.3 CPU-s here, plus the grace period)."""
    with hold_port() as held:
        address = held_address(held)
        res = subprocess.run([sys.executable, "-c", _NO_TORCH, address], capture_output=True, text=True, timeout=50,
                             cwd=REPO)
    assert res.returncode == 1, res.stderr[-2000:]
    waited = re.search(rf"server {re.escape(address)} {re.escape(REFUSED)} for (\d+\.\d) s: the join request was not",
                       res.stderr)
    assert waited is not None and float(waited.group(1)) >= REFUSED_GRACE_S - 0.05, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_a_url_is_not_a_server_address() -> None:
    """(`--servers http://host:port` was taken for a host name and failed to resolve after seconds.)"""
    from psgrad.core.addresses import parse_address, parse_servers
    from psgrad.errors import ConfigError

    for text in ("http://127.0.0.1:7000", "grpc://h:1", "127.0.0.1:7000/", "h/x:7000"):
        with pytest.raises(ConfigError, match="without a scheme or a path"):
            parse_address(text)
    assert parse_servers("127.0.0.1:7000,[::1]:7001|h:2") == ("127.0.0.1:7000", "[::1]:7001|h:2")
