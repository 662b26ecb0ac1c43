"""The package's layers (docs/architecture.md): imports run one way, down the data flow, and backends use the kit.

Every module is placed in ORDER, lowest first. A module imports only modules placed before it: at import, inside a
function, or for type checking alone (under ``if TYPE_CHECKING:``), so no two modules import each other. The one way
up is the facade: Cartridge's constructors that need the making layer. And at run time, importing the package or
the kit loads neither the making nor the serve layer.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "cartridges_sdk"
LAYERS = {
    # the nouns and the contract: the file, what lower modules read of a model and a cartridge (protocols), requests,
    # backend ABCs, KV helpers, the model, where models come from, the cartridge, the kit
    "core": ["errors", "checks", "files", "net", "identity", "rope", "fileformat", "protocols", "generation",
             "trainer_inputs", "plugins", "runtime_choice", "kv", "sampling", "lm", "named_models", "tiny", "models", "interop", "cartridge",
             "probe", "kit"],
    # the built-in backend, a plugin like any other (it imports the kit alone)
    "hf": ["hf.decode", "hf.runtime", "hf.synthesizer", "hf"],
    # making cartridges: corpus -> seeds -> synthesis -> dataset -> training (or compaction)
    "making": ["making.corpus", "making.dataset", "making.seeds", "making.settings", "making.distributed", "making.precision",
              "making.conversations", "making.windows", "making.synthesis", "making.memory", "making.distractors",
              "making.checkpoint", "making.trainable", "making.loss", "making.training", "making.evaluation",
              "making.report", "making.recording", "making.compaction", "making.selfstudy", "making"],
    # serving them
    "serve": ["serve.background", "serve.words", "serve.subjects", "serve.documents", "serve.catalog", "serve.settings", "serve.records", "serve.guard",
              "serve.sync", "serve.store_selfstudy", "serve.forget", "serve.rerank", "serve.embedding", "serve.attended", "serve.passages", "serve.store", "serve.answering", "serve.watch", "serve.access", "serve.audit", "serve.parse",
              "serve.engine", "serve.replies", "serve.state", "serve.admission", "serve.server", "serve.mcp_tool", "serve"],
    # for plugin authors' tests
    "testing": ["testing.fakes", "testing.contract", "testing.isolation", "testing.fixtures", "testing"],
    # the entry points: the command line and the public API
    "top": ["cli.common", "cli.files", "cli.selfstudy", "cli.use", "cli.access", "cli.parser", "cli", "cli.__main__",
            ""],
}
ORDER = [m for group in LAYERS.values() for m in group]
LAYER_OF = {m: name for name, group in LAYERS.items() for m in group}
# the facade (docs/architecture.md): Cartridge.from_corpus and Cartridge.compact hand off to the making
# layer, imported inside the method, so `Cartridge` is the one front door and cartridge.py depends on nothing above
FACADE = {("cartridge", "making.selfstudy"), ("cartridge", "making.compaction")}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _targets(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules an import statement loads, as names relative to the package ("" is the package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level:
        base = module.split(".") if module else []
        if MODULES[module].name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
        names = ["cartridges_sdk" + ("." + stem if stem else "") + "." + a.name for a in node.names]
        names = [n if n.removeprefix("cartridges_sdk.") in MODULES else n.rsplit(".", 1)[0] for n in names]
    else:
        names = [f"{node.module}.{a.name}" for a in node.names]
        names = [n if n.removeprefix("cartridges_sdk.") in MODULES else node.module for n in names]
    out = []
    for n in names:
        if n == "cartridges_sdk" or n.startswith("cartridges_sdk."):
            rel = n.removeprefix("cartridges_sdk").removeprefix(".")
            while rel and rel not in MODULES:
                rel = rel.rpartition(".")[0]
            out.append(rel)
    return out


def _imports(tree: ast.AST, *, typing_only: bool = False):
    """(is it type-checking only, node) for every import, at any depth: module level, in functions, in classes."""
    for node in ast.iter_child_nodes(tree):
        guarded = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield typing_only, node
        yield from _imports(node, typing_only=typing_only or guarded)


def _edges() -> list[tuple[str, str, bool]]:
    edges = []
    for module, path in MODULES.items():
        for typing_only, node in _imports(ast.parse(path.read_text())):
            edges += [(module, t, typing_only) for t in _targets(module, node) if t != module]
    return edges


def test_every_module_has_a_place():
    unplaced = sorted(set(MODULES) - set(ORDER))
    assert not unplaced, f"place {unplaced} in tests/test_layers.py LAYERS (and docs/architecture.md)"
    assert not set(ORDER) - set(MODULES), f"LAYERS names modules that do not exist: {sorted(set(ORDER) - set(MODULES))}"


def test_imports_run_down_the_layers():
    wrong = []
    for module, target, typing_only in _edges():
        if ORDER.index(target) > ORDER.index(module) and (module, target) not in FACADE:
            how = "names" if typing_only else "imports"
            wrong.append(f"{module or '__init__'} {how} {target}{' for type checking' * typing_only}, placed above it")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    """Typing-only imports count: two modules that name each other only for a type checker still cannot be read,
    or moved, one without the other."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, target, _ in _edges():
        if (module, target) not in FACADE:
            graph[module].add(target)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_facade_is_the_only_way_up_and_is_lazy():
    for module, target, typing_only in _edges():
        if (module, target) in FACADE:
            assert not typing_only
    top_level = [t for n in ast.parse(MODULES["cartridge"].read_text()).body if isinstance(n, ast.ImportFrom)
                 for t in _targets("cartridge", n)]
    assert not {t for _, t in FACADE} & set(top_level), "the facade's imports must sit inside the methods"


@pytest.mark.parametrize("module", ["cartridges_sdk", "cartridges_sdk.kit"])
def test_importing_the_package_or_the_kit_loads_the_core_alone(module):
    """In a fresh interpreter: the making and serve layers (and hf/, testing/, cli/) stay unloaded until used."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    ours = [m.removeprefix("cartridges_sdk").removeprefix(".") for m in loaded if m.split(".")[0] == "cartridges_sdk"]
    above = sorted(m for m in ours if LAYER_OF.get(m, "core") != "core" and m != "")
    assert not above, f"import {module} loads {above}; the package resolves those layers' names on first use"
    assert not {"vllm", "llama_cpp", "fastapi"} & set(loaded)


def test_the_lazy_names_resolve_and_type_checkers_see_them():
    import cartridges_sdk

    tree = ast.parse(MODULES[""].read_text())
    typing_only = {a.asname or a.name: node.module for guarded, node in _imports(tree) if guarded
                   for a in node.names}
    assert typing_only == cartridges_sdk._LAZY, "the TYPE_CHECKING imports and _LAZY in __init__.py must agree"
    assert set(cartridges_sdk._LAZY) <= set(cartridges_sdk.__all__) <= set(dir(cartridges_sdk))
    for name in cartridges_sdk.__all__:
        assert getattr(cartridges_sdk, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        cartridges_sdk.NoSuchName  # noqa: B018


KIT = {"cartridges_sdk", "cartridges_sdk.kit"}


def _sdk_imports(path: Path) -> list[str]:
    names = []
    for _, node in _imports(ast.parse(path.read_text())):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        names += [m for m in mods if m == "cartridges_sdk" or m.startswith("cartridges_sdk.")]
    return names


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "backends").glob("*/cartridges_*/**/*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_backends_import_the_public_api_and_the_kit_only(path):
    others = sorted(set(_sdk_imports(path)) - KIT)
    assert not others, f"{path.relative_to(ROOT)} imports {others}; backends use cartridges_sdk and cartridges_sdk.kit only"


def test_the_builtin_backend_keeps_the_same_rule():
    for module, target, _ in _edges():
        if LAYER_OF[module] == "hf":
            assert target == "kit" or target.startswith("hf"), f"{module} imports {target}; hf/ uses the kit alone"


def test_long_modules_say_why():
    for module, path in MODULES.items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert lines <= 400 or "Longer than 400 lines because" in doc, f"{path.relative_to(ROOT)} has {lines} lines"


def test_the_architecture_page_and_the_readme_draw_these_layers():
    page = (ROOT / "docs" / "architecture.md").read_text()
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):readme.index("## Tests")]
    for folder in ("hf/", "making/", "serve/", "testing/"):
        assert folder in page and folder in layout, f"{folder} is missing from docs/architecture.md or the README"
    for module in LAYERS["core"]:
        assert module in page, f"docs/architecture.md does not place the core module {module}"
    for module in [m.rpartition(".")[2] for m in LAYERS["making"] + LAYERS["serve"] if "." in m]:
        assert module in page, f"docs/architecture.md does not name {module}"


# Folder names that standard Python ignore templates (GitHub's Python.gitignore, for one) and linters' default
# excludes (ruff's, for one) treat as build output or environments at any depth: a package folder so named is
# silently skipped by `git add` in a repository with that template, and never read by a linter run with defaults.
OUTPUT_NAMES = {"build", "dist", "develop-eggs", "downloads", "eggs", ".eggs", "lib", "lib64", "parts", "sdist", "var",
                "wheels", "env", "venv", "ENV", "site", "target", "htmlcov", "instance", "_build", "buck-out",
                "node_modules", "site-packages", "__pypackages__", "cover"}


def test_no_package_folder_has_a_name_tools_treat_as_output():
    roots = [PACKAGE, *ROOT.glob("backends/*/cartridges_*"), *ROOT.glob("integrations/*/cartridges_*")]
    bad = sorted(str(d.relative_to(ROOT)) for r in roots for d in [r, *r.rglob("*")]
                 if d.is_dir() and d.name in OUTPUT_NAMES)
    assert not bad, f"rename {bad}: standard ignore templates and linters skip folders with these names"
