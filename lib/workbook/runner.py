"""Run every notebook headless, in order, into one run folder: `workbook run`.

Each notebook is executed by papermill (kernel `python3`, working directory the repo root) into
`outputs/<timestamp>-<profile>/`, next to the JSON and PNG files it writes and a `manifest.json`
that records the params, versions, git commit, and per-notebook status, duration and headline.
The run prints one line per notebook (its seconds, what it did and its headline figure, read from
the metrics JSON it wrote) and ends with the run folder; every cell's output stays in the executed
notebooks, and `verbose` prints it as it runs too. The first failing notebook stops the run; the
message names the cell and the executed notebook to open.
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
from workbook.units import format_bytes


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


def execute(path: Path, run_dir: Path, parameters: dict, log_output: bool = True) -> Path:
    """Execute one notebook with papermill into the run folder; returns the executed copy's path.
    `log_output` also prints each cell's output as it runs (the executed copy keeps it either way)."""
    import papermill
    output = run_dir / path.name
    papermill.execute_notebook(str(path), str(output), parameters=parameters, kernel_name="python3",
                               cwd=str(REPO_ROOT), log_output=log_output, progress_bar=False,
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


# The one line each notebook gets: what it did and its headline figure, from the metrics JSON it writes
# into the run folder (the file name its `session.save_json` call gives). A notebook not listed (one a
# user added) gets "ok".
def _detection_headline(data: dict) -> str:
    gpus, cpu = data["detection"]["gpus"], data["detection"]["cpu"]
    found = (f"{len(gpus)} x {gpus[0]['name']} ({format_bytes(gpus[0]['memory_total_bytes'])} each)" if gpus else
             f"no GPU ({cpu['model']}, {cpu['usable_cores']} cores)")
    mismatches = data.get("profile_mismatches") or []
    return (f"detected {found}: profile {data['run_profile']}"
            + (f" ({len(mismatches)} of its values differ from this machine)" if mismatches else ""))


def _planning_headline(data: dict) -> str:
    plans = data["plans"]
    first = next(iter(plans.values()))
    where = "in this machine's RAM" if first.get("in_ram") else "per GPU"
    largest = ", ".join(f"{plan['max_batch_size']:,} to {mode}" for mode, plan in plans.items())
    # `model` is the architecture (config.model_type); the parameter count tells a 1B from an 8B.
    return (f"planned {first['model']} with {first['params']:,} parameters ({first['dtype']}) {where}: largest batch {largest} "
            f"(budget {format_bytes(first['budget_bytes'])})")


def _generation_headline(data: dict) -> str:
    summary = data["summary"]
    outputs = "examples" if summary.get("samples_per_prompt", 1) == 1 else "outputs"
    rate = summary["output_tokens_per_second"]  # None when nothing was generated in this run (all resumed)
    return (f"generated {summary['generated']:,} {outputs}: "
            + (f"{rate:,.0f} output tokens/s" if rate is not None else "output tokens/s not measured")
            + f" ({summary['backend']}, batch {summary['batch_size']}, {summary['processes']} process(es))")


def _training_headline(data: dict) -> str:
    steps, loss, throughput = data["steps"], data["loss"], data["throughput"]
    final = (f"final loss {loss['epoch_means'][-1]:.4f} (mean of the last epoch)" if loss["epoch_means"]
             else "no step ran")
    tokens = throughput["tokens_per_second"]
    return (f"trained {steps['reached']} of {steps['total']} steps: {final}, "
            + (f"{tokens:,.0f} tokens/s" if tokens else "tokens/s not measured"))


# bench.counting.HF_PIPELINE, the baseline measured beside the workbook's strategies (importing it here
# would import torch into `workbook run`; a test holds the two equal).
HF_PIPELINE = "hf-pipeline"


def _benchmark_headline(data: dict) -> str:
    # The workbook's fastest point of each sweep, by its median (generation) or its one run (training);
    # a point skipped or failed has no rate.
    parts = []
    points = [p for p in (data.get("generation") or {}).get("points", [])
              if p.get("output_tokens_per_second") and p["strategy"] != HF_PIPELINE]
    if points:
        best = max(points, key=lambda p: p["output_tokens_per_second"]["median"])
        parts.append(f"best generation {best['strategy']} at batch {best['batch_size']}: "
                     f"{best['output_tokens_per_second']['median']:,.0f} output tokens/s")
    points = [p for p in (data.get("training") or {}).get("points", []) if p.get("tokens_per_second")]
    if points:
        best = max(points, key=lambda p: p["tokens_per_second"])
        settings = [best["padding"]] + [name for name, on in (("checkpointing", best.get("grad_checkpointing")),
                                                              ("compiled", best.get("torch_compile"))) if on]
        parts.append(f"best training micro-batch {best['micro_batch_size']} ({', '.join(settings)}): "
                     f"{best['tokens_per_second']:,.0f} tokens/s")
    return "benchmarked: " + ("; ".join(parts) if parts else "no point measured")


def _review_headline(data: dict) -> str:
    return f"reviewed {len(data['runs'])} run(s) side by side"


HEADLINES = {  # notebook -> (the metrics file it writes, its line)
    "00_gpu_detection": ("gpu.json", _detection_headline),
    "01_memory_planning": ("memory_plan.json", _planning_headline),
    "02_batched_generation": ("generation.json", _generation_headline),
    "03_training": ("training_metrics.json", _training_headline),
    "04_benchmarking": ("benchmark.json", _benchmark_headline),
    "05_review_runs": ("review.json", _review_headline),
}


def headline(name: str, run_dir: Path) -> str:
    """What notebook `name` did and its headline figure, read from the metrics JSON it wrote into
    `run_dir`; a file that is missing or lacks a figure is named rather than failing the run."""
    if name not in HEADLINES:
        return "ok"
    file_name, describe = HEADLINES[name]
    try:
        return describe(json.loads((run_dir / file_name).read_text()))
    except OSError:
        return f"ok, but it wrote no {file_name}"
    except (ValueError, KeyError, TypeError, IndexError, StopIteration) as error:
        return f"ok, but {file_name} has no headline figure ({type(error).__name__}: {error})"


def notebook_line(name: str, seconds: float, text: str, width: int = 0) -> str:
    """One notebook's line in the run's output: name, seconds, what it did."""
    return f"{name:<{width}}  {seconds:>7.1f} s  {text}"


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
        outputs_root: Path | None = None, notebooks_dir: Path | None = None, log=print,
        verbose: bool = False) -> RunResult:
    """Run the selected notebooks in order into a new run folder; stop at the first failure.

    Logs one line per notebook (`notebook_line`) and ends with the run folder; `verbose` also logs
    every cell and its output as papermill runs it. `outputs_root` and `notebooks_dir` default to
    the checkout's `outputs/` and `notebooks/`.
    """
    logging.basicConfig(format="%(message)s")
    # papermill logs each cell and its output at INFO; its warnings show either way.
    logging.getLogger("papermill").setLevel(logging.INFO if verbose else logging.WARNING)
    outputs_root = outputs_root or OUTPUTS_DIR
    notebooks_dir = notebooks_dir or NOTEBOOKS_DIR
    params, params_file, detection = resolve_params(params_arg, overrides or [], log)
    notebooks = select_notebooks(only, notebooks_dir)
    if not notebooks:
        raise RunError(f"no notebooks found in {notebooks_dir}")
    run_dir = notebook.new_run_dir(params["profile"], outputs_root)
    manifest = _new_manifest(params, params_file, overrides or [], detection or gpu.detect())
    _write_manifest(run_dir, manifest)
    log(f"running {len(notebooks)} notebook(s) into {run_dir}" + ("" if verbose else
        " (each cell's output is in its executed notebook there; --verbose prints it here too)"))
    width = max(len(path.stem) for path in notebooks)
    for path in notebooks:
        entry = {"name": path.stem, "status": "running", "started_at": now()}
        manifest["notebooks"].append(entry)
        _write_manifest(run_dir, manifest)
        if verbose:
            log(f"--- {path.name}")
        began = time.perf_counter()
        output = run_dir / path.name
        try:
            parameters = notebook_parameters(path, params, run_dir)
            entry["parameters_file"] = str(write_parameters_file(path, parameters, run_dir))
            execute(path, run_dir, parameters, log_output=verbose)
            entry["status"] = "ok"
        except Exception as error:  # the run must record any failure before stopping
            entry.update(status="failed", **describe_failure(error, output))
        entry["seconds"] = round(time.perf_counter() - began, 2)
        entry["executed_notebook"] = str(output)
        if entry["status"] == "failed":
            break
        entry["headline"] = headline(path.stem, run_dir)
        _write_manifest(run_dir, manifest)
        log(notebook_line(path.stem, entry["seconds"], entry["headline"], width))
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
        log(f"done: {len(notebooks)} notebook(s) in {total:.0f} s\nrun folder: {run_dir}")
    return RunResult(run_dir, not failed, manifest)
