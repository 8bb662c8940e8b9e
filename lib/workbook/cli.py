"""The `workbook` command (also `python -m workbook`). Each subcommand parses its arguments and
calls the same library function the notebooks call; no logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import sys

from workbook import job_keys, params as params_module
from workbook.arguments import WorkbookParser, add_set_argument
from workbook.runner import RunError


# `workbook plan --dtype`: the planner's names (planner.shape.BITS_PER_PARAMETER, DTYPE_ALIASES), written
# out here so `workbook --help` does not import torch.
PLAN_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
PLAN_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _cmd_gpu(args) -> int:
    from workbook import gpu, notebook
    detection = gpu.detect()
    choice = gpu.select_profile(detection["gpus"], params_module.load_all())
    detection["profile"] = {"name": choice.profile, "exact": choice.exact, "reason": choice.reason}
    if args.json:
        print(json.dumps(detection, indent=2, default=str))
        return 0
    print(f"host {detection['hostname']}, {detection['platform']}")
    for title, rows in gpu.machine_tables(detection):
        print(f"\n{title}\n{notebook.markdown_table(rows)}")
    if not detection["gpus"]:
        print("\nNo GPU detected." + (f" ({'; '.join(detection['notes'])})" if detection["notes"] else ""))
    print("\n" + ("profile: " if choice.exact else "WARNING: ") + choice.reason)
    return 0


def _cmd_run(args) -> int:
    from workbook import runner
    result = runner.run(args.params, only=args.only, overrides=args.set, verbose=args.verbose)
    return 0 if result.ok else 1


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _int_or_auto(text: str) -> int | str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}")


def _cmd_plan(args) -> int:
    from workbook import runner
    from workbook.planner import profile as planner_profile
    profile = runner.resolve_params(args.profile, [], log=lambda line: print(line, file=sys.stderr))[0]
    dtype = args.dtype and PLAN_DTYPE_ALIASES.get(args.dtype, args.dtype)  # "bfloat16" -> "bf16"
    overrides = {key: value for key, value in {
        "model": args.model, "dtype": dtype, "prompt_len": args.prompt_len,
        "max_new_tokens": args.new_tokens, "seq_len": args.seq_len, "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets,
        "grad_checkpointing": args.grad_checkpointing or None, "safety_margin": args.safety_margin,
        "optimizer": args.optimizer, "sharding": args.sharding, "tensor_parallel_size": args.tensor_parallel_size,
        "num_nodes": args.num_nodes, "attn_implementation": args.attn_implementation,
        "loss_chunk_tokens": args.loss_chunk_tokens, "precision": args.precision,
        "offload_activations": args.offload_activations or None, "double_quant": args.double_quant or None,
    }.items() if value is not None}
    flags = {"max_new_tokens": "--new-tokens"}  # the params key's flag, where the two names differ
    for key, value in overrides.items():
        # int8/int4 are weight formats the planner knows but no profile runs in.
        if key in params_module.SCHEMA and not (key == "dtype" and value in ("int8", "int4")):
            params_module.validate_value(key, value, flags.get(key, f"--{key.replace('_', '-')}"))
    options = []
    from workbook.planner import trace
    try:
        trace.refuse_non_causal(args.model or profile["model"])  # BERT, T5: exit 2, what is planned instead
        result = planner_profile.plan(profile, mode=args.mode, batch_size=args.batch_size, **overrides)
        if result.mode == "train" and not result.fits:  # its alternatives (LoRA among them) can be refused too
            from workbook.planner import fit
            options = fit.ways_to_fit(profile, batch_size=args.batch_size, **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from workbook.planner import accelerate_estimate
    beside = accelerate_estimate.beside_plan(result, args.model or profile["model"])
    traced = (trace.traced_plan({**profile, **overrides}, result, auto_batch=args.batch_size == "auto")
              if args.trace else None)
    if args.json:
        print(json.dumps({"profile": profile["profile"], **result.to_dict(), "advice": result.advice(),
                          "ways_to_fit": options, "accelerate_estimate_memory": beside,
                          **({"trace": traced} if traced else {})}, indent=2, default=str))
    else:
        print(planner_profile.plan_text(result, profile["profile"]))
        print(accelerate_estimate.comparison_line(beside))
        if options:
            print("\n".join(fit.ways_to_fit_lines(options)))
        if traced:
            print("\n".join(trace.traced_plan_lines(traced)))
    if result.max_batch_size == 0:
        print(f"error: {result.advice()}", file=sys.stderr)
        return 3
    return 0 if result.fits else 1


def _cmd_calibrate(args) -> int:
    import torch
    from workbook.planner import calibration
    # Without a GPU only the exact CPU checks run: they belong to the cpu reference, not to the GPU's.
    default = f"outputs/reference/{args.profile if torch.cuda.is_available() else 'cpu'}"
    return calibration.main(["--out", args.out or default, "--profile", args.profile,
                             *(["--only", args.only] if args.only else []),
                             *(["--cases", args.cases] if args.cases else []),
                             *(["--overhead-from", args.overhead_from] if args.overhead_from else [])])


def _cmd_forecast(args) -> int:
    from workbook.forecast.command import cli_main
    return cli_main(args.params, args.set, mode=args.mode, as_json=args.json, share=args.pilot_share,
                    seconds=args.pilot_seconds, clock=args.clock, method=args.method,
                    expected_new_tokens=args.expected_new_tokens, seed_000=args.seed_000)


def _cmd_generate(args) -> int:
    from workbook.generation.cli import cli_main
    return cli_main(args.params, args.set)


def _cmd_train(args) -> int:
    from workbook.training.cli import cli_main
    return cli_main(args.params, args.set)


def _cmd_verify(args) -> int:
    from workbook.generation.cli import verify_main
    return verify_main(args.params, args.set)


def _cmd_bench(args) -> int:
    from workbook import benchmark_plots  # matplotlib: only the command draws, the benchmark does not
    from workbook.bench.report import cli_main
    return cli_main(args.params, args.set, args.time_budget_seconds, figures=benchmark_plots.benchmark_figures)


# The measurement tools, each with its own options (`workbook <tool> --help`): name -> (module, help).
# The module is imported only when its tool runs, and parses the rest of the command line itself.
TOOLS = {
    "ceilings": ("workbook.ceilings", "measure what this device really does: copy bandwidth and dense matmul "
                 "throughput, beside a profile's datasheet figures"),
    "overhead-probe": ("workbook.planner.overhead_probe", "measure one GPU's CUDA context and library "
                       "workspaces and write them into its profile (cuda_overhead_gib)"),
    "random-weights": ("workbook.random_weights", "write a preset architecture with random weights as a "
                       "local model folder: a real architecture's speed and memory, nothing downloaded"),
    "trace-vs-plan": ("workbook.planner.trace_reference", "the plan beside the fake-tensor trace of the same step, "
                      "for every preset and setting (no weights, no GPU)"),
    "bench-continuous": ("workbook.bench.continuous_batching", "benchmark: static batches against continuous batching "
                         "on full-length and uneven outputs"),
    "bench-engine-overhead": ("workbook.bench.engine_overhead", "benchmark: what the generation engine costs over a "
                              "bare generate() loop, and what sorting prompts by length gains"),
    "bench-loss-head": ("workbook.bench.loss_head", "benchmark: the training loss over all logits against "
                        "the chunked loss, as the share of positions with loss falls"),
    "bench-rejection-sampling": ("workbook.bench.rejection_sampling", "benchmark: rounds of rejection-sampling "
                                 "fine-tuning (sample, verify, train; the next round with the trained model), "
                                 "held-out accuracy before and after each"),
    "forecast-check": ("workbook.bench.forecast_check", "benchmark: the forecast against the run it forecast, "
                       "on this machine"),
    "roofline-check": ("workbook.forecast.roofline_check", "benchmark: the forecast without a pilot (the job's work "
                       "at an efficiency measured once) against real runs on this machine"),
    "gpu-session": ("workbook.bench.gpu_session", "a lent GPU's call: a sweep of steps, each under its own time "
                    "budget, everything written under one folder (--list shows them)"),
    "gpu-summary": ("workbook.bench.gpu_summary", "a lent GPU's results against every goal, read from the "
                    "files its calls wrote"),
}


def _run_tool(name: str, argv: list[str]) -> int:
    import importlib
    return importlib.import_module(TOOLS[name][0]).main(argv)


# The jobs that take a params profile: name -> (handler, help); job_keys.READ_BY lists the keys each
# reads. Each handler imports its job only when called, so `workbook gpu` or `workbook plan` never pays
# for the training stack.
JOBS = {
    "generate": (_cmd_generate, "batched generation of teacher outputs (JSONL in, JSONL out), resumable"),
    "train": (_cmd_train, "supervised fine-tuning on input/output JSONL"),
    "bench": (_cmd_bench, "generation and training sweeps against the hardware's limits"),
    "forecast": (_cmd_forecast, "how long the job takes and what it costs, here and on every profile: a pilot of "
                 "its own batches (their outputs count toward the job), then the whole job simulated"),
    "verify": (_cmd_verify, "check an existing output with a verifier; the right ones go to <output>.accepted.jsonl"),
}


def note_keys_not_read(job: str, pairs: list[str]) -> None:
    """A note on stderr for each --set key the job does not read (a profile holds every notebook's keys:
    `train --set seq_len=...` is valid and changes nothing), with the key it may have meant."""
    from workbook.suggest import did_you_mean
    used = job_keys.READ_BY[job]
    for key in dict.fromkeys(pair.partition("=")[0].strip() for pair in pairs):
        if key in params_module.SCHEMA and key not in used:
            print(f"note: --set {key}: `workbook {job}` does not read it, so it changes nothing here."
                  f"{did_you_mean(key, used)}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = WorkbookParser(prog="workbook", description="GPU experiment workbook: detect the GPU, "
                     "plan memory, generate, train and benchmark; run the notebooks headless.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=WorkbookParser)

    gpu_parser = commands.add_parser("gpu", help="show the GPUs, versions and the matching params profile")
    gpu_parser.add_argument("--json", action="store_true", help="print everything as JSON")
    gpu_parser.set_defaults(handler=_cmd_gpu)

    run_parser = commands.add_parser("run", help="run the notebooks headless into outputs/<timestamp>-<profile>/")
    run_parser.add_argument("--params", default="auto",
                            help="'auto' (detect the GPU), a profile name (h200) or a file (params/h200.yaml)")
    run_parser.add_argument("--only", nargs="+", metavar="NOTEBOOK",
                            help="run only these notebooks, e.g. --only 00 or --only 00_gpu_detection")
    run_parser.add_argument("--verbose", action="store_true",
                            help="print every cell and its output as it runs, not one line per notebook "
                                 "(the executed notebooks in the run folder keep it either way)")
    add_set_argument(run_parser)
    run_parser.set_defaults(handler=_cmd_run)

    plan_parser = commands.add_parser(
        "plan", help="predict peak GPU memory and the largest batch that fits (like accelerate estimate-memory, "
                     "but with KV cache, activations, optimizer states and overhead)")
    plan_parser.add_argument("--model", help="preset name (e.g. llama-3.1-8b) or a local model dir; "
                                             "default: the profile's model")
    plan_parser.add_argument("--profile", default="auto", help="params profile (h200, params/h100.yaml) or 'auto'")
    plan_parser.add_argument("--mode", choices=params_module.PLAN_MODES, help="default: the profile's plan_mode")
    plan_parser.add_argument("--batch-size", type=_int_or_auto, help="plan this batch, or 'auto': the largest that "
                                                                     "fits (default: the profile's)")
    plan_parser.add_argument("--prompt-len", type=int, help="prompt tokens (generate)")
    plan_parser.add_argument("--new-tokens", type=int, help="new tokens per sequence (generate)")
    plan_parser.add_argument("--seq-len", type=int, help="sequence length (train)")
    plan_parser.add_argument("--dtype", choices=(*PLAN_DTYPES, *PLAN_DTYPE_ALIASES), metavar="DTYPE",
                             help=f"weights dtype: {', '.join(PLAN_DTYPES)} (int8/int4: bitsandbytes weight "
                                  f"formats; {', '.join(PLAN_DTYPE_ALIASES)} are accepted too)")
    plan_parser.add_argument("--grad-checkpointing", action="store_true", help="plan with activation recomputation")
    plan_parser.add_argument("--lora-rank", type=int, help="LoRA rank (train); 0 = full fine-tune")
    plan_parser.add_argument("--lora-targets", help="train: comma-separated module names LoRA adapts "
                                                    "(e.g. q_proj,v_proj); default: every linear projection")
    plan_parser.add_argument("--attn-implementation", choices=("sdpa", "flash_attention_2", "eager"),
                             help="default: the profile's attn_implementation")
    plan_parser.add_argument("--optimizer", choices=("adamw", "adamw-8bit"), help="train: optimizer states")
    plan_parser.add_argument("--sharding", choices=("none", "fsdp"),
                             help="train: 'fsdp' shards weights, gradients and optimizer over the profile's GPUs")
    plan_parser.add_argument("--tensor-parallel-size", type=_int_or_auto, metavar="N",
                             help="generate: shard the model over N GPUs (tensor parallel) and run gpu_count / N copies "
                                  "(data parallel); 'auto' picks the smallest N that fits a useful batch "
                                  "(default: the profile's tensor_parallel_size)")
    plan_parser.add_argument("--loss-chunk-tokens", type=int,
                             help="train: the loss over chunks of N positions (0: all logits at once)")
    plan_parser.add_argument("--precision", choices=("mixed", "bf16"),
                             help="train: 'mixed' (autocast, fp32 master weights) or 'bf16' (pure bf16 weights and "
                                  "AdamW states; needs --dtype bf16)")
    plan_parser.add_argument("--offload-activations", action="store_true",
                             help="train: saved activations in host memory (about one layer's on the GPU)")
    plan_parser.add_argument("--double-quant", action="store_true",
                             help="train, --dtype int4 (QLoRA): bitsandbytes' double quantization of the 4-bit "
                                  "weights' absmax (bnb_4bit_use_double_quant), about 0.37 bits per weight less")
    plan_parser.add_argument("--safety-margin", type=float, help="fraction of memory kept free (default: the profile's "
                             "safety_margin)")
    plan_parser.add_argument("--num-nodes", type=int, help="machines of the profile's GPUs (default: the profile's "
                             "num_nodes); the plan says what crosses the network between them")
    plan_parser.add_argument("--trace", action="store_true",
                             help="also run the step on fake tensors (no weights, no GPU; seconds to a minute) and show "
                                  "its peak, when it happens and what it holds, beside the plan")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.set_defaults(handler=_cmd_plan)

    calibrate_parser = commands.add_parser(
        "calibrate", help="measure peak memory over a grid of models x batches x modes on this GPU and compare "
                          "with the planner (memory_accuracy.json + .png); without a GPU only the exact CPU checks")
    calibrate_parser.add_argument("--profile", required=True, help="the GPU profile of this machine, e.g. h200")
    calibrate_parser.add_argument("--out", help="output folder (default outputs/reference/<profile>)")
    calibrate_parser.add_argument("--only", help="comma-separated beginnings of case names: only the first case "
                                  "each matches (a smoke pass)")
    calibrate_parser.add_argument("--cases", choices=("first-light",), help="a named case list instead of the grid "
                                  "(first-light: six cases spanning generation and training, one near the largest batch)")
    calibrate_parser.add_argument("--overhead-from", help="an overhead probe's cuda_overhead.json "
                                  "(workbook overhead-probe): plan each case's CUDA context with it")
    calibrate_parser.set_defaults(handler=_cmd_calibrate)

    for name, (handler, what) in JOBS.items():
        job = commands.add_parser(name, help=what, description=what, keys=job_keys.READ_BY[name],
                                  schema=params_module.SCHEMA)
        job.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
        add_set_argument(job)
        job.set_defaults(handler=handler)
        if name == "bench":
            job.add_argument("--time-budget-seconds", type=_positive_seconds,
                             help="stop after this many seconds: the point running is stopped, the rest marked not "
                                  "run, and the report written with what was measured (a lent GPU's call)")
        if name == "forecast":
            job.add_argument("--mode", choices=params_module.PLAN_MODES, help="default: the profile's plan_mode")
            job.add_argument("--json", action="store_true", help="print the forecast as JSON")
            job.add_argument("--pilot-share", type=float, default=0.1,  # pilot.DEFAULT_SHARE (a test holds them equal)
                             help="the pilot runs at most this share of the job's batches (training: steps), "
                                  "at least one; default 0.1")
            job.add_argument("--pilot-seconds", type=float,
                             help="generation: also stop the pilot after this many seconds (after its first batch; "
                                  "the continuous backend's pilot is one stream, run whole: lower --pilot-share)")
            job.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                             help="forecast wall seconds (default), or this process's CPU seconds: a machine "
                                  "shared with other work stretches wall time, not CPU time (use OMP_NUM_THREADS=1)")
            job.add_argument("--method", choices=("auto", "pilot", "work", "both"), default="auto",
                             help="pilot: run a share of the job here and time it; work: count the job's FLOPs and "
                                  "bytes from the model's config and price them on every profile at a measured "
                                  "efficiency or a labelled prior (no GPU, no weights); both: side by side; auto "
                                  "(default): the pilot where this machine can run the model, else work")
            job.add_argument("--expected-new-tokens", metavar="TOKENS",
                             help="work: the outputs' expected length in tokens where the prompts carry no reference "
                                  "outputs, e.g. 400, or equally likely lengths, e.g. 120,300,650: the params key "
                                  "expected_new_tokens, set here (neither set: max_new_tokens, an upper bound)")
            job.add_argument("--seed-000", metavar="FOLDER",
                             help="forecast seed 000's job (53,597 prompts, an 8B model, up to 2,048 new tokens) on "
                                  "every profile from its work, into FOLDER/seed_000_forecast.md and .json")
    for name, (_, what) in TOOLS.items():  # listed here; main() hands their arguments to the tool's own parser
        commands.add_parser(name, help=what, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        return _run_tool(argv[0], argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.command in JOBS:
            note_keys_not_read(args.command, args.set)
        try:
            code = args.handler(args)
        except (params_module.ParamsError, RunError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`workbook gpu --json | head -1`): nothing more to say, and no traceback.
        # Python's recipe (library/signal.html, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush cannot fail again, and exit 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
