"""Supervised fine-tuning (notebook 03, `workbook train`): one `train(config)` for one process or many.

    config = config_from_params(params, run_dir)        # every setting from a params profile
    prepared = prepare_data(config)                      # tokens, lengths, truncation, padding waste
    result = launch(config, prepared)                    # 1 process in-process, N via notebook_launcher

From the shell, the same function: `workbook train --params h200 [--set key=value ...]`, or one
process per GPU (several nodes: the launcher's usual node flags) with
`accelerate launch --multi_gpu --num_processes 8 -m workbook.training --params h100x8 --run-dir DIR`
(FSDP: `accelerate launch --config_file fsdp.yaml ...` instead of the first two flags) or
`torchrun --nproc_per_node 8 -m workbook.training --params h100x8 --run-dir DIR`.

Where each part lives: ``config`` (params -> one typed TrainConfig), ``examples`` (tokenize,
truncate, split), ``batches`` (packing, length grouping, the collator and the loss), ``prepare`` (the
data a run trains on), ``run_plan`` (micro-batch, steps, learning rate, memory plan, FLOPs), ``loop``
(``train``), ``evaluation`` (validation loss, accuracy), ``checkpoints``, ``report`` (what was
measured, and how), ``processes`` (one or many), ``run_folder`` (a new run folder, or the one the
same command left unfinished: rerunning it after a kill resumes) and ``cli`` (``workbook train``).
"""

from workbook.training.cli import main
from workbook.training.config import PARAMS_USED, TrainConfig, TrainError, TrainingDiverged, config_from_params
from workbook.training.loop import train
from workbook.training.prepare import PreparedData, prepare_data
from workbook.training.processes import launch
from workbook.training.report import summary_lines
from workbook.training.run_plan import RunPlan, largest_micro_batch, memory_plan, plan_run

__all__ = [
    "PARAMS_USED", "PreparedData", "RunPlan", "TrainConfig", "TrainError", "TrainingDiverged", "config_from_params", "launch", "main",
    "largest_micro_batch", "memory_plan", "plan_run", "prepare_data", "summary_lines", "train",
]
