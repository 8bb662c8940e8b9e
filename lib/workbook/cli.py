"""The `workbook` command (also `python -m workbook`). Each subcommand parses its arguments and
calls the same library function the notebooks call; no logic lives here."""

from __future__ import annotations

import argparse
import json
import sys

from workbook import params as params_module
from workbook.runner import RunError


def _cmd_gpu(args) -> int:
    from workbook import gpu
    detection = gpu.detect()
    choice = gpu.select_profile(detection["gpus"], params_module.load_all())
    detection["profile"] = {"name": choice.profile, "exact": choice.exact, "reason": choice.reason}
    if args.json:
        print(json.dumps(detection, indent=2, default=str))
        return 0
    versions = detection["versions"]
    print(f"host {detection['hostname']}: python {versions['python']}, torch {versions['torch']} "
          f"(CUDA {versions['torch_cuda']}), transformers {versions['transformers']}, "
          f"accelerate {versions['accelerate']}")
    cpu = detection["cpu"]
    ram = f"{cpu['ram_bytes'] / 2**30:.1f} GiB" if cpu["ram_bytes"] else "unknown"
    print(f"cpu: {cpu['model']}, {cpu['usable_cores']} usable cores, {ram} RAM")
    if not detection["gpus"]:
        print("gpu: none detected" + (f" ({'; '.join(detection['notes'])})" if detection["notes"] else ""))
    else:
        print(f"driver {detection['driver_version']}, CUDA driver {detection['cuda_driver_version']}")
    for g in detection["gpus"]:
        print(f"gpu {g['index']}: {g['name']}, {g['memory_total_bytes'] / 2**30:.1f} GiB total, "
              f"{g['memory_free_bytes'] / 2**30:.1f} GiB free, compute capability {g['compute_capability']}, "
              f"bf16 {'yes' if g['supports_bf16'] else 'no'}, TF32 {'yes' if g['supports_tf32'] else 'no'}")
    print(("profile: " if choice.exact else "WARNING: ") + choice.reason)
    return 0


def _cmd_run(args) -> int:
    from workbook import runner
    result = runner.run(args.params, only=args.only, overrides=args.set)
    return 0 if result.ok else 1


def _cmd_plan(args) -> int:
    from workbook import planning, runner
    profile = runner.resolve_params(args.profile, [], log=lambda line: print(line, file=sys.stderr))[0]
    overrides = {key: value for key, value in {
        "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
        "max_new_tokens": args.new_tokens, "seq_len": args.seq_len, "lora_rank": args.lora_rank,
        "grad_checkpointing": args.grad_checkpointing or None, "safety_margin": args.safety_margin,
        "optimizer": args.optimizer, "sharding": args.sharding,
    }.items() if value is not None}
    for key, value in overrides.items():
        # int8/int4 are weight formats the planner knows but no profile runs in.
        if key in params_module.SCHEMA and not (key == "dtype" and value in ("int8", "int4")):
            params_module.validate_value(key, value, f"--{key.replace('_', '-')}")
    try:
        result = planning.plan(profile, mode=args.mode, batch_size=args.batch_size, **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"profile": profile["profile"], **result.to_dict(), "advice": result.advice()},
                         indent=2, default=str))
    else:
        print(_plan_text(result, profile["profile"]))
    if result.max_batch_size == 0:
        print(f"error: {result.advice()}", file=sys.stderr)
        return 3
    return 0 if result.fits else 1


def _plan_text(result, profile_name: str) -> str:
    from workbook.units import format_bytes
    lengths = ", ".join(f"{key} {value}" for key, value in result.lengths.items())
    lines = [f"{result.model} ({result.params:,} parameters), {result.mode}, {result.dtype}, "
             f"batch {result.batch_size}, {lengths}; profile {profile_name}: "
             f"{format_bytes(result.capacity_bytes)} per GPU x {result.gpu_count}",
             f"{'term':<28}{'bytes':>16}  {'':>10}  how it was computed"]
    for term in result.terms:
        lines.append(f"{term.name:<28}{term.bytes:>16,}  {format_bytes(term.bytes):>10}  {term.explanation}")
    lines.append(f"{'total (predicted peak)':<28}{result.total_bytes:>16,}  {format_bytes(result.total_bytes):>10}")
    verdict = "FITS" if result.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: budget {format_bytes(result.budget_bytes)} per GPU "
                 f"({result.safety_margin:.0%} of {format_bytes(result.capacity_bytes)} kept free); "
                 f"largest batch that fits: {result.max_batch_size}")
    if result.kv_cache_bytes_per_token:
        lines.append(f"KV cache: {result.kv_cache_bytes_per_token:,} bytes per token")
    lines += [f"note: {note}" for note in result.notes]
    if not result.fits:
        lines.append(result.advice())
    return "\n".join(lines)


def _cmd_calibrate(args) -> int:
    from workbook import calibration
    return calibration.main(["--out", args.out or f"outputs/reference/{args.profile}", "--profile", args.profile])


def _job(module_name: str):
    """Handler for a job subcommand whose logic lives in `workbook.<module_name>.cli_main`."""
    def handler(args) -> int:
        import importlib
        return importlib.import_module(f"workbook.{module_name}").cli_main(args.params, args.set)
    return handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbook", description="GPU experiment workbook: detect the GPU, "
                                     "plan memory, generate, train and benchmark; run the notebooks headless.")
    commands = parser.add_subparsers(dest="command", required=True)

    gpu_parser = commands.add_parser("gpu", help="show the GPUs, versions and the matching params profile")
    gpu_parser.add_argument("--json", action="store_true", help="print everything as JSON")
    gpu_parser.set_defaults(handler=_cmd_gpu)

    run_parser = commands.add_parser("run", help="run the notebooks headless into outputs/<timestamp>-<profile>/")
    run_parser.add_argument("--params", default="auto",
                            help="'auto' (detect the GPU), a profile name (h200) or a file (params/h200.yaml)")
    run_parser.add_argument("--only", nargs="+", metavar="NOTEBOOK",
                            help="run only these notebooks, e.g. --only 00 or --only 00_gpu_detection")
    run_parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                            help="override a parameter, e.g. --set dtype=fp16 (validated like the file)")
    run_parser.set_defaults(handler=_cmd_run)

    plan_parser = commands.add_parser(
        "plan", help="predict peak GPU memory and the largest batch that fits (like accelerate estimate-memory, "
                     "but with KV cache, activations, optimizer states and overhead)")
    plan_parser.add_argument("--model", help="preset name (e.g. llama-3.1-8b) or a local model dir; "
                                             "default: the profile's model")
    plan_parser.add_argument("--profile", default="auto", help="params profile (h200, params/h100.yaml) or 'auto'")
    plan_parser.add_argument("--mode", choices=params_module.PLAN_MODES, help="default: the profile's plan_mode")
    plan_parser.add_argument("--batch-size", type=int, help="plan this batch (default: the profile's; "
                                                            "'auto' there means the largest that fits)")
    plan_parser.add_argument("--prompt-len", type=int, help="prompt tokens (generate)")
    plan_parser.add_argument("--new-tokens", type=int, help="new tokens per sequence (generate)")
    plan_parser.add_argument("--seq-len", type=int, help="sequence length (train)")
    plan_parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "int8", "int4"),
                             help="weights dtype (int8/int4: bitsandbytes weight formats)")
    plan_parser.add_argument("--grad-checkpointing", action="store_true", help="plan with activation recomputation")
    plan_parser.add_argument("--lora-rank", type=int, help="LoRA rank (train); 0 = full fine-tune")
    plan_parser.add_argument("--optimizer", choices=("adamw", "adamw-8bit"), help="train: optimizer states")
    plan_parser.add_argument("--sharding", choices=("none", "fsdp"),
                             help="train: 'fsdp' shards weights, gradients and optimizer over the profile's GPUs")
    plan_parser.add_argument("--safety-margin", type=float, help="fraction of memory kept free (default 0.05)")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.set_defaults(handler=_cmd_plan)

    calibrate_parser = commands.add_parser(
        "calibrate", help="measure peak memory over a grid of models x batches x modes on this GPU and compare "
                          "with the planner (memory_accuracy.json + .png); without a GPU only the exact CPU checks")
    calibrate_parser.add_argument("--profile", required=True, help="the GPU profile of this machine, e.g. h200")
    calibrate_parser.add_argument("--out", help="output folder (default outputs/reference/<profile>)")
    calibrate_parser.set_defaults(handler=_cmd_calibrate)

    for name, module_name, what in (
            ("generate", "generate", "batched generation of teacher outputs (JSONL in, JSONL out), resumable"),
            ("train", "train", "supervised fine-tuning on input/output JSONL"),
            ("bench", "bench", "generation and training sweeps against the hardware's limits")):
        job = commands.add_parser(name, help=what)
        job.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
        job.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override a parameter")
        job.set_defaults(handler=_job(module_name))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (params_module.ParamsError, RunError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
