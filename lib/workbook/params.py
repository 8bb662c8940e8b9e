"""Parameter files (`params/<profile>.yaml`): the schema, loading, validation and overrides.

A profile file holds the hardware facts the workbook needs and the run settings. Every key is
declared once in `SCHEMA` (type, allowed range, one-line meaning); files, `--set key=value`
overrides and notebook parameters all go through `validate_value`, so a typo or a wrong type is
caught with the file, line and key named, instead of silently doing nothing (papermill only warns
about a parameter that no notebook declares).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workbook.paths import PARAMS_DIR

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

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        text = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[self.kind]
        if self.minimum is not None:
            text += f" >= {self.minimum:g}"
        if self.maximum is not None:
            text += f" and <= {self.maximum:g}"
        return text + (" or 'auto'" if self.auto else "")


# Every key a profile file must hold. Adding a key: declare it here, add it to every
# params/*.yaml, and declare it in the parameters cell of the notebook that consumes it.
SCHEMA: dict[str, Key] = {k.name: k for k in (
    # Hardware facts.
    Key("profile", str, "profile name; equals the file name without .yaml"),
    Key("gpu_name_pattern", str, "regular expression matched against the detected GPU name ('' for cpu)"),
    Key("gpu_count", int, "GPUs the profile expects (0 for cpu)", minimum=0),
    Key("gpu_memory_gib", float, "memory per GPU in GiB as the driver reports it", minimum=0),
    Key("peak_bf16_tflops", float, "dense bf16 tensor-core peak per GPU, TFLOP/s (0: none)", minimum=0),
    Key("peak_fp16_tflops", float, "dense fp16 tensor-core peak per GPU, TFLOP/s (0: none)", minimum=0),
    Key("memory_bandwidth_gbs", float, "peak memory bandwidth per GPU, GB/s (1e9 bytes/s)", minimum=0),
    Key("supports_bf16", bool, "whether the GPU computes in bfloat16"),
    Key("supports_tf32", bool, "whether the GPU has TF32 tensor cores"),
    Key("usd_per_gpu_hour", float, "rental price per GPU-hour in US dollars, for cost estimates", minimum=0),
    # Run settings.
    Key("model", str, "'tiny' (built locally) or a local Hugging Face model directory"),
    Key("dtype", str, "dtype the model runs in", choices=DTYPES),
    Key("interactive", bool, "show ipywidgets controls (JupyterLab); false draws static figures (papermill)"),
    # Memory planning (notebook 01) and the batch sizes the later notebooks run with.
    Key("plan_mode", str, "what notebook 01 plans first", choices=PLAN_MODES),
    Key("batch_size", int, "generation batch size (sequences per GPU)", minimum=1, auto=True),
    Key("micro_batch_size", int, "training micro-batch per GPU", minimum=1, auto=True),
    Key("prompt_len", int, "prompt tokens per sequence the generation plan assumes", minimum=1),
    Key("max_new_tokens", int, "new tokens generated per sequence", minimum=1),
    Key("seq_len", int, "training sequence length in tokens", minimum=1),
    Key("grad_checkpointing", bool, "recompute activations in backward: less memory, ~30% more compute"),
    Key("lora_rank", int, "LoRA rank; 0 trains every weight", minimum=0),
    Key("safety_margin", float, "fraction of GPU memory the planner keeps free", minimum=0, maximum=0.5),
    Key("cuda_overhead_gib", float, "CUDA context + library workspaces per GPU, GiB (measured or prior)",
        minimum=0),
)}


class Params(dict):
    """Validated parameters: a dict that also allows `params.gpu_count`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def validate_value(key: str, value: Any, where: str) -> Any:
    """Check one value against the schema and return it normalized (ints accepted as floats).

    `where` names the source for the error message: a file and line, `--set`, or a notebook.
    """
    if key not in SCHEMA:
        close = difflib.get_close_matches(key, SCHEMA, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ParamsError(f"{where}: unknown parameter '{key}'.{hint} Known parameters: {', '.join(SCHEMA)}.")
    spec = SCHEMA[key]
    if spec.auto and value == AUTO:
        return value
    # bool is a subclass of int in Python; `batch_size: true` must not pass as 1.
    ok = isinstance(value, spec.kind) and not (spec.kind in (int, float) and isinstance(value, bool))
    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if ok and spec.choices and value not in spec.choices:
        ok = False
    if ok and spec.minimum is not None and value < spec.minimum:
        ok = False
    if ok and spec.maximum is not None and value > spec.maximum:
        ok = False
    if not ok:
        raise ParamsError(f"{where}: '{key}' is {value!r}; expected {spec.expected()} ({spec.meaning}).")
    return value


def _check_consistency(params: dict, where: str) -> None:
    """Rules that involve more than one key."""
    if params["dtype"] == "bf16" and params["gpu_count"] > 0 and not params["supports_bf16"]:
        raise ParamsError(f"{where}: 'dtype' is 'bf16' but this profile says supports_bf16: false. "
                          "Use dtype: fp16 (or fp32) on this GPU.")
    try:
        re.compile(params["gpu_name_pattern"])
    except re.error as error:
        raise ParamsError(f"{where}: 'gpu_name_pattern' is not a valid regular expression: {error}") from None


def _read_yaml_mapping(path: Path) -> tuple[dict, dict[str, int]]:
    """Read a YAML mapping safely; also return each top-level key's line number (1-based)."""
    text = path.read_text()
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
    return data, lines


def load(path: str | Path) -> Params:
    """Load and validate one profile file. Every schema key must be present, no other key may be."""
    path = Path(path)
    if not path.is_file():
        available = ", ".join(profile_names()) or "none"
        raise ParamsError(f"{path}: no such parameter file. Profiles in {PARAMS_DIR}: {available}.")
    data, lines = _read_yaml_mapping(path)
    params = Params()
    for key, value in data.items():
        params[key] = validate_value(str(key), value, f"{path}:{lines.get(key, '?')}")
    missing = [key for key in SCHEMA if key not in params]
    if missing:
        raise ParamsError(f"{path}: missing parameter(s) {', '.join(missing)}. "
                          + " ".join(f"'{k}': {SCHEMA[k].meaning}." for k in missing))
    if params["profile"] != path.stem:
        raise ParamsError(f"{path}:{lines['profile']}: 'profile' is {params['profile']!r} but the file "
                          f"is {path.name}; they must agree.")
    _check_consistency(params, str(path))
    return params


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ['batch_size=8', 'dtype=bf16'] into validated values; YAML rules type each value."""
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
        overrides[key.strip()] = validate_value(key.strip(), value, f"--set {pair}")
    return overrides


def apply_overrides(params: Params, overrides: dict[str, Any]) -> Params:
    """A copy of `params` with overrides applied and cross-key rules checked again."""
    merged = Params(params)
    merged.update(overrides)
    _check_consistency(merged, "--set " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    return merged


def profile_names() -> list[str]:
    return sorted(p.stem for p in PARAMS_DIR.glob("*.yaml"))


def profile_path(name_or_path: str) -> Path:
    """'h200' or 'params/h200.yaml' -> the file's path (not checked for existence here)."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        return candidate
    return PARAMS_DIR / f"{name_or_path}.yaml"


def load_all() -> dict[str, Params]:
    """Every profile in params/, validated."""
    return {name: load(PARAMS_DIR / f"{name}.yaml") for name in profile_names()}
