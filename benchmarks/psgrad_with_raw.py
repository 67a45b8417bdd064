"""A psgrad shard server whose gRPC server also serves bare gRPC methods: a diagnostic.

    python benchmarks/psgrad_with_raw.py [--lease-s 600] [--stream-window-bytes N]

Runs what `psgrad server` runs (default settings, torch on one thread, 127.0.0.1, port 0) and adds,
on the same gRPC server, raw_grpc.py's methods three times: `rawbench.Raw` (Upload copies each
chunk, the ceiling's work), `rawbench.RawSgd` (Upload does a shard's per-chunk finiteness sum and
SGD update into the next weights) and `rawbench.RawSgdInPlace` (the same update, in place). A
psgrad push and the three raw uploads then share one server process, its gRPC settings
and its memory, so comparing them leaves out what differs between processes (on a shared 2-vCPU
machine two instances of the same server can differ by 15%). Prints
`psgrad server listening on HOST:PORT`; stops on SIGTERM. transport.py uses it for `diagnostics`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import window_bytes_arg  # noqa: E402
from raw_grpc import SERVICE, raw_handler  # noqa: E402

from psgrad.config import ServerConfig  # noqa: E402
from psgrad.server.runtime import serve_forever  # noqa: E402

SGD_SERVICE = "rawbench.RawSgd"
SGD_IN_PLACE_SERVICE = "rawbench.RawSgdInPlace"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lease-s", type=float, default=600.0, help="worker lease in seconds (default: 600)")
    parser.add_argument(
        "--stream-window-bytes",
        type=window_bytes_arg,
        default=ServerConfig.stream_window_bytes,
        help="as `psgrad server --stream-window-bytes` (0 = gRPC's automatic windows; "
        f"default: {ServerConfig.stream_window_bytes})",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `psgrad server` (its --torch-threads default)
    extra = (
        raw_handler("copy", SERVICE),
        raw_handler("sgd", SGD_SERVICE),
        raw_handler("sgd-in-place", SGD_IN_PLACE_SERVICE),
    )
    config = ServerConfig(host="127.0.0.1", port=0, lease_s=args.lease_s, stream_window_bytes=args.stream_window_bytes)
    serve_forever(config, lambda address: print(f"psgrad server listening on {address}", flush=True), extra)


if __name__ == "__main__":
    main()
