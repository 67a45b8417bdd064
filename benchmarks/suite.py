"""Every psgrad benchmark in one run: each figure beside its ceiling, and a summary of the targets.

    python benchmarks/suite.py --preset full                         # a few minutes per part
    python benchmarks/suite.py --preset tiny                         # CI smoke run
    python benchmarks/suite.py --preset full --only transport,peer   # some parts
    python benchmarks/suite.py --preset full --markdown --save out.json
    python benchmarks/suite.py --from-json out.json --markdown       # render a saved run

Each part is a function `run(preset) -> dict` (JSON-able) of a script here (transport.py holds
three: the matrix, latency and peer parts), run one after the other in this process; a part that is missing or fails is recorded as {"error": ...} and the others still run.
Prints one JSON document: {"machine", "preset", "parts": {name: result}, "targets": [...]} where
"targets" concatenates the parts' own "targets" rows (name, value, ceiling, ratio, target, better,
met), the summary to read first. --markdown prints the targets and figures as Markdown tables
instead. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import resource
import time
import traceback
from pathlib import Path
from typing import Any

from lib import code_version, log, machine_info, write_doc, write_json

# part name -> "MODULE" (its run function) or "MODULE:FUNCTION", a script in benchmarks/
PARTS = {
    "transport": "transport",
    "peer": "transport:run_peer",
    "latency": "transport:run_latency",
    "server": "server_bench",
    "scaling": "scaling",
}
PRESETS = ("tiny", "full")
SHARE_PROCESSES = ("transport", "peer")  # these parts reuse one set of worker processes and servers


def run_part(name: str, preset: str) -> dict[str, Any]:
    """One part's result, or {"error": ...} when its module is missing or its run fails."""
    module_name, _, function = PARTS[name].partition(":")
    function = function or "run"
    t0 = time.monotonic()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return {"error": f"benchmarks/{module_name}.py not found"}
        return {"error": f"importing {module_name}: {exc}", "traceback": traceback.format_exc()}
    except Exception as exc:
        return {"error": f"importing {module_name}: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    run = getattr(module, function, None)
    if not callable(run):
        return {"error": f"benchmarks/{module_name}.py has no {function}(preset) function"}
    try:
        result = run(preset)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "elapsed_s": time.monotonic() - t0}
    if not isinstance(result, dict):
        return {"error": f"run({preset!r}) returned {type(result).__name__}, not a dict"}
    result.setdefault("elapsed_s", time.monotonic() - t0)
    return result


def collect_targets(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The parts' target rows in part order, each tagged with its part."""
    rows = []
    for name, result in parts.items():
        for row in result.get("targets", []):
            rows.append({"part": name, **row})
    return rows


def _sharing() -> contextlib.AbstractContextManager[Any]:
    """lib.swarm.keep_swarms() when it loads: transport and peer then share their worker processes
    and psgrad servers instead of each starting its own."""
    try:
        keep: contextlib.AbstractContextManager[Any] = importlib.import_module("lib.swarm").keep_swarms()
        return keep
    except Exception:
        return contextlib.nullcontext()


def _cpu_s() -> float:
    """CPU seconds used by this process and every child it has reaped. A part's processes are
    reaped by the time it ends, so the difference is the part's cost whatever the load (processes
    transport and peer share are counted with the last of them, which stops them)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_suite(preset: str, only: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    doc: dict[str, Any] = {"machine": machine_info(), "code": code_version(), "preset": preset, "parts": {},
                           "timing": {}}
    sharing = [n for n in only if n in SHARE_PROCESSES]
    with contextlib.ExitStack() as stack:
        for name in only:
            if len(sharing) > 1 and name == sharing[0]:
                stack.enter_context(_sharing())
            log(f"suite: part {name} ({preset}) starting")
            t_part, cpu_part = time.monotonic(), _cpu_s()
            doc["parts"][name] = run_part(name, preset)
            if sharing and name == sharing[-1]:
                stack.close()  # stop the shared processes before the next part runs
            doc["timing"][name] = {"wall_s": time.monotonic() - t_part, "cpu_s": _cpu_s() - cpu_part}
            state = f"failed: {doc['parts'][name]['error']}" if "error" in doc["parts"][name] else "done"
            log(f"suite: part {name} {state} after {doc['timing'][name]['wall_s']:.1f} s "
                f"({doc['timing'][name]['cpu_s']:.1f} CPU-s)")
    doc["targets"] = collect_targets(doc["parts"])
    doc["errors"] = [name for name, r in doc["parts"].items() if "error" in r]
    doc["elapsed_s"] = time.monotonic() - t0
    doc["machine"]["loadavg_1m_at_end"] = machine_info()["loadavg_1m"]
    return doc


# ---------------------------------------------------------------------------------------------
# Markdown


def _num(x: Any) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict[str, Any]) -> str:
    """The targets table, then every part's figures table, then any part errors."""
    m = doc.get("machine", {})
    lines = [
        (f"Preset `{doc.get('preset')}` on {m.get('cpus')} CPUs ({m.get('cpu_model', '?')}), "
         f"{m.get('mem_total_gib', '?')} GiB, Python {m.get('python')}, torch {m.get('torch')}, "
         f"grpcio {m.get('grpcio')}; load average {_num(m.get('loadavg_1m'))} at start."),
        "",
        "| target | psgrad | beside | ratio | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in doc.get("targets", []):
        unit = f" {t['unit']}" if t.get("unit") else ""
        beside = f"{_num(t['ceiling'])}{unit}" + (f" ({t['ceiling_name']})" if t.get("ceiling_name") else "")
        goal = ("≥ " if t.get("better", "higher") == "higher" else "≤ ") + _num(t["target"])
        lines.append(f"| {_cell(t['name'])} | {_num(t['value'])}{unit} | {_cell(beside)} | {_num(t['ratio'])} | "
                     f"{goal} | {'yes' if t['met'] else '**no**'} |")
    figures = [(name, f) for name, r in doc.get("parts", {}).items() for f in r.get("figures", [])]
    if figures:
        lines += ["", "| figure | value | beside | ratio |", "|---|---|---|---|"]
        for _, f in figures:
            unit = f" {f['unit']}" if f.get("unit") else ""
            if "ceiling" in f:
                beside = f"{_num(f['ceiling'])}{unit} ({f.get('ceiling_name', '')})"
                ratio = _num(f["ratio"])
            else:
                beside, ratio = "", ""
            lines.append(f"| {_cell(f['name'])} | {_num(f['value'])}{unit} | {_cell(beside)} | {ratio} |")
    errors = {name: r["error"] for name, r in doc.get("parts", {}).items() if "error" in r}
    if errors:
        lines.append("")
        lines += [f"- part `{name}` failed: {_cell(str(err))}" for name, err in errors.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="size of every part (default: tiny)")
    parser.add_argument("--only", help=f"comma-separated parts to run (default: all of {','.join(PARTS)})")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables instead of JSON")
    parser.add_argument("--save", metavar="FILE", help="also write the JSON document to FILE")
    parser.add_argument("--from-json", metavar="FILE", help="render a saved JSON document instead of running")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
    else:
        only = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else list(PARTS)
        unknown = [p for p in only if p not in PARTS]
        if unknown or not only:
            parser.error(f"unknown part(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(PARTS)}")
        doc = run_suite(args.preset, only)
        if args.save:
            with open(args.save, "w") as f:
                write_json(doc, f)
    write_doc(doc, markdown if args.markdown else None)


if __name__ == "__main__":
    main()
