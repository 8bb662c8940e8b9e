"""The job's own start-up and exit, which a pilot inside an already running process never sees:
this process's time before its pilot, and a fresh interpreter importing what the job imports,
timed after the pilot (when the disk cache holds what the job will read) until it exits."""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys
import time

from workbook import launcher_watch, runtime
from workbook.paths import REPO_ROOT


def seconds_so_far(clock: str) -> float:
    """What this process has spent so far (interpreter, imports, then reading and model load): a
    fresh run of the job spends the same before its first batch."""
    return time.process_time() if clock == "cpu" else runtime.process_age_seconds() or 0.0


@dataclasses.dataclass
class FreshProcess:
    """A fresh interpreter that imports what the job imports and exits, timed from here."""

    startup_seconds: float  # interpreter and imports
    exit_seconds: float
    modules: list[str]
    cpu_seconds: float | None = None  # its CPU time (user + system), start-up and exit


def fresh_process(entry: str) -> FreshProcess | None:
    """Time a fresh process importing the job's modules (``workbook.cli``, ``entry`` and the model's
    transformers module), after the pilot: the job run after the forecast finds the disk cache as
    this process leaves it, where this process's own first imports may have been cold (the first
    command on a fresh machine: 48 s measured on a fresh 2-core VM, against 2 s warm). It times
    the exit too, which the job pays and the pilot never sees (0.5 s there with torch loaded).
    None when the child fails: the forecast then keeps this process's own start-up."""
    modules = ["workbook.cli", entry, *sorted(name for name in sys.modules
                                              if name.startswith("transformers.models.") and ".modeling_" in name)]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ready', flush=True)"
    env = launcher_watch.child_environment(  # it ends with this process, killed or not
        {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "lib"), os.environ.get("PYTHONPATH")]))})
    began, cpu_began = time.perf_counter(), _children_cpu_seconds()
    try:
        child = subprocess.Popen([sys.executable, "-c", code, *modules], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env)
    except OSError:
        return None
    try:
        ready_line = child.stdout.readline()
        ready = time.perf_counter()
        child.wait(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        return None
    if child.returncode != 0 or ready_line.strip() != "ready":
        return None
    return FreshProcess(ready - began, time.perf_counter() - ready, modules, _children_cpu_seconds() - cpu_began)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def job_startup(clock: str, entered: float, before_pilot: float, fresh: FreshProcess | None) -> float:
    """The job's start-up: this process's own up to the pilot, with its interpreter and imports
    (``entered``: its age, or CPU seconds, on entering the forecast) as a fresh process takes them
    now: on the wall clock when that is less (a cold disk cache), in CPU seconds always (this
    process imported the forecast's own modules too, generation's for a training run)."""
    if fresh is None:
        return before_pilot
    if clock == "wall":
        return before_pilot - entered + min(entered, fresh.startup_seconds)
    return before_pilot - entered + (fresh.cpu_seconds if fresh.cpu_seconds is not None else entered)


def job_exit(clock: str, fresh: FreshProcess | None) -> float:
    """The job's exit: the fresh process's, on the wall clock; none more in CPU seconds, where
    ``job_startup`` counted the fresh process's CPU, its exit's included (its exit's wall time is
    mostly waiting: 3 to 4 s on a loaded 2-core machine, for about half a CPU second)."""
    return fresh.exit_seconds if fresh is not None and clock == "wall" else 0.0


def record(fresh: FreshProcess | None, entered: float) -> dict:
    """What the forecast's JSON says of the fresh process it timed."""
    if fresh is None:
        return {"measured": False, "this_process_start_seconds": entered}
    return {"measured": True, "startup_seconds": fresh.startup_seconds, "exit_seconds": fresh.exit_seconds,
            "cpu_seconds": fresh.cpu_seconds, "this_process_start_seconds": entered, "modules": fresh.modules}
