"""Parameter files (`params/<profile>.yaml`): the schema, its defaults, loading, validation and overrides.

Every key is declared once in `SCHEMA`: type, allowed range, one-line meaning and its default. A
profile is built in one way (`resolve`): the schema's defaults, overlaid by the facts of the GPU spec
table row the profile names (`gpu`, see `workbook.gpu.GPU_SPECS`), overlaid by what the file states,
overlaid by `--set key=value`. So a profile file holds what is its own: its GPU, and the settings in
which its runs differ from the defaults. Files, overrides and notebook parameters all go through
`validate_value`, so a typo or a wrong type is caught with the file, line and key named, instead of
silently doing nothing (papermill only warns about a parameter that no notebook declares).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from workbook import gpu as gpu_table
from workbook.paths import PARAMS_DIR
from workbook.suggest import did_you_mean

DTYPES = ("fp32", "bf16", "fp16")
PLAN_MODES = ("generate", "train")
AUTO = "auto"


class ParamsError(ValueError):
    """A parameter file, override or notebook parameter is invalid. The message says where and why."""


@dataclass(frozen=True)
class Key:
    name: str
    kind: type  # int, float, bool or str
    meaning: str
    minimum: float | None = None
    choices: tuple = ()
    maximum: float | None = None
    auto: bool = False  # the value may also be 'auto': the memory planner chooses it
    int_list: bool = False  # a str of comma-separated positive integers, e.g. '8,32'
    choice_list: bool = False  # a str of comma-separated names, each one of choices, e.g. 'hf-trainer,trl-sft'
    non_empty: bool = False  # a str that must name something ('' is no model, no file)
    default: Any = None  # the value when neither the GPU's row, the profile file nor --set gives one

    def expected(self) -> str:
        if self.choices:
            names = ", ".join(repr(c) for c in self.choices)
            return f"comma-separated names, each one of {names}" if self.choice_list else f"one of {names}"
        if self.int_list:
            return ("comma-separated positive integers, e.g. '8,32'" + (", or 'auto' among them" if self.auto else "")
                    + (", or '' (not stated)" if self.default == "" else ""))
        text = {int: "an integer", float: "a finite number", bool: "true or false",
                str: "a non-empty string" if self.non_empty else "a string"}[self.kind]
        if self.minimum is not None:
            text += f" >= {self.minimum:g}"
        if self.maximum is not None:
            text += f" and <= {self.maximum:g}"
        return text + (" or 'auto'" if self.auto else "")


# Every key, with its default: the one place a default is written. Adding a key: declare it here
# with its default, and declare it in the parameters cell of the notebook that consumes it (with the
# same value: tests/test_params.py holds them equal); a profile states it only where it differs.
# The run settings' defaults are those of a run on one GPU; the hardware facts' are "no GPU".
SCHEMA: dict[str, Key] = {k.name: k for k in (
    # Hardware facts.
    Key("profile", str, "profile name; equals the file name without .yaml (the default: what a notebook opened "
        "alone loads)", default='cpu'),
    Key("gpu_spec", str, "the row of the GPU spec table (workbook.gpu.GPU_SPECS) this profile's memory, peaks, "
        "bandwidth and bf16/TF32 support come from; '' for none (cpu, or a GPU the table lacks: state them)",
        choices=("",) + tuple(spec.name for spec in gpu_table.GPU_SPECS), default=''),
    Key("gpu_name_pattern", str, "regular expression matched against the detected GPU name ('' for cpu)", default=''),
    Key("gpu_count", int, "GPUs the profile expects (0 for cpu)", minimum=0, default=0),
    Key("gpu_memory_gib", float, "memory per GPU in GiB as the driver reports it", minimum=0, default=0.0),
    Key("peak_bf16_tflops", float, "dense bf16 tensor-core peak per GPU, TFLOP/s (0: none)", minimum=0, default=0.0),
    Key("peak_fp16_tflops", float, "dense fp16 tensor-core peak per GPU, TFLOP/s (0: none)", minimum=0, default=0.0),
    Key("memory_bandwidth_gbs", float, "peak memory bandwidth per GPU, GB/s (1e9 bytes/s)", minimum=0, default=0.0),
    Key("supports_bf16", bool, "whether the GPU computes in bfloat16", default=False),
    Key("supports_tf32", bool, "whether the GPU has TF32 tensor cores", default=False),
    Key("usd_per_gpu_hour", float, "rental price per GPU-hour in US dollars, for cost estimates", minimum=0, default=0.0),
    # Run settings.
    Key("model", str, "'tiny' (built locally) or a local Hugging Face model directory", non_empty=True, default='tiny'),
    Key("dtype", str, "dtype the model runs in", choices=DTYPES, default='bf16'),
    Key("interactive", bool, "show ipywidgets controls (JupyterLab); false draws static figures (papermill)", default=False),
    # Memory planning (notebook 01) and the batch sizes the later notebooks run with.
    Key("plan_mode", str, "what notebook 01 plans first", choices=PLAN_MODES, default='generate'),
    Key("trace_plan", bool, "notebook 01: also run each plan's step on fake tensors (no GPU, no weights; seconds for a "
        "small model, about a minute for an 8B one) and show its peak beside the plan", default=True),
    Key("batch_size", int, "generation batch size (sequences per GPU)", minimum=1, auto=True, default='auto'),
    Key("micro_batch_size", int, "training micro-batch per GPU", minimum=1, auto=True, default='auto'),
    Key("prompt_len", int, "prompt tokens per sequence the generation plan assumes", minimum=1, default=512),
    Key("max_new_tokens", int, "new tokens generated per sequence", minimum=1, default=2048),
    Key("expected_new_tokens", str, "the outputs' length in new tokens (end of sequence included) for the forecast "
        "without a pilot, where the prompts carry no reference outputs: '' = not stated (every output runs to "
        "max_new_tokens, the bound); one number = the typical length, e.g. '400'; several = lengths equally likely, "
        "e.g. a previous run's percentiles '120,300,650,1400' (the forecast's middle deals them out in equal shares, "
        "its range runs from every output at the shortest to every output at the longest); each capped at "
        "max_new_tokens", int_list=True, default=''),
    Key("seq_len", int, "training sequence length in tokens", minimum=1, default=2048),
    Key("grad_checkpointing", bool, "recompute activations in backward: less memory, ~30% more compute", default=False),
    Key("lora_rank", int, "LoRA rank; 0 trains every weight", minimum=0, default=0),
    Key("lora_save", str, "what a LoRA run saves as <train_output_dir>/final: 'merged' (a standalone model, the "
        "adapters added into the weights) or 'adapters' (loaded on top of the base model, which must stay where it "
        "is)", choices=("merged", "adapters"), default='merged'),
    Key("lora_targets", str, "comma-separated module names LoRA adapts, e.g. 'q_proj,v_proj'; '' = every linear "
        "projection of the architecture (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)", default=''),
    Key("safety_margin", float, "fraction of GPU memory the planner keeps free", minimum=0, maximum=0.5, default=0.05),
    Key("cuda_overhead_gib", float, "CUDA context + library workspaces per GPU, GiB (measured or prior)",
        minimum=0, default=0.5),
    # Generation (notebook 02, `workbook generate`); batch_size, max_new_tokens, model and dtype above.
    Key("prompts_path", str, "JSONL of prompts, one object per line (a relative path is read from the working "
        "directory, else the repository root)", non_empty=True, default='lib/workbook/data/arithmetic_prompts.jsonl'),
    Key("prompt_field", str, "the field holding each prompt: 'auto' (the first of input, prompt, question) "
        "or a field name", default='auto'),
    Key("output_path", str, "JSONL the outputs are appended to; '' writes generations.jsonl in the run folder; "
        "rerunning with the same path resumes", default=''),
    Key("backend", str, "generation backend; auto: continuous or static, as the profile's measurement says",
        choices=("static", "static-compiled", "continuous", "auto"), default='static'),
    Key("do_sample", bool, "sample with temperature/top_p (true) or decode greedily (false)", default=False),
    Key("temperature", float, "sampling temperature, used when do_sample is true", minimum=0, default=0.7),
    Key("top_p", float, "nucleus sampling probability mass, used when do_sample is true", minimum=0, maximum=1, default=0.9),
    Key("seed", int, "random seed for sampling (each process adds its index)", minimum=0, default=0),
    Key("max_examples", int, "generate for the first N examples of the file only; 0: all", minimum=0, default=0),
    Key("on_bad_line", str, "malformed line, missing or empty prompt, duplicate id (training: a missing or non-text "
        "input/output): 'fail' stops with file:line, 'skip' lists it (the failures file, or the training console)",
        choices=("fail", "skip"), default='fail'),
    Key("on_long_prompt", str, "prompt that leaves no room in the model's context: 'fail' or 'skip'",
        choices=("fail", "skip"), default='fail'),
    Key("use_chat_template", bool, "wrap each prompt as one user turn with the tokenizer's chat template", default=True),
    Key("log_every_batches", int, "print a progress line every N batches; 0: never", minimum=0, default=10),
    Key("data_parallel_processes", int, "processes sharing the job, one per GPU, each holding the whole model",
        minimum=1, default=1),
    Key("tensor_parallel_size", int, "GPUs (processes) each copy of the model is sharded over with transformers' "
        "tensor parallelism; data_parallel_processes / tensor_parallel_size copies share the prompts; 'auto': the "
        "planner's smallest that fits a useful batch", minimum=1, auto=True, default=1),
    Key("samples_per_prompt", int, "outputs per prompt, each its own record (metadata.sample_index); > 1 needs "
        "do_sample (rejection sampling: sample, verify, keep the right ones); batch_size counts outputs", minimum=1, default=1),
    Key("verifier", str, "checks each output after generation and keeps the right ones in <output>.accepted.jsonl: "
        "'' (none), final_number, exact_match, or module:function (your own, importable)", default=''),
    Key("max_accepted_per_prompt", int, "accepted outputs kept per prompt (identical ones once); 0: no cap", minimum=0, default=0),
    Key("system_prompt", str, "a system prompt the teacher sees and the training input does not (prompt "
        "distillation): the text, or @path to a file; '' for none", default=''),
    Key("on_no_system_role", str, "system_prompt with a chat template that refuses a system turn (Gemma's): 'fail' "
        "says so, 'fold' puts it at the start of the user's turn", choices=("fail", "fold"), default='fail'),
    # Training (notebook 03, `workbook train`); model, dtype, micro_batch_size, grad_checkpointing,
    # lora_rank and use_chat_template above. Choices mirror workbook.planner (checked by tests/test_train.py).
    Key("train_data_path", str, "JSONL of input/output pairs; '' = notebook 02's output (output_path, or "
        "generations.jsonl in the run folder), else the shipped arithmetic sample", default=''),
    Key("input_field", str, "the field of each training record holding the prompt", default='input'),
    Key("output_field", str, "the field of each training record holding the response (the only tokens with loss)", default='output'),
    Key("max_seq_length", int, "training tokens per row; 'auto': smallest multiple of 64 covering length_percentile",
        minimum=1, auto=True, default='auto'),
    Key("length_percentile", float, "percentile of example lengths that max_seq_length 'auto' covers (100: all)",
        minimum=1, maximum=100, default=100.0),
    Key("padding", str, "'packing' (several examples per row, no attention across them) or 'length_grouped' "
        "(similar lengths batched, padded to the longest)", choices=("packing", "length_grouped"), default='packing'),
    Key("validation_fraction", float, "fraction of the examples held out for validation loss and accuracy",
        minimum=0, maximum=0.5, default=0.1),
    Key("eval_prompts_path", str, "held-out arithmetic questions answered greedily before and after training and "
        "scored against their true answers (a rejection-sampling round's proof); '' scores the validation split", default=''),
    Key("learning_rate", float, "peak learning rate (linear warmup, cosine decay to 10%)", minimum=0, default=2e-05),
    Key("lr_scaling", str, "heuristic applied when the effective batch differs from base_batch",
        choices=("none", "linear", "sqrt"), default='none'),
    Key("base_batch", int, "effective batch (rows per optimizer step) learning_rate was tuned at; 0: this run's",
        minimum=0, default=0),
    Key("gradient_accumulation_steps", int, "micro-batches per optimizer step and process", minimum=1, default=1),
    Key("epochs", int, "passes over the training split (when max_steps is 0)", minimum=1, default=1),
    Key("max_steps", int, "optimizer steps to run; 0: epochs decide", minimum=0, default=0),
    Key("warmup_steps", int, "optimizer steps of linear learning-rate warmup", minimum=0, default=20),
    Key("weight_decay", float, "AdamW decoupled weight decay (matrices only)", minimum=0, default=0.0),
    Key("optimizer", str, "'adamw' (fused on CUDA) or 'adamw-8bit' (needs bitsandbytes)",
        choices=("adamw", "adamw-8bit"), default='adamw'),
    Key("tf32", bool, "TF32 for float32 matmuls on Ampere and later (bf16 autocast matmuls are bf16 anyway)", default=True),
    Key("torch_compile", bool, "torch.compile the model (inductor): slower start, often faster steps", default=False),
    Key("attn_implementation", str, "attention kernels", choices=("sdpa", "flash_attention_2", "eager"), default='sdpa'),
    Key("dataloader_workers", int, "DataLoader worker processes (0: batches are built in the training process)",
        minimum=0, default=4),
    Key("pin_memory", bool, "page-locked host batches for faster copies to the GPU", default=True),
    Key("prefetch_factor", int, "batches each DataLoader worker prepares ahead (with workers > 0)", minimum=1, default=2),
    Key("save_every_steps", int, "checkpoint every N optimizer steps (training resumes from the last); 0: only "
        "the final model", minimum=0, default=200),
    Key("train_output_dir", str, "checkpoints and the final model; '' = <run folder>/training; an existing "
        "folder with checkpoints resumes", default=''),
    Key("train_processes", int, "training processes, one per GPU (data parallel)", minimum=1, default=1),
    Key("precision", str, "16-bit training: 'mixed' (autocast over fp32 master weights, 16 B/param of states) or "
        "'bf16' (pure bf16 weights, gradients and AdamW states, 8 B/param; small updates can round away)",
        choices=("mixed", "bf16"), default='mixed'),
    Key("offload_activations", bool, "move what autograd saves to host memory in forward and back in backward: "
        "GPU activations of about one layer, PCIe copies every step (GPU only)", default=False),
    Key("report_to", str, "per-step training metrics (loss, learning rate, grad norm, tokens/s, MFU, memory) to "
        "TensorBoard (<train_output_dir>/tracking) or Weights & Biases (offline; needs wandb)",
        choices=("none", "tensorboard", "wandb"), default='none'),
    Key("loss_chunk_tokens", int, "0: the loss over all logits at once; N: over chunks of N positions, one chunk's "
        "logits alive at a time, computed only where a target carries loss (same loss and gradients, less memory)",
        minimum=0, default=0),
    # Benchmarks (notebook 04/05, `workbook bench`); dtype, prompt_len, seq_len and the peaks above.
    Key("bench_generate_model", str, "model of the generation sweep: 'tiny', a local dir, or a preset (random "
        "weights built on the device)", default='Llama-3.1-8B'),
    Key("bench_train_model", str, "model of the training sweep: 'tiny', a local dir, or a preset (random weights, "
        "synthetic sequences of seq_len tokens)", default='Llama-3.2-1B'),
    Key("bench_strategies", str, "comma-separated generation strategies: seed-before, seed-after, static-sorted, "
        "static-compiled, continuous, and hf-pipeline (Hugging Face's pipeline('text-generation') on the same model "
        "and prompts, measured beside ours)", default='seed-before,seed-after,static-sorted,static-compiled,continuous,hf-pipeline'),
    Key("bench_batch_sizes", str, "comma-separated batch sizes of the per-batch strategies, e.g. '8,32,auto' "
        "('auto': the planner's largest batch for the benchmark's longest prompt)", int_list=True, auto=True, default='8,32,64,128,auto'),
    Key("bench_examples", int, "prompts every generation point runs", minimum=1, default=64),
    Key("bench_max_new_tokens", int, "new tokens per prompt, forced (every output runs to this length)", minimum=1, default=64),
    Key("bench_repeats", int, "timed runs per generation point (the median counts)", minimum=1, default=2),
    Key("bench_train_micro_batches", str, "comma-separated training micro-batches, e.g. '4,16,auto' ('auto': the "
        "planner's largest for each point's settings, so a memory setting runs at the batch it makes fit)",
        int_list=True, auto=True, default='4,auto'),
    Key("bench_train_steps", int, "optimizer steps per training point (the first 2 are warm-up); 0: no training "
        "sweep", minimum=0, default=10),
    Key("bench_train_settings", str, "comma-separated memory settings the training sweep also runs, one point "
        "each beside the plain one: loss_chunk_tokens, precision_bf16, chunked_loss_bf16 (both), offload_activations, "
        "sdpa_block_mask (packing through the 4D-mask fallback); '' = none", default=''),
    Key("bench_train_baselines", str, "tools users already know, measured beside the workbook's loop in the same "
        "sweep: 'hf-trainer' trains each micro-batch's plain point again with transformers.Trainer (same model, "
        "batches, precision and optimizer settings), 'trl-sft' with TRL's SFTTrainer (same model, examples and "
        "optimizer settings, its own packing and loss); the workbook's tokens/s and peak memory are reported over "
        "each; 'none' skips them", choices=("none", "hf-trainer", "trl-sft"), choice_list=True, default='hf-trainer,trl-sft'),
    # Several nodes (the planner, notebook 01, `workbook plan`).
    Key("num_nodes", int, "machines the job spans, each with gpu_count GPUs (torchrun --nnodes, accelerate launch "
        "--num_machines); the plan says what crosses the network between them", minimum=1, default=1),
    Key("peer_timeout_seconds", float, "seconds a process of a launch waits for the others, at the process group's "
        "start and at each exchange (gradients, gathers, a tensor-parallel forward), before it stops and names the "
        "missing one; raise it for a slow network, or where one process saves a large checkpoint while the others "
        "wait (torch's own default: 10 minutes for NCCL, 30 for gloo)", minimum=1, default=600.0),
)}


class Params(dict):
    """Validated parameters: a dict that also allows `params.gpu_count`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


_INT_LIST = re.compile(r"[1-9][0-9]*(,[1-9][0-9]*)*")
_INT_OR_AUTO_LIST = re.compile(r"([1-9][0-9]*|auto)(,([1-9][0-9]*|auto))*")


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def choice_list(params, key: str) -> list[str]:
    """The names of a ``choice_list`` key's value, in order (validated on load)."""
    return _names(params[key])


def default(key: str) -> Any:
    """The schema's default for a params key: what a typed settings object's field starts as, so no job
    keeps defaults of its own to disagree with the profiles."""
    return SCHEMA[key].default


def settings_of(cls, params):
    """A typed settings object (a dataclass whose fields are params keys) from validated params: the one
    way a job's entry turns params into what the job reads. Fields that are not params keys keep their
    defaults; a key the params lack is named."""
    names = [f.name for f in fields(cls) if f.name in SCHEMA]
    absent = [name for name in names if name not in params]
    if absent:
        raise ParamsError(f"{cls.__name__} needs the parameter(s) {', '.join(absent)}, which these params lack")
    return cls(**{name: params[name] for name in names})


def validate_value(key: str, value: Any, where: str) -> Any:
    """Check one value against the schema and return it normalized (ints accepted as floats).

    `where` names the source for the error message: a file and line, `--set`, or a notebook.
    """
    if key not in SCHEMA:
        raise ParamsError(f"{where}: unknown parameter '{key}'.{did_you_mean(key, SCHEMA)} "
                          f"Known parameters: {', '.join(SCHEMA)}.")
    spec = SCHEMA[key]
    if spec.auto and value == AUTO:
        return value
    if spec.kind is float and isinstance(value, str):
        # PyYAML reads `1e-4` (no dot) as a string, a YAML 1.1 rule nobody expects.
        try:
            value = float(value)
        except ValueError:
            pass
    if spec.int_list and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # YAML and --set read a single batch size, `8`, as an integer
    # bool is a subclass of int in Python; `batch_size: true` must not pass as 1.
    ok = isinstance(value, spec.kind) and not (spec.kind in (int, float) and isinstance(value, bool))
    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if ok and spec.kind is float and not math.isfinite(value):
        ok = False  # NaN passes every comparison below unnoticed; infinity is no setting either
    if ok and spec.int_list and not (value == "" == spec.default) and not (
            _INT_OR_AUTO_LIST if spec.auto else _INT_LIST).fullmatch(value.replace(" ", "")):
        ok = False  # '' passes only where it is the default: "not stated"
    if ok and spec.choices:
        names = _names(value) if spec.choice_list else [value]
        ok = bool(names) and set(names) <= set(spec.choices)
    if ok and spec.non_empty and not value.strip():
        ok = False
    if ok and spec.minimum is not None and value < spec.minimum:
        ok = False
    if ok and spec.maximum is not None and value > spec.maximum:
        ok = False
    if not ok:
        raise ParamsError(f"{where}: '{key}' is {value!r}; expected {spec.expected()} ({spec.meaning}).")
    return value


def check_consistency(params: dict, where: str) -> None:
    """Rules that involve more than one key (each where its keys are all there: a notebook holds the
    keys it declares)."""
    if params.get("dtype") == "bf16" and params.get("gpu_count", 0) > 0 and params.get("supports_bf16") is False:
        raise ParamsError(f"{where}: 'dtype' is 'bf16' but this profile says supports_bf16: false. "
                          "Use dtype: fp16 (or fp32) on this GPU.")
    try:
        re.compile(params.get("gpu_name_pattern", ""))
    except re.error as error:
        raise ParamsError(f"{where}: 'gpu_name_pattern' is not a valid regular expression: {error}") from None


def _read_yaml_mapping(path: Path) -> tuple[dict, dict[str, int]]:
    """Read a YAML mapping safely; also return each top-level key's line number (1-based)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise ParamsError(f"{path}:{line}: not UTF-8 text (byte {error.start + 1}); save the file as UTF-8") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict) or root is None:
        raise ParamsError(f"{path}: expected a mapping of 'key: value' lines, got {type(data).__name__}.")
    lines: dict[str, int] = {}
    for key_node, _ in root.value:
        key = key_node.value
        if key in lines:
            raise ParamsError(f"{path}:{key_node.start_mark.line + 1}: key '{key}' appears twice "
                              f"(first on line {lines[key]}).")
        lines[key] = key_node.start_mark.line + 1
    if len(data) != len(lines):  # e.g. 'no:' and 'false:', two keys YAML reads as one value
        raise ParamsError(f"{path}: two keys YAML reads as the same value among lines "
                          f"{', '.join(map(str, lines.values()))}; parameter names are plain words.")
    # Keyed as typed: YAML reads 'no:' or '12:' as False or 12, which would hide the key and its line.
    return dict(zip(lines, data.values())), lines


# The hardware keys a GPU spec table row states, and the row's field for each.
GPU_FACTS = {"gpu_memory_gib": "memory_gib", "peak_bf16_tflops": "peak_bf16_tflops",
             "peak_fp16_tflops": "peak_fp16_tflops", "memory_bandwidth_gbs": "memory_bandwidth_gbs",
             "supports_bf16": "supports_bf16", "supports_tf32": "supports_tf32"}
# What a profile file states of its own besides the settings that differ from the defaults.
HARDWARE_KEYS = ("profile", "gpu_spec", "gpu_name_pattern", "gpu_count", "usd_per_gpu_hour")


def defaults() -> Params:
    """Every key at its schema default."""
    return Params({name: key.default for name, key in SCHEMA.items()})


def gpu_facts(gpu: str) -> dict[str, Any]:
    """The hardware keys the spec table's row named ``gpu`` states (a ``gpu_spec`` value); {} for '' (no row)."""
    if not gpu:
        return {}
    spec = next(spec for spec in gpu_table.GPU_SPECS if spec.name == gpu)  # validated: one of SCHEMA's choices
    return {key: validate_value(key, getattr(spec, field), f"GPU spec table row {gpu!r}")
            for key, field in GPU_FACTS.items()}


def resolve(stated: dict[str, Any], where: str, check: bool = True) -> Params:
    """A whole profile from the values a file, a notebook or papermill states (validated): the schema's
    defaults, overlaid by the facts of the GPU row ``stated`` names, overlaid by ``stated``; cross-key
    rules checked (``check``). The one way `load` and `notebook.start` build params."""
    merged = defaults()
    merged.update(gpu_facts(stated.get("gpu_spec", merged["gpu_spec"])))
    merged.update(stated)
    if check:
        check_consistency(merged, where)
    return merged


def load(path: str | Path) -> Params:
    """Load and validate one profile file: the schema's defaults, the facts of its GPU's row, and
    what the file states. The file must name itself (``profile``); any other key is optional."""
    path = Path(path)
    if path.is_dir():
        raise ParamsError(f"{path}: a folder, not a parameter file; give a profile name or a .yaml file in it.")
    if not path.is_file():
        available = ", ".join(profile_names()) or "none"
        raise ParamsError(f"{path}: no such parameter file.{did_you_mean(path.stem, profile_names())} "
                          f"Profiles in {PARAMS_DIR}: {available}.")
    data, lines = _read_yaml_mapping(path)
    stated = {key: validate_value(str(key), value, f"{path}:{lines.get(key, '?')}") for key, value in data.items()}
    if "profile" not in stated:
        raise ParamsError(f"{path}: missing parameter(s) profile. Add 'profile: {path.stem}' "
                          f"({SCHEMA['profile'].meaning}).")
    if stated["profile"] != path.stem:
        raise ParamsError(f"{path}:{lines['profile']}: 'profile' is {stated['profile']!r} but the file "
                          f"is {path.name}; they must agree.")
    return resolve(stated, str(path))


def stated_keys(path: str | Path) -> list[str]:
    """The keys a profile file states itself, in file order (what it holds of its own)."""
    return [str(key) for key in _read_yaml_mapping(Path(path))[0]]


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ['batch_size=8', 'dtype=bf16'] into validated values; YAML rules type each value (a text key
    takes its text). A key given twice takes its last value: scripts layer their settings that way."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ParamsError(f"--set {pair!r}: expected key=value, e.g. --set dtype=bf16.")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        if isinstance(value, (dict, list)):
            value = text  # `model={x}` is a path-like string, not YAML structure
        if key.strip() == "profile":  # the file's name: a profile's hardware facts come with it, not from --set
            raise ParamsError(f"--set {pair!r}: the profile is the parameter file's own; choose it with --params "
                              f"{text.strip() or '<profile>'} (and change its settings with --set).")
        key_schema = SCHEMA.get(key.strip())
        if key_schema is not None and key_schema.kind is str and not isinstance(value, str):
            value = text.strip()  # a text key takes the text: system_prompt=no, output_path=2026-01-01, prompts_path=123
        overrides[key.strip()] = validate_value(key.strip(), value, f"--set {pair}")
    return overrides


def apply_overrides(params: Params, overrides: dict[str, Any]) -> Params:
    """A copy of `params` with overrides applied and cross-key rules checked again."""
    merged = Params(params)
    if "gpu_spec" in overrides:  # another row: its facts replace the profile's, and any --set of them wins
        merged.update(gpu_facts(overrides["gpu_spec"]))
    merged.update(overrides)
    check_consistency(merged, "--set " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    return merged


def profile_names() -> list[str]:
    return sorted(p.stem for p in PARAMS_DIR.glob("*.yaml"))


def profile_path(name_or_path: str) -> Path:
    """'h200' or 'params/h200.yaml' -> the file's path (not checked for existence here)."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) > 1:
        return candidate  # a path, not a profile name
    return PARAMS_DIR / f"{name_or_path}.yaml"


def load_all() -> dict[str, Params]:
    """Every profile in params/, validated."""
    return {name: load(PARAMS_DIR / f"{name}.yaml") for name in profile_names()}
