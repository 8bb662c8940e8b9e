"""Benchmark (not a test) of the training loss's output head: the full logits (``loss_chunk_tokens: 0``)
against the chunked loss (``loss_chunk_tokens: N``), which computes logits only at the positions that
carry loss, as the share of such positions falls (prompt tokens carry none in SFT).

    workbook bench-loss-head --out outputs/reference/cpu

Forward and backward of the loss alone, from the head's input (random, a real model's head shape), median
of ``--repeats`` runs; writes ``loss_head.json`` and ``loss_head.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from workbook import runtime
from workbook.training.chunked_loss import ChunkedCrossEntropy
from workbook.training.examples import IGNORE_INDEX


def timed(loss_fn, hidden, weight, targets, repeats: int, device: torch.device) -> float:
    """Median seconds of the loss's forward and backward over ``repeats`` runs."""
    runs = []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        runs.append(runtime.timed(device, lambda: loss_fn(hidden, weight, targets).backward())[0])
    return statistics.median(runs)


def measure(positions: int, hidden_size: int, vocab: int, chunk: int, shares: list[float], repeats: int,
            device: torch.device) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=generator).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden_size, generator=generator)).to(device).requires_grad_()
    full = lambda h, w, t: torch.nn.functional.cross_entropy(h @ w.T, t, reduction="sum")  # noqa: E731
    chunked = lambda h, w, t: ChunkedCrossEntropy.apply(h, w, t, chunk, h.dtype)  # noqa: E731
    rows = []
    for share in shares:
        kept = max(1, round(positions * share))
        targets = torch.full((positions,), IGNORE_INDEX)
        targets[torch.randperm(positions, generator=generator)[:kept]] = torch.randint(0, vocab, (kept,),
                                                                                       generator=generator)
        targets = targets.to(device)
        full_seconds = timed(full, hidden, weight, targets, repeats, device)
        chunked_seconds = timed(chunked, hidden, weight, targets, repeats, device)
        rows.append({"loss_share": share, "loss_positions": kept, "full_logits_seconds": full_seconds,
                     "chunked_seconds": chunked_seconds, "speedup": full_seconds / chunked_seconds})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook bench-loss-head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=896, help="default: Qwen2.5-0.5B's")
    parser.add_argument("--vocab", type=int, default=151936, help="default: Qwen2.5-0.5B's")
    parser.add_argument("--chunk", type=int, default=256, help="loss_chunk_tokens")
    parser.add_argument("--shares", default="1.0,0.5,0.25", help="shares of positions that carry loss")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = runtime.default_device()
    shares = [float(share) for share in args.shares.split(",")]
    rows = measure(args.positions, args.hidden_size, args.vocab, args.chunk, shares, args.repeats, device)
    hardware = runtime.device_description(device)
    command = "workbook bench-loss-head " + " ".join(argv if argv is not None else sys.argv[1:])
    what = (f"forward + backward of the training loss from the head's input: {args.positions} positions, hidden "
            f"{args.hidden_size}, vocab {args.vocab:,}, fp32, on {hardware}; median of {args.repeats}; full logits "
            f"(cross-entropy over every position) against the chunked loss ({args.chunk} loss positions per chunk, "
            "logits only where a target carries loss)")
    lines = [what, "", "| positions carrying loss | full logits s | chunked s | chunked speedup |", "|---|---|---|---|"]
    lines += [f"| {r['loss_share']:.0%} ({r['loss_positions']}) | {r['full_logits_seconds']:.2f} | "
              f"{r['chunked_seconds']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_head.json").write_text(json.dumps({"what": what, "command": command, "rows": rows}, indent=2) + "\n")
    (out / "loss_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
