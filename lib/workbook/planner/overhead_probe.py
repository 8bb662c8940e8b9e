"""The CUDA context and library workspaces of one GPU, measured once by its own probe and written into
that GPU's profile (``cuda_overhead_gib``), never fitted to the calibration grid.

    workbook overhead-probe --profile h100 --out outputs/reference/h100   # on the GPU
    workbook overhead-probe --apply outputs/reference/h100/cuda_overhead.json   # here

Memory outside PyTorch's allocator (total - free - reserved, ``runtime.peak_memory``) grows as the
process loads what a job loads: the context itself, cuBLAS/cuBLASLt handles and workspaces, the
attention kernels' modules (CUDA loads modules lazily), the fused optimizer's. The probe runs, in a
fresh process, what the workbook's jobs run (a two-layer model of the profile's training architecture
at its real width, bf16: generation, a training step with fused AdamW, then packed rows through the
trainer's packed attention, flex attention's compiled Triton kernels on a GPU) and reads that memory
after each stage; the largest reading is the constant. ``workbook calibrate --overhead-from`` plans the
grid with it, so the grid tests the constant too. ``--apply`` rewrites the profile's line, comment
and all, with where the value came from.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from workbook import gpu, params, presets, runtime
from workbook.paths import PARAMS_DIR
from workbook.planner.architectures import model_attention, training_attention
from workbook.planner.shape import model_shape
from workbook.training import packed_attention
from workbook.units import GiB

RESULT_FILE = "cuda_overhead.json"
PROBE_LAYERS = 2  # the architecture's width, two layers: the kernels a job loads, in seconds
STAGES = ("context", "bf16 matmul (cuBLAS)", "generation (left-padded sdpa, sampling)",
          "training step (backward, fused AdamW)", "packed training step (the trainer's packed attention)")


def non_pytorch_bytes(device: torch.device) -> int:
    """Device memory in use outside PyTorch's caching allocator, now (``runtime.peak_memory`` reads it so)."""
    return runtime.peak_memory(device).non_pytorch_bytes


def measure(model_name: str, device: torch.device, read: Callable[[torch.device], int] = non_pytorch_bytes) -> dict:
    """Run each stage on ``device`` and ``read`` the memory outside PyTorch after it; the constant is the
    largest reading (CUDA never unloads a module)."""
    from transformers import AutoModelForCausalLM

    readings = {}
    torch.empty(1, device=device)  # creates the context
    readings[STAGES[0]] = read(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    (a @ a).sum().item()
    readings[STAGES[1]] = read(device)
    config = presets.load_config(model_name)
    config.num_hidden_layers = PROBE_LAYERS
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    prompt = torch.randint(0, config.vocab_size, (4, 64), device=device)
    # Left-padded, as the engine's batches are: a masked sdpa loads other kernels than an unmasked one.
    attention_mask = torch.ones_like(prompt)
    attention_mask[1:, :8] = 0
    with torch.no_grad():
        model.generate(prompt, attention_mask=attention_mask, max_new_tokens=4, do_sample=True, pad_token_id=0)
    readings[STAGES[2]] = read(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    model.train()
    model(input_ids=prompt, labels=prompt, use_cache=False).loss.backward()
    optimizer.step()
    readings[STAGES[3]] = read(device)
    result = {"model": f"{model_name} ({PROBE_LAYERS} layers at full width, random {str(dtype).split('.')[-1]} weights)"}
    try:
        result["packed_attention"] = packed_training_step(model, config, device)
    except Exception as error:  # a path never run on this GPU: the other stages' constant still stands
        result["packed_attention_failed"] = f"{type(error).__name__}: {error}"[:500]
    readings[STAGES[4]] = read(device)
    return {**result, "readings_bytes": readings, "overhead_bytes": max(readings.values())}


def packed_training_step(model, config, device: torch.device) -> str:
    """A backward over two packed rows through the attention the trainer runs them with (flex attention
    on a GPU: Triton kernels compiled and loaded as modules, outside PyTorch's allocator); its name."""
    packed_attention.register()
    attention = training_attention(model_shape(config), "sdpa", "packing", 128, on_gpu=device.type == "cuda")
    model.set_attn_implementation(model_attention(attention))
    tokens = torch.randint(0, config.vocab_size, (2, 128), device=device)
    positions = torch.cat([torch.arange(48), torch.arange(80)]).repeat(2, 1).to(device)  # two examples a row
    model(input_ids=tokens, position_ids=positions, labels=tokens, use_cache=False).loss.backward()
    runtime.synchronize(device)
    return attention


def apply(result_path: str | Path, params_dir: Path = PARAMS_DIR) -> Path:
    """Write a probe's constant into its profile's ``cuda_overhead_gib`` line (comment included); a
    profile that still takes the schema's prior (no such line) gets the line at its end."""
    result = json.loads(Path(result_path).read_text())
    path = params_dir / f"{result['profile']}.yaml"
    text = path.read_text()
    gib = result["overhead_bytes"] / GiB
    line = (f"cuda_overhead_gib: {gib:.2f}   # CUDA context + workspaces, measured on {result['hardware_name']} "
            f"(torch {result['torch']}) by workbook overhead-probe")
    updated, count = re.subn(r"(?m)^cuda_overhead_gib:.*$", line, text)
    if count == 0:
        updated = text + ("" if text.endswith("\n") else "\n") + line + "\n"
    elif count != 1:
        raise ValueError(f"{path}: expected one 'cuda_overhead_gib:' line, found {count}")
    path.write_text(updated)
    try:
        params.load(path)  # still a valid profile, or the error names the line
    except params.ParamsError:
        path.write_text(text)  # a bad constant never stays in the profile
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook overhead-probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="the GPU profile in params/ this GPU is (its training model is probed)")
    parser.add_argument("--out", help=f"folder for {RESULT_FILE}")
    parser.add_argument("--apply", metavar="JSON", help=f"write a probe's {RESULT_FILE} into its profile's line")
    args = parser.parse_args(argv)
    if args.apply:
        print(f"wrote cuda_overhead_gib into {apply(args.apply)}")
        return 0
    if not (args.profile and args.out):
        parser.error("give --profile and --out (on the GPU), or --apply JSON (here)")
    if not torch.cuda.is_available():
        print("error: the probe measures a CUDA GPU's memory and there is none here; run it on the GPU the "
              f"profile describes: workbook overhead-probe --profile {args.profile} --out DIR",
              file=sys.stderr)
        return 2
    profile = params.load(params.profile_path(args.profile))
    device = torch.device("cuda")
    result = {"profile": args.profile, **measure(profile["bench_train_model"], device),
              "hardware_name": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "hardware": gpu.detect(), "versions": gpu.software_versions(),
              "command": f"workbook overhead-probe --profile {args.profile} --out {args.out}",
              "what": "memory outside PyTorch's allocator (total - free - reserved) after each stage, in a fresh "
                      "process; the constant is the largest"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    for stage, value in result["readings_bytes"].items():
        print(f"{stage}: {value / GiB:.3f} GiB outside PyTorch's allocator")
    print(f"cuda_overhead_gib {result['overhead_bytes'] / GiB:.2f} (was {profile['cuda_overhead_gib']}, a prior); "
          f"wrote {out / RESULT_FILE}; apply here with --apply")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
