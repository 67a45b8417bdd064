"""`psgrad status` output: the shards' status as a table or as JSON."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

if TYPE_CHECKING:
    from psgrad.config import ClientConfig

T = TypeVar("T")
# The live view's main thread never blocks longer than this: Python runs the Ctrl-C handler in the
# main thread, and a signal that another thread (gRPC's, a status call's) received wakes no wait.
WAKE_S = 0.1


def fetch(
    addresses: Sequence[str], timeout_s: float, tolerant: bool = False, client: ClientConfig | None = None,
    unanswered: list[tuple[int, BaseException]] | None = None,
) -> list[dict[str, Any]]:
    """Every server's status as plain data (to_dict() plus its address). A server that does not
    answer is an error, unless the shards have backups or `tolerant`: then its row says why; with
    `unanswered`, its row says why and its error is added there (with its row's index) for the
    caller to raise. client: the credentials to ask with (see shard_status). The servers are asked
    at once, each in a daemon thread: a caller that stops waiting (Ctrl-C on the live view) leaves
    their calls to end at their deadlines without the interpreter waiting for them at exit."""
    from psgrad.client.status_client import shard_status  # no torch: status stays light
    from psgrad.errors import PsgradError

    servers = [a for entry in addresses for a in entry.split("|")]  # a shard's backup gets a row of its own
    rows: list[dict[str, Any] | None] = [None] * len(servers)
    failures: list[tuple[int, BaseException]] = []

    def one(i: int, address: str) -> None:
        try:
            rows[i] = dict(shard_status([address], timeout_s, client=client)[0].to_dict(), address=address)
        except PsgradError as exc:
            if unanswered is not None:
                unanswered.append((i, exc))
            elif not tolerant and "|" not in ",".join(addresses):
                failures.append((i, exc))  # no backups: as before, a server that does not answer is an error
            rows[i] = {"address": address, "initialized": False, "error": str(exc)}
        except BaseException as exc:  # raised in the caller's thread below
            failures.append((i, exc))

    threads = [threading.Thread(target=one, args=(i, a), name=f"psgrad-status-{i}", daemon=True)
               for i, a in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # in slices: the main thread sees Ctrl-C at once, whichever thread the signal hit
            t.join(WAKE_S)
    if failures:
        raise min(failures, key=lambda f: f[0])[1]  # the first server's, in order
    return [r for r in rows if r is not None]


def print_status(addresses: Sequence[str], timeout_s: float, as_json: bool, client: ClientConfig | None = None) -> None:
    """Ask every server for its shard's status and print it (a table, or JSON with as_json). A server
    that does not answer gets a row that says why, and then (the shards having no backups) its error
    is raised; where none answers, the error alone."""
    unanswered: list[tuple[int, BaseException]] = []
    shards = fetch(addresses, timeout_s, client=client, unanswered=unanswered)
    if unanswered and len(unanswered) == len(shards):
        raise min(unanswered, key=lambda f: f[0])[1]  # (nothing to show: the first server's error)
    if as_json:
        print(json.dumps({"shards": shards}, indent=2), flush=True)
    else:
        print(format_status(shards), flush=True)
    if unanswered and "|" not in ",".join(addresses):  # (with backups, a server down is the backup's to cover)
        raise min(unanswered, key=lambda f: f[0])[1]


def _lifetime_shows(table: dict[str, Any]) -> bool:
    """Whether a sparse table's line shows its admitted rows: a dynamic table's always (rows come and
    go by id), another's where rows were dropped, expired or evicted (else admitted is the rows
    touched, said already)."""
    return not table["rows"] or any(table.get(k) for k in ("expired", "evicted", "dropped"))


def format_status(shards: Sequence[dict[str, Any]]) -> str:
    """The human-readable table `psgrad status` prints."""
    from psgrad.core.status import start_wait_phrase  # not at the CLI's start
    head = f"{'shard':>5} {'address':<21} {'range':<21} {'version':>8} {'applied':>8} {'dup':>4} {'rej':>4} {'pulls':>7} {'MB in':>9} {'MB out':>9}"
    lines = [head]
    for s in shards:
        if not s["initialized"]:
            role = (s.get("replica") or {}).get("role")
            what = ("not answering: " + s["error"]) if "error" in s else (
                "backup without state yet" if role == "backup" else "not initialized (start worker rank 0 first)")
            lines.append(f"{'-':>5} {s['address']:<21} {what}")
            continue
        rng = f"[{s['range'][0]}, {s['range'][1]})"
        lines.append(
            f"{s['shard']:>5} {s['address']:<21} {rng:<21} {s['version']:>8} {s['pushes_applied']:>8} "
            f"{s['pushes_duplicate']:>4} {s['pushes_rejected']:>4} {s['pulls']:>7} "
            f"{s['bytes_in'] / 1e6:>9.1f} {s['bytes_out'] / 1e6:>9.1f}"
        )
    for s in shards:
        if not s["initialized"]:
            continue
        workers = " ".join(f"{w['rank']}:clock={w['clock']},{w['state']}" for w in s["workers"]) or "none"
        st = s["staleness"]
        hist = " ".join(f"{k}:{v}" for k, v in st["histogram"].items()) or "none"
        lines.append(f"shard {s['shard']}: workers {workers}")
        missing = s.get("missing_at_start") or []
        if missing:
            lines.append(f"shard {s['shard']}: waiting for the start ({s['spec']['mode']} mode starts all workers "
                         f"together): {start_wait_phrase(s['spec']['num_workers'], missing)}")
        if s["evictions"] or s["pending"] or s["waiting"]:
            lines.append(
                f"shard {s['shard']}: evictions {s['evictions']}, sync gradients buffered {s['pending']}, "
                f"pulls waiting {s['waiting']}"
            )
        rep = s.get("replica") or {}
        if rep.get("backup") or rep.get("role", "primary") != "primary" or rep.get("epoch"):
            attached = f", backup {rep['backup']} attached (replicated to version {rep['replicated_version']})" if rep.get("backup") else ""
            follows = f" of {rep['primary']}" if rep.get("primary") else ""
            lines.append(f"shard {s['shard']}: {s['address']} is {rep['role']}{follows} at epoch {rep['epoch']}{attached}")
        spec = s.get("spec") or {}
        if spec.get("compress", "none") != "none":
            pushes = s["pushes_applied"] + s["pushes_duplicate"] + s["pushes_rejected"]
            plain = (s["range"][1] - s["range"][0]) * (4 if spec["wire_dtype"] == "float32" else 2)
            each = f": {s['bytes_in'] / pushes:,.0f} bytes a push, {s['bytes_in'] / pushes / plain:.3f} of plain" if pushes and plain else ""
            ef = "" if spec.get("error_feedback", True) else ", no error feedback"
            lines.append(f"shard {s['shard']}: pushes compressed {spec['compress']}{ef}{each}")
            if s.get("pushes_plain"):  # (why the ratio is near 1)
                lines.append(f"shard {s['shard']}: {s['pushes_plain']:,} of {pushes:,} pushes came uncompressed, from "
                             "workers on this server's host (through shared memory, where fewer bytes save nothing): "
                             "the worker flag --compress-same-host, or ClientConfig(compress_same_host=True), "
                             "compresses them too")
        delta = s.get("delta") or {}
        if delta.get("compressed") or delta.get("exact"):
            lines.append(
                f"shard {s['shard']}: compressed pulls: {delta['compressed']:,} changes, {delta['exact']:,} exact "
                f"({delta['resyncs']:,} resyncs), drift now {delta['drift']:.4f} (max {delta['drift_max']:.4f}), "
                f"copies of {delta['copies']} worker(s) {delta['nbytes'] / 1e6:.1f} MB")
        tables = s.get("tables") or []
        if tables:
            lines.append(f"shard {s['shard']}: tables " + ", ".join(
                f"{t['name']} ({t['kind']}, "
                + ((f"{t['rows_touched']:,} of {t['rows']:,} rows touched, " if t["rows"] else
                    f"dynamic: {t['rows_touched']:,} rows stored, ")
                   + f"{t['updates']:,} updates, staleness max {t['staleness_max']} mean {t['staleness_mean']:.2f}, "
                   + "".join(f"{t.get(k, 0):,} {k}, " for k in ("admitted", "expired", "evicted", "dropped")
                             if (_lifetime_shows(t) if k == "admitted" else t.get(k)))
                   if t["kind"] == "sparse" else "")
                + f"{t['numel']:,} parameters, {t['nbytes'] / 1e6:.1f} MB, optimizer state {t['state_bytes'] / 1e6:.1f} MB)"
                for t in tables))
        dc = s.get("delay") or {}
        if s["spec"] and s["spec"].get("dc_asgd"):
            lines.append(f"shard {s['shard']}: DC-ASGD lambda {s['spec']['dc_asgd']:g}"
                         f"{' (adaptive)' if s['spec'].get('dc_asgd_adaptive') else ''}: copies of pulled weights for "
                         f"{dc.get('copies', 0)} workers ({dc.get('nbytes', 0) / 1e6:.1f} MB), pushes compensated "
                         f"{dc.get('compensated', 0)}, uncompensated {dc.get('uncompensated', 0)}")
        pub = s.get("published") or {}
        if pub.get("slots"):
            lines.append(f"shard {s['shard']}: same-host published versions: {pub['leased']} of {pub['slots']} slots "
                         f"leased ({pub['nbytes'] / 1e6:.1f} MB in /dev/shm), {pub['copies']} versions published, "
                         f"{pub['leases']} pulls served from them, {pub['pinned']} pushes checked as applied")
        tr = s.get("transfers") or {}
        if tr.get("streams_open") or tr.get("streams_cancelled") or tr.get("streams_refused"):
            lines.append(f"shard {s['shard']}: client streams open {tr['streams_open']}, cancelled for a stalled or slow transfer "
                         f"{tr['streams_cancelled']}, refused over a limit {tr['streams_refused']}")
        if tr.get("reads_queued") or tr.get("reads_refused"):
            lines.append(f"shard {s['shard']}: {reads_phrase(tr)}")
        ckpt = s.get("checkpoint") or {}
        if ckpt.get("enabled"):
            lines.append(f"shard {s['shard']}: {checkpoint_phrase(ckpt)}")
        if s["updates_lost"]:
            lines.append(f"shard {s['shard']}: {s['updates_lost']} updates lost to a restart from a checkpoint")
        if s.get("job_lr_clock", -1) >= 0:
            lines.append(f"shard {s['shard']}: job lr {s['job_lr']:.6g} (set by the chief's push at clock {s['job_lr_clock']})")
        if s["rolled_back"]:
            lines.append(f"shard {s['shard']}: {s['rolled_back']} iterations rolled back to a checkpoint and recomputed")
        if s.get("late_dropped"):
            lines.append(f"shard {s['shard']}: {s['late_dropped']} late gradients dropped (backup workers)")
        if s.get("pushes_skipped"):
            lines.append(f"shard {s['shard']}: {s['pushes_skipped']} steps skipped (applied by other shards, then "
                         "dropped by their workers)")
        if s.get("staleness_bound"):
            lines.append(f"shard {s['shard']}: adaptive staleness bound now {s['staleness_bound']}")
        lines.append(f"shard {s['shard']}: staleness histogram {hist} (mean {st['mean']:.2f}, max {st['max']})")
    return "\n".join(lines)


def reads_phrase(tr: dict[str, Any]) -> str:
    """'reads of rows: 12.0 MB in flight now (peak 40.0 MB) of --max-read-mb 64, ...': the bound on the
    bytes of reads in flight and what it made reads do."""
    limit = tr.get("read_limit_bytes", 0)
    bound = f" of --max-read-mb {limit / 2**20:g}" if limit else " (no --max-read-mb)"
    return (f"reads of rows: {tr['read_bytes'] / 1e6:.1f} MB in flight now (peak {tr['read_bytes_peak'] / 1e6:.1f} MB)"
            f"{bound}, {tr['reads_waiting']} waiting for their turn; {tr['reads_queued']:,} waited their turn, "
            f"{tr['reads_expired']:,} of them until their deadline, {tr['reads_refused']:,} refused as larger than "
            "all of it")


def checkpoint_phrase(ckpt: dict[str, Any]) -> str:
    """'last checkpoint: version 120, 3.2 s ago; ...' with its failed writes and the last error."""
    newest = (f"version {ckpt['version']}, {ckpt['age_s']:.1f} s ago" if ckpt.get("version", -1) >= 0
              else "none written yet")
    text = f"last checkpoint: {newest}"
    if ckpt.get("failures"):
        state = "FAILING now" if ckpt.get("failing") else "written again since"
        text += (f"; {ckpt['failures']} writes failed ({state}), the last {ckpt['error_age_s']:.0f} s ago: "
                 f"{ckpt['last_error']}")
    return text


def percentile(hist: dict[Any, int], q: float) -> int | None:
    """The q-quantile (0..1) of a value -> count histogram (None when empty)."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for value, count in sorted((int(k), v) for k, v in hist.items()):
        seen += count
        if seen >= q * total:
            return value
    return None


def watch_rows(now: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]] | None, dt_s: float) -> str:
    """The live view's table: per server its version, push and pull rates since the last refresh,
    live workers, their clocks, the slowest worker's lag, staleness p50/p99 and parked pulls."""
    head = (f"{'shard':>5} {'address':<21} {'version':>8} {'push/s':>7} {'pull/s':>7} {'live':>4} {'clocks':<11} "
            f"{'lag':>4} {'stale p50/p99':>13} {'waiting':>7}")
    lines = [head]
    previous = {s["address"]: s for s in before or ()}
    for s in now:
        if not s["initialized"]:
            lines.append(f"{'-':>5} {s['address']:<21} {s.get('error') or 'not initialized'}")
            continue
        old = previous.get(s["address"])
        rates = ["", ""]
        if old is not None and old.get("initialized") and dt_s > 0:
            rates = [f"{(s[k] - old[k]) / dt_s:.1f}" for k in ("pushes_applied", "pulls")]
        live = [w["clock"] for w in s["workers"] if w["state"] == "live"]
        clocks = f"{min(live)}..{max(live)}" if live else "-"
        lag = str(max(live) - min(live)) if live else "-"
        hist = s["staleness"]["histogram"]
        p50, p99 = percentile(hist, 0.5), percentile(hist, 0.99)
        stale = "-" if p50 is None else f"{p50}/{p99}"
        lines.append(f"{s['shard']:>5} {s['address']:<21} {s['version']:>8} {rates[0]:>7} {rates[1]:>7} {len(live):>4} "
                     f"{clocks:<11} {lag:>4} {stale:>13} {s['waiting']:>7}")
    return "\n".join(lines)


def _pause(seconds: float, check: Callable[[], None]) -> None:
    """Wait, in slices of WAKE_S, calling check() after each: a signal another thread received
    wakes no lock wait, so the main thread must wake by itself to run the Ctrl-C handler."""
    end = time.monotonic() + seconds
    nap = threading.Event()  # never set: wait() is an interruptible pause
    while (left := end - time.monotonic()) > 0:
        check()
        nap.wait(min(left, WAKE_S))


def _in_background(fn: Callable[[], T], check: Callable[[], None]) -> T:
    """fn() in a daemon thread, waited for in slices, check() after each (Ctrl-C ends the wait at
    once, and the thread is abandoned: the process exits without waiting for its calls)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="psgrad-status-watch", daemon=True).start()
    while not done.wait(WAKE_S):
        check()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def watch_status(addresses: Sequence[str], timeout_s: float, interval_s: float, count: int | None = None,
                 out: TextIO | None = None, client: ClientConfig | None = None) -> None:
    """Refresh the live view every interval_s until Ctrl-C (or `count` refreshes): on a terminal in
    place, elsewhere as successive blocks. Ctrl-C ends it within WAKE_S, even while a server takes
    its time to answer (up to timeout_s): nothing waits for those calls; and even where Python
    swallowed the KeyboardInterrupt (raised in a __del__ of a gRPC object the main thread collected):
    see CtrlC."""
    from psgrad.launch.supervisor import CtrlC

    with CtrlC() as ctrl_c:
        _watch(addresses, timeout_s, interval_s, count, out, client, ctrl_c.check)


def _watch(addresses: Sequence[str], timeout_s: float, interval_s: float, count: int | None, out: TextIO | None,
           client: ClientConfig | None, check: Callable[[], None]) -> None:
    stream = out or sys.stdout
    tty = stream.isatty()
    servers = sum(len(entry.split("|")) for entry in addresses)
    stream.write(f"psgrad status --watch: asking {servers} server(s) every {interval_s:g} s, Ctrl-C to stop\n")
    stream.flush()
    before: list[dict[str, Any]] | None = None
    last = time.monotonic()
    done = 0
    while count is None or done < count:
        shards = _in_background(lambda: fetch(addresses, timeout_s, tolerant=True, client=client), check)
        now = time.monotonic()
        table = watch_rows(shards, before, now - last)
        stamp = time.strftime("%H:%M:%S")
        if tty:
            stream.write("\x1b[H\x1b[2J")  # home, clear: redraw in place
        stream.write(f"psgrad status --watch  {stamp}  every {interval_s:g} s, Ctrl-C to stop\n{table}\n")
        stream.flush()
        before, last = shards, now
        done += 1
        if count is None or done < count:
            _pause(interval_s, check)
