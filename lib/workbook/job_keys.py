"""The params keys each job reads: one list per job, in one torch-free place, so `--help` lists them
without importing the job, `--set` can say when a key changes nothing, and a job checks its params
hold every key before it starts. Each notebook's parameters cell declares its job's keys."""

# workbook generate (notebook 02)
GENERATE = (
    "profile", "model", "dtype", "interactive", "batch_size", "prompt_len", "max_new_tokens", "gpu_count",
    "gpu_memory_gib", "safety_margin", "cuda_overhead_gib", "prompts_path", "prompt_field", "output_path",
    "backend", "do_sample", "temperature", "top_p", "seed", "max_examples", "on_bad_line", "on_long_prompt",
    "use_chat_template", "log_every_batches", "data_parallel_processes", "verifier", "max_accepted_per_prompt",
    "system_prompt", "on_no_system_role", "samples_per_prompt", "tensor_parallel_size", "peer_timeout_seconds",
)

# workbook train (notebook 03)
TRAIN = (
    "profile", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops", "peak_fp16_tflops", "usd_per_gpu_hour", "model",
    "dtype", "micro_batch_size", "grad_checkpointing", "lora_rank", "lora_targets", "lora_save", "safety_margin",
    "cuda_overhead_gib", "train_data_path", "on_bad_line", "input_field", "output_field", "use_chat_template",
    "max_seq_length", "length_percentile", "padding", "validation_fraction", "learning_rate", "lr_scaling",
    "base_batch", "gradient_accumulation_steps", "epochs", "max_steps", "warmup_steps", "weight_decay", "optimizer",
    "tf32", "torch_compile", "attn_implementation", "dataloader_workers", "pin_memory", "prefetch_factor",
    "save_every_steps", "train_output_dir", "train_processes", "loss_chunk_tokens", "report_to", "precision",
    "eval_prompts_path", "offload_activations", "peer_timeout_seconds",
    "output_path",  # where notebook 02 wrote its outputs: the default training data
    "verifier",  # set: notebook 02 verified its outputs, and the accepted ones are the default training data
)

# workbook bench (notebook 04)
BENCH = (
    "profile", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops", "peak_fp16_tflops", "memory_bandwidth_gbs",
    "usd_per_gpu_hour", "dtype", "prompt_len", "seq_len", "safety_margin", "cuda_overhead_gib",
    "bench_generate_model", "bench_train_model", "bench_batch_sizes", "bench_strategies", "bench_examples",
    "bench_max_new_tokens", "bench_repeats", "bench_train_micro_batches", "bench_train_steps",
    "bench_train_settings", "bench_train_baselines", "lora_rank", "lora_targets", "attn_implementation", "optimizer",
    "dataloader_workers", "pin_memory", "prefetch_factor", "learning_rate",
)

# workbook verify: an existing output through a verifier
VERIFY = ("profile", "output_path", "verifier", "max_accepted_per_prompt")

# workbook forecast pilots either job (generate or train), so it reads both jobs' keys, and besides
# them the profile's bandwidth for the simulated rows, plan_mode (its default --mode), the node count
# (the job's global split) and seq_len.
FORECAST = tuple(dict.fromkeys(GENERATE + TRAIN + ("memory_bandwidth_gbs", "plan_mode", "num_nodes", "seq_len")))

READ_BY = {"generate": GENERATE, "train": TRAIN, "bench": BENCH, "forecast": FORECAST, "verify": VERIFY}

NOTEBOOKS = {"generate": "notebooks/02_batched_generation", "train": "notebooks/03_training",
             "bench": "notebooks/04_benchmarking"}


def missing(params, job: str) -> str | None:
    """Why ``params`` cannot run ``job`` (the keys it lacks, and where to declare them), or None."""
    absent = [key for key in READ_BY[job] if key not in params]
    if not absent:
        return None
    where = f" (see {NOTEBOOKS[job]})" if job in NOTEBOOKS else ""  # forecast and verify have no notebook of their own
    return (f"workbook {job} needs the parameter(s) {', '.join(absent)}; a notebook that runs it must declare them "
            f"in its parameters cell{where}, or add them to the params file")
