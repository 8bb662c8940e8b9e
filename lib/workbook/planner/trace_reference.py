"""The analytical plan beside the fake-tensor trace, per preset and setting: the table that says how far
the fast plan is from the peak the workbook's own code reaches (``planner.trace``).

    workbook trace-vs-plan --out outputs/reference/cpu

writes ``trace_vs_plan.json`` (one row per preset x setting, appended as each trace finishes, so a cut
run keeps its rows) and ``trace_vs_plan.md`` (the table, with the command that made it and the seconds
each trace took on this machine). A preset whose step cannot run on fake tensors gets a row naming the
op and module instead of a peak. ``--keep --models A`` traces A again and keeps the other presets' rows (a
run in parts); ``--replan`` traces nothing and plans every kept row again beside its trace (a change to the
planner alone). Rows more than 2% from their trace are listed under the table with the substitution the
trace names for them, where it names one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from workbook import presets
from workbook.planner import trace
from workbook.planner.generation import plan_generate
from workbook.planner.training import plan_train
from workbook.units import GiB

TRAIN_SEQ_LEN = 2048  # tokens per row
TRAIN_MICRO_BATCH = 2  # rows per micro-batch
GENERATE_BATCH, PROMPT_LEN, NEW_TOKENS = 8, 512, 256
UNBOUNDED = 1 << 50  # the comparison plans against no budget: only the terms matter

# Each setting: its label and the TrainConfig fields (training) or the backend (generation) it changes.
TRAINING_SETTINGS = {
    "mixed bf16": {"dtype": "bf16", "precision": "mixed"},
    "pure bf16": {"dtype": "bf16", "precision": "bf16"},
    "mixed bf16, checkpointing": {"dtype": "bf16", "precision": "mixed", "grad_checkpointing": True},
    "mixed bf16, chunked loss 1024": {"dtype": "bf16", "precision": "mixed", "loss_chunk_tokens": 1024},
    "LoRA r16 on bf16": {"dtype": "bf16", "precision": "mixed", "lora_rank": 16},
    "LoRA r16 on bf16, checkpointing": {"dtype": "bf16", "precision": "mixed", "lora_rank": 16,
                                        "grad_checkpointing": True},
}
GENERATION_SETTINGS = {"static (dynamic cache)": "static", "static-compiled (static cache)": "static-compiled"}


def training_config(model: str, fields: dict):
    """The TrainConfig of one preset x training setting: the run the trace runs."""
    from workbook.training.config import TrainConfig
    return TrainConfig(model=model, data_path="", data_description="", output_dir="", max_seq_length=TRAIN_SEQ_LEN,
                       micro_batch_size=TRAIN_MICRO_BATCH, padding="packing", optimizer="adamw",
                       attn_implementation="sdpa", **{"grad_checkpointing": False, "lora_rank": 0,
                                                      "loss_chunk_tokens": 0, **fields})


def training_plan(model: str, fields: dict, attention: str):
    """The plan of one preset x training setting with the attention the trace ran: fused AdamW as on a GPU, no
    CUDA context or fragmentation terms."""
    config = training_config(model, fields)
    return plan_train(presets.load_config(model), micro_batch_size=TRAIN_MICRO_BATCH, seq_len=TRAIN_SEQ_LEN,
                      gpu_memory_bytes=UNBOUNDED, dtype=config.dtype,
                      mixed_precision=config.precision == "mixed", grad_checkpointing=config.grad_checkpointing,
                      lora_rank=config.lora_rank, attn_implementation=attention,
                      loss_chunk_tokens=config.loss_chunk_tokens,
                      gradient_accumulation_steps=config.gradient_accumulation_steps, overhead_bytes=0,
                      fragmentation_fraction=0.0)


def generation_plan(model: str, backend: str, attention: str):
    return plan_generate(presets.load_config(model), batch_size=GENERATE_BATCH, prompt_len=PROMPT_LEN,
                         new_tokens=NEW_TOKENS, gpu_memory_bytes=UNBOUNDED, dtype="bf16",
                         attn_implementation=attention, static_cache=backend == "static-compiled",
                         overhead_bytes=0, fragmentation_fraction=0.0)


def training_row(model: str, label: str, fields: dict) -> dict:
    """One preset x training setting: the trace on fake tensors and the plan of the same run."""
    traced = trace.trace_training(training_config(model, fields), on_gpu=True)
    return _row(model, "train", label, training_plan(model, fields, traced.settings["attention"]), traced)


def generation_row(model: str, label: str, backend: str) -> dict:
    traced = trace.trace_generation(model, batch_size=GENERATE_BATCH, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
                                    dtype="bf16", backend=backend)
    return _row(model, "generate", label, generation_plan(model, backend, traced.settings["attention"]), traced)


def replanned(row: dict) -> dict:
    """A kept row with its plan made again by the planner as it is now, beside the trace it holds (not run again):
    for a planner change that leaves the traced step as it was."""
    if "error" in row:
        return row
    plan = (training_plan(row["model"], TRAINING_SETTINGS[row["setting"]], row["attention"]) if row["mode"] == "train"
            else generation_plan(row["model"], GENERATION_SETTINGS[row["setting"]], row["attention"]))
    traced = trace.Trace(mode=row["mode"], model=row["model"], peak_bytes=row["trace_peak_bytes"], phase=row["phase"],
                         by_kind=row["by_kind"], phase_peaks={}, seconds=row["seconds"],
                         settings={"attention": row["attention"]}, substitutions=row.get("substitutions", []))
    return _row(row["model"], row["mode"], row["setting"], plan, traced)


def _row(model, mode, label, plan, traced) -> dict:
    beside = trace.beside_plan(plan, traced)
    return {"model": model, "mode": mode, "setting": label, "trace_peak_bytes": traced.peak_bytes,
            "phase": traced.phase, "by_kind": traced.by_kind, "plan_tensor_bytes": beside["plan_tensor_bytes"],
            "plan_moment": plan.settings.get("peak_moment", ""), "substitutions": traced.substitutions,
            "plan_over_trace": beside["plan_over_trace"], "groups": beside["groups"], "seconds": traced.seconds,
            "attention": traced.settings["attention"]}


def rows(models: list[str], modes: tuple[str, ...] = ("train", "generate"), log=print):
    """Every preset x setting as a row (yielded as each trace finishes); a failure is a row with ``error``."""
    for model in models:
        jobs = []
        if "train" in modes:
            jobs += [("train", label, lambda m=model, l=label, f=fields: training_row(m, l, f))
                     for label, fields in TRAINING_SETTINGS.items()]
        if "generate" in modes:
            jobs += [("generate", label, lambda m=model, l=label, b=backend: generation_row(m, l, b))
                     for label, backend in GENERATION_SETTINGS.items()]
        for mode, label, job in jobs:
            started = time.perf_counter()
            try:
                row = job()
            except (trace.TraceError, ValueError) as error:
                row = {"model": model, "mode": mode, "setting": label, "error": str(error),
                       "seconds": round(time.perf_counter() - started, 2)}
            log(f"{model} {mode} {label}: " + (f"plan/trace {row['plan_over_trace']}, {row['seconds']} s" if "error" not in row
                                               else f"not traced ({row['error'][:160]})"))
            yield row


TOLERANCE = 0.02  # the plan is held to this of the trace
# A substitution that makes the CPU trace hold more than the GPU step the plan plans says so in these words.
TRACE_HOLDS_MORE = "the trace holds more than the GPU step"


def markdown(table: list[dict], command: str) -> str:
    lines = ["# The analytical plan beside the fake-tensor trace", "",
             f"Made by `{command}` on this machine's CPU (fake tensors: no weights, no GPU). Training: "
             f"{TRAIN_MICRO_BATCH} x {TRAIN_SEQ_LEN} tokens of packed rows, AdamW (fused, as on a GPU), two steps; "
             f"generation: batch {GENERATE_BATCH}, {PROMPT_LEN} prompt + {NEW_TOKENS} new tokens, bf16. Bytes are "
             "tensors only (no CUDA context, no allocator rounding); the plan is planned with the attention the "
             "trace ran. The plan's peak is a moment of the step (planner/step_moments.py): the start of backward, "
             "a checkpointed layer recomputed in backward, the end of backward or the optimizer step; the trace's "
             "phase is when its own peak was.", "",
             "| model | mode | setting | trace peak (GiB) | phase | plan (GiB) | plan's moment | plan vs trace "
             "| trace seconds |",
             "|---|---|---|---:|---|---:|---|---:|---:|"]
    for row in table:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['mode']} | {row['setting']} | not traced | {row['error'][:200]} "
                         f"| | | | {row['seconds']} |")
            continue
        lines.append(f"| {row['model']} | {row['mode']} | {row['setting']} | {row['trace_peak_bytes'] / GiB:.2f} | "
                     f"{row['phase']} | {row['plan_tensor_bytes'] / GiB:.2f} | {row.get('plan_moment', '')} | "
                     f"{100 * (row['plan_over_trace'] - 1):+.1f}% | {row['seconds']} |")
    outside = [row for row in table if "error" not in row and abs(row["plan_over_trace"] - 1) > TOLERANCE]
    traced = [row for row in table if "error" not in row]
    lines += ["", f"{len(traced) - len(outside)} of {len(traced)} traced rows are within {TOLERANCE:.0%} of the trace."]
    if outside:
        lines += ["", f"## Rows more than {TOLERANCE:.0%} from the trace, and why", ""]
        for row in outside:
            reasons = [text for text in row.get("substitutions", []) if TRACE_HOLDS_MORE in text]
            why = "; ".join(reasons) if reasons else "not explained by a substitution the trace names"
            lines.append(f"- {row['model']}, {row['mode']}, {row['setting']} "
                         f"({100 * (row['plan_over_trace'] - 1):+.1f}%): {why}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook trace-vs-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/reference/cpu", help="folder for trace_vs_plan.json and .md")
    parser.add_argument("--models", default=",".join(presets.preset_names()[1:]),
                        help="comma-separated presets (default: every preset)")
    parser.add_argument("--modes", default="train,generate", help="train, generate or both")
    parser.add_argument("--keep", action="store_true",
                        help="keep the rows of other models already in trace_vs_plan.json (a run in parts)")
    parser.add_argument("--replan", action="store_true",
                        help="trace nothing: plan every row of trace_vs_plan.json again beside the trace it holds "
                             "(after a change to the planner alone)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    command = "workbook trace-vs-plan " + " ".join(argv if argv is not None else sys.argv[1:])
    table, earlier = [], out / "trace_vs_plan.json"
    if args.replan:
        kept = json.loads(earlier.read_text())
        table, command = [replanned(row) for row in kept["rows"]], f"{kept['command']}; then {command}"
        earlier.write_text(json.dumps({"command": command, "rows": table}, indent=1) + "\n")
        (out / "trace_vs_plan.md").write_text(markdown(table, command))
        return 0
    if args.keep and earlier.is_file():
        kept = json.loads(earlier.read_text())
        table = [row for row in kept["rows"] if row["model"] not in models]
        command = f"{kept['command']}; then {command}"
    for row in rows(models, tuple(args.modes.split(",")), log=lambda line: print(line, flush=True)):
        table.append(row)
        (out / "trace_vs_plan.json").write_text(json.dumps({"command": command, "rows": table}, indent=1) + "\n")
        (out / "trace_vs_plan.md").write_text(markdown(table, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
