"""A preset architecture with random weights as a local Hugging Face model directory, so the jobs that
load only directories (the generation job refuses a preset name: it writes text) run a real
architecture's speed and memory with nothing downloaded::

    workbook random-weights --preset Llama-3.1-8B --out /tmp/llama-3.1-8b-random --device cuda
    workbook generate --params h100 --set model=/tmp/llama-3.1-8b-random ...

The weights are ``models.build_random``'s, the benchmarks' own (built on the device in the dtype),
saved with ``save_pretrained`` (safetensors); the tokenizer is the tiny model's, so prompts tokenize
and outputs decode. Its 128 ids are a subset of every preset's vocabulary; an id beyond them, which
random weights generate, decodes to nothing (``tests/test_random_weights.py``). The text is noise:
the directory is for timing and memory, never for answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from workbook import decoding, models, tiny_model

BUILD_INFO_FILE = "workbook_random_weights.json"  # what the directory is, for reports and for a reader


def save_random_model(preset: str, directory: str | Path, dtype: str = "bf16", device: str | torch.device = "cpu", *,
                      seed: int = 0) -> Path:
    """``preset`` with random ``dtype`` weights built on ``device`` (seeded: the same weights every
    time), saved to ``directory`` with the tiny model's tokenizer; returns the directory."""
    began = time.perf_counter()
    torch.manual_seed(seed)
    loaded = models.build_random(preset, dtype, device)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(directory)
    tokenizer = models.load_tokenizer(tiny_model.TINY_MODEL_NAME)
    # The tokenizer's limit is the tiny model's 256 positions; the trainer caps sequences at it.
    tokenizer.model_max_length = decoding.context_length(loaded.model)
    tokenizer.save_pretrained(directory)
    parameters = sum(parameter.numel() for parameter in loaded.model.parameters())
    del loaded
    info = {"preset": preset, "dtype": dtype, "built_on": str(device), "seed": seed, "parameters": parameters,
            "tokenizer": "the tiny model's (byte-level BPE)",
            "seconds": round(time.perf_counter() - began, 1),
            "note": "random weights: speed and memory of the architecture; the text is noise"}
    (directory / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook random-weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="a preset name, e.g. Llama-3.1-8B (workbook.presets)")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="bf16", choices=sorted(models.TORCH_DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the weights are built (default: cuda when there is one)")
    args = parser.parse_args(argv)
    directory = save_random_model(args.preset, args.out, args.dtype, args.device)
    print(json.dumps(json.loads((directory / BUILD_INFO_FILE).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
