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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbook", description=__doc__.split("\n")[0])
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (params_module.ParamsError, RunError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
