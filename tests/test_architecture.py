"""The layer rules of ARCHITECTURE.md, checked from every import in the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rapydli"


def layers() -> list[tuple[str, list[str]]]:
    """The ``layers`` block of ARCHITECTURE.md: (name, module prefixes), bottom first."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block is not None, "ARCHITECTURE.md has no ```layers block"
    return [(line.split()[0], line.split()[1:]) for line in block.group(1).splitlines() if line.strip()]


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    for index, (_, prefixes) in enumerate(table):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if name != "rapydli":
            found.append((name, path))
    return found


def imports(path: Path) -> list[str]:
    """Every absolute module imported anywhere in the file (also inside functions and TYPE_CHECKING)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names if node.module == "rapydli"]
    return names


def test_every_module_belongs_to_a_layer() -> None:
    table = layers()
    assert [name for name, _ in table][:2] == ["base", "cluster"]
    homeless = [name for name, _ in modules() if layer_of(name, table) is None]
    assert not homeless, f"modules in no layer of ARCHITECTURE.md: {homeless}"


def test_no_module_imports_a_higher_layer() -> None:
    table = layers()
    violations = []
    for name, path in modules():
        mine = layer_of(name, table)
        for imported in imports(path):
            if imported.startswith("rapydli.") or imported == "rapydli":
                theirs = layer_of(imported, table)
                if theirs is not None and mine is not None and theirs > mine:
                    violations.append(f"{name} ({table[mine][0]}) imports {imported} ({table[theirs][0]})")
    assert not violations, "\n".join(violations)


def rooms() -> list[tuple[str, list[str]]]:
    """The ``rooms`` block of ARCHITECTURE.md (experiments/ inside): (name, module prefixes), bottom first."""
    block = re.search(r"```rooms\n(.*?)```", (ROOT / "ARCHITECTURE.md").read_text(), re.S)
    assert block is not None, "ARCHITECTURE.md has no ```rooms block"
    return [(line.split()[0], line.split()[1:]) for line in block.group(1).splitlines() if line.strip()]


def room_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The room of ``module``'s longest matching prefix (``planning.planner`` is a front door, ``planning`` a model)."""
    found = [
        (len(p), index)
        for index, (_, prefixes) in enumerate(table)
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    return max(found)[1] if found else None


def test_experiments_import_only_downward_and_never_the_package_root() -> None:
    table = rooms()
    inside = [(name, path) for name, path in modules() if name.startswith("rapydli.experiments.")]
    homeless = [name for name, _ in inside if room_of(name, table) is None]
    assert not homeless, f"experiments modules in no room of ARCHITECTURE.md: {homeless}"
    violations = []
    for name, path in inside:
        mine = room_of(name, table)
        for imported in imports(path):
            theirs = room_of(imported, table) if imported.startswith("rapydli.experiments.") else None
            if theirs is not None and mine is not None and theirs > mine:
                violations.append(f"{name} ({table[mine][0]}) imports {imported} ({table[theirs][0]})")
    assert not violations, "\n".join(violations)
    rooted = [
        name for name, path in modules() if "rapydli" in imports(path)
    ]  # `from rapydli import ...`, `import rapydli`
    assert not rooted, (
        f"modules importing the package root (import what you need from the module that owns it): {rooted}"
    )


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("rapydli.experiments", ("rapydli.widgets", "rapydli.server", "rapydli.notebook", "IPython", "ipywidgets")),
        ("rapydli.trainer", ("rapydli.notebook", "rapydli.widgets", "rapydli.magics", "rapydli.experiments")),
        ("rapydli.trainer.loop", ("rapydli.cluster",)),
        ("rapydli.parallel", ("rapydli.trainer", "rapydli.zoo")),
        ("rapydli.objective", ("rapydli.trainer", "rapydli.parallel", "rapydli.zoo")),
        ("rapydli.widgets", ("rapydli.notebook",)),
    ],
)
def test_named_rules(importer: str, forbidden: tuple[str, ...]) -> None:
    """Experiments run headless; engine code imports no front end; the Trainer never asks the cluster;
    the notebook front door uses the widgets, never the other way round; ``parallel`` holds building
    blocks below the Trainer and the reference models, and the objective sits below all of them."""
    hits = [
        f"{name} imports {imported}"
        for name, path in modules()
        if name == importer or name.startswith(importer + ".")
        for imported in imports(path)
        if any(imported == f or imported.startswith(f + ".") for f in forbidden)
    ]
    assert not hits, "\n".join(hits)


def test_only_the_cluster_layer_starts_processes() -> None:
    """``subprocess`` and ``multiprocessing`` appear only where ARCHITECTURE.md allows them."""
    # batch and batchhosts name subprocess types; their processes are started by cluster.processes and cluster.sshhosts
    allowed = (
        "rapydli.cluster",
        "rapydli.native",
        "rapydli.data.workers",
        "rapydli.experiments.batch.batch",
        "rapydli.experiments.batch.hosts",
    )
    users = [
        name
        for name, path in modules()
        if any(i.split(".")[0] in ("subprocess", "multiprocessing") for i in imports(path))
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert not users, f"modules that import subprocess/multiprocessing outside the cluster layer: {users}"


def test_no_figure_is_a_widget() -> None:
    """Figures are plain plotly figures, live ones too: a ``FigureWidget``'s saved state carries ~5 MB of
    plotly.js, which plain papermill and nbconvert keep even for a closed widget."""

    def builds_widgets(path: Path) -> bool:
        return any(
            (isinstance(node, ast.Attribute) and node.attr == "FigureWidget")
            or (isinstance(node, ast.Name) and node.id == "FigureWidget")
            for node in ast.walk(ast.parse(path.read_text()))
        )

    users = [name for name, path in modules() if builds_widgets(path)]
    assert not users, f"modules that build FigureWidgets: {users}"


def test_no_code_outside_the_launcher_registry_decides_by_a_launchers_name() -> None:
    """What a launcher can do is a capability of its ``LauncherSpec`` (a batch queue, hosts over ssh, batch items),
    so adding one touches the registry and its own module: no comparison with a launcher's name and no table
    keyed by it elsewhere. The launchers' own modules (``cluster.slurm``, ``cluster.sshhosts``) may name theirs."""
    from rapydli.cluster.launchers import LAUNCHERS

    names = set(LAUNCHERS)
    owners = {"rapydli.cluster.launchers", "rapydli.cluster.slurm", "rapydli.cluster.sshhosts"}

    def named(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(element) for element in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    found = []
    for name, path in modules():
        if name in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            decides = isinstance(node, ast.Compare) and any(named(side) for side in (node.left, *node.comparators))
            keyed = isinstance(node, ast.Dict) and any(key is not None and named(key) for key in node.keys)
            if decides or keyed:
                found.append(f"{name}:{node.lineno}")
    assert not found, f"decisions by a launcher's name outside the launcher registry: {found}"


def test_packages_name_their_api_through_the_one_lazy_loader() -> None:
    """Every package whose ``__init__`` imports names on first use does it through ``rapydli.lazy.LazyExports``
    (seven had each written their own ``__getattr__`` with ``import_module``)."""
    own = [str(path.relative_to(ROOT)) for path in PACKAGE.rglob("__init__.py") if "import_module" in path.read_text()]
    assert not own, f"package __init__ files with a loader of their own: {own}"
    lazy = [path for path in PACKAGE.rglob("__init__.py") if "def __getattr__" in path.read_text()]
    assert lazy and all("LazyExports" in path.read_text() for path in lazy)
