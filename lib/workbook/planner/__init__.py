"""The memory planner: the largest batch that fits on a GPU, and why, read from the model's config.

Everything is in bytes and comes from the architecture alone (no GPU, no weights)::

    config = presets.load_config("llama-3.1-8b")
    plan = plan_generate(config, batch_size=32, prompt_len=512, new_tokens=2048,
                         gpu_memory_bytes=int(140.4 * GiB))
    plan.max_batch_size        # largest batch whose total stays under the budget
    plan.terms                 # weights, KV cache, activations, logits, overhead, each explained
    plan.to_dict()             # the same, for a metrics JSON

A plan is a list of ``Term`` s whose bytes add up to ``total_bytes``, the peak on one GPU. It fits
when ``total_bytes <= capacity_bytes * (1 - safety_margin)``. The formulas start from a Llama-style
decoder: RMSNorm, rotary attention with grouped key/value heads, a SwiGLU MLP and no dropout, run by
transformers 5.x with its default DynamicCache; ``architectures`` says what Mixtral, Qwen-MoE/Qwen3,
Gemma-2/3, Phi-3 and DeepSeek (MLA) do differently, and refuses what it does not model. Every
formula lives in one function, with its source; the activation formulas were checked
tensor by tensor against what autograd saves (tests/test_memory.py).

Conventions, so two readers get the same number:
- dtype names: fp32, bf16, fp16, int8, int4 (float32, bfloat16, float16 are accepted too).
  int8/int4 are weight formats only (bitsandbytes); activations and the KV cache are then bf16.
- "mixed precision" is torch autocast over fp32 master weights (the Hugging Face Trainer's
  ``bf16=True`` on a model loaded in fp32); ``mixed_precision=False`` keeps everything in
  ``dtype`` (a model loaded in bf16 and trained in bf16).
- The training peak is the sum of weights, gradients, optimizer states, activations and the loss
  buffers. In a real step gradients appear while activations are freed, so this is an upper bound
  by at most the gradient bytes; it is the convention of ZeRO (Rajbhandari et al. 2020, sec. 3) and
  Korthikanti et al. 2022, which count the two separately and add them.

Where each part lives:
- ``shape``: the model's sizes (``model_shape``), LoRA's targets and the argument checks;
- ``architectures``: each family's differences from Llama, read from the config in one place;
- ``formulas``: weights, KV cache, LoRA adapters and training activations, one function each;
- ``plans``: ``Term``, ``Plan``, the budget and the largest-batch search;
- ``generation`` / ``training``: ``plan_generate`` and ``plan_train``;
- ``layout``: tensor x data parallel generation (what one GPU of a sharded model holds, which T);
- ``profile``: the same from a params profile ('auto' batch sizes, the per-GPU tables, the text);
- ``finder`` / ``probes``: prove a planned batch by running its worst case on the device;
- ``calibration`` / ``exact_checks``: the planner against measured peaks (GPU) and real tensors (CPU).
"""

from workbook.planner.formulas import (
    kv_cache_bytes, kv_cache_bytes_per_token, lora_parameter_count, training_activation_bytes_per_layer,
    weights_bytes,
)
from workbook.planner.generation import plan_generate
from workbook.planner.plans import (
    DEFAULT_FRAGMENTATION_FRACTION, DEFAULT_OVERHEAD_BYTES, DEFAULT_SAFETY_MARGIN, DoesNotFitError, Plan, Term,
    budget_bytes, max_batch_size,
)
from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, BITS_PER_PARAMETER, DEFAULT_LORA_TARGET_MODULES, OPTIMIZERS, QUANTIZED_DTYPES,
    SHARDINGS, ModelShape, canonical_dtype, model_shape,
)
from workbook.planner.training import plan_train

__all__ = [
    "ATTENTION_IMPLEMENTATIONS", "OPTIMIZERS", "QUANTIZED_DTYPES", "SHARDINGS", "BITS_PER_PARAMETER",
    "DEFAULT_FRAGMENTATION_FRACTION", "DEFAULT_LORA_TARGET_MODULES", "DEFAULT_OVERHEAD_BYTES",
    "DEFAULT_SAFETY_MARGIN", "DoesNotFitError", "ModelShape", "Plan", "Term", "budget_bytes", "canonical_dtype",
    "kv_cache_bytes", "kv_cache_bytes_per_token", "lora_parameter_count", "max_batch_size", "model_shape",
    "plan_generate", "plan_train", "training_activation_bytes_per_layer", "weights_bytes",
]
