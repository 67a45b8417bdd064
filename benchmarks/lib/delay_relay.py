"""A TCP relay that holds every byte for a fixed one-way delay in each direction: the test bed's
round-trip delay (this kernel has no netem, so no qdisc can delay packets).

It runs in one host's network namespace (NetBed(rtt_ms=...) starts one per host). nftables there
redirects the host's outgoing TCP connections to the other hosts to it; it reads each connection's
original destination (SO_ORIGINAL_DST), opens its own connection there (its sockets carry a mark
that the redirect skips) and forwards what either side sends `--one-way-ms` after it read it, in
order, a chunk at a time. At most --buffer-bytes wait in each direction, so a sender still feels
the link's backpressure as TCP's window would make it. The shaped link (tc tbf on the host's veth)
lies after the relay, so the delay adds to the serialization time as a propagation delay does.
Unlike a real link's, the handshake is not delayed (the relay accepts at once, then connects), and
a port nothing listens on shows as a connection closed at once instead of refused.

    python benchmarks/lib/delay_relay.py --port 7000 --one-way-ms 10    # prints "relaying on 7000"
"""
from __future__ import annotations

import argparse
import queue
import socket
import struct
import threading
import time

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
MARK = 0x5053  # the relay's own connections: not redirected again (NetBed's rule skips it)
CHUNK = 64 << 10


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (its sockaddr_in as conntrack kept it)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    (port,) = struct.unpack_from("!H", raw, 2)
    return socket.inet_ntoa(raw[4:8]), port


def _pump(src: socket.socket, dst: socket.socket, delay_s: float, limit: int) -> None:
    """Copy src to dst, each chunk delay_s after it was read (a thread reads, this one writes at
    the due time: threads, since an event loop's timers are only good to a millisecond); EOF is
    passed on as a half-close."""
    held: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=max(1, limit // CHUNK))

    def read() -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            held.put((time.monotonic() + delay_s, data))
            if not data:
                return

    threading.Thread(target=read, daemon=True).start()
    while True:
        due, data = held.get()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
        except OSError:
            return


def _relay(client: socket.socket, delay_s: float, limit: int) -> None:
    try:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        server.connect(original_destination(client))
    except OSError:
        client.close()  # as a refused or unreachable destination would end the connection
        return
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(server, client, delay_s, limit), daemon=True)
    back.start()
    _pump(client, server, delay_s, limit)
    back.join()
    client.close()
    server.close()


def serve(port: int, delay_s: float, limit: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(256)
    print(f"relaying on {port}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay, args=(client, delay_s, limit), daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the port nftables redirects to")
    parser.add_argument("--one-way-ms", type=float, required=True, help="the delay of each direction (half the round trip)")
    parser.add_argument("--buffer-bytes", type=int, default=4 << 20, help="bytes that may wait in each direction")
    args = parser.parse_args()
    serve(args.port, args.one_way_ms / 1000, args.buffer_bytes)


if __name__ == "__main__":
    main()
