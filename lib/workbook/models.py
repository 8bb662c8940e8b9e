"""Model names and loading: what 'tiny', a local directory and a preset name mean, in one home.

Generation, training, the batch finder, the calibration and the benchmarks all load through
``load_model``, so 'tiny', a local Hugging Face directory and a preset name (an architecture built
from its config with random weights on the device: nothing is downloaded) mean the same everywhere::

    loaded = load_model("tiny", "fp32", "cpu")            # loaded.model, loaded.description
    tokenizer = load_tokenizer("tiny")                     # None for a preset: random weights have none

The token-level facts of a loaded model (end ids, pad id, context, left padding) are in ``decoding``.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from workbook import presets, tiny_model
from workbook.jsonl import DataError
from workbook.planner.architectures import attention_implementation_run
from workbook.planner.shape import choose_lora_targets, is_lora_target

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {value: key for key, value in TORCH_DTYPES.items()}
DEFAULT_ATTENTION = "sdpa"  # transformers' default, and the planner's


def is_preset(model: str) -> bool:
    """True for a preset architecture name (not 'tiny', not a directory): random weights, no tokenizer.
    Raises ValueError listing the presets for a name that is neither."""
    if model == tiny_model.TINY_MODEL_NAME or Path(model).expanduser().is_dir():
        return False
    presets.load_config(model)  # raises with the list of presets for an unknown name
    return True


def model_source(model: str) -> str:
    """What ``presets.load_config`` reads for ``model``: the name itself, or the expanded directory."""
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
    from transformers import AutoModelForCausalLM

    if is_preset(model):
        return build_random(model, dtype, device, attn_implementation=attn_implementation)
    torch_dtype = _torch_dtype(dtype)
    path = tiny_model.resolve_model_path(model)
    if presets.is_adapter_folder(path):
        return _load_with_adapters(model, path, torch_dtype, device, attn_implementation)
    needs = "config.json and the weights (*.safetensors)"
    with _loading(model, path, needs):
        # The planner's reading of config.json: transformers' refusals (any exception type) become one line.
        attn_implementation = runnable_attention(presets.load_config(path), attn_implementation)
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


def _load_with_adapters(model: str, path: str, torch_dtype, device, attn_implementation: str) -> LoadedModel:
    """A LoRA run saved with lora_save: adapters: its base model (adapter_config.json names it), then
    the adapters on top, unmerged (PEFT's forward adds them). Raises ModelError when the base is gone."""
    import peft

    try:
        base = presets.adapter_base_model(path)
    except ValueError as error:
        raise ModelError(f"model {model}: {error}") from None
    loaded = load_model(base, torch_dtype, device, attn_implementation=attn_implementation)
    with _loading(model, path, "adapter_config.json and adapter_model.safetensors"):
        adapted = peft.PeftModel.from_pretrained(loaded.model, path, is_trainable=False)
    return LoadedModel(adapted.eval(), f"{model}: LoRA adapters from {path} on {loaded.description}", path)


class ModelError(DataError):
    """A local model directory that cannot be loaded (a broken config.json, no weights, no tokenizer), or an
    attention implementation whose package is missing: said in one line, before any work."""


@contextmanager
def _loading(model: str, path, needs: str):
    """transformers' errors for a broken model directory (OSError, ValueError: a traceback) as a ModelError."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, RuntimeError) as error:  # RuntimeError: weights whose shapes config.json contradicts
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

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return attention_implementation_run(getattr(model_class, "_supports_sdpa", True), requested)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype


def load_tokenizer(model: str):
    """The model's tokenizer; None for a preset (random weights have no tokenizer). Never touches a GPU."""
    if is_preset(model):
        return None
    from transformers import AutoTokenizer

    path = tiny_model.resolve_model_path(model)
    needs = "its tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json)"
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        # AutoTokenizer would fall back to the hub or return a wrong tokenizer from a bare config.
        raise ModelError(f"model {model}: {path} holds no tokenizer; a model directory needs its tokenizer files "
                         f"(any of {', '.join(TOKENIZER_FILES)}): copy those of the model it was trained from into it "
                         "(tokenizer.save_pretrained)")
    with _loading(model, path, needs):
        tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer_fits(model, tokenizer, presets.load_config(model_source(model)))
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_tokenizer_fits(model: str, tokenizer, config) -> None:
    """A tokenizer with more ids than the model's embedding has rows would index past it (a CUDA
    device-side assert mid-run): refused here, naming both sizes. Fewer ids are normal (embeddings are
    rounded up)."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    rows = getattr(text_config, "vocab_size", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ModelError(f"model {model}: its tokenizer has {len(tokenizer):,} ids but the model's embedding only "
                         f"{rows:,} rows (config.json vocab_size): they belong to different models; use the "
                         "tokenizer saved with these weights, or resize the embedding before saving "
                         "(model.resize_token_embeddings(len(tokenizer)))")


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
    return choose_lora_targets(_linear_names(model), _output_name(model), target_modules)
