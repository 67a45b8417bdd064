"""A multi-host test bed on one Linux machine: network namespaces as hosts, joined by one switch.

Each host is a network namespace with its own address (198.18.0.0/15, the range set aside for
network benchmarks, so no real network is ever addressed) and its own /dev/shm: a process started
on a host sees that host's private tmpfs there, so psgrad's same-host shared-memory path cannot
cross hosts by accident. Hosts are joined by veth pairs to a bridge in a namespace of its own (the
"switch"); the root namespace is never touched. Optional: every link shaped with `tc ... tbf` to a
rate (both directions; a token bucket of a few ms of line rate, at most 64 KB: see BURST_S), and a
host cut off from the others with nftables drops (`partition`), and a round-trip delay on every TCP
connection between two hosts (`rtt_ms`: this kernel has no netem, so a relay in each host, lib/
delay_relay.py, holds the bytes; nftables hands it the host's connections). `templates(hosts)` runs
a preloaded template (psgrad/launch/template.py) on hosts, so that their psgrad processes start as
forks of it instead of cold interpreters.

    with NetBed(3, rate_mbit=1000) as bed:
        server = subprocess.Popen(bed.command(0, ["python", "-m", "psgrad", "server", ...]))
        ...
        bed.partition(2)   # host 2 can reach nobody (and nobody it) until bed.heal(2)

Needs root, `ip` (iproute2), `tc` for rates and `nft` for partitions: `NetBed.unavailable()` says
which is missing so a test can skip with the reason. Everything created is removed on exit, even
after a failure; namespaces left by a killed run (their pid is gone) are removed by the next bed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from psgrad.launch.template import Template

PREFIX = "psgbed"
SUBNET = "198.18.0"  # host i is SUBNET.(i+1)/24
# The token bucket of a shaped link holds BURST_S of line rate, within [BURST_MIN, BURST_MAX] bytes:
# a real link's queue lets out at most a frame burst at line rate (a 64 KB TSO segment) before the
# rate holds. (It was 1 MB at every rate: at 100 Mbit/s 84 ms of line rate, more than a step's
# traffic, so the link capped only the average and a burst of a whole push went through at once.)
# Measured on the project's VM with a 20-200 MB TCP transfer: 95-99 % of the rate at 100 Mbit/s and
# 1 Gbit/s with these buckets, as with the 1 MB one.
BURST_S, BURST_MIN, BURST_MAX = 0.002, 16 << 10, 64 << 10
# Round-trip delay (rtt_ms): this kernel has no netem, so each host runs lib/delay_relay.py, which
# its nftables rules hand every TCP connection the host opens to another host. A privileged port:
# never one a process of the bed is given for port 0. Documented defaults for the figures:
RELAY_PORT = 1019
RTT_RACK_MS, RTT_REGION_MS = 0.5, 20.0  # inside a rack; across regions


def burst_bytes(rate_mbit: float) -> int:
    """The token bucket of a link shaped to rate_mbit (see BURST_S)."""
    return int(min(BURST_MAX, max(BURST_MIN, rate_mbit * 1e6 / 8 * BURST_S)))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    """One namespace host: its name, namespace, address and private /dev/shm directory."""

    index: int
    netns: str
    addr: str
    shm_dir: str
    link: str  # the host's end of its veth pair


class NetBed:
    """Hosts in network namespaces on a shaped switch; a context manager that cleans up after itself."""

    def __init__(self, num_hosts: int, rate_mbit: float | None = None, uplinks: Mapping[int, float] | None = None,
                 rtt_ms: float = 0.0) -> None:
        """rate_mbit: every link's rate in both directions (None: unshaped); uplinks: hosts whose
        uplink (what they send) has another rate, in Mbit/s (with rate_mbit); rtt_ms: a round-trip
        delay added to every TCP connection between two hosts (half each way; 0: none; see
        RTT_RACK_MS, RTT_REGION_MS)."""
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts must be 1..200, got {num_hosts}")
        if uplinks and rate_mbit is None:
            raise ValueError("uplinks need a rate_mbit for the other links")
        self.num_hosts = num_hosts
        self.rate_mbit = rate_mbit
        self.uplinks = dict(uplinks or {})
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        self.rtt_ms = rtt_ms
        self._relays: list[subprocess.Popen[str]] = []
        self.tag = f"{PREFIX}{os.getpid()}x{os.urandom(2).hex()}"
        self.switch = f"{self.tag}sw"
        self.hosts: list[Host] = []
        self._root = ""
        self._partitioned: set[int] = set()
        self._templates: dict[int, Template] = {}
        self._templates_lock = threading.Lock()

    @staticmethod
    def unavailable() -> str | None:
        """Why a bed cannot be built here (None when it can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc", "nft", "mount"):
            if shutil.which(tool) is None:
                return f"the {tool!r} tool is not installed"
        probe = f"{PREFIX}probe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> NetBed:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self._root = tempfile.mkdtemp(prefix=f"{self.tag}-")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.num_hosts):
            netns = f"{self.tag}h{i}"
            shm_dir = os.path.join(self._root, f"host{i}-shm")
            os.mkdir(shm_dir)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=1777", "tmpfs", shm_dir], check=True,
                           capture_output=True, timeout=30)
            host = Host(i, netns, f"{SUBNET}.{i + 1}", shm_dir, "eth0")
            self.hosts.append(host)
            _ip("netns", "add", netns)
            port = f"port{i}"
            _ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if self.rate_mbit is not None:  # the host's uplink (its egress) and downlink (the port's egress)
                for ns, dev, rate in ((netns, "eth0", self.uplinks.get(i, self.rate_mbit)), (self.switch, port, self.rate_mbit)):
                    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                    f"{rate}mbit", "burst", str(burst_bytes(rate)), "latency", "100ms"],
                                   check=True, capture_output=True, timeout=30)
        if self.rtt_ms:
            for host in self.hosts:
                self._delay(host)

    def _delay(self, h: Host) -> None:
        """Start the host's delay relay and redirect its TCP connections to other hosts to it."""
        relay = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_relay.py")
        p = subprocess.Popen(["ip", "netns", "exec", h.netns, sys.executable, relay, "--port", str(RELAY_PORT),
                              "--one-way-ms", str(self.rtt_ms / 2)], stdout=subprocess.PIPE, text=True)
        self._relays.append(p)
        assert p.stdout is not None
        if not p.stdout.readline().startswith("relaying on"):
            raise RuntimeError(f"the delay relay of host {h.index} did not start (exit {p.poll()})")
        rules = (f"table ip {PREFIX}rtt {{\n"
                 "  chain out { type nat hook output priority -100;\n"
                 f"    meta mark != 0x5053 ip daddr {SUBNET}.0/24 ip daddr != {h.addr} meta l4proto tcp "
                 f"redirect to :{RELAY_PORT}; }}\n"
                 "}\n")
        subprocess.run(["ip", "netns", "exec", h.netns, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run on a host: in its network namespace, with the host's own /dev/shm."""
        h = self.hosts[host]
        script = 'mount --bind "$0" /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", h.netns, "sh", "-c", script, h.shm_dir, *argv]

    def templates(self, hosts: Sequence[int]) -> list[Template]:
        """A preloaded template (psgrad/launch/template.py) running on each of these hosts (its network
        namespace and /dev/shm), those not running yet started together; each is kept until the bed
        closes. `SupervisedProcess([sys.executable, "-m", "psgrad", ...], template=bed.templates([h])[0])`
        starts the command on host h as a fork of it, in milliseconds instead of the seconds a cold
        interpreter spends importing torch. (Templates are started with this process's environment;
        each child gets its own.)"""
        with self._templates_lock:
            missing = sorted(set(hosts) - set(self._templates))
            if missing:
                wraps = [lambda argv, h=h: self.command(h, argv) for h in missing]
                self._templates.update(zip(missing, Template.start_all(dict(os.environ), wraps)))
            return [self._templates[h] for h in hosts]

    def templates_started(self) -> list[Template]:
        """The templates running on the bed's hosts now."""
        with self._templates_lock:
            return list(self._templates.values())

    def run(self, host: int, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run argv on a host to completion (output captured)."""
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout_s)

    @property
    def partitioned(self) -> frozenset[int]:
        """The hosts cut off now."""
        return frozenset(self._partitioned)

    def partition(self, host: int) -> None:
        """Cut a host off: nftables in its namespace drops every packet to or from another host."""
        h = self.hosts[host]
        rules = (f"table inet {PREFIX} {{\n"
                 "  chain pin { type filter hook input priority 0; iifname \"eth0\" drop; }\n"
                 "  chain pout { type filter hook output priority 0; oifname \"eth0\" drop; }\n"
                 "}\n")
        subprocess.run(["ip", "netns", "exec", h.netns, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)
        self._partitioned.add(host)

    def heal(self, host: int) -> None:
        """Undo partition(host)."""
        h = self.hosts[host]
        subprocess.run(["ip", "netns", "exec", h.netns, "nft", "delete", "table", "inet", PREFIX], check=True,
                       capture_output=True, timeout=30)
        self._partitioned.discard(host)

    def close(self) -> None:
        """Remove every namespace, link, qdisc, rule, relay, template and tmpfs this bed made (idempotent)."""
        with self._templates_lock:
            running, self._templates = list(self._templates.values()), {}
        closing = [threading.Thread(target=t.close) for t in running]  # (at once: each exit takes seconds)
        for t in closing:  # (their children, if any are left, get SIGTERM)
            t.start()
        for t in closing:
            t.join()
        for p in self._relays:
            p.kill()
            p.wait(timeout=30)
        self._relays = []
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)  # its veth pair, qdiscs and nft tables go with it
        _ip("netns", "del", self.switch, check=False)
        for h in self.hosts:
            subprocess.run(["umount", "-l", h.shm_dir], capture_output=True, timeout=30)
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)
        self.hosts, self._root = [], ""


def remove_stale() -> None:
    """Delete namespaces of beds whose process is gone (a run killed before it could clean up)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(PREFIX) or "x" not in name[len(PREFIX):]:
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
    tmp = tempfile.gettempdir()
    for entry in os.listdir(tmp):
        pid = entry[len(PREFIX):].split("x", 1)[0]
        if entry.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            root = os.path.join(tmp, entry)
            for sub in os.listdir(root):
                subprocess.run(["umount", "-l", os.path.join(root, sub)], capture_output=True, timeout=30)
            shutil.rmtree(root, ignore_errors=True)
