"""Every run side by side: the logic behind notebook 05.

A run is a folder under ``outputs/`` (``workbook run``, ``generate``, ``train`` and ``bench`` write
``manifest.json`` there; older ``workbook bench`` folders hold only ``benchmark.json``) or under the
committed ``outputs/reference/<gpu>/``. A run may be incomplete, failed, still running or stopped
(killed mid-run: its manifest says "running" but its process is gone), and a JSON file may be half
written or broken: such a run is listed with what is wrong, never an exception.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from workbook.bench.counting import HF_PIPELINE
from workbook.paths import OUTPUTS_DIR
from workbook.runner import MANIFEST_FILE

# The metric files the notebooks and commands write, by the name a run's ``metrics`` uses.
METRIC_FILES = {"gpu": "gpu.json", "memory_plan": "memory_plan.json", "generation": "generation.json",
                "training": "training_metrics.json", "benchmark": "benchmark.json",
                "memory_accuracy": "memory_accuracy.json"}
REFERENCE_FOLDER = "reference"


@dataclass
class Run:
    """One run folder: what its manifest says and the metric files it holds."""

    path: Path
    reference: bool
    manifest: dict | None = None
    metrics: dict = field(default_factory=dict)  # name in METRIC_FILES -> parsed JSON
    problems: list[str] = field(default_factory=list)  # unreadable files, a failed or unfinished run
    stopped: bool = False  # the manifest says running, but the process that wrote it is gone
    this_run: bool = False  # the run doing the reviewing (notebook 05's own, still running)
    name: str = ""  # the folder as listed: its name, or for a reference's run folder 'h100/<run folder>'

    @property
    def label(self) -> str:
        return (("reference/" if self.reference else "") + (self.name or self.path.name)
                + (" (this run)" if self.this_run else ""))

    @property
    def profile(self) -> str | None:
        if self.manifest and self.manifest.get("profile"):
            return self.manifest["profile"]
        bench = self.metrics.get("benchmark") or {}
        if bench.get("profile"):
            return bench["profile"]
        # outputs/<YYYYmmdd-HHMMSS>-[bench-]<profile>[-N]/ (notebook.new_run_dir); a reference folder is the GPU.
        parts = self.path.name.split("-")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            rest = [part for part in parts[2:] if part != "bench"]
            return "-".join(rest[:-1] if len(rest) > 1 and rest[-1].isdigit() else rest) or None
        return None

    @property
    def status(self) -> str:
        if self.stopped:
            return "stopped"
        if self.manifest:
            status = str(self.manifest.get("status", "unknown"))
            return status + (" (its last notebook, 05, is reviewing it)" if self.this_run and status == "running"
                             else "")
        return "no manifest" if self.metrics else "empty"

    def gpu_name(self) -> str:
        hardware = (self.manifest or {}).get("hardware") or (self.metrics.get("benchmark") or {}).get("hardware") or {}
        gpus = hardware.get("gpus") or []
        if gpus:
            return f"{len(gpus)} x {gpus[0].get('name', '?')}"
        return "no GPU" if hardware else "?"

    def date(self) -> str:
        """When the run started: its manifest's, else its folder's timestamp (outputs/<YYYYmmdd-HHMMSS>-...)."""
        started = (self.manifest or {}).get("started_at") or (self.metrics.get("benchmark") or {}).get("started_at")
        if started:
            return str(started)
        stamp = self.path.name[:15]
        return stamp if re.fullmatch(r"\d{8}-\d{6}", stamp) else "n/a (no manifest, no timestamp)"

    def commit(self) -> str:
        git = (self.manifest or {}).get("git") or (self.metrics.get("benchmark") or {}).get("git") or {}
        commit = git.get("commit")
        return (commit[:10] + (" (dirty)" if git.get("dirty") else "")) if commit else "?"


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        problems.append(f"{path.name}: unreadable ({type(error).__name__}: {str(error)[:80]})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return value


def process_alive(manifest: dict) -> bool | None:
    """Whether the process that wrote a manifest still runs: None when that cannot be told from here
    (another host, or a manifest that does not name its process)."""
    pid = manifest.get("pid")
    if not isinstance(pid, int) or manifest.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _manifest_problem(run: Run) -> str | None:
    """What is wrong with the run by its manifest, or None: ok, or still running."""
    status = run.manifest.get("status")
    if status in ("ok", None):
        return None
    if status == "running":
        alive = None if run.this_run else process_alive(run.manifest)
        if run.this_run or alive:
            return None
        if alive is False:
            run.stopped = True
            return (f"stopped before finishing: process {run.manifest['pid']} is gone (killed or crashed)"
                    + ("; rerun the same command to resume" if run.manifest.get("job") == "generate" else ""))
        return "status running (its process cannot be checked from this host)"
    failed = [n["name"] for n in run.manifest.get("notebooks", []) if n.get("status") == "failed"]
    error = run.manifest.get("error")
    return f"status {status}" + (f": {', '.join(failed)} failed" if failed else "") + (f": {error}" if error else "")


def load_run(path: Path, reference: bool = False, this_run: bool = False) -> Run:
    run = Run(Path(path), reference, this_run=this_run)
    manifest_path = run.path / MANIFEST_FILE
    if manifest_path.is_file():
        run.manifest = _read_json(manifest_path, run.problems)
        problem = _manifest_problem(run) if run.manifest is not None else None
        if problem:
            run.problems.append(problem)
    for name, file_name in METRIC_FILES.items():
        if (run.path / file_name).is_file():
            value = _read_json(run.path / file_name, run.problems)
            if value is not None:
                run.metrics[name] = value
    return run


def load_runs(outputs_dir: Path = OUTPUTS_DIR, reference_dir: Path | None = None,
              this_run: Path | None = None) -> list[Run]:
    """Every run folder under ``outputs_dir`` (newest first) and under the reference folder
    (default ``outputs_dir/reference``); folders holding neither a manifest nor a metric file are skipped.
    ``this_run``, the reviewing run's own folder, is marked as such and not a problem while it runs."""
    outputs_dir = Path(outputs_dir)
    reference_dir = Path(reference_dir) if reference_dir is not None else outputs_dir / REFERENCE_FOLDER
    runs = []
    for root, is_reference in ((reference_dir, True), (outputs_dir, False)):
        if not root.is_dir():
            continue
        for folder in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
            if not is_reference and folder.resolve() == reference_dir.resolve():
                continue
            # A GPU session's calls leave run folders inside the GPU's reference folder (gpu_session).
            nested = sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True) if is_reference else []
            for candidate in [folder, *nested]:
                own = this_run is not None and candidate.resolve() == Path(this_run).resolve()
                run = load_run(candidate, is_reference, this_run=own)
                run.name = str(candidate.relative_to(root))
                if run.manifest is not None or run.metrics or run.problems:
                    runs.append(run)
    return runs


def run_rows(runs: list[Run]) -> list[dict]:
    return [{"run": run.label, "profile": run.profile or "?", "GPU": run.gpu_name(), "date": run.date(),
             "commit": run.commit(), "status": run.status, "metrics": ", ".join(run.metrics) or "none",
             "problems": "; ".join(run.problems)} for run in runs]


def throughput_series(runs: list[Run], strategy: str | None = None) -> list[dict]:
    """Generation tokens/s vs batch per run and strategy (``strategy`` None: the workbook's best per
    batch, the HF pipeline baseline left out; ``notes`` names the strategy of each point)."""
    series = []
    for run in runs:
        points = [p for p in (run.metrics.get("benchmark") or {}).get("generation", {}).get("points", [])
                  if "output_tokens_per_second" in p and (p.get("strategy") == strategy if strategy
                                                          else p.get("strategy") != HF_PIPELINE)]
        best: dict[int, dict] = {}
        for p in points:
            if p["output_tokens_per_second"]["median"] > best.get(p["batch_size"], {}).get("y", 0.0):
                best[p["batch_size"]] = {"y": p["output_tokens_per_second"]["median"], "strategy": p.get("strategy")}
        if best:
            xs = sorted(best)
            series.append({"label": f"{run.label} ({run.profile})", "x": xs, "y": [best[x]["y"] for x in xs],
                           "notes": [best[x]["strategy"] for x in xs]})
    return series


def memory_accuracy_series(runs: list[Run]) -> list[dict]:
    """Measured peak / planner prediction vs batch, per run (generation points that measured one)."""
    series = []
    for run in runs:
        points = [p for p in (run.metrics.get("benchmark") or {}).get("generation", {}).get("points", [])
                  if p.get("peak_memory_bytes") and p.get("predicted_peak_bytes")]
        if points:
            points.sort(key=lambda p: p["batch_size"])
            series.append({"label": f"{run.label} ({run.profile})", "x": [p["batch_size"] for p in points],
                           "y": [p["peak_memory_bytes"] / p["predicted_peak_bytes"] for p in points]})
    return series


def mfu_rows(runs: list[Run]) -> list[dict]:
    """MFU (or why there is none) and tokens/s of every training measurement of every run."""
    rows = []
    for run in runs:
        for p in ((run.metrics.get("benchmark") or {}).get("training") or {}).get("points", []):
            if "tokens_per_second" in p:
                rows.append({"run": run.label, "source": "benchmark", "micro-batch": p.get("micro_batch_size"),
                             "setting": f"ckpt {p.get('grad_checkpointing')}, compile {p.get('torch_compile')}, "
                                        f"{p.get('padding')}",
                             "tokens/s": f"{p['tokens_per_second'] or 0:,.0f}",
                             "MFU": f"{p['mfu']:.1%}" if p.get("mfu") is not None else p.get("mfu_note", "n/a")})
        training = run.metrics.get("training") or {}
        throughput = training.get("throughput")
        if throughput:
            rows.append({"run": run.label, "source": "notebook 03",
                         "micro-batch": (training.get("plan") or {}).get("micro_batch_size"), "setting": "",
                         "tokens/s": f"{throughput.get('tokens_per_second') or 0:,.0f}",
                         "MFU": f"{throughput['mfu']:.1%}" if throughput.get("mfu") is not None
                         else throughput.get("mfu_note", "n/a")})
    return rows
