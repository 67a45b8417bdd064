"""Where a module's tests are. The tests are grouped by kind (tests/unit, tests/integration, tests/e2e),
not by module, so to find the tests of psgrad/server/pushes.py:

1. a test file of the same name, `tests/**/test_<name>.py` (leading underscores of the module's name
   dropped): `ls tests/*/test_pushes.py`;
2. else its entry in TESTS_OF below, most direct tests first (an entry may wrap onto a second line):
   `grep -n -A1 "psgrad/server/pushes.py" tests/test_index.py`.

Every module under psgrad/ (but psgrad/proto/, __init__.py and __main__.py) has one or the other, and
the tests below keep it so: a new module without a same-name test file needs a line here, a module
renamed or removed loses its line, and each line names a test file that imports the module (directly or
through a name it defines, e.g. `from psgrad import Embedding`) or names it (its path, its dotted name,
or the `psgrad COMMAND` its docstring says it implements). Where the tests exercise a module only
through another (a shard's internals through Shard, a flag through a real process), BY_BEHAVIOUR says
what in the listed files marks it, and why.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Module (repo-relative path) -> the test files that test it, most direct first.
# fmt: off
TESTS_OF: dict[str, tuple[str, ...]] = {
    "psgrad/cli/commands.py":               ("tests/e2e/test_cli.py", "tests/e2e/test_operations.py",
                                             "tests/e2e/test_allreduce.py", "tests/e2e/test_server_restart.py"),
    "psgrad/cli/flags.py":                  ("tests/e2e/test_cli.py", "tests/unit/test_config.py",
                                             "tests/unit/test_optimizers.py"),
    "psgrad/cli/helptext.py":               ("tests/e2e/test_docs.py", "tests/e2e/test_cli.py"),
    "psgrad/cli/logs.py":                   ("tests/e2e/test_operations.py",),
    "psgrad/cli/main.py":                   ("tests/e2e/test_cli.py", "tests/e2e/test_resume.py",
                                             "tests/unit/test_render.py", "tests/unit/test_launch_ray.py"),
    "psgrad/cli/parser.py":                 ("tests/e2e/test_cli.py", "tests/e2e/test_docs.py",
                                             "tests/e2e/test_compare.py", "tests/unit/test_config.py"),
    "psgrad/cli/status.py":                 ("tests/integration/test_observe.py", "tests/integration/test_messages.py",
                                             "tests/e2e/test_operations.py", "tests/e2e/test_cli.py"),
    "psgrad/cli/train.py":                  ("tests/integration/test_schedules.py", "tests/e2e/test_cli.py"),
    "psgrad/client/parameter_client.py":    ("tests/integration/test_step.py", "tests/integration/test_servicer.py",
                                             "tests/integration/test_reconnect.py",
                                             "tests/integration/test_rollback.py"),
    "psgrad/client/delta_wire.py":          ("tests/integration/test_compressed_pulls.py",),
    "psgrad/client/same_host.py":           ("tests/integration/test_shm.py", "tests/integration/test_transport.py",
                                             "tests/integration/test_published.py"),
    "psgrad/client/shard_client.py":        ("tests/integration/test_servicer.py",
                                             "tests/integration/test_push_gated.py", "tests/integration/test_step.py",
                                             "tests/integration/test_transport.py"),
    "psgrad/client/status_client.py":       ("tests/integration/test_observe.py",
                                             "tests/integration/test_replication.py", "tests/e2e/test_hardening.py"),
    "psgrad/core/adaptive.py":              ("tests/unit/test_adaptive_staleness.py",),
    "psgrad/core/backup.py":                ("tests/unit/test_backup_workers.py",
                                             "tests/integration/test_backup_grpc.py"),
    "psgrad/core/build.py":                 ("tests/e2e/test_operations.py",),
    "psgrad/core/compiled.py":              ("tests/unit/test_draw_kernel.py",),
    "psgrad/core/compression.py":           ("tests/unit/test_gradient_codecs.py",
                                             "tests/integration/test_compressed_pushes.py"),
    "psgrad/core/delay.py":                 ("tests/unit/test_config.py", "tests/integration/test_dc_asgd.py",
                                             "tests/e2e/test_cli.py"),
    "psgrad/core/job.py":                   ("tests/unit/test_config.py", "tests/integration/test_dc_asgd.py",
                                             "tests/e2e/test_cli.py"),
    "psgrad/core/layout.py":                ("tests/unit/test_config.py", "tests/unit/test_gradient_codecs.py",
                                             "tests/unit/test_shard.py", "tests/unit/test_state.py"),
    "psgrad/core/optimizer_settings.py":    ("tests/unit/test_optimizers.py", "tests/unit/test_config.py"),
    "psgrad/core/optimizers/adadelta.py":   ("tests/unit/test_optimizers.py",),
    "psgrad/core/optimizers/adagrad.py":    ("tests/unit/test_optimizers.py", "tests/unit/test_sparse_table.py"),
    "psgrad/core/optimizers/adam.py":       ("tests/unit/test_optimizers.py", "tests/unit/test_sparse_table.py"),
    "psgrad/core/optimizers/base.py":       ("tests/unit/test_optimizers.py",),
    "psgrad/core/optimizers/rmsprop.py":    ("tests/unit/test_optimizers.py",),
    "psgrad/core/optimizers/rows.py":       ("tests/unit/test_sparse_table.py", "tests/unit/test_optimizers.py"),
    "psgrad/core/optimizers/segments.py":   ("tests/integration/test_api.py",
                                             "tests/integration/test_sparse_embeddings.py",
                                             "tests/unit/test_optimizers.py"),
    "psgrad/core/optimizers/sgd.py":        ("tests/unit/test_optimizers.py", "tests/unit/test_transfers.py",
                                             "tests/unit/test_kernels.py"),
    "psgrad/core/policies.py":              ("tests/unit/test_adaptive_staleness.py",
                                             "tests/unit/test_backup_workers.py", "tests/unit/test_consistency.py"),
    "psgrad/core/push_outcome.py":          ("tests/unit/test_serde.py", "tests/unit/test_shard.py"),
    "psgrad/core/rows.py":                  ("tests/unit/test_sparse_table.py",
                                             "tests/integration/test_atomic_push.py"),
    "psgrad/core/schedule.py":              ("tests/unit/test_workloads.py", "tests/integration/test_schedules.py"),
    "psgrad/core/status.py":                ("tests/unit/test_serde.py", "tests/unit/test_env.py",
                                             "tests/integration/test_dc_asgd.py", "tests/integration/test_export.py"),
    "psgrad/errors.py":                     ("tests/unit/test_protocol.py", "tests/integration/test_servicer.py",
                                             "tests/integration/test_messages.py", "tests/unit/test_shard.py"),
    "psgrad/experiments/claims.py":         ("tests/unit/test_verdicts.py",),
    "psgrad/experiments/compare_config.py": ("tests/e2e/test_compare.py", "tests/unit/test_modes.py",
                                             "tests/unit/test_lrgrid.py"),
    "psgrad/launch/certs.py":               ("tests/unit/test_guard.py", "tests/integration/test_api_security.py",
                                             "tests/e2e/test_security.py"),
    "psgrad/launch/jobkeys.py":             ("tests/unit/test_credentials.py", "tests/e2e/test_security.py",
                                             "tests/e2e/test_run.py"),
    "psgrad/launch/k8s.py":                 ("tests/unit/test_render.py",),
    "psgrad/launch/local.py":               ("tests/e2e/test_cli.py", "tests/e2e/test_resume.py",
                                             "tests/unit/test_print_line.py"),
    "psgrad/launch/ray_actors.py":          ("tests/unit/test_launch_ray.py", "tests/e2e/test_ray.py"),
    "psgrad/launch/rendezvous.py":          ("tests/e2e/test_run.py", "tests/e2e/test_netbed.py"),
    "psgrad/launch/roles.py":               ("tests/unit/test_env.py", "tests/unit/test_render.py"),
    "psgrad/launch/slurm.py":               ("tests/unit/test_render.py",),
    "psgrad/launch/slurm_env.py":           ("tests/unit/test_env.py", "tests/e2e/test_run.py"),
    "psgrad/launch/supervisor.py":          ("tests/unit/test_print_line.py", "tests/unit/test_ctrl_c.py",
                                             "tests/integration/test_fork_safety.py"),
    "psgrad/metrics/exporters.py":          ("tests/e2e/test_operations.py",),
    "psgrad/metrics/jsonl.py":              ("tests/integration/test_schedules.py", "tests/e2e/test_allreduce.py"),
    "psgrad/nn/_lookup_kernels.py":         ("tests/unit/test_lookups.py",),
    "psgrad/nn/collection.py":              ("tests/integration/test_grouped_tables.py",
                                             "tests/e2e/test_dlrm_bench.py"),
    "psgrad/nn/embedding.py":               ("tests/unit/test_embedding_modules.py",
                                             "tests/integration/test_sparse_embeddings.py",
                                             "tests/integration/test_embedding_state.py"),
    "psgrad/server/_sgd_kernel.py":         ("tests/unit/test_kernels.py",),
    "psgrad/server/aggregation.py":         ("tests/unit/test_consistency.py", "tests/unit/test_backup_workers.py"),
    "psgrad/server/buffers.py":             ("tests/unit/test_receive_buffers.py",
                                             "tests/integration/test_push_gated.py", "tests/unit/test_transfers.py"),
    "psgrad/server/delay_comp.py":          ("tests/integration/test_dc_asgd.py",),
    "psgrad/server/ledger.py":              ("tests/unit/test_shard.py", "tests/unit/test_consistency.py"),
    "psgrad/server/limits.py":              ("tests/e2e/test_hardening.py",),
    "psgrad/server/membership.py":          ("tests/unit/test_shard.py", "tests/unit/test_consistency.py",
                                             "tests/unit/test_kernels.py"),
    "psgrad/server/publisher.py":           ("tests/integration/test_published.py",),
    "psgrad/server/pushes.py":              ("tests/unit/test_shard.py", "tests/integration/test_atomic_push.py",
                                             "tests/integration/test_push_gated.py", "tests/integration/test_route.py"),
    "psgrad/server/replica_path.py":        ("tests/integration/test_replication.py", "tests/e2e/test_failover.py"),
    "psgrad/server/replica_servicer.py":    ("tests/integration/test_replication.py", "tests/e2e/test_failover.py"),
    "psgrad/server/rows_path.py":           ("tests/integration/test_sparse_embeddings.py",
                                             "tests/integration/test_atomic_push.py",
                                             "tests/unit/test_sparse_table.py"),
    "psgrad/server/runtime.py":             ("tests/integration/test_servicer.py", "tests/e2e/test_cli.py",
                                             "tests/e2e/test_hardening.py"),
    "psgrad/server/shard_core.py":          ("tests/unit/test_shard.py", "tests/unit/test_consistency.py"),
    "psgrad/server/streams.py":             ("tests/unit/test_stream_limits.py", "tests/integration/test_transfer_deadlines.py",
                                             "tests/e2e/test_hardening.py"),
    "psgrad/server/tables.py":              ("tests/unit/test_sparse_table.py", "tests/unit/test_state.py",
                                             "tests/integration/test_grouped_tables.py",
                                             "tests/integration/test_export.py"),
    "psgrad/tasks/base.py":                 ("tests/unit/test_tasks.py",),
    "psgrad/tasks/charlm.py":               ("tests/unit/test_workloads.py",),
    "psgrad/tasks/digits.py":               ("tests/unit/test_tasks.py",),
    "psgrad/tasks/files.py":                ("tests/unit/test_workloads.py", "tests/unit/test_registry.py"),
    "psgrad/tasks/images.py":               ("tests/unit/test_workloads.py",),
    "psgrad/tasks/mnist1d.py":              ("tests/unit/test_tasks.py",),
    "psgrad/tasks/recipes.py":              ("tests/unit/test_registry.py", "tests/unit/test_workloads.py",
                                             "tests/unit/test_ctr.py"),
    "psgrad/wire/frames.py":                ("tests/unit/test_codecs.py", "tests/unit/test_transfers.py",
                                             "tests/integration/test_push_gated.py"),
    "psgrad/wire/rows.py":                  ("tests/integration/test_sparse_embeddings.py", "tests/unit/test_serde.py",
                                             "tests/integration/test_atomic_push.py",
                                             "tests/integration/test_replication.py"),
    "psgrad/worker/loop.py":                ("tests/unit/test_stragglers.py", "tests/unit/test_workloads.py"),
    "psgrad/worker/param_groups.py":        ("tests/integration/test_api.py", "tests/unit/test_optimizers.py"),
    "psgrad/worker/prefetch.py":            ("tests/integration/test_grouped_tables.py",
                                             "tests/integration/test_sparse_embeddings.py"),
    "psgrad/worker/step_stats.py":          ("tests/integration/test_api.py", "tests/integration/test_schedules.py"),
}
# fmt: on

# Entries whose tests exercise the module without importing or naming it: module -> (a string that
# appears in one of its listed test files, preferably the test's name; why that test is this module's).
BY_BEHAVIOUR: dict[str, tuple[str, str]] = {
    "psgrad/cli/logs.py": (
        "--log-format",
        "its servers run with --log-format json and --log-level, the flags this module implements",
    ),
    "psgrad/core/build.py": (
        "psgrad_build_info",
        "checks the build-info metric whose labels build_labels() makes",
    ),
    "psgrad/core/delay.py": (
        "test_dc_asgd_is_a_setting_of_the_modes_with_stale_gradients",
        "JobSpec's dc_asgd checks live here",
    ),
    "psgrad/core/optimizers/segments.py": ("test_parameter_groups_equal_torchs", "groups become a shard's segments"),
    "psgrad/launch/rendezvous.py": (
        "test_real_torchrun_one_group_serves_and_trains",
        "finds the servers via torchrun's store",
    ),
    "psgrad/launch/slurm_env.py": (
        "test_slurm_multi_prog_first_tasks_serve_on_port_base_plus_i",
        "SLURM -> Role via launch.env",
    ),
    "psgrad/server/aggregation.py": (
        "test_sync_mean_is_independent_of_arrival_order",
        "sync's round, through Shard",
    ),
    "psgrad/server/delay_comp.py": (
        "test_the_servers_apply_the_papers_update",
        "the shard's DC-ASGD update, through real servers",
    ),
    "psgrad/server/limits.py": (
        "test_hundreds_of_idle_connections_do_not_lock_out_a_new_client",
        "RLIMIT_NOFILE and the caps",
    ),
    "psgrad/server/replica_path.py": (
        "test_the_backup_holds_the_primarys_state_bit_for_bit",
        "replication, through real servers",
    ),
    "psgrad/server/rows_path.py": (
        "test_bad_ids_and_tables_fail_with_messages_that_name_them",
        "row reads and pushes, via gRPC",
    ),
    "psgrad/server/shard_core.py": (
        "psgrad.server.shard.Shard",
        "Shard is built on it: its lock, conditions and state",
    ),
}


def _modules() -> list[str]:
    pkg = ROOT / "psgrad"
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in pkg.rglob("*.py")
        if p.relative_to(pkg).parts[0] != "proto" and p.name not in ("__init__.py", "__main__.py")
    )


def _test_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py"))


def _same_name(module: str, test_files: list[str]) -> bool:
    name = "test_" + Path(module).stem.lstrip("_") + ".py"
    return any(Path(t).name == name for t in test_files)


def _dotted(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _source(dotted: str) -> Path | None:
    base = ROOT / dotted.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _names_from(src: Path) -> dict[str, tuple[str, str]]:
    """name -> (module, its name there) for each name a module takes from another psgrad module: its
    `from psgrad... import` lines and, for a package's lazy names, its dicts {"Task": "psgrad.tasks.base",
    ...}; the first in ast.walk's order wins. (Once per module: _origin asks for many names.)"""
    out: dict[str, tuple[str, str]] = {}
    for node in ast.walk(_tree(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("psgrad"):
            for alias in node.names:
                out.setdefault(alias.asname or alias.name, (node.module or "", alias.name))
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Constant) \
                        and isinstance(value.value, str) and _source(value.value) is not None:
                    out.setdefault(key.value, (value.value, key.value))
    return out


@functools.cache
def _origin(dotted: str, name: str, depth: int = 0) -> str:
    """The psgrad module that defines `name` as seen from module `dotted`, through re-exports."""
    if _source(f"{dotted}.{name}") is not None:
        return f"{dotted}.{name}"
    src = _source(dotted)
    if src is None or depth > 5:
        return dotted
    found = _names_from(src).get(name)
    return dotted if found is None else _origin(found[0], found[1], depth + 1)


@functools.cache
def _imported(test_file: str) -> frozenset[str]:
    """The psgrad modules a test file imports: by module, or by a name they define (re-exports followed,
    also for `module.Name` after `import psgrad` or `from psgrad.tasks import registry`)."""
    tree = _tree(ROOT / test_file)
    out: set[str] = set()
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "psgrad":
                    out.add(alias.name)
                    aliases[alias.asname or "psgrad"] = alias.name if alias.asname else "psgrad"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "psgrad":
            out.add(node.module or "")
            for alias in node.names:
                origin = _origin(node.module or "", alias.name)
                out.add(origin)
                if _source(origin) is not None and origin.endswith("." + alias.name):
                    aliases[alias.asname or alias.name] = origin
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.add(_origin(aliases[node.value.id], node.attr))
    return frozenset(out)


def _commands(module: str) -> list[str]:
    """The `psgrad COMMAND`s a module's docstring says it implements."""
    doc = ast.get_docstring(_tree(ROOT / module)) or ""
    return sorted(set(re.findall(r"`psgrad ([a-z][a-z0-9-]*)", doc)))


def _imports_or_names(test_file: str, module: str) -> bool:
    dotted = _dotted(module)
    if dotted in _imported(test_file):
        return True
    text = (ROOT / test_file).read_text(encoding="utf-8")
    if module in text or re.search(re.escape(dotted) + r"(?![\w])", text):
        return True
    return any(f"psgrad {c}" in text or f'["{c}"' in text for c in _commands(module))


def test_every_module_has_a_same_name_test_file_or_an_entry() -> None:
    tests = _test_files()
    missing = [m for m in _modules() if not _same_name(m, tests) and m not in TESTS_OF]
    assert not missing, (
        f"modules with neither a tests/**/test_<name>.py nor a line in TESTS_OF ({__file__}): {missing}"
    )


def test_entries_name_existing_modules_and_test_files_and_no_module_twice() -> None:
    modules, tests = set(_modules()), _test_files()
    stale = sorted(set(TESTS_OF) - modules)
    assert not stale, f"TESTS_OF names modules that are gone (or are not modules it indexes): {stale}"
    doubled = sorted(m for m in TESTS_OF if _same_name(m, tests))
    assert not doubled, f"these modules have a same-name test file, so no TESTS_OF line: {doubled}"
    for module, files in TESTS_OF.items():
        assert 1 <= len(files) <= 4 and len(set(files)) == len(files), (module, files)
        gone = [f for f in files if f not in tests or f == "tests/test_index.py"]
        assert not gone, f"{module}: no such test files: {gone}"


def test_each_entry_lists_a_test_file_that_imports_or_names_its_module() -> None:
    unmarked = []
    for module, files in TESTS_OF.items():
        files = tuple(f for f in files if (ROOT / f).is_file())  # a missing one fails the test above
        if any(_imports_or_names(f, module) for f in files):
            assert module not in BY_BEHAVIOUR, f"{module}: its tests name it; drop its BY_BEHAVIOUR line"
            continue
        if module not in BY_BEHAVIOUR:
            unmarked.append(module)
            continue
        marker, why = BY_BEHAVIOUR[module]
        assert why.strip(), module
        assert any(marker in (ROOT / f).read_text(encoding="utf-8") for f in files), (
            f"{module}: none of {files} contains {marker!r} ({why})"
        )
    assert not unmarked, (
        f"no listed test file imports or names these modules (list one, or add a BY_BEHAVIOUR line): {unmarked}"
    )
    assert set(BY_BEHAVIOUR) <= set(TESTS_OF), sorted(set(BY_BEHAVIOUR) - set(TESTS_OF))
