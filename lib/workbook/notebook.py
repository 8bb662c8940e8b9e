"""The few helpers every notebook uses: validated parameters, the run folder, tables, saving.

A notebook calls `session = start(globals(), "00_gpu_detection")` right after its parameters
cell, whose values are the schema's defaults. The whole profile is built here, once, as
`params.load` builds it: the defaults, the GPU row's facts, then what papermill injected (`-f
params/<profile>.yaml`, `-p`, or the runner's values), so a plain papermill run gets exactly what
`workbook run` gives. A notebook run with nothing injected (opened in JupyterLab) loads the profile
its `profile` names. A value edited in the cell (one that differs from its default) wins in both.
A parameter injected by papermill that no schema knows (a typo in a params file or `-p`) is an
error here, not papermill's warning.
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbook import params as params_module
from workbook.paths import OUTPUTS_DIR

# Notebook parameters that are not profile settings: where to write, and how to display.
RUN_DIR_PARAMETER = "run_dir"
# papermill marks the cell it injects with this first line (papermill.parameterize).
INJECTED_CELL_HEADER = "# Parameters"
PARAMS_RECORD_SUFFIX = ".params.json"  # <run>/<notebook>.params.json: the params a notebook ran with


def new_run_dir(profile: str, root: Path = OUTPUTS_DIR) -> Path:
    """`outputs/<UTC timestamp>-<profile>/`, created; a suffix keeps two same-second runs apart."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        path = root / (f"{stamp}-{profile}" + (f"-{attempt}" if attempt else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def injected_parameter_names(namespace: dict) -> list[str]:
    """Names assigned by papermill's injected-parameters cell, read from IPython's input history."""
    names: list[str] = []
    for source in namespace.get("In", []) or []:
        if not isinstance(source, str) or not source.startswith(INJECTED_CELL_HEADER):
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign):
                names += [target.id for target in node.targets if isinstance(target, ast.Name)]
    return names


def notebook_params(namespace: dict, injected: list[str], where: str) -> params_module.Params:
    """The profile a notebook runs with, from its namespace (validated). With a profile injected
    (`-f params/<profile>.yaml`, or the runner): the keys the notebook declares or was given, built as
    `params.load` builds a profile from its file (the schema's defaults, the GPU row's facts, the
    injected values). Without one (JupyterLab, or papermill with `-p` alone): the whole profile file
    the cell's `profile` names, with the injected values over it. Values edited in the cell (unlike
    their defaults) count as given in both."""
    given = {key: params_module.validate_value(key, namespace[key], where)
             for key in params_module.SCHEMA if key in namespace}
    defaults = params_module.defaults()
    stated = {key: value for key, value in given.items()
              if key in injected or (value, type(value)) != (defaults[key], type(defaults[key]))}
    if "profile" in injected:
        # Only these keys: the runner injects the declared ones alone, so the rest would be defaults, not the
        # profile's. The runner checked its whole profile; a papermill -f file is checked on what is here.
        values = params_module.resolve(stated, where, check=False)
        values = params_module.Params({key: values[key] for key in given})
        params_module.check_consistency(values, where)
        return values
    base = params_module.load(params_module.profile_path(given.get("profile", defaults["profile"])))
    return params_module.apply_overrides(base, {key: value for key, value in stated.items() if key != "profile"})


@dataclass
class Session:
    """One notebook's view of a run: its validated parameters and the folder it writes to."""
    notebook: str
    params: params_module.Params
    run_dir: Path

    def save_json(self, name: str, data: Any) -> Path:
        """Write `data` as indented JSON into the run folder; returns the path."""
        path = self.run_dir / name
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {path}")
        return path

    def save_figure(self, figure, name: str) -> Path:
        """Save a matplotlib figure as PNG into the run folder; returns the path."""
        path = self.run_dir / name
        figure.savefig(path, dpi=120, bbox_inches="tight")
        print(f"wrote {path}")
        return path


def start(namespace: dict, notebook: str) -> Session:
    """Build the notebook's params (see the module's docstring) and open (or create) the run folder.

    `namespace` is the notebook's `globals()`: every schema key found there is validated, and so is
    every name papermill injected. A run folder given as `run_dir` is used as is (the runner passes
    one); an empty `run_dir` creates `outputs/<timestamp>-<profile>/` for a stand-alone run.
    """
    where = f"notebook {notebook} parameters"
    injected = injected_parameter_names(namespace)
    unknown = [name for name in injected if name not in params_module.SCHEMA and name != RUN_DIR_PARAMETER]
    if unknown:
        # validate_value raises with a did-you-mean hint for the first unknown name.
        params_module.validate_value(unknown[0], namespace[unknown[0]], where)
    values = notebook_params(namespace, injected, where)
    run_dir_value = namespace.get(RUN_DIR_PARAMETER) or ""
    run_dir = Path(run_dir_value) if run_dir_value else new_run_dir(values.get("profile", "adhoc"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if injected or values.get("interactive") is False:  # papermill (the runner always injects run_dir)
        quiet_library_progress()
    print(f"{notebook}: profile {values.get('profile', '?')}, writing to {run_dir}")
    # What this notebook ran with, however it was started (papermill -f, workbook run, JupyterLab).
    (run_dir / f"{notebook}{PARAMS_RECORD_SUFFIX}").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    return Session(notebook, values, run_dir)


# (module, its switch) for the libraries whose progress bars are notebook widgets in a kernel.
LIBRARY_PROGRESS_SWITCHES = (("huggingface_hub.utils", "disable_progress_bars"),
                             ("transformers.utils.logging", "disable_progress_bar"),
                             ("datasets", "disable_progress_bars"))


def quiet_library_progress() -> None:
    """Headless runs (papermill, or ``interactive: false``): the libraries' progress bars (loading weights,
    writing shards, TRL's dataset passes) are widgets whose saved text is their first frame, '0%', so a
    finished step reads as stalled in the executed notebook; they are switched off (the environment
    for libraries not imported yet). The workbook's own bars write text in such runs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for module, switch in LIBRARY_PROGRESS_SWITCHES:
        if module in sys.modules:
            getattr(sys.modules[module], switch)()


NOT_APPLICABLE = "n/a"


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table of `rows` (dicts); numbers keep their given formatting. Without `columns`, a
    column that is n/a in every row of several (a GPU's roofline on a CPU run) is named under the
    table instead of filling it."""
    empty: list[str] = []
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        if len(rows) > 1:
            empty = [column for column in columns if {str(row.get(column, "")) for row in rows} <= {NOT_APPLICABLE, ""}
                     and any(column in row for row in rows)]
            columns = [column for column in columns if column not in empty]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [str(row.get(column, "")).replace("|", "\\|").replace("\n", " ") for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    if empty:
        lines += ["", f"n/a or empty in every row, so not shown: {', '.join(empty)}"]
    return "\n".join(lines)


def show_table(rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
    """Display a table in the notebook (Markdown), with an optional bold title."""
    show_markdown((f"**{title}**\n\n" if title else "") + markdown_table(rows, columns))


def show_markdown(text: str) -> None:
    """Display Markdown text in the notebook; nothing for ''. Its plain-text form is the same text, so
    `workbook run`'s log (papermill logs cell output) shows the table, not '<Markdown object>'."""
    if text:
        from IPython.display import display
        display({"text/markdown": text, "text/plain": text}, raw=True)
