"""The house plan (README "Layout"): steptrace's modules import only downward, so there is no import
circle and each layer can be read without the ones above it.

    leaf modules (with the device backends adapters.jax and adapters.torch, and the collective
    timing adapters.torch_distributed, which import no steptrace module) → handles → sinks (_sinks
    and the exporters the API plugs in: prometheus, otlp, trackers) → resolver → runtime → public API
    (steptrace/__init__)
    analysis, testing and the CLI sit beside the API: they import leaf modules, the public API and
    each other, never the runtime's layers

Every import counts: at module level, inside functions (lazy imports of optional parts) and under
``if TYPE_CHECKING:`` (a type-only import still sends a reader up a layer). Modules are named by
their dotted path (``steptrace.timeline`` and ``steptrace.analysis.timeline`` are two modules).

And no module imports another's private names: ``from steptrace.x import _name`` is allowed only
where ``_name`` is a submodule (``from steptrace import _attribution``)."""

import ast
import importlib.util
from pathlib import Path

import pytest

import steptrace

ROOT = Path(steptrace.__file__).parent

LAYER = {
    **{f"steptrace.{leaf}": 0 for leaf in (
        "_version", "_errors", "_ids", "_buckets", "_wakeup", "_config", "_attribution", "_clock",
        "_devices", "_schema", "_metadata", "_ratelimit", "_attempts", "_stall", "_capture", "_health", "_peaks",
        "_loops", "_hotpath", "_pauses",
        "adapters.jax", "adapters.torch", "adapters.torch_distributed")},
    "steptrace._handles": 1,
    "steptrace._sinks": 2, "steptrace.prometheus": 2, "steptrace.otlp": 2, "steptrace.trackers": 2,
    "steptrace._resolver": 3,
    "steptrace._runtime": 4,
    "steptrace": 5,
}
BESIDE_THE_API = 6  # analysis, testing, CLI: anything not listed above
ADAPTERS = Path(importlib.util.find_spec("steptrace.adapters").submodule_search_locations[0])
# _devices loads them lazily
DEVICE_BACKENDS = [ADAPTERS / "jax.py", ADAPTERS / "torch.py", ADAPTERS / "torch_distributed.py"]


def _core_modules() -> list[Path]:
    # steptrace/analysis/* sit beside the API (they are not in LAYER): they must not reach the runtime.
    return sorted(ROOT.glob("*.py")) + sorted((ROOT / "analysis").glob("*.py")) + DEVICE_BACKENDS


def _name(path: Path) -> str:
    if path.parent == ADAPTERS:
        return f"steptrace.adapters.{path.stem}"
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in _core_modules()}


def _is_module(dotted: str) -> bool:
    """A steptrace module or package (also those installed from adapters/ and collector/)."""
    if dotted in MODULES:
        return True
    parent, _, last = dotted.rpartition(".")
    try:
        spec = importlib.util.find_spec(parent) if parent.startswith("steptrace") else None
    except (ImportError, ValueError):
        return False
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / f"{last}.py").exists() or (Path(location) / last / "__init__.py").exists():
            return True
        if any(Path(location).glob(f"{last}.*.so")) or (Path(location) / f"{last}.c").exists():
            return True  # a C extension (steptrace._hotpath), built or not
    return False


def _imports(path: Path, source: str | None = None) -> list[tuple[str, str | None, int]]:
    """Every steptrace import in *path*, anywhere in it: (module, name or None, line).

    ``from steptrace.x import y`` gives (steptrace.x.y, None) when y is a submodule, else
    (steptrace.x, y); ``import steptrace.x`` gives (steptrace.x, None). The packages a module's
    import loads on the way (``steptrace`` for ``steptrace._ids``) are not counted."""
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "steptrace"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module.split(".")[0] != "steptrace":
                continue
            for alias in node.names:
                if _is_module(f"{module}.{alias.name}"):
                    found.append((f"{module}.{alias.name}", None, node.lineno))
                else:
                    found.append((module, alias.name, node.lineno))
    return found


def _imported_modules(path: Path) -> set[str]:
    return {module for module, _, _ in _imports(path)}


@pytest.mark.parametrize("path", _core_modules(), ids=_name)
def test_modules_import_only_from_layers_below(path):
    name = _name(path)
    layer = LAYER.get(name, BESIDE_THE_API)
    for imported in sorted(_imported_modules(path) - {name}):
        imported_layer = LAYER.get(imported, BESIDE_THE_API)
        if layer == BESIDE_THE_API:
            assert imported_layer in (0, LAYER["steptrace"], BESIDE_THE_API), (
                f"{name} (beside the API) imports {imported}; it may use leaf modules, the public API "
                "and its neighbours, never the runtime's layers")
        elif layer == 0:
            assert imported_layer == 0, f"leaf module {name} imports {imported}"
        else:
            assert imported_layer < layer, f"{name} (layer {layer}) imports {imported} (layer {imported_layer})"


def test_no_import_circle_at_all():
    graph = {name: _imported_modules(path) - {name} for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(module, path):
        if state.get(module) == 1:
            raise AssertionError(f"import circle: {' -> '.join(path + [module])}")
        if state.get(module) == 2 or module not in graph:
            return
        state[module] = 1
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        state[module] = 2

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize("path", _core_modules(), ids=_name)
def test_no_module_imports_another_modules_private_names(path):
    private = [f"{module}.{name} (line {line})" for module, name, line in _imports(path)
               if name is not None and name.startswith("_") and not name.startswith("__")]
    assert not private, f"{_name(path)} imports private names of other modules: {private}"


def test_the_checks_see_imports_in_functions_and_under_type_checking():
    """The checks above are only as good as what they read: a type-only import, a lazy import in a
    function, a relative import and a private name must all be found."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from steptrace._runtime import Runtime\n"
        "def f():\n    from steptrace.analysis.plotting import render_png\n"
        "    from . import _resolver\n"
        "    from .analysis.summary import _hidden\n"
    )
    found = _imports(ROOT / "_example.py", source)
    assert {(module, name) for module, name, _ in found} == {
        ("steptrace._runtime", "Runtime"), ("steptrace.analysis.plotting", "render_png"),
        ("steptrace._resolver", None), ("steptrace.analysis.summary", "_hidden")}


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
