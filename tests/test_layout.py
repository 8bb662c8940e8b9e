"""The package's layout stays readable: small modules, and the plotting stack only where it belongs."""

import ast
from pathlib import Path

import workbook

PACKAGE = Path(workbook.__file__).parent
MAX_MODULE_LINES = 450  # one job per module: a newcomer reads a module, not a thousand lines
# Only these may import the plotting and widget stack: everything else runs on a bare GPU image.
DISPLAY_MODULES = {"plots.py", "benchmark_plots.py", "widgets.py"}
DISPLAY_PACKAGES = {"matplotlib", "ipywidgets"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_small_enough_to_read_whole():
    too_long = {str(path.relative_to(PACKAGE)): lines for path in modules()
                if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {too_long}"


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
