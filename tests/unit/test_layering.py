"""The package's layering, checked on the code's own imports (``ast``, nothing imported).

Each top-level part of ``clawray`` sits on one layer (``LAYERS``, lowest first; the same table
as ``docs/architecture.md``). A module may import from its own layer and the layers below,
never from a layer above: commands (``apps``) are imported by nothing in the library, and the
domain packages never reach into ``serve``. The Ray-free cores import no Ray, not even through
the clawray modules they import. Imports inside functions are counted too (a lazy import is
still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.common import REPO

PACKAGE = REPO / "clawray"

# lowest first; a part may import from its own layer and below
LAYERS: list[tuple[str, ...]] = [
    ("clawray", "config", "samples", "records", "files", "stats", "names", "ledger",
     "placement"),
    # ^ data contracts
    ("models",),
    ("inference",),
    ("weights",),
    ("gate",),
    ("buffer",),
    ("judging",),
    ("learner",),
    ("envs",),
    ("curriculum",),
    ("rollout",),
    ("rlanything",),
    ("sessions",),
    ("serve",),
    ("training",),
    ("sim",),
    ("apps", "experiments", "train", "cli"),  # commands and experiments; train and cli are
    # shims for python -m
]
DOMAIN = ("envs", "curriculum", "rlanything", "sessions", "judging", "learner", "buffer",
          "weights", "gate")
# Ray-free cores: plain Python, testable without a cluster
RAY_FREE = ("clawray.config", "clawray.samples", "clawray.records", "clawray.files",
            "clawray.stats", "clawray.names", "clawray.ledger", "clawray.placement",
            "clawray.buffer.core",
            "clawray.sessions.core", "clawray.sessions.matching", "clawray.sessions.rows",
            "clawray.learner.losses", "clawray.learner.batch", "clawray.curriculum.alp_gmm",
            "clawray.curriculum.samplers", "clawray.curriculum.core", "clawray.rlanything.core",
            "clawray.rlanything.steps", "clawray.rlanything.env_adapter",
            "clawray.envs.rollout", "clawray.judging.parse", "clawray.judging.prompts",
            "clawray.judging.formats",
            "clawray.judging.step_rm", "clawray.gate.core", "clawray.gate.health",
            "clawray.training.tracking")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def part(module: str) -> str:
    """``clawray.serve.chat`` -> ``serve``; ``clawray.config`` -> ``config``."""
    return module.split(".")[1] if "." in module else "clawray"


def layer(module: str) -> int:
    p = part(module)
    for i, names in enumerate(LAYERS):
        if p in names:
            return i
    raise AssertionError(f"{module}: part {p!r} is on no layer of tests/unit/test_layering.py")


def resolve(name: str) -> str | None:
    """The clawray module an import names (``clawray.x.y.func`` -> ``clawray.x.y``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported, line, at_top)`` for every import in ``module``: clawray modules resolved,
    others by their top-level name."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base.startswith("clawray") \
                else [base]
        else:
            continue
        for name in names:
            target = resolve(name) if name.startswith("clawray") else name.split(".")[0]
            if target and target != module:
                out.append((target, node.lineno, id(node) in top))
    return out


def test_every_part_is_on_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_runs_up_a_layer():
    upward = [f"{m}:{line} imports {t} (layer {LAYERS[layer(t)][0]} above {LAYERS[layer(m)][0]})"
              for m in MODULES for t, line, _ in imports(m)
              if t.startswith("clawray") and layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_library_module_imports_a_command():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if part(m) not in LAYERS[-1]
           for t, line, _ in imports(m) if t.startswith("clawray.apps")]
    assert not bad, "\n".join(bad)


def test_domain_packages_import_nothing_from_serve():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if part(m) in DOMAIN
           for t, line, _ in imports(m) if t.startswith("clawray.serve")]
    assert not bad, "\n".join(bad)


def test_the_import_graph_has_no_circle():
    graph = {m: {t for t, _, _ in imports(m) if t.startswith("clawray")} for m in MODULES}
    # a package imports its own modules (re-exports): only module-to-module arrows count
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):]
                                                                      + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("core", RAY_FREE)
def test_ray_free_cores_import_no_ray(core):
    """Through every clawray module the core imports at module level, too."""
    seen, todo = set(), [core]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for t, line, at_top in imports(m):
            assert t != "ray", f"{core} reaches Ray: {m}:{line} imports it"
            if at_top and t.startswith("clawray"):
                todo.append(t)
                parent = t.rpartition(".")[0]  # importing a.b.c runs a.b's __init__ too
                while parent.startswith("clawray"):
                    todo.append(parent)
                    parent = parent.rpartition(".")[0]


def test_each_rule_fails_on_a_module_that_breaks_it(tmp_path, monkeypatch):
    """The rules are not vacuous: planted modules that break them make each check fail."""
    planted = {
        "clawray.envs._up": "from clawray.serve.app import build_app\n",  # up, into serve
        "clawray.sessions._cmd": "from clawray.apps.cli import main\n",  # a command
        "clawray.judging._a": "import clawray.judging._b\n",  # a circle a -> b -> a
        "clawray.judging._b": "def f():\n    from clawray.judging import _a\n",
        "clawray.buffer._ray": "import ray\n",  # Ray, reached from a Ray-free core
    }
    for name, text in planted.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)
    checks = [test_no_import_runs_up_a_layer, test_no_library_module_imports_a_command,
              test_domain_packages_import_nothing_from_serve, test_the_import_graph_has_no_circle]
    for check in checks:
        with pytest.raises(AssertionError):
            check()
    core = tmp_path / "core.py"
    core.write_text("from clawray.buffer import _ray\n")
    monkeypatch.setitem(MODULES, "clawray.buffer._core", core)
    with pytest.raises(AssertionError, match="reaches Ray"):
        test_ray_free_cores_import_no_ray("clawray.buffer._core")
