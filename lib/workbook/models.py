"""Loading a model, and the token-level facts every job asks of it: one home for each.

Generation, training, the batch finder, the calibration and the benchmarks all load through
``load_model``, so 'tiny', a local Hugging Face directory and a preset name (an architecture built
from its config with random weights on the device: nothing is downloaded) mean the same everywhere::

    loaded = load_model("tiny", "fp32", "cpu")            # loaded.model, loaded.description
    tokenizer = load_tokenizer("tiny")                     # None for a preset: random weights have none
    input_ids, attention_mask = left_pad(rows, pad_token_id(loaded.model, tokenizer), device)
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from workbook.jsonl import DataError

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {value: key for key, value in TORCH_DTYPES.items()}
DEFAULT_ATTENTION = "sdpa"  # transformers' default, and the planner's


def is_preset(model: str) -> bool:
    """True for a preset architecture name (not 'tiny', not a directory): random weights, no tokenizer.
    Raises ValueError listing the presets for a name that is neither."""
    from workbook import presets, tiny_model
    if model == tiny_model.TINY_MODEL_NAME or Path(model).expanduser().is_dir():
        return False
    presets.load_config(model)  # raises with the list of presets for an unknown name
    return True


def model_source(model: str) -> str:
    """What ``presets.load_config`` reads for ``model``: the name itself, or the expanded directory."""
    from workbook import tiny_model
    return model if model == tiny_model.TINY_MODEL_NAME else str(Path(model).expanduser())


@dataclass
class LoadedModel:
    model: torch.nn.Module
    description: str  # what was loaded and how, for reports
    path: str | None  # the directory the weights came from; None for a preset (random weights)


def load_model(model: str, dtype: str | torch.dtype, device: str | torch.device, *,
               attn_implementation: str = DEFAULT_ATTENTION, sharding: dict | None = None) -> LoadedModel:
    """``model`` on ``device`` in ``dtype`` (a name in TORCH_DTYPES or a torch dtype), in eval mode.

    'tiny' or a local directory loads its weights; a preset name builds the architecture with random
    weights (``build_random``). ``sharding``, keyword arguments of ``from_pretrained`` such as
    ``{"distributed_config": DistributedConfig(...)}``, loads this process's shard of the weights onto
    its own device instead (tensor parallel: ``generation.tensor_parallel.sharding_arguments``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workbook import tiny_model
    if is_preset(model):
        return build_random(model, dtype, device, attn_implementation=attn_implementation)
    torch_dtype = _torch_dtype(dtype)
    path = tiny_model.resolve_model_path(model)
    needs = "config.json and the weights (*.safetensors)"
    with _loading(model, path, needs):
        attn_implementation = runnable_attention(AutoConfig.from_pretrained(path), attn_implementation)
    check_attention_installed(attn_implementation)
    description = f"{model}: weights from {path}, {DTYPE_NAMES[torch_dtype]}"
    # A shard: transformers places it on this rank's device. Else straight onto a GPU: through host memory,
    # an 8B model's 16 GB would be read into RAM first, then copied.
    placed = sharding or ({"device_map": str(torch.device(device))} if torch.device(device).type == "cuda" else {})
    with _loading(model, path, needs):
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn_implementation,
                                                      **placed)
    if sharding:
        return LoadedModel(loaded.eval(), f"{description}, tensor parallel over {loaded.tp_size} processes", path)
    return LoadedModel((loaded if placed else loaded.to(device)).eval(), description, path)


class ModelError(DataError):
    """A local model directory that cannot be loaded (a broken config.json, no weights, no tokenizer), or an
    attention implementation whose package is missing: said in one line, before any work."""


@contextmanager
def _loading(model: str, path, needs: str):
    """transformers' errors for a broken model directory (OSError, ValueError: a traceback) as a ModelError."""
    try:
        yield
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"model {model}: cannot load it from {path} ({first[:300]}); a model directory needs "
                         f"{needs} (nothing is downloaded)") from None


def check_attention_installed(attn_implementation: str | None) -> None:
    """flash_attention_2 needs the flash-attn package: refused in one line, not transformers' ImportError."""
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ModelError("attn_implementation flash_attention_2 needs the flash-attn package, which is not installed "
                         "(pip install flash-attn, on a CUDA machine); or set attn_implementation: sdpa")


def build_random(model: str, dtype: str | torch.dtype, device: str | torch.device, *,
                 attn_implementation: str = DEFAULT_ATTENTION) -> LoadedModel:
    """A preset's architecture (or 'tiny''s, untrained) built directly on ``device`` with random
    weights, in eval mode: speed and memory do not depend on the values, and nothing is downloaded."""
    from transformers import AutoModelForCausalLM

    from workbook import presets
    torch_dtype = _torch_dtype(dtype)
    config = presets.load_config(model)
    with torch.device(device):
        built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype,
                                                 attn_implementation=runnable_attention(config, attn_implementation))
    description = f"{model}: preset architecture, random {DTYPE_NAMES[torch_dtype]} weights built on {device}"
    return LoadedModel(built.eval(), description, None)


def runnable_attention(config, requested: str) -> str:
    """``requested``, or eager for a model that refuses sdpa (Gemma-2), as the planner plans it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from workbook.planner.architectures import attention_implementation_run
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return attention_implementation_run(getattr(model_class, "_supports_sdpa", True), requested)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype


def load_tokenizer(model: str):
    """The model's tokenizer; None for a preset (random weights have no tokenizer). Never touches a GPU."""
    if is_preset(model):
        return None
    from transformers import AutoTokenizer

    from workbook import tiny_model
    path = tiny_model.resolve_model_path(model)
    with _loading(model, path, "its tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)"):
        return AutoTokenizer.from_pretrained(path)


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in backward, non-reentrant (the form that works with DDP, LoRA
    and frozen inputs); the trainer, the batch finder and the calibration all switch it on here, so
    the probe that proves a micro-batch runs what the trainer runs."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def with_lora(model, rank: int, target_modules=None):
    """LoRA adapters of ``rank`` (alpha 2 x rank, no dropout) on ``lora_targets(model, target_modules)``:
    every linear projection by default, the rule the planner counts.

    PEFT keeps the adapters in fp32 on a 16-bit base (``autocast_adapter_dtype=True``, its default),
    which is what the planner assumes. Raises ImportError when peft is missing, RuntimeError when PEFT
    adapted other modules than the rule picks."""
    import peft

    from workbook.planner.shape import choose_lora_targets, is_lora_target
    linear_names, output_name = _linear_names(model), _output_name(model)
    targets = choose_lora_targets(linear_names, output_name, target_modules)
    planned = {name for name in linear_names if name != output_name and is_lora_target(name, targets.names)}
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=list(targets.names))
    with _without_peft_v4_moe_remap():
        adapted = peft.get_peft_model(model, config)
    built = {name.removeprefix("base_model.model.") for name, module in adapted.named_modules()
             if isinstance(module, peft.tuners.lora.LoraLayer)}
    if built != planned:
        raise RuntimeError(f"PEFT {peft.__version__} adapted {sorted(built - planned)} and not "
                           f"{sorted(planned - built)}, unlike the planner's LoRA targets {list(targets.names)}")
    return adapted


@contextmanager
def _without_peft_v4_moe_remap():
    """PEFT 0.21 on transformers 5 rewrites the targets gate_proj/up_proj/down_proj of the MoE families
    transformers converts from v4 checkpoints (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-MoE, ...) into
    ``target_parameters`` on the routed experts' fused 3-D weights, so that adapters trained on v4 still load;
    no list or regex ``target_modules`` escapes it. A fresh adapter needs none of that: switched off here, the
    shared experts' and dense layers' ``nn.Linear`` keep their adapters and the routed experts stay frozen and
    unadapted, which is what the planner's LoRA terms assume (no adapter, no merged copy of expert weights)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # transformers 4, or a PEFT without the remap
        yield
        return
    remap = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None  # looked up at each injection
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = remap


def _linear_names(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _output_name(model) -> str | None:
    output = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is output), None)


def lora_targets(model, target_modules=None):
    """The module names LoRA adapts on ``model`` and the requested ones that match nothing
    (``workbook.planner.shape.choose_lora_targets``, the planner's rule)."""
    from workbook.planner.shape import choose_lora_targets
    return choose_lora_targets(_linear_names(model), _output_name(model), target_modules)


# ----------------------------------------------------------------------------------------------
# Tokens: end of sequence, padding, context.


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the generation config's (often several), the model config's
    and the tokenizer's."""
    candidates = [getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(getattr(model, "config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)]
    ids: list[int] = []
    for candidate in candidates:
        for value in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def pad_token_id(model, tokenizer) -> int:
    """The tokenizer's pad id, else the model's, else the first end-of-sequence id, else 0: padded
    positions are masked out (generation) or carry no loss (training), so any id serves."""
    for candidate in (getattr(tokenizer, "pad_token_id", None),
                      getattr(getattr(model, "generation_config", None), "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    eos_ids = eos_token_ids(model, tokenizer)
    return eos_ids[0] if eos_ids else 0


def context_length(model) -> int | None:
    """Positions the model was built for (None when its config does not say)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def left_pad(rows: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each row right-aligned: every prompt ends where generation starts.

    Padded here rather than with ``tokenizer(..., padding_side="left")``, which leaves the padding
    side set inside the tokenizer; a later ``save_pretrained`` would then write it to disk."""
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([[pad_token_id] * (width - len(row)) + list(row) for row in rows], dtype=torch.long,
                             device=device)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long,
                                  device=device)
    return input_ids, attention_mask


def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                       batch_size: int = 64) -> list[str]:
    """Greedy continuation of each prompt (token ids), left-padded in batches, special tokens removed.
    For accuracy checks; the generation job has its own engine."""
    pad = pad_token_id(model, tokenizer)
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(prompts), batch_size):
        input_ids, attention_mask = left_pad(prompts[start:start + batch_size], pad, device)
        with torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                    use_cache=True)  # a training model may have switched its cache off
        texts += tokenizer.batch_decode(output[:, input_ids.shape[1]:], skip_special_tokens=True)
    return texts
