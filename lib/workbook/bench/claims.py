"""The seeds' claims (``../shared/seeds/README.md``) and the workbook's performance goals, each beside
this run's figure or the reason there is none."""

from __future__ import annotations

import time

import torch

from workbook import runtime
from workbook.bench.counting import BASELINE, HF_PIPELINE, NA
from workbook.bench.training_sweep import training_setting
from workbook.planner import kv_cache_bytes
from workbook.units import format_bytes
from workbook import params
from workbook.paths import PARAMS_DIR
from workbook.planner import profile


# Seed 000's own job and what it promised per GPU (../shared/seeds/000_*.txt, "Hardware-Specific Settings"
# and "Cost Estimate"), set beside the forecast check's projection to the same profiles.
SEED_000_JOB = {"prompts": 53597, "max_new_tokens": 2048,
                "what": "53,597 prompts to an 8B model, up to 2,048 new tokens each (sampled at temperature 0.7), "
                        "static batches of 32 (H200), 16 (H100), 8 (A100 40GB), 10 (A6000)"}
SEED_000_CLAIMS = {"h200": "~2-3 h; $1.00-2.40 at $0.50-0.80/h (Vast.ai)", "h100": "~3-4 h",
                   "a100-40gb": "~5-6 h", "a6000": "~6-7 h"}


def tf32_matmul_speedup(device: torch.device, size: int = 8192, repeats: int = 10) -> dict | None:
    """fp32 matmul TFLOP/s with TF32 off and on, and bf16, on a GPU; None on CPU (no TF32)."""
    if device.type != "cuda":
        return None
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    previous = runtime.tf32_enabled()
    figures = {}
    try:
        for label, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                   ("bf16", torch.bfloat16, False)):
            runtime.set_tf32(tf32)
            x, y = a.to(dtype), b.to(dtype)
            torch.matmul(x, y)
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            for _ in range(repeats):
                torch.matmul(x, y)
            torch.cuda.synchronize(device)
            figures[label] = 2 * size ** 3 * repeats / (time.perf_counter() - began) / 1e12
    finally:
        runtime.set_tf32(previous)
    return {"tflops": figures, "tf32_over_fp32": figures["tf32"] / figures["fp32"],
            "bf16_over_tf32": figures["bf16"] / figures["tf32"]}


def _point(points: list[dict], strategy: str, batch: int | None = None) -> dict | None:
    for point in points:
        if point["strategy"] == strategy and "seconds" in point and (batch is None or point["batch_size"] == batch):
            return point
    return None


def claims_table(generation: dict | None, training: dict | None, matmul: dict | None, on_gpu: bool) -> list[dict]:
    """Each claim of ../shared/seeds/README.md beside this run's figure, or why there is none."""
    points = generation["points"] if generation else []
    after = _point(points, BASELINE)
    timed = [p for p in points if "seconds" in p]
    big_model = bool(generation) and "8B" in generation["model_name"].upper()
    rows = []

    # The engine's claim: the hf-pipeline's outputs are not the engine's (their equality is in its report lines).
    equal = [p for p in timed if "identical_to_one_at_a_time" in p and p["strategy"] != HF_PIPELINE]
    rows.append({"seed": "000", "claim": "slice each output at its count of non-pad prompt tokens",
                 "measured": (f"engine slices at the padded prompt length; {sum(p['identical_to_one_at_a_time'] for p in equal)}"
                              f" of {sum(p['examples'] for p in equal)} outputs over {len(equal)} points identical to "
                              "one-at-a-time generation (an output continuous batching ended at EOS is compared up to "
                              "it: that backend ignores min_new_tokens)") if equal else "not measured in this run (needs seed-before)"})

    if after:
        figure = (f"{after['examples_per_minute']:.0f} examples/min at batch 32, "
                  f"{generation['max_new_tokens']} new tokens each ({generation['model']})")
        rows.append({"seed": "000", "claim": "~300-400 examples/minute, 8B model, batch 32, 2048 new tokens",
                     "measured": figure if (on_gpu and big_model) else
                     f"not measurable on this hardware (no GPU / not an 8B model); here: {figure}"})
    else:
        rows.append({"seed": "000", "claim": "~300-400 examples/minute, 8B model, batch 32, 2048 new tokens",
                     "measured": "not measured in this run (needs seed-after)"})

    rows.append({"seed": "003", "claim": "TF32 gives 8x faster matrix ops",
                 "measured": (f"fp32 matmul: TF32 {matmul['tf32_over_fp32']:.1f}x over plain fp32; bf16 a further "
                              f"{matmul['bf16_over_tf32']:.1f}x (TF32 changes fp32 matmuls only)") if matmul else
                 "not measurable on this hardware (no TF32 on CPU); bf16 autocast matmuls do not use TF32"})
    rows.append({"seed": "003", "claim": "2-3x speedup from library upgrades",
                 "measured": "not measurable in one run (one software version; compare runs across versions in notebook 05)"})

    kernel = [p["nvml"]["kernel_time_percent"]["mean"] for p in timed
              if p.get("nvml", {}).get("available") and p["nvml"].get("kernel_time_percent")]
    fractions = [p["fraction_of_roofline"]["datasheet"] for p in timed
                 if p["fraction_of_roofline"]["datasheet"] is not None]
    rows.append({"seed": "000/002", "claim": "GPU utilization 85-95% (nvidia-smi)",
                 "measured": (f"NVML kernel time {min(kernel):.0f}-{max(kernel):.0f}% of the time while the points reached "
                              f"{min(fractions):.0%}-{max(fractions):.0%} of their roofline")
                 if kernel and fractions else "not measurable on this hardware (no NVML / no bandwidth peak)"})

    measured_memory = [p for p in timed if p.get("peak_memory_bytes") and p.get("predicted_peak_bytes")]
    kv_8b = kv_cache_bytes("Llama-3.1-8B", "bf16", batch_size=1, tokens=512 + 2048)
    rows.append({"seed": "000", "claim": "batch 32 on an H200 ('only 28% utilization' of its 141 GB), 16 on an H100 "
                 "(8B, 2048 new tokens)", "measured": seed_000_batch_claim(generation, on_gpu and big_model)})
    rows.append({"seed": "000", "claim": "KV cache ~500MB per example (8B, 2048 new tokens)",
                 "measured": (f"counted from the Llama-3.1-8B config: {kv_8b / 1e6:.0f} MB ({format_bytes(kv_8b)}) per "
                              "example at 512 prompt + 2048 new tokens (bf16): arithmetic, not hardware")})
    rows.append({"seed": "001", "claim": "~20GB per GPU with TP=4 (30B teacher on 4 of 8 H100s)",
                 "measured": tensor_parallel_claim()})
    rows.append({"seed": "004", "claim": "memory figures per batch size",
                 "measured": ("measured peak / planner: " + ", ".join(
                     f"{p['strategy']} b{p['batch_size']} {p['peak_memory_bytes'] / p['predicted_peak_bytes']:.2f}"
                     for p in measured_memory)) if measured_memory else
                 "not measurable on this hardware (CPU: no peak memory); planner predictions are in the points"})
    failed = sum(p["failed"] for p in timed)
    lost = sum(generation["examples"] - p["examples"] - p["failed"] for p in timed) if generation else 0
    rows.append({"seed": "000", "claim": "a failed batch counts all its examples as lost",
                 "measured": f"{lost} examples lost, {failed} failed alone, over {len(timed)} points" if timed
                 else "not measured in this run"})
    if training:
        mfus = [p["mfu"] for p in training["points"] if p.get("mfu") is not None]
        rows.append({"seed": "004", "claim": "bf16 + compile + flash attention make a 1B fine-tune fast",
                     "measured": f"MFU {min(mfus):.1%}-{max(mfus):.1%} over the training points" if mfus else
                     "not measurable on this hardware (no GPU peak: MFU n/a)"})
    return rows


def seed_000_batch_claim(generation: dict | None, measured_here: bool) -> str:
    """Seed 000's batch per GPU beside the planner's largest on the h200 and h100 profiles (Llama-3.1-8B,
    512 prompt + 2048 new tokens, bf16, each profile's budget and margin), and where this run decoded the
    8B on a GPU, the planner's batch it ran and the peak it measured there."""
    planned = {name: profile.plan(params.load(PARAMS_DIR / f"{name}.yaml"), mode="generate", model="Llama-3.1-8B",
                                  batch_size="auto", prompt_len=512, max_new_tokens=2048, dtype="bf16").max_batch_size
               for name in ("h200", "h100")}
    text = (f"planned (Llama-3.1-8B, 512 prompt + 2048 new tokens, bf16, the profile's budget less its margin): the "
            f"largest batch is {planned['h200']} on h200 ({planned['h200'] / 32:.0f}x the seed's 32) and "
            f"{planned['h100']} on h100 ({planned['h100'] / 16:.0f}x its 16)")
    ran = [p for p in (generation or {}).get("points", []) if p.get("planner_batch") and p.get("peak_memory_bytes")]
    if measured_here and ran:
        point = max(ran, key=lambda p: p["batch_size"])
        text += (f"; this run decoded batch {point['batch_size']} ({point['planner_batch']}) at a measured peak of "
                 f"{point['peak_memory_bytes'] / 2**30:.1f} GiB")
    return text


def tensor_parallel_claim(model: str = "Qwen2.5-32B", tensor_parallel_size: int = 4) -> str:
    """The planner's per-GPU figure for a 30B-class teacher sharded over 4 H100s (the h100x8 profile,
    512 prompt + 2048 new tokens, bf16): planned from the config, not measured (no multi-GPU machine)."""
    h100x8 = params.load(PARAMS_DIR / "h100x8.yaml")
    plan = profile.plan(h100x8, mode="generate", model=model, batch_size=1, tensor_parallel_size=tensor_parallel_size,
                        prompt_len=512, max_new_tokens=2048, dtype="bf16")
    return (f"planned, not measured (no multi-GPU machine): {model} ({plan.params / 1e9:.1f}B) at T={tensor_parallel_size}"
            f" holds {plan.weights_bytes / 1e9:.1f} GB ({format_bytes(plan.weights_bytes)}) of weights per GPU; batch 1 "
            f"peaks at {plan.total_bytes / 1e9:.1f} GB per GPU, and the largest batch per GPU ({plan.max_batch_size}) "
            f"fills the {format_bytes(plan.budget_bytes)} budget with KV cache ({plan.kv_cache_bytes_per_token:,} B/token "
            "per GPU; 512 prompt + 2048 new tokens, bf16)")


def goals_table(generation: dict | None, training: dict | None) -> list[dict]:
    """The workbook's performance goals (issue 6) beside this run's figures: the best strategy at the
    planner's batch against the bandwidth roofline and the seeds' baseline, and the best MFU."""
    at_planner = [p for p in (generation or {}).get("points", []) if p.get("planner_batch") and "seconds" in p
                  and p["strategy"] != HF_PIPELINE]  # the goals are the workbook's, not the pipeline's
    best = max(at_planner, key=lambda p: p["output_tokens_per_second"]["median"], default=None)
    where = f" ({best['strategy']}, batch {best['batch_size']}; {best['planner_batch']})" if best else ""
    # Over the roofline at this GPU's measured copy bandwidth and matmul where the run measured them: the
    # datasheet's peaks are never reached, so a fraction of them mixes the hardware's shortfall with the engine's.
    fractions = best["fraction_of_roofline"] if best else {}
    bandwidth, over = fractions.get("datasheet"), " of the roofline at the datasheet's peaks"
    if fractions.get("measured_ceilings") is not None:
        over = (" of the roofline at this GPU's measured copy bandwidth and matmul"
                + (f"; {bandwidth:.1%} at the datasheet's" if bandwidth is not None else ""))
        bandwidth = fractions["measured_ceilings"]
    if best and best["roofline"]["seconds"]:
        seconds = best["roofline"]["seconds"]
        over += f"; prefill is {seconds['prefill'] / seconds['total']:.0%} of that roofline"
    speedup = best and best.get("speedup_over_seed_after")
    mfus = [p["mfu"] for p in (training or {}).get("points", []) if p.get("mfu") is not None]

    def row(goal: str, value, target: float, text: str, missing: str) -> dict:
        if value is None:
            return {"goal": goal, "measured": missing, "met": NA}
        return {"goal": goal, "measured": text,
                "met": "yes" if value >= target else f"no: {value / target:.0%} of the goal"}

    no_auto = "not measured: bench_batch_sizes has no 'auto' point"
    noisy = f" ({best['speedup_noise']})" if best and best.get("speedup_noise") else ""
    speedup_row = row(GOALS[1], speedup, 10.0, f"{speedup or 0:.1f}x{where}{noisy}",
                      no_auto if not best else "not measured: needs seed-after")
    if speedup is not None and not str((generation or {}).get("device", "")).startswith("cuda"):
        # The goal is a GPU's (an 8B decoding in large batches); a CPU's small model is bound by overheads.
        speedup_row["met"] = "n/a: a GPU goal, measured here on a CPU"
    return [row(GOALS[0], bandwidth, 0.60, f"{bandwidth or 0:.1%}{over}{where}",
                no_auto if not best else "n/a: the profile has no bandwidth peak"),
            speedup_row,
            row(GOALS[2], max(mfus) if mfus else None, 0.45, f"{max(mfus or [0]):.1%} (best training point)",
                "n/a: no MFU (no GPU peak or no training sweep)"),
            memory_setting_goal(training), planner_out_of_memory_goal(training)]


def memory_setting_goal(training: dict | None) -> dict:
    """Issue 20's goal on this run's 'auto' points: some memory setting (or checkpointing) fits a micro-batch
    at least twice the plain plan's, and trains at that batch at no fewer tokens/s than the plain point."""
    planned = [p for p in (training or {}).get("points", []) if p.get("micro_batch_rule") and not p["torch_compile"]
               and p.get("tokens_per_second") and p["padding"] == "packing"]
    plain = next((p for p in planned if not p["grad_checkpointing"] and not training_setting(p)), None)
    settings = [p for p in planned if p is not plain]
    if plain is None or not settings:
        return {"goal": GOALS[3], "met": NA, "measured": "not measured: needs bench_train_micro_batches 'auto' with "
                "bench_train_settings (or checkpointing) beside the plain point, each measured"}
    capped = [p for p in [plain, *settings] if p.get("micro_batch_capped")]
    if capped:
        return {"goal": GOALS[3], "met": NA, "measured": "not measured: the data, not memory, chose the 'auto' "
                f"micro-batch ({capped[0]['micro_batch_rule']})"}
    ratios = [(p["micro_batch_size"] / plain["micro_batch_size"], p["tokens_per_second"] / plain["tokens_per_second"],
               ", ".join(filter(None, ["checkpointing" if p["grad_checkpointing"] else "", training_setting(p, short=True)])))
              for p in settings]
    text = (f"plain: micro-batch {plain['micro_batch_size']}, {plain['tokens_per_second']:,.0f} tokens/s; "
            + "; ".join(f"{name}: micro-batch x{batch:.2f}, tokens/s x{speed:.2f}" for batch, speed, name in ratios))
    doubled = [speed for batch, speed, _ in ratios if batch >= 2]
    if not doubled:
        return {"goal": GOALS[3], "measured": text, "met": "no: no setting fits twice the plain micro-batch"}
    return {"goal": GOALS[3], "measured": text,
            "met": "yes" if max(doubled) >= 1 else f"no: the best at twice the batch trains at {max(doubled):.2f}x"}


def planner_out_of_memory_goal(training: dict | None) -> dict:
    """Issue 10's rule: no point the planner says fits may run out of memory."""
    points = (training or {}).get("points", []) + (training or {}).get("baselines", [])
    # The points the planner judged (the HF Trainer and TRL baselines are not planned).
    ran = [p for p in points if ("tokens_per_second" in p and p.get("predicted_peak_bytes")) or p.get("out_of_memory")]
    wrong = [p for p in ran if p.get("planner_said", "").startswith("fits")]
    if not ran:
        return {"goal": GOALS[4], "measured": "not measured: no planned training point ran", "met": NA}
    refused = sum(1 for p in ran if p.get("out_of_memory")) - len(wrong)
    measured = (f"{len(ran)} planned training points ran; {len(wrong)} ran out of memory where the planner said they "
                f"fit, {refused} where it said they do not")
    if not str(training.get("device", "")).startswith("cuda"):
        # Past a CPU's RAM no out-of-memory error is raised (the kernel kills the process): nothing was tested.
        return {"goal": GOALS[4], "measured": measured, "met": "n/a: a GPU rule (a CPU raises no out-of-memory error)"}
    return {"goal": GOALS[4], "met": "yes" if not wrong else f"no: {len(wrong)} of {len(ran)}", "measured": measured}


GOALS = ("best generation strategy at the planner's batch >= 60% of the roofline (decode at the bandwidth, prefill "
         "at the compute peak)",
         "best generation strategy at the planner's batch >= 10x the seeds' static batch 32",
         "training >= 45% MFU (the 1B full fine-tune on an H200)",
         "a memory setting fits >= 2x the plain plan's micro-batch at no loss of tokens/s (its planned batch)",
         "no training point the planner says fits runs out of memory")
