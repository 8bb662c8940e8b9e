"""Checkpoints: accelerate's state (model, optimizer, scaler, RNG) plus ours, complete only once our
state file is written, resumed only by a run with the same data and settings; the final model.

Over several nodes the checkpoint folder may be shared (NFS, a cluster filesystem) or each node's
own disk. DDP replicates the model and optimizer, so each node then keeps a full copy of every
checkpoint (accelerate's ``save_on_each_node``) and resumes from its own disk: nothing has to be
mounted everywhere. FSDP shards them, and resuming reads every shard plus the first process's
metadata, so its checkpoint folder must be shared; that is checked when training starts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from workbook import jsonl, presets, runtime
from workbook.training.config import TrainError

STATE_FILE = "workbook_state.json"  # written last into a checkpoint: its presence marks it complete
KEEP_CHECKPOINTS = 2  # older checkpoints are deleted: one holds weights and optimizer (16 B/param)


def fingerprint(config, prepared, run) -> dict:
    """What a checkpoint must agree on to be resumed: the data (hashed) and every setting that
    changes which examples a step sees or how far the schedule has gone. Not the process count: a
    step sees the same examples for any split of the effective batch over processes and
    accumulation, so a DDP run may resume on fewer or more GPUs with the same effective batch.
    ``config``, ``prepared`` and ``run``: the run's TrainConfig, PreparedData and RunPlan."""
    data = hashlib.sha256(json.dumps([e.input_ids for e in prepared.train]).encode()).hexdigest()[:16]
    return {"model": config.model, "data": data, "max_seq_length": prepared.max_seq_length, "padding": config.padding,
            "micro_batch_size": run.micro_batch_size, "effective_batch_rows": run.effective_batch_rows,
            "learning_rate": run.learning_rate, "total_steps": run.total_steps,
            "warmup_steps": config.warmup_steps, "lora_rank": config.lora_rank, "optimizer": config.optimizer,
            "dtype": config.dtype, "precision": config.precision, "seed": config.seed}


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (one whose state file was written), or None."""
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    folder = Path(output_dir) / "checkpoints"
    return sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file()) if folder.is_dir() else []


def choose_where_to_save(accelerator, output_dir: Path, *, fsdp: bool, saves_checkpoints: bool) -> bool:
    """Whether every process sees the first process's ``output_dir``; when some do not (nodes each with
    their own disk), DDP saves a full copy on each node, and FSDP, which cannot, stops with a TrainError
    before the first step. A collective: every process calls it."""
    if accelerator.num_processes == 1:
        return True
    shared = runtime.folder_shared_with_first(output_dir, accelerator.process_index, _all_gather)
    if all(shared):
        return True
    others = [rank for rank, seen in enumerate(shared) if not seen]
    if fsdp and saves_checkpoints:
        raise TrainError(f"FSDP checkpoints are sharded across the processes, and process(es) {others} do not see "
                         f"the first process's checkpoint folder {output_dir} (each node has its own disk), so a "
                         "resume could not read them: put train_output_dir (or --run-dir) on a filesystem every node "
                         "mounts at the same path, or set save_every_steps: 0 (no checkpoints; the final model is "
                         "still saved on the first node)")
    accelerator.project_configuration.save_on_each_node = True
    return False


def agreed_checkpoint(accelerator, output_dir: Path) -> Path | None:
    """The newest checkpoint complete in every process's view of ``output_dir`` (nodes that keep their
    own copies may differ by the one a kill interrupted), or None. A TrainError when some process has
    checkpoints and another has none in common with it: resuming only some would train apart."""
    mine = [path.name for path in complete_checkpoints(output_dir)]
    if accelerator.num_processes == 1:
        return output_dir / "checkpoints" / mine[-1] if mine else None
    every = _all_gather(mine)
    common = set(every[0]).intersection(*every[1:])
    if common:
        return output_dir / "checkpoints" / max(common)
    if any(every):
        newest = {rank: names[-1] if names else "none" for rank, names in enumerate(every)}
        raise TrainError(f"the processes do not hold a common checkpoint in {output_dir / 'checkpoints'} (newest per "
                         f"process: {newest}). Each node keeps its own copy when the "
                         "folder is not shared: copy the newest checkpoint folder from a node that has it to the "
                         "same path on the others, or move the checkpoints away to train anew")
    return None


def _all_gather(value) -> list:
    from accelerate.utils import gather_object
    return gather_object([value])


def saved_state(checkpoint: Path) -> dict:
    """What our state file holds: the step, the fingerprint and the history so far; TrainError
    naming the checkpoint when the file is damaged."""
    path = Path(checkpoint) / STATE_FILE
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not {"step", "fingerprint", "history", "eval_history"} <= state.keys():
            raise ValueError("not the state a checkpoint saves (step, fingerprint, history, eval_history)")
    except (OSError, ValueError) as error:
        raise damaged(Path(checkpoint), f"{path.name}: {error}") from error
    return state


def damaged(checkpoint: Path, what: str):
    """The TrainError for a checkpoint that cannot be read back: what is wrong, and the ways on
    (the older checkpoint kept beside it, or a new folder), nothing deleted."""
    older = [p for p in complete_checkpoints(checkpoint.parent.parent) if p.name < checkpoint.name]
    back = (f"move {checkpoint} away to resume from the older checkpoint kept, {older[-1].name}"
            if older else f"move {checkpoint} away to train from the start")
    return TrainError(f"cannot resume from {checkpoint}, it is damaged ({what}; a full disk or a copy cut short "
                      f"can do this): {back}, or set train_output_dir to a new folder")


def resumable_state(checkpoint: Path, fingerprint: dict) -> dict:
    """The state saved with ``checkpoint``; TrainError naming what differs when it was saved by a run
    with other settings or data (resuming it would silently train something else)."""
    state = saved_state(checkpoint)
    if state["fingerprint"] != fingerprint:
        differences = ", ".join(f"{key} {value} (now {fingerprint[key]})" for key, value in state["fingerprint"].items()
                                if fingerprint.get(key) != value)
        raise TrainError(f"{checkpoint} was saved by a run with other settings or data: {differences}. "
                         "Resume with the same settings and data; or, to train anew, set train_output_dir to a new "
                         f"folder or move {checkpoint.parent.parent} away")
    return state


def save(accelerator, output_dir, step, fingerprint, history, eval_history, accuracy_before):
    """accelerate's state (model, optimizer, scaler, RNG) and ours; the state file goes last."""
    target = checkpoint_dir(output_dir, step)
    accelerator.save_state(str(target))
    accelerator.wait_for_everyone()
    # One writer per copy: the first process, or each node's first when each node keeps its own.
    each_node = accelerator.project_configuration.save_on_each_node
    if accelerator.is_main_process or (each_node and accelerator.is_local_main_process):
        state = {"step": step, "fingerprint": fingerprint, "history": history, "eval_history": eval_history,
                 "accuracy_before": accuracy_before}
        # Atomic: a kill while it is written must not leave a torn file that marks the checkpoint complete.
        jsonl.write_text_atomically(target / STATE_FILE, json.dumps(state, default=str) + "\n")
        older = sorted(p for p in target.parent.glob("step-*") if p != target)
        for stale in older[:max(0, len(older) - (KEEP_CHECKPOINTS - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_final(accelerator, model, unwrapped, tokenizer, output_dir: Path, lora_save: str = "merged") -> str:
    """The trained model in Hugging Face format with its tokenizer, as <output_dir>/final: a model that
    ``model: <output_dir>/final`` loads for the next generation or training. ``model`` as accelerate
    prepared it, ``unwrapped`` the model inside. LoRA: with ``lora_save: merged`` (the default) the
    adapters are added into the base weights, a standalone model; with ``adapters`` only they are
    saved, and loading them needs the base model where adapter_config.json says it is."""
    final = output_dir / "final"
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP: every process calls it
    if accelerator.is_main_process:
        unwrapped.save_pretrained(final, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(final)
        if lora_save == "merged" and (final / "adapter_config.json").is_file():
            merge_adapters(final)
    accelerator.wait_for_everyone()
    return str(final)


def merge_adapters(folder: Path) -> None:
    """Replace a folder of LoRA adapters with the merged model (base + adapters, PEFT's merge_and_unload),
    in the base model's dtype, with the folder's tokenizer. Merged from the saved adapters on the CPU, so
    it works the same whether the run was sharded or not: the base is read once more from its folder."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(presets.adapter_base_model(folder), dtype="auto")
    merged = peft.PeftModel.from_pretrained(base, folder).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    staging = folder.with_name(folder.name + ".merging")
    shutil.rmtree(staging, ignore_errors=True)
    merged.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder)
    staging.rename(folder)
