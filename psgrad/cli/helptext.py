"""`psgrad COMMAND --help`'s layout: descriptions filled to the terminal, long group headings wrapped,
and an epilog per command with two examples and the docs page to read next (kept as written)."""
from __future__ import annotations

import argparse
import textwrap

# Two examples per command (each parses: tests/e2e/test_docs.py checks), and the page that explains it.
EXAMPLES: dict[str, tuple[tuple[str, str], tuple[str, str], str]] = {
    "server": (("a shard on a free port, written to ps0 once it listens",
                "psgrad server --port 0 --port-file ps0"),
               ("a shard with Prometheus metrics and checkpoints (restart it with the same flags)",
                "psgrad server --port 7000 --metrics-port 9100 --checkpoint-dir ckpt/shard0"),
               "docs/getting-started/by-hand.md, docs/operations/fault-tolerance.md"),
    "worker": (("the chief (rank 0) of a two-worker async job on two shards",
                "psgrad worker --servers 127.0.0.1:7000,127.0.0.1:7001 --rank 0 --num-workers 2 --steps 1000"),
               ("rank 1 of an ssp job ($SERVERS: the same list), writing its metrics records",
                "psgrad worker --servers $SERVERS --rank 1 --num-workers 2 --mode ssp --metrics-out w1.jsonl"),
               "docs/getting-started/by-hand.md, docs/guide/tasks.md"),
    "allreduce": (("rank 0 of a two-rank all-reduce baseline (a new --store file per run, shared by the ranks)",
                   "psgrad allreduce --rank 0 --num-workers 2 --store rdzv --steps 500"),
                  ("rank 1, on the mnist CNN, writing its metrics records",
                   "psgrad allreduce --rank 1 --num-workers 2 --store rdzv --task mnist --metrics-out a1.jsonl"),
                  "docs/guide/compare.md"),
    "launch": (("2 servers and 2 async workers on digits, stopped at the end",
                "psgrad launch --num-servers 2 --num-workers 2 --task digits --mode async --steps 1000"),
               ("a sync job with a backup per shard, checkpoints and mutual TLS",
                "psgrad launch --num-workers 4 --mode sync --replicas 1 --checkpoint-dir ckpt --tls"),
               "docs/getting-started/launch.md"),
    "run": (("every process of a one-node torchrun job: the first 2 ranks serve",
             "torchrun --nnodes 1 --nproc-per-node 6 -m psgrad run --num-servers 2 --insecure --task digits"),
            ("the command of every pod of a Kubeflow TFJob (roles from TF_CONFIG)",
             "psgrad run --engine tf-config --insecure --task digits --mode sync --steps 1000"),
            "docs/operations/clusters.md"),
    "k8s": (("a JobSet of 2 servers and 4 workers (IMAGE has psgrad installed), written to job.yaml",
             "psgrad k8s --name digits --image IMAGE --num-servers 2 --num-workers 4 --out job.yaml -- --task digits"),
            ("plain Indexed Jobs, secured with a Secret made from `psgrad certs`",
             "psgrad k8s --name digits --image IMAGE --num-servers 2 --num-workers 4 --format jobs "
             "--tls-secret digits-tls -- --task digits"),
            "docs/operations/clusters.md"),
    "slurm": (("an srun --multi-prog script of 2 servers and 4 workers",
               "psgrad slurm --name digits --num-servers 2 --num-workers 4 --out job.sbatch -- --task digits"),
              ("a heterogeneous job (workers with a GPU each), secured with a `psgrad certs` directory",
               "psgrad slurm --name digits --num-servers 2 --num-workers 4 --het --worker-gpus 1 "
               "--tls-dir /shared/digits-tls -- --task mnist"),
              "docs/operations/clusters.md"),
    "compare": (("the default: sync, async and ssp:2 on digits, 2 servers + 4 workers, twice each",
                 "psgrad compare"),
                ("backup workers and ssp against a straggler, each mode at its best learning rate",
                 "psgrad compare --modes sync,sync:backup=1,async,ssp:2 --straggler 0:4 --lr-grid 0.05,0.1,0.2"),
                "docs/getting-started/compare.md, docs/guide/compare.md"),
    "status": (("each shard's version, workers and staleness",
                "psgrad status --servers 127.0.0.1:7000,127.0.0.1:7001"),
               ("a live view, refreshed every 2 s until Ctrl-C",
                "psgrad status --servers 127.0.0.1:7000,127.0.0.1:7001 --watch --interval-s 2"),
               "docs/getting-started/status.md, docs/operations/monitoring.md"),
    "export": (("a running job's model as a state_dict",
                "psgrad export --servers 127.0.0.1:7000,127.0.0.1:7001 --out model.pt"),
               ("with every embedding table whole (what torch.nn.Embedding loads)",
                "psgrad export --servers 127.0.0.1:7000,127.0.0.1:7001 --out model.pt --materialize"),
               "docs/guide/python-api.md, docs/guide/embeddings.md"),
    "certs": (("credentials for 2 workers, the servers reached as node-1 or 10.0.0.7",
               "psgrad certs job --num-workers 2 --names node-1,10.0.0.7"),
              ("for a cluster job: every server certificate names psgrad-server",
               "psgrad certs /shared/digits-tls --num-workers 4"),
              "docs/operations/security.md"),
}

REFERENCE = "docs/reference/commands.md (every flag: the docs site's command-line reference)"


def epilog(command: str) -> str:
    """Two examples and where to read more, as `--help` prints them (lines kept as written)."""
    first, second, docs = EXAMPLES[command]
    lines = ["examples:"]
    for comment, example in (first, second):
        lines += [f"  # {comment}", f"  {example}"]
    lines += ["", f"docs: {docs}", f"      {REFERENCE}"]
    return "\n".join(lines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A description (one paragraph) is filled to the width as argparse does; an epilog (several lines:
    the examples) is printed as written; a group heading longer than the width is wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def start_section(self, heading: str | None) -> None:
        width = max(self._width - self._current_indent - 1, 20)  # the ':' argparse appends
        if heading and len(heading) > width:
            heading = textwrap.fill(heading, width, subsequent_indent="  ")
        super().start_section(heading)


def decorate(parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser]) -> None:
    """Give the parser and every command the formatter, and each command its epilog."""
    parser.formatter_class = HelpFormatter
    parser.epilog = ("examples:\n  psgrad compare                      # the main job: sync, async and ssp side by side\n"
                     "  psgrad COMMAND --help               # a command's flags, and two examples\n\n"
                     "docs: README.md, docs/index.md (a MkDocs site: pip install -e '.[docs]' && mkdocs serve)")
    for name, command in commands.items():
        command.formatter_class = HelpFormatter
        command.epilog = epilog(name)
