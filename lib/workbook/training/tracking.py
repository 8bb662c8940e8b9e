"""Watching a run from the tools practitioners already use (``report_to``): TensorBoard or Weights &
Biases through accelerate's trackers, one point per optimizer step.

Per step: loss, learning rate, gradient norm (before clipping), tokens/s, MFU (GPU with a profile
peak) and peak memory (GPU). TensorBoard writes event files to ``<output_dir>/tracking/training/``
(``tensorboard --logdir <output_dir>/tracking``); W&B runs offline unless WANDB_MODE says otherwise
(``wandb sync`` uploads later), so neither needs an account or a network.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from workbook import gpu, runtime
from workbook.training.config import TrainError

REPORT_TO = ("none", "tensorboard", "wandb")
TRACKING_DIR_NAME = "tracking"
RUN_NAME = "training"  # accelerate's project name: TensorBoard's subfolder, W&B's project


def accelerator_kwargs(report_to: str, output_dir: str | Path) -> dict:
    """What ``Accelerator(...)`` needs for ``report_to``; TrainError when its package is missing."""
    from accelerate.utils import ProjectConfiguration


    if report_to not in REPORT_TO:
        raise TrainError(f"report_to {report_to!r}: expected one of {', '.join(REPORT_TO)}")
    if report_to == "none":
        return {}
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}[report_to]
    if importlib.util.find_spec(package) is None:
        raise TrainError(f"report_to: {report_to} needs the package {package}, which is not installed "
                         f"(pip install {package}); or set report_to: tensorboard (pinned in requirements.txt) "
                         "or none")
    if report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network; `wandb sync` uploads later
    logging_dir = Path(output_dir) / TRACKING_DIR_NAME
    return {"log_with": report_to,
            "project_config": ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(logging_dir))}


def start(accelerator, config) -> None:
    """Open the run in every configured tracker, with the run's settings (main process only)."""
    if config.report_to == "none":
        return
    settings = {key: value for key, value in vars(config).items() if isinstance(value, (int, float, str, bool))}
    accelerator.init_trackers(RUN_NAME, config=settings)


def step_metrics(record: dict, peak_tflops: float, processes: int, device) -> dict[str, float]:
    """The numbers of one optimizer step for the trackers (None-valued ones left out)."""
    mfu = gpu.mfu(record["flops"], record["seconds"], peak_tflops, processes) if device.type == "cuda" else None
    peak = runtime.peak_memory(device)
    metrics = {"train/loss": record["loss"], "train/learning_rate": record["learning_rate"],
               "train/grad_norm": record["grad_norm"], "train/tokens_per_second": record["tokens_per_second"],
               "train/mfu": mfu, "train/peak_memory_bytes": peak.total_bytes if peak else None}
    return {name: float(value) for name, value in metrics.items() if value is not None}
