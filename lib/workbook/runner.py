"""Run every notebook headless, in order, into one run folder: `workbook run`.

Each notebook is executed by papermill (kernel `python3`, working directory the repo root, cell
output logged) into `outputs/<timestamp>-<profile>/`, next to the JSON and PNG files it writes
and a `manifest.json` that records the params, versions, git commit, and per-notebook status and
duration. The first failing notebook stops the run; the message names the cell and the executed
notebook to open.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from workbook import gpu, notebook, params as params_module
from workbook.paths import NOTEBOOKS_DIR, OUTPUTS_DIR, REPO_ROOT


MANIFEST_FILE = "manifest.json"  # a run folder's record: params, versions, status (notebook 05 reads it)

class RunError(RuntimeError):
    """The run could not start (bad params, unknown notebook) or a notebook failed."""


@dataclass
class RunResult:
    run_dir: Path
    ok: bool
    manifest: dict = field(repr=False)


def list_notebooks(notebooks_dir: Path) -> list[Path]:
    """The workbook's notebooks in run order (`NN_name.ipynb`)."""
    return sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb"))


def select_notebooks(only: list[str] | None, notebooks_dir: Path) -> list[Path]:
    """All notebooks, or those named by `only` ('00', '00_gpu_detection' or the file name)."""
    available = list_notebooks(notebooks_dir)
    if not only:
        return available
    chosen = []
    for wanted in only:
        stem = Path(wanted).stem
        matches = [nb for nb in available if nb.stem == stem or nb.stem.split("_", 1)[0] == stem]
        if not matches:
            raise RunError(f"--only {wanted}: no such notebook. Notebooks: "
                           + ", ".join(nb.stem for nb in available))
        chosen += [nb for nb in matches if nb not in chosen]
    return sorted(chosen)


def resolve_params(params_arg: str, overrides: list[str], log=print) -> tuple[params_module.Params, str, dict | None]:
    """Load the profile named by `--params` ('auto', a name, or a file), then apply `--set` overrides.

    Returns (params, params file, detection or None). 'auto' detects the GPUs and says loudly
    when no profile matches exactly; the nearest profile then runs with the detected GPU's own
    hardware facts (`gpu.hardware_overrides`), and `--set` still overrides those.
    """
    detection = None
    hardware = {}
    if params_arg == "auto":
        detection = gpu.detect()
        choice = gpu.select_profile(detection["gpus"], params_module.load_all())
        log(("profile: " if choice.exact else "WARNING: ") + choice.reason)
        path = params_module.profile_path(choice.profile)
        if not choice.exact and detection["gpus"]:
            hardware, source = gpu.hardware_overrides(detection["gpus"])
            log("hardware figures from " + source + ": "
                + ", ".join(f"{key}={value}" for key, value in hardware.items()))
    else:
        path = params_module.profile_path(params_arg)
    loaded = params_module.load(path)
    if hardware and loaded["dtype"] == "bf16" and not hardware["supports_bf16"]:
        hardware["dtype"] = "fp16"  # the profile's bf16 cannot run here: fp16 is this GPU's half precision
        log("dtype=fp16: this GPU has no bf16")
    merged = {**hardware, **params_module.parse_overrides(overrides)}
    return params_module.apply_overrides(loaded, merged), str(path), detection


def git_state() -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _write_manifest(run_dir: Path, manifest: dict) -> None:
    # Write-then-rename: a reader (notebook 05, a user's `cat`) never sees half a manifest.
    temporary = run_dir / f"{MANIFEST_FILE}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    temporary.replace(run_dir / MANIFEST_FILE)


def _new_manifest(params: dict, params_file: str, overrides: list[str], hardware: dict | None) -> dict:
    """What every run folder records: the params, versions, commit, and who is writing it (the
    process and host: notebook 05 tells a run still running from one that died)."""
    return {
        "profile": params["profile"],
        "params_file": params_file,
        "overrides": overrides,
        "params": dict(params),
        "git": git_state(),
        "versions": gpu.software_versions(),
        "hardware": hardware,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": now(),
        "finished_at": None,
        "status": "running",
        "notebooks": [],
    }


@dataclass
class JobRun:
    """A run folder a command made (`workbook generate`, `train`, `bench`) and its manifest."""
    run_dir: Path
    manifest: dict = field(repr=False)


def start_job(run_dir: Path, job: str, params: dict, params_file: str, overrides: list[str]) -> JobRun:
    """Write `manifest.json` (status 'running') into a run folder a command made, as `workbook run`
    does, so notebook 05 lists it like any run. A folder that already has one (a resumed run)
    keeps its first start and gets this one appended to `resumed_at`.

    The hardware is read at `finish_job`: reading it here could initialise CUDA in a process that
    is about to fork one worker per GPU.
    """
    run_dir = Path(run_dir)
    command = f"workbook {job} --params {params_file}" + (" --set " + " ".join(overrides) if overrides else "")
    manifest = {**_new_manifest(params, params_file, list(overrides), None), "job": job, "command": command}
    with contextlib.suppress(OSError, ValueError):
        earlier = json.loads((run_dir / MANIFEST_FILE).read_text())
        manifest["started_at"] = earlier["started_at"]
        manifest["resumed_at"] = earlier.get("resumed_at", []) + [now()]
    _write_manifest(run_dir, manifest)
    return JobRun(run_dir, manifest)


def finish_job(run: JobRun | None, exit_code: int, error: object = None) -> int:
    """Record how a job ended (exit 0 'ok', 1 'incomplete': some work failed, it says where; else
    'failed', with the error) and return `exit_code`, so a job can `return finish_job(run, code)`.

    `run` None (the job made no run folder) records nothing. A job that failed before writing
    anything (the folder holds only its manifest) leaves no folder behind.
    """
    if run is None:
        return exit_code
    if exit_code not in (0, 1) and not run.manifest.get("resumed_at") and \
            [path.name for path in run.run_dir.iterdir()] == [MANIFEST_FILE]:
        (run.run_dir / MANIFEST_FILE).unlink()
        with contextlib.suppress(OSError):
            run.run_dir.rmdir()
        return exit_code
    run.manifest.update(status={0: "ok", 1: "incomplete"}.get(exit_code, "failed"), exit_code=exit_code,
                        finished_at=now(), hardware=gpu.detect())
    if error:
        run.manifest["error"] = str(error)[:2000]
    _write_manifest(run.run_dir, run.manifest)
    return exit_code


def job_folder(path: Path, job: str) -> Path | None:
    """The run folder `workbook <job>` made that holds `path` (its manifest names the job), else None:
    rerunning a job into its own folder resumes that run's record."""
    folder = Path(path).parent
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads((folder / MANIFEST_FILE).read_text()).get("job") == job:
            return folder
    return None


def notebook_parameters(path: Path, params: dict, run_dir: Path) -> dict:
    """The values to inject: only what the notebook declares, so papermill has nothing to warn about."""
    import papermill
    declared = papermill.inspect_notebook(str(path))
    values = {key: params[key] for key in declared if key in params}
    if notebook.RUN_DIR_PARAMETER in declared:
        values[notebook.RUN_DIR_PARAMETER] = str(run_dir)
    return values


def write_parameters_file(path: Path, parameters: dict, run_dir: Path) -> Path:
    """`<run>/<notebook>.parameters.yaml`: what the notebook was given, and the papermill command that
    reruns it alone with exactly that and no "Passed unknown parameter" warning (a params profile
    holds keys this notebook does not declare; papermill warns once per such key)."""
    target = run_dir / f"{path.stem}.parameters.yaml"
    source = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    header = (f"# The parameters `workbook run` gave {path.name}. To rerun this notebook alone with them:\n"
              f"#   .venv/bin/papermill {source} {run_dir / path.name} -f {target}\n")
    target.write_text(header + yaml.safe_dump(parameters, sort_keys=False))
    return target


def execute(path: Path, run_dir: Path, parameters: dict) -> Path:
    """Execute one notebook with papermill into the run folder; returns the executed copy's path."""
    import papermill
    output = run_dir / path.name
    papermill.execute_notebook(str(path), str(output), parameters=parameters, kernel_name="python3",
                               cwd=str(REPO_ROOT), log_output=True, progress_bar=False,
                               kernel_manager_class=_ipc_kernel_manager())
    return output


def _ipc_kernel_manager() -> type:
    """The kernel manager papermill starts the kernel with, talking over Unix sockets in Jupyter's runtime
    folder rather than TCP on localhost (which ipykernel warns about in every run's log: plain text that
    any local user can connect to)."""
    from jupyter_client import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets import default

    class IpcKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self) -> str:
            # A socket's path must fit in 108 bytes: <runtime>/kernel-<uuid>-ipc-<n>; a deep home keeps TCP.
            return "ipc" if len(jupyter_runtime_dir()) + 50 < 108 else "tcp"

    return IpcKernelManager


def describe_failure(error: Exception, output: Path) -> dict:
    """What failed and where, from papermill's error (cell number, exception) or any other error."""
    details = {"error": f"{type(error).__name__}: {error}".strip()[:2000], "executed_notebook": str(output)}
    if hasattr(error, "exec_count"):  # papermill.PapermillExecutionError
        details.update(cell=error.exec_count, cell_index=error.cell_index,
                       error=f"{error.ename}: {error.evalue}", cell_source=error.source[:500])
        return details
    started = _last_started_cell(output)  # a kernel that died (killed for memory, ...) raises no cell error
    if started is not None:  # its execution count may not have come back: the cell's place in the notebook
        index, cell = started
        details.update(cell_index=index, cell_source="".join(cell.get("source", ""))[:500])
    if type(error).__name__ == "DeadKernelError":
        details["error"] += (" (the kernel process ended mid-cell: on Linux, `dmesg | grep -i 'out of memory'` says "
                             "whether the system killed it for memory)")
    return details


def _last_started_cell(output: Path) -> tuple[int, dict] | None:
    """The last cell papermill started, from the executed notebook it saves as each cell starts and ends."""
    try:
        cells = json.loads(output.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return None
    started = [(index, cell) for index, cell in enumerate(cells)
               if cell.get("metadata", {}).get("papermill", {}).get("start_time")]
    return started[-1] if started else None


def run(params_arg: str = "auto", only: list[str] | None = None, overrides: list[str] | None = None,
        outputs_root: Path | None = None, notebooks_dir: Path | None = None, log=print) -> RunResult:
    """Run the selected notebooks in order into a new run folder; stop at the first failure.

    `outputs_root` and `notebooks_dir` default to the checkout's `outputs/` and `notebooks/`.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    outputs_root = outputs_root or OUTPUTS_DIR
    notebooks_dir = notebooks_dir or NOTEBOOKS_DIR
    params, params_file, detection = resolve_params(params_arg, overrides or [], log)
    notebooks = select_notebooks(only, notebooks_dir)
    if not notebooks:
        raise RunError(f"no notebooks found in {notebooks_dir}")
    run_dir = notebook.new_run_dir(params["profile"], outputs_root)
    manifest = _new_manifest(params, params_file, overrides or [], detection or gpu.detect())
    _write_manifest(run_dir, manifest)
    log(f"run folder: {run_dir}")
    for path in notebooks:
        entry = {"name": path.stem, "status": "running", "started_at": now()}
        manifest["notebooks"].append(entry)
        _write_manifest(run_dir, manifest)
        log(f"--- {path.name}")
        began = time.perf_counter()
        output = run_dir / path.name
        try:
            parameters = notebook_parameters(path, params, run_dir)
            entry["parameters_file"] = str(write_parameters_file(path, parameters, run_dir))
            execute(path, run_dir, parameters)
            entry["status"] = "ok"
        except Exception as error:  # the run must record any failure before stopping
            entry.update(status="failed", **describe_failure(error, output))
        entry["seconds"] = round(time.perf_counter() - began, 2)
        entry["executed_notebook"] = str(output)
        if entry["status"] == "failed":
            break
    manifest["finished_at"] = now()
    failed = [entry for entry in manifest["notebooks"] if entry["status"] == "failed"]
    manifest["status"] = "failed" if failed else "ok"
    _write_manifest(run_dir, manifest)
    if failed:
        entry = failed[0]
        where = (f"at cell In [{entry['cell']}]" if entry.get("cell") is not None else
                 f"at cell {entry['cell_index'] + 1} (papermill's 'Executing Cell {entry['cell_index'] + 1}')"
                 if entry.get("cell_index") is not None else
                 "before any cell ran")
        log(f"FAILED: {entry['name']} {where}: {entry['error']}\n"
            f"  open the executed notebook to see the traceback: {entry['executed_notebook']}\n"
            f"  run folder: {run_dir}")
    else:
        total = sum(entry["seconds"] for entry in manifest["notebooks"])
        log(f"done: {len(notebooks)} notebook(s) in {total:.0f} s; results in {run_dir}")
    return RunResult(run_dir, not failed, manifest)
