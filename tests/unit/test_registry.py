"""psgrad/tasks/registry.py: task names, recipes and data checks without torch; a built-in's module
imported when its factory is first asked for."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, child_env
from psgrad.errors import TaskError
from psgrad.tasks import registry

_PROGRAM = """
import sys
from psgrad.tasks import check_task, known_task, recipe_for, task_names
from psgrad.cli.flags import BUILTIN_TASKS

assert recipe_for("ctr").metric == "test_auc" and recipe_for("charlm").optimizer == "adamw"
check_task("digits")
known_task("mnist1d")
try:
    check_task("digits", "/tmp")
except Exception as exc:
    print(type(exc).__name__, exc)
print(BUILTIN_TASKS)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.timeout(120)
def test_names_recipes_and_checks_import_no_torch() -> None:
    """What a launcher and every usage error need: without torch (3 CPU-s to import)."""
    res = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=100, cwd=REPO,
                         env=child_env())
    assert res.returncode == 0, res.stderr
    refused, names, torch_modules = res.stdout.strip().splitlines()
    assert refused == "TaskError task 'digits' reads no data directory: leave out --data-dir"
    assert names == "digits, mnist1d, mnist, fashion-mnist, charlm, ctr, pyfunc, skipgram"
    assert torch_modules == "[]"


@pytest.mark.parametrize("name", sorted(registry.BUILT_IN))
def test_every_built_in_module_registers_its_name(name: str) -> None:
    factory = registry.resolve_task(name)
    assert factory.__module__ == registry.BUILT_IN[name].module
    assert registry.TASKS[name] is factory
    assert registry.takes_data_dir(factory) == registry.BUILT_IN[name].reads_data_dir


def test_a_user_task_keeps_its_recipe_and_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "TASKS", dict(registry.TASKS))
    monkeypatch.setattr(registry, "DATA_CHECKS", dict(registry.DATA_CHECKS))
    recipe = registry.Recipe(metric="test_loss", lr=0.5)

    def missing(data_dir: str | None) -> None:
        raise TaskError(f"nothing in {data_dir}")

    @registry.register_task("mine", recipe, check=missing)
    def mine(seed: int = 0, data_dir: str | None = None) -> None:  # type: ignore[return]
        pass

    try:
        assert registry.recipe_for("mine") is recipe and "mine" in registry.task_names()
        with pytest.raises(TaskError, match="nothing in /data"):
            registry.check_task("mine", "/data")
    finally:
        registry.RECIPES.pop("mine", None)
    with pytest.raises(TaskError, match="unknown task 'nope'; valid tasks: charlm, ctr, digits"):
        registry.known_task("nope")
