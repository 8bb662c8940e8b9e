"""One process, several (accelerate's ``notebook_launcher``), or one of those ``accelerate launch``
started: who this process is in a data-parallel job, and starting the job.

N processes, each with the whole model on its own GPU, take every N-th prompt of the length-sorted
list, write their own part, and the first merges the parts (deduplicated, ordered); over several
nodes without a shared disk the parts come to it over the process group (``nodes``). Nothing here
touches CUDA before the processes exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from workbook import launcher_watch, process_group, runtime
from workbook.planner import profile
from workbook.generation import job, tensor_parallel
from workbook.generation.engine import GenerationError
from workbook.generation.files import OutputFiles, lock_output, resolve_output_path
from workbook.generation.settings import GenerationSettings


@record  # a failing process's traceback reaches the launcher's error instead of "see the logs"
def _process_entry(settings: GenerationSettings, output_path: str) -> None:
    launcher_watch.end_with_launcher()  # forked: the watch this process's import started is not in it
    with process_group.peers_named(GenerationError, settings.peer_timeout_seconds):
        job.run(settings, output_path, lock_held_by_parent=True)


def launch(params, output_path: str | Path | None = None, *, run_dir: str | Path | None = None,
           log: Callable[[str], None] = print) -> dict | None:
    """``start`` from a validated params profile (notebook 02): the settings are built here, once."""
    return start(GenerationSettings.from_params(params), output_path, run_dir=run_dir, log=log)


def start(settings: GenerationSettings, output_path: str | Path | None = None, *, run_dir: str | Path | None = None,
          log: Callable[[str], None] = print) -> dict | None:
    """Run the job and return its summary (None in the non-first processes of ``accelerate launch``).

    The output is ``output_path``, else the settings' ``output_path``, else ``<run_dir>/generations.jsonl``.
    With ``data_parallel_processes`` > 1, and not already under a launcher, the processes are started
    with accelerate's ``notebook_launcher`` (fork; this process must not have used CUDA yet, and
    nothing before this call in this module does).
    """
    warning = runtime.missing_gpu_warning(settings.profile, settings.gpu_count)
    if warning and runtime.launched_processes() == 1:
        log(warning)
    if output_path is None:
        if runtime.launched_processes() > 1 and not settings.output_path:
            raise GenerationError("under a launcher (accelerate launch, torchrun) every process must write to the "
                                  "same file: set output_path (e.g. --set output_path=outputs/teacher.jsonl).")
        output_path = resolve_output_path(settings.output_path, run_dir)
    output_path = Path(output_path)
    processes = settings.data_parallel_processes
    if not runtime.inside_launcher():  # a tensor-parallel size these processes cannot run stops before they start
        tensor_parallel.resolve_layout(settings, processes, launched=processes > 1)
    if processes > 1 and not runtime.inside_launcher():
        # So do processes the RAM cannot hold together.
        profile.refuse_over_ram(settings.profile_params, "generate", processes)
        from accelerate import notebook_launcher
        files = OutputFiles(output_path)
        # This process holds the output's lock for its children (forked, they share it), and reads
        # the prompts and the output first: a bad line or a stale output then fails with its
        # message, not as a crashed process.
        with lock_output(files):
            job.read_inputs(settings, files, record_skipped=True)
            files.summary.unlink(missing_ok=True)
            log(f"starting {processes} processes (accelerate notebook_launcher)")
            try:
                notebook_launcher(_process_entry, args=(settings, str(output_path)), num_processes=processes,
                                  use_port=str(runtime.free_port()))
            except Exception as error:  # torch elastic's ChildFailedError, or the launcher's RuntimeError
                raise GenerationError(f"a generation process failed (its traceback is printed above): "
                                      f"{_root_cause(error)}. Everything written so far is kept; rerun with the "
                                      "same output_path to resume.") from error
        if not files.summary.exists():  # write_summary warned why (a full disk)
            raise GenerationError(f"the processes finished but {files.summary} was not written (see the warning "
                                  f"above); the outputs are safe in {files.output}: free some space and rerun.")
        return json.loads(files.summary.read_text())
    if runtime.inside_launcher() and runtime.launched_processes() != processes:
        log(f"note: running as {runtime.launched_processes()} processes (the launcher's count), not "
            f"data_parallel_processes={processes}")
    if runtime.launched_processes() > 1:  # a peer that is gone or silent is named, after peer_timeout_seconds at most
        with process_group.peers_named(GenerationError, settings.peer_timeout_seconds):
            return job.run(settings, output_path, log=log)
    return job.run(settings, output_path, log=log)


def _root_cause(error: Exception) -> str:
    """The first failing process's last traceback line, when torch elastic recorded it."""
    if hasattr(error, "get_first_failure"):
        message = error.get_first_failure()[1].message  # the error file's {"message": ...}, or text
        text = str(message.get("message", message) if isinstance(message, dict) else message).strip()
        return text.splitlines()[-1].rstrip(".") if text else type(error).__name__
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
