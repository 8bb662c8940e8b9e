"""Model architectures the memory planner knows by name, and how to count their parameters.

One place for each fact: the table in ``preset_configs`` copies the published ``config.json`` of each model (the
Hugging Face repository is named in ``_name_or_path``), so a plan for "Llama-3.1-8B" needs neither
a download nor the weights. Any other model is planned from a local Hugging Face directory, of
which only ``config.json`` is read::

    config = load_config("llama-3.1-8b")           # a preset, any case; the hub id works too
    config = load_config("/models/Qwen2.5-14B")    # a local directory: config.json only
    count_parameters(config)                       # 8_030_261_248, exact

Parameters are counted on the ``meta`` device: the real model class is built with shapes but no
storage, so the count includes every bias and norm the architecture has and counts tied
embeddings once, in well under a second even for 70B.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from workbook.preset_configs import PRESETS
from workbook.suggest import did_you_mean

TINY_PRESET = "tiny"  # the workbook's own model (workbook.tiny_model), built locally


def preset_names() -> list[str]:
    """The built-in model names, the tiny model first."""
    return [TINY_PRESET, *PRESETS]


def load_config(model: str | Path) -> PretrainedConfig:
    """The configuration of a preset (any case, or its hub id) or of a local model directory.

    A directory must hold a Hugging Face ``config.json``; nothing else in it is read and nothing is
    ever downloaded. Raises ValueError naming the presets when ``model`` is neither.
    """
    name = str(model).strip()
    if name.lower() == TINY_PRESET:
        from workbook.tiny_model import tiny_config  # imported late: it pulls in the tokenizer

        return tiny_config()
    preset = _preset_by_alias().get(name.lower())
    if preset is not None:
        return _config_from_dict(PRESETS[preset])
    directory = Path(name).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").is_file() and (directory / ADAPTER_CONFIG).is_file():
            # A LoRA run saved with lora_save: adapters. Its shape is its base model's (the adapters add
            # rank x (in + out) per adapted layer, well inside the planner's margin).
            config = load_config(adapter_base_model(directory))
            config.name_or_path = str(directory)  # plans and reports name the folder the user gave
            return config
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"model directory {directory} has no config.json; point `model` at a Hugging Face "
                "model directory (the one holding config.json) or use a preset name"
            )
        return _config_from_directory(directory)
    raise ValueError(
        f"unknown model {name!r}: not a preset and not a local directory.{did_you_mean(name, preset_names())} "
        f"Presets (any case): {', '.join(preset_names())}; or pass a local Hugging Face model "
        "directory that holds config.json (nothing is downloaded)."
    )


ADAPTER_CONFIG = "adapter_config.json"  # what PEFT writes beside LoRA adapters


def is_adapter_folder(directory: str | Path) -> bool:
    """True for a folder of LoRA adapters (PEFT's adapter_config.json, no model config.json)."""
    directory = Path(directory).expanduser()
    return (directory / ADAPTER_CONFIG).is_file() and not (directory / "config.json").is_file()


def adapter_base_model(directory: str | Path) -> str:
    """The local directory of the base model a folder of LoRA adapters was trained on (its
    adapter_config.json's base_model_name_or_path). Raises ValueError naming the file, the base it
    names and what to do when that base is not a local model directory (nothing is downloaded)."""
    path = Path(directory).expanduser() / ADAPTER_CONFIG
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable as JSON ({error}); restore the adapters' {ADAPTER_CONFIG}") from None
    base = values.get("base_model_name_or_path") if isinstance(values, dict) else None
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"{path}: no base_model_name_or_path, so the base model the adapters belong to is unknown; "
                         "set it to the base model's local directory")
    if not (Path(base).expanduser() / "config.json").is_file():
        raise ValueError(f"{path}: the adapters' base model {base} (base_model_name_or_path) is not a local model "
                         "directory with config.json; copy the base model there, or set base_model_name_or_path to "
                         "where it is, or train again with lora_save: merged (a standalone model)")
    return str(Path(base).expanduser())


def _config_from_directory(directory: Path) -> PretrainedConfig:
    """A local model's config; a config.json that is empty, not JSON, not an object or that
    transformers cannot read gets a ValueError naming the file (not a traceback from inside)."""
    path = directory / "config.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        what = ("empty" if not text.strip()
                else f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})")
        raise ValueError(f"{path}: {what}; restore the model's config.json") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(f"{path}: expected a JSON object with a 'model_type' (e.g. \"llama\"), as Hugging Face "
                         "writes it; restore the model's config.json")
    _check_size_fields(path, values)
    _check_sizes_given(path, values)
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as error:  # transformers' own checks (types, head counts) raise several kinds
        reason = " ".join(str(error).split())
        raise ValueError(f"{path}: transformers refuses it: {reason}") from None


# Sizes every decoder config gives as a positive integer (null where optional). Checked on the raw
# JSON, so the error names the file and key instead of transformers' validator or a torch shape error.
SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "sliding_window", "num_local_experts",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
)


# The sizes a plan cannot do without (with the other names some architectures give them): absent, transformers
# would fill in its defaults for the model_type, another model's size (a 6.7B Llama for {"model_type": "llama"}).
REQUIRED_SIZES = {"hidden_size": ("n_embd", "d_model"), "num_hidden_layers": ("n_layer", "num_layers"), "vocab_size": ()}


def _check_sizes_given(path: Path, values: dict) -> None:
    sizes = values["text_config"] if isinstance(values.get("text_config"), dict) else values
    missing = [key for key, others in REQUIRED_SIZES.items() if not any(name in sizes for name in (key, *others))]
    if missing:
        raise ValueError(f"{path}: no {', '.join(repr(key) for key in missing)}; transformers would plan its default "
                         f"{values['model_type']} in their place, another model's size; restore the model's config.json")


def _check_size_fields(path: Path, values: dict) -> None:
    for key in SIZE_FIELDS:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: {key!r} is {json.dumps(value)} ({type(value).__name__}); expected a "
                             "positive integer; restore the model's config.json")
        if value < 1:
            raise ValueError(f"{path}: {key!r} is {value}; expected a positive integer; "
                             "restore the model's config.json")
    heads, key_value_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if heads and key_value_heads and heads % key_value_heads:
        raise ValueError(f"{path}: 'num_attention_heads' {heads} is not a multiple of 'num_key_value_heads' "
                         f"{key_value_heads} (grouped-query attention shares each key/value head among a whole "
                         "number of query heads)")


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model ``config`` describes, exactly; tied embeddings are counted once.

    Counts what ``AutoModelForCausalLM.from_config(config)`` builds, on the meta device.
    """
    # parameters() yields a shared (tied) tensor once, so the input and output embeddings of a
    # tied model are one matrix here, as in the checkpoint.
    return sum(parameter.numel() for parameter in build_on_meta_device(config).parameters())


def build_on_meta_device(config: PretrainedConfig) -> torch.nn.Module:
    """The causal LM ``config`` describes, with shapes but no storage (``torch.device("meta")``).

    Cached per distinct config, so planners may call it in a loop; treat the result as read-only.
    """
    key = config.to_json_string(use_diff=False)
    if key not in _meta_models:
        with torch.device("meta"):
            _meta_models[key] = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        if len(_meta_models) > _META_MODEL_CACHE_SIZE:
            _meta_models.pop(next(iter(_meta_models)))  # oldest first
    return _meta_models[key]


_meta_models: dict[str, torch.nn.Module] = {}
_META_MODEL_CACHE_SIZE = 16  # meta models hold no storage; this only bounds Python objects


def _preset_by_alias() -> dict[str, str]:
    """Lower-case names and hub ids ("llama-3.1-8b", "meta-llama/llama-3.1-8b") -> preset name."""
    aliases = {}
    for name, values in PRESETS.items():
        aliases[name.lower()] = name
        aliases[values["_name_or_path"].lower()] = name
    return aliases


def _config_from_dict(values: dict) -> PretrainedConfig:
    values = copy.deepcopy(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)
