"""Launching: one process in-process, several through accelerate's ``notebook_launcher``, or this
process as one of those ``accelerate launch`` / ``torchrun`` started."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from workbook import launcher_watch, process_group, runtime
from workbook.training.config import RESULT_FILE, TrainConfig, TrainError
from workbook.training.loop import train
from workbook.training.prepare import PreparedData


def launch(config: TrainConfig, prepared: PreparedData | None = None) -> dict:
    """Run `train` in ``config.processes`` processes and return the main process's result.

    One process runs here. Several are forked by accelerate's ``notebook_launcher`` (DDP; gloo on
    CPU, NCCL on GPUs), so nothing in this process may have initialised CUDA before (the notebook
    never asks torch.cuda anything). Inside a launch (``accelerate launch``, ``torchrun``) this
    process is one of the launched ones and runs `train` directly.
    """
    warning = runtime.missing_gpu_warning(config.profile, config.budget.gpu_count)
    if warning and not runtime.inside_launcher():
        print(warning, file=sys.stderr, flush=True)
    if runtime.launched_processes() > 1:  # a peer that is gone or silent is named, after peer_timeout_seconds at most
        with process_group.peers_named(TrainError, config.peer_timeout_seconds):
            return train(config, prepared)
    if config.processes == 1 or runtime.inside_launcher():
        return train(config, prepared)
    from accelerate import notebook_launcher
    if torch.cuda.is_initialized():  # asks, without initialising it
        raise TrainError("CUDA is already initialised in this process, so it cannot fork one training process per "
                         "GPU: restart the kernel and run this notebook from the top, or launch from the shell with "
                         "`accelerate launch -m workbook.training --params ... --run-dir ...`")
    result_path = Path(config.output_dir) / RESULT_FILE
    result_path.unlink(missing_ok=True)
    port = os.environ.get("MASTER_PORT") or str(runtime.free_port())
    notebook_launcher(_process_entry, args=(config, prepared), num_processes=config.processes, use_port=port)
    if not result_path.is_file():
        raise TrainError(f"the {config.processes} training processes ended without writing {result_path}; "
                         "see their output above")
    return json.loads(result_path.read_text())


def _process_entry(config: TrainConfig, prepared: PreparedData | None) -> dict:
    """One forked training process: it ends with this one (a fork has no watch of its own yet)."""
    launcher_watch.end_with_launcher()
    with process_group.peers_named(TrainError, config.peer_timeout_seconds):
        return train(config, prepared)
