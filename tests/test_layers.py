"""The house plan (README "Layout"): steptrace's modules import only downward, so there is no import
circle and each layer can be read without the ones above it.

    leaf modules → handles → sinks → resolver → runtime → public API (steptrace/__init__)
    exporters, analysis, testing and the CLI sit beside the API: they import leaf modules and each
    other, never the runtime's layers (they reach a run through the public API)

Only module-level imports count (imports inside functions load optional frameworks lazily, and
``if TYPE_CHECKING:`` blocks never run)."""

import ast
from pathlib import Path

import pytest

import steptrace

ROOT = Path(steptrace.__file__).parent

LAYER = {
    "_version": 0, "_errors": 0, "_ids": 0, "_buckets": 0, "_wakeup": 0, "_config": 0,
    "_attribution": 0, "_clock": 0, "_devices": 0, "_schema": 0, "_metadata": 0,
    "_handles": 1,
    "_sinks": 2,
    "_resolver": 3,
    "_runtime": 4,
    "__init__": 5,
}
BESIDE_THE_API = 6  # exporters, analysis, testing, CLI: anything not listed above


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            if isinstance(sub, ast.ImportFrom) and sub.level == 1:  # from ._ids import x / from . import x
                if sub.module:
                    found.add(sub.module.split(".")[0])
                else:
                    found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("steptrace"):
                parts = sub.module.split(".")
                if len(parts) == 1:  # from steptrace import x: x is a submodule or the API itself
                    found.update(alias.name if alias.name.startswith("_") else "__init__" for alias in sub.names)
                else:
                    found.add(parts[1])
            elif isinstance(sub, ast.Import):
                for alias in sub.names:
                    if alias.name.startswith("steptrace."):
                        found.add(alias.name.split(".")[1])
    return found


def _core_modules():
    # steptrace/analysis/* sit beside the API (they are not in LAYER): they must not reach the runtime.
    return sorted(ROOT.glob("*.py")) + sorted((ROOT / "analysis").glob("*.py"))


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: p.stem)
def test_modules_import_only_from_layers_below(path):
    layer = LAYER.get(path.stem, BESIDE_THE_API)
    for imported in _module_level_imports(path):
        imported_layer = LAYER.get(imported, BESIDE_THE_API)
        if layer == BESIDE_THE_API:
            assert imported_layer in (0, BESIDE_THE_API), (
                f"{path.name} (beside the API) imports steptrace.{imported}; it may use leaf modules "
                "and its neighbours, never the runtime's layers")
        elif layer == 0:
            assert imported_layer == 0, f"leaf module {path.name} imports steptrace.{imported}"
        else:
            assert imported_layer < layer, (
                f"{path.name} (layer {layer}) imports steptrace.{imported} (layer {imported_layer})")


def test_no_import_circle_at_all():
    graph = {p.stem: _module_level_imports(p) for p in _core_modules()}
    state: dict[str, int] = {}

    def visit(module, path):
        if state.get(module) == 1:
            raise AssertionError(f"import circle: {' -> '.join(path + [module])}")
        if state.get(module) == 2 or module not in graph:
            return
        state[module] = 1
        for imported in graph[module]:
            visit(imported, path + [module])
        state[module] = 2

    for module in graph:
        visit(module, [])


def test_no_submodule_is_shadowed_by_a_global_of_the_package():
    """``steptrace._runtime`` and ``steptrace._config`` are the submodules (hooks read the open step
    through the public API, not through a package global)."""
    import importlib

    for path in _core_modules():
        if path.parent == ROOT and path.stem not in ("__init__", "__main__"):
            assert getattr(steptrace, path.stem, None) in (None, importlib.import_module(f"steptrace.{path.stem}"))


def test_current_step_and_last_step_are_public():
    from steptrace.testing import capture

    assert steptrace.current_step() is None and steptrace.last_step() is None
    with capture():
        with steptrace.step(3) as s:
            assert steptrace.current_step() is s and steptrace.current_step().step == 3
        assert steptrace.current_step() is None and steptrace.last_step() == 3
    assert steptrace.last_step() is None


def test_the_version_is_the_packages():
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert steptrace.__version__ == project["version"]
