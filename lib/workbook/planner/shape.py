"""The model's sizes the planner's formulas need, read once from its config, and the checks
every planner entry point makes on its arguments (errors name the argument and the allowed values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from workbook import presets
from workbook.planner.architectures import Architecture, describe, refuse_unsupported

# Storage bits per weight, by the dtype name a user writes. int4 is NF4/FP4 (bitsandbytes).
BITS_PER_PARAMETER = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
QUANTIZED_DTYPES = ("int8", "int4")  # weights only: compute and KV cache run in bf16
ATTENTION_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")  # training also: architectures.TRAINING_ATTENTIONS
OPTIMIZERS = ("adamw", "adamw-8bit")
SHARDINGS = ("none", "fsdp")
DEFAULT_LORA_TARGET_MODULES = ""  # every linear projection of the architecture (choose_lora_targets)


FP32_BYTES = 4
INT64_BYTES = 8


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of the model: its qualified name and shape."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int
    has_bias: bool
    is_output_embedding: bool  # the lm_head: bitsandbytes leaves it unquantized

    @property
    def parameters(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.has_bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The sizes every formula needs. Build it with ``model_shape(config)``."""

    name: str
    parameters: int
    decoder_layer_parameters: int  # the largest decoder layer
    decoder_parameters: int  # all decoder layers together
    linear_layers: tuple[LinearLayer, ...]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    attention_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full
    architecture: Architecture  # what differs from a Llama decoder (planner/architectures.py)

    @property
    def query_width(self) -> int:
        """Query (and attention output) features per token: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def key_value_width(self) -> int:
        """Key (or value) features per token: key/value heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def non_decoder_parameters(self) -> int:
        """Embeddings, final norm and (untied) lm_head."""
        return self.parameters - self.decoder_parameters


def model_shape(model: PretrainedConfig | ModelShape | str) -> ModelShape:
    """The sizes of ``model``: a config, a preset name or local directory, or a ModelShape."""
    if isinstance(model, ModelShape):
        return model
    config = presets.load_config(model) if isinstance(model, str) else model
    refuse_unsupported(config, f"model {_model_name(model, config)}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [name for name in _REQUIRED_CONFIG_FIELDS if getattr(text, name, None) is None]
    if missing:
        raise ValueError(
            f"the {config.model_type!r} config has no {', '.join(missing)}: the memory planner "
            "supports decoder-only transformers (Llama, Qwen, Mistral/Mixtral, Gemma, Phi, DeepSeek and alike)"
        )
    _check_sizes(text, _model_name(model, config))
    meta_model = presets.build_on_meta_device(config)
    layers = _decoder_layers(meta_model, text.num_hidden_layers)
    layer_parameters = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    output_embedding = meta_model.get_output_embeddings()
    linear_layers = tuple(
        LinearLayer(
            name=name,
            in_features=module.in_features,
            out_features=module.out_features,
            has_bias=module.bias is not None,
            is_output_embedding=module is output_embedding,
        )
        for name, module in meta_model.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    num_attention_heads = text.num_attention_heads
    return ModelShape(
        name=_model_name(model, config),
        parameters=presets.count_parameters(config),
        decoder_layer_parameters=max(layer_parameters),
        decoder_parameters=sum(layer_parameters),
        linear_layers=linear_layers,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_attention_heads,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        attention_windows=_attention_windows(text),
        architecture=describe(config, meta_model, layers),
    )


_REQUIRED_CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"
)


def _check_sizes(text_config: PretrainedConfig, source: str) -> None:
    """Sizes must be positive integers and query heads a multiple of key/value heads: a config that
    breaks either would build a model that cannot exist, or fail deep inside torch."""
    optional = ("num_key_value_heads", "head_dim", "max_position_embeddings")
    for name in _REQUIRED_CONFIG_FIELDS + optional:
        value = getattr(text_config, name, None)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config of {source}: {name} is {value!r}; expected a positive integer")
    heads = text_config.num_attention_heads
    key_value_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % key_value_heads:
        raise ValueError(f"config of {source}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {key_value_heads} (grouped-query attention shares each "
                         "key/value head among a whole number of query heads)")


def _decoder_layers(meta_model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    for module in meta_model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(
        f"could not find the {num_layers} decoder layers in {type(meta_model).__name__}; the "
        "memory planner supports decoder-only models whose layers sit in one ModuleList"
    )


def _attention_windows(text_config: PretrainedConfig) -> tuple[int | None, ...]:
    """Per layer, how many past tokens attention sees (None: all), as transformers' cache reads it.

    Mirrors ``transformers.cache_utils.get_layer_types_and_kwargs``: explicit ``layer_types`` win;
    without them a set ``sliding_window`` makes every layer sliding (Mistral).
    """
    layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    sliding_window = getattr(text_config, "sliding_window", None)
    if layer_types is None:
        return (sliding_window,) * layers
    windows = {
        "sliding_attention": sliding_window,
        "chunked_attention": getattr(text_config, "attention_chunk_size", None),
    }
    return tuple(windows.get(layer_type) for layer_type in layer_types)


def _model_name(model, config: PretrainedConfig) -> str:
    if isinstance(model, str):
        return model
    return getattr(config, "name_or_path", "") or config.model_type



def has_window(shape: ModelShape) -> bool:
    return any(window is not None for window in shape.attention_windows)


def target_names(target_modules) -> tuple[str, ...]:
    """'q_proj, v_proj' or a list -> ('q_proj', 'v_proj'); '' or None -> () (= every linear projection)."""
    if not target_modules:
        return ()
    if isinstance(target_modules, str):
        return tuple(name.strip() for name in target_modules.split(",") if name.strip())
    return tuple(target_modules)


@dataclass(frozen=True)
class LoraTargets:
    """The module names LoRA adapts, as PEFT's ``target_modules`` takes them, and requested names that match
    no ``nn.Linear`` (a warning: a typo, or a projection another architecture names differently)."""

    names: tuple[str, ...]
    unmatched: tuple[str, ...]


def choose_lora_targets(linear_names, output_embedding_name: str | None, requested=None) -> LoraTargets:
    """The one rule for LoRA's targets, used by the planner (the meta model) and the trainer (the real one).

    ``linear_names``: qualified names of the model's ``nn.Linear`` modules. Nothing requested ('' or None):
    every linear projection except the lm_head, by its last name part (Llama: q_proj ... down_proj; Phi-3:
    qkv_proj, o_proj, gate_up_proj, down_proj; DeepSeek: q_a_proj, kv_a_proj_with_mqa, kv_b_proj, ...).
    Routed experts are 3-D parameters, no ``nn.Linear``: LoRA never adapts them (``models.with_lora`` keeps
    PEFT from moving gate_proj/up_proj/down_proj onto them). Requested
    names match like PEFT's: the full name, or its ending after a dot.
    """
    linear_names = [name for name in linear_names if name != output_embedding_name]
    requested = target_names(requested)
    if not requested:
        return LoraTargets(tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name in linear_names)), ())

    unmatched = tuple(t for t in requested if not any(is_lora_target(name, (t,)) for name in linear_names))
    if len(unmatched) == len(requested):
        available = sorted({name.rsplit(".", 1)[-1] for name in linear_names})
        raise ValueError(f"lora_targets {list(requested)} match no Linear layer of the model; its Linear layers "
                         f"are named: {', '.join(available)} (leave lora_targets empty to adapt all of them)")
    return LoraTargets(tuple(t for t in requested if t not in unmatched), unmatched)


def is_lora_target(module_name: str, target_names) -> bool:
    """Whether PEFT's list ``target_modules`` picks ``module_name``: a target is the full name or its ending
    after a dot (``peft.tuners.tuners_utils.check_target_module_exists``)."""
    return any(module_name == target or module_name.endswith("." + target) for target in target_names)


def lora_target_choice(shape: ModelShape, target_modules=None) -> LoraTargets:
    """``choose_lora_targets`` on the Linear layers of ``shape``."""
    output = next((layer.name for layer in shape.linear_layers if layer.is_output_embedding), None)
    return choose_lora_targets([layer.name for layer in shape.linear_layers], output, target_modules)


def lora_targets(shape: ModelShape, target_modules=None) -> list[LinearLayer]:
    """The Linear layers of ``shape`` LoRA adapts."""
    names = lora_target_choice(shape, target_modules).names
    return [layer for layer in shape.linear_layers if not layer.is_output_embedding
            and is_lora_target(layer.name, names)]


# ----------------------------------------------------------------------------------------------
# Validation: errors name the argument and the allowed values.


def canonical_dtype(dtype: str) -> str:
    """'bf16' for 'bf16' or 'bfloat16', and so on; ValueError naming the allowed values."""
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in BITS_PER_PARAMETER:
        allowed = ", ".join([*BITS_PER_PARAMETER, *DTYPE_ALIASES])
        raise ValueError(f"dtype {dtype!r} is not supported; use one of: {allowed}")
    return name


def compute_bytes(dtype: str) -> int:
    """Bytes per value of activations and KV cache: quantized weights compute in bf16."""
    dtype = canonical_dtype(dtype)
    return 2 if dtype in QUANTIZED_DTYPES else BITS_PER_PARAMETER[dtype] // 8


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer (1 or more), got {value!r}")


def positive_bytes(name: str, value: float) -> int:
    """A byte count given as int or float (e.g. ``140.4 * GiB``), rounded down."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return int(value)


def require_non_negative(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 disables it), got {value!r}")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not supported; use one of: {', '.join(allowed)}")

