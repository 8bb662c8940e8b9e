"""The package's layout stays readable: imports run one way, and the plotting stack only where it belongs."""

import ast
from pathlib import Path

import workbook

PACKAGE = Path(workbook.__file__).parent
# Only these may import the plotting and widget stack: everything else runs on a bare GPU image.
DISPLAY_MODULES = {"plots.py", "benchmark_plots.py", "widgets.py"}
DISPLAY_PACKAGES = {"matplotlib", "ipywidgets"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, names: set[str], this: str | None = None) -> set[str]:
    """The workbook modules ``path`` (module ``this``) imports anywhere in it, inside functions included:
    an import placed in a function to dodge a cycle still is one. ``from a import b`` counts a.b when b
    is a module, else a."""
    this = this or module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != this:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in modules()}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each a set of modules that import
    each other round a loop."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_an_import_inside_a_function_and_a_cycle_through_it(tmp_path):
    # The detector itself: a function-level import closes the loop.
    graph = {"a": {"b"}, "b": set(), "c": set()}
    assert cycles(graph) == []
    module = tmp_path / "b.py"
    module.write_text("def f():\n    from workbook import models\n")
    assert imported_modules(module, {"workbook.models", "workbook.b"}, "workbook.b") == {"workbook.models"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]


def test_no_two_modules_import_each_other_round_a_loop():
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports included): " + "; ".join(" <-> ".join(c) for c in found)


def _importers_of(prefixes: tuple[str, ...], within: str, except_modules: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{name} imports {target}" for name, targets in import_graph().items()
                  if name.startswith(within) and name not in except_modules
                  for target in targets if target.startswith(prefixes))


def test_generation_and_training_know_nothing_of_the_jobs_that_run_them():
    # The forecast pilots generation and training, the benchmarks sweep them, the CLI launches them:
    # they sit above, and the jobs they run never import them back.
    above = ("workbook.forecast", "workbook.bench", "workbook.cli", "workbook.widgets")
    assert _importers_of(above, "workbook.generation") == []
    assert _importers_of(above, "workbook.training") == []


def test_the_planners_memory_maths_imports_nothing_from_the_jobs():
    # The fake-tensor trace (and its table) runs the workbook's own training step and the overhead probe
    # its attention path: they run jobs. The formulas, plans and the batch finder do not.
    jobs = ("workbook.generation", "workbook.training", "workbook.forecast", "workbook.bench")
    runs_jobs = ("workbook.planner.trace", "workbook.planner.trace_reference", "workbook.planner.overhead_probe")
    assert _importers_of(jobs, "workbook.planner", except_modules=runs_jobs) == []


def test_the_parser_helpers_import_nothing_of_the_workbook():
    assert import_graph()["workbook.arguments"] == set()


def test_only_plots_and_widgets_import_matplotlib_or_ipywidgets():
    offenders = []
    for path in modules():
        if path.name in DISPLAY_MODULES and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(PACKAGE)}: {name}" for name in names
                          if name.split(".")[0] in DISPLAY_PACKAGES]
    assert not offenders, offenders
