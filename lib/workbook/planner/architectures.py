"""What differs between the decoder families the planner models, read once from the config and the
meta-device model: the one place that knows Qwen from Gemma from DeepSeek.

The formulas (``formulas``, ``training``, ``generation``) read these facts and never a model_type:
- the KV cache width (DeepSeek's compressed latent instead of full keys and values) and that latent
  attention's head dims (queries and keys wider than values);
- mixture-of-experts layers (routed experts per token, shared experts, router);
- per-head q/k norms (Qwen3, Gemma-3), norms per layer (Gemma: 4), fused q/k/v (Phi-3);
- the attention implementation the model really runs (Gemma-2 refuses sdpa: eager);
- logit soft-capping in the loss path (Gemma-2).
Architectures the planner does not model are refused here, naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# Families with no per-layer key/value cache of the kind the formulas count, by model_type prefix.
STATE_SPACE_TYPES = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "rwkv", "recurrent_gemma",
                     "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "nemotron_h", "qwen3_next", "xlstm")
# Rotary embedding written with torch.cat into a new (batch, heads, tokens, head_dim) tensor: attention's
# output is then laid out head-major, and its transpose for o_proj is a real copy (Phi-3's partial rotary).
ROTARY_BY_CONCATENATION_TYPES = ("phi3",)
# RMSNorm scaled by (1 + weight) in fp32 before the cast back (Gemma's): the normalized value it saves is fp32.
FP32_SCALED_NORM_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class MixtureOfExperts:
    """The routed feed-forward of a mixture-of-experts layer (Mixtral, Qwen2/3-MoE, DeepSeek)."""

    num_experts: int
    experts_per_token: int  # top-k
    expert_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together; 0 = none
    shared_expert_gate: bool  # Qwen2-MoE scales the shared expert by sigmoid(Linear(h -> 1))
    normalizes_top_k: bool  # the top-k weights are divided by their sum (one more saved tensor)
    expert_parameters: int  # all layers: the 3-D expert tensors, which bitsandbytes leaves unquantized


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): keys and values expanded from one compressed latent."""

    q_lora_rank: int | None  # the query's low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj); None: q_proj
    kv_lora_rank: int  # the latent kv_a_layernorm normalizes and kv_b_proj expands
    qk_nope_head_dim: int  # per-head query/key features without rotary
    qk_rope_head_dim: int  # rotary features: per head in the query, one shared head in the key
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Architecture:
    """Per-family facts the formulas need; the Llama values are the defaults."""

    kv_cache_values_per_token_per_layer: int  # keys + values (or latents) one token adds to one layer
    kv_cache_explanation: str
    moe: MixtureOfExperts | None = None
    moe_layers: int = 0  # decoder layers whose MLP is the routed experts; the rest are dense
    per_head_qk_norm: bool = False
    fused_qkv: bool = False
    rotary_by_concatenation: bool = False
    norms_per_layer: int = 2
    norm_scales_in_fp32: bool = False  # Gemma: (x * (1 + w)).to(dtype), where Llama does w * x.to(dtype)
    latent_attention: LatentAttention | None = None  # DeepSeek MLA
    final_logit_softcapping: float | None = None
    attention_logit_softcapping: float | None = None  # Gemma-2: eager saves tanh(scores / cap)
    sdpa_supported: bool = True


def refuse_unsupported(config: PretrainedConfig, source: str) -> None:
    """ValueError naming what the planner lacks for state-space, encoder-decoder and vision-language models."""
    model_type = getattr(config, "model_type", "") or ""
    if model_type in STATE_SPACE_TYPES or getattr(config, "ssm_cfg", None) or hasattr(config, "state_size"):
        raise ValueError(f"{source}: {model_type!r} is a state-space (or hybrid) model: the memory planner models "
                         "attention layers with a key/value cache, not recurrent state; plan it by measurement "
                         "(workbook calibrate) instead")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{source}: {model_type!r} is an encoder-decoder model: the memory planner models "
                         "decoder-only causal LMs (no encoder, no cross-attention cache)")
    if getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None:
        raise ValueError(f"{source}: {model_type!r} is a vision/audio-language model: the memory planner models the "
                         "text decoder only (no image or audio encoder, no image tokens); point it at the text "
                         "model's own config (e.g. model_type 'gemma3_text') to plan the decoder alone")


def describe(config: PretrainedConfig, meta_model: torch.nn.Module, layers: torch.nn.ModuleList) -> Architecture:
    """The facts of ``config``'s architecture, read from the config and the meta-device model."""
    text = config.get_text_config(decoder=True)
    attention = getattr(layers[0], "self_attn", None)
    moe_blocks = [block for block in (_experts_block(layer) for layer in layers) if block is not None]
    sdpa = getattr(type(meta_model), "_supports_sdpa", True)
    return Architecture(
        **_kv_cache(text),
        moe=_mixture_of_experts(text, moe_blocks) if moe_blocks else None,
        moe_layers=len(moe_blocks),
        per_head_qk_norm=hasattr(attention, "q_norm") and attention.q_norm is not None,
        fused_qkv=hasattr(attention, "qkv_proj"),
        rotary_by_concatenation=text.model_type in ROTARY_BY_CONCATENATION_TYPES,
        norms_per_layer=sum(1 for name, _ in layers[0].named_children() if name.endswith("layernorm")),
        norm_scales_in_fp32=text.model_type in FP32_SCALED_NORM_TYPES,
        latent_attention=_latent_attention(text),
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        attention_logit_softcapping=getattr(text, "attn_logit_softcapping", None),
        sdpa_supported=bool(sdpa),
    )


def attention_implementation_run(sdpa_supported: bool, requested: str) -> str:
    """The attention the model really runs: transformers loads a model that refuses sdpa (Gemma-2:
    its soft-capping) with eager when none is named, and refuses sdpa when it is named; the planner,
    the trainer and the finder all ask for this one (``models.load_model`` passes it)."""
    if requested in ("sdpa", SDPA_BLOCK_MASK, DOCUMENT_SDPA, FLEX_ATTENTION) and not sdpa_supported:
        return "eager"
    return requested


# Attention paths of packed training rows (training/packed_attention.py), beside the profile's choices:
DOCUMENT_SDPA = "document_sdpa"  # sdpa with is_causal over each packed example's span: no mask (CPU)
FLEX_ATTENTION = "flex_attention"  # transformers' BlockMask from the packed position ids: O(seq) (CUDA)
SDPA_BLOCK_MASK = "sdpa_block_mask"  # the fallback: sdpa given the block-causal 4D mask masking_utils builds
PACKED_ATTENTIONS = (DOCUMENT_SDPA, FLEX_ATTENTION, SDPA_BLOCK_MASK)
# sdpa on CPU when values are narrower than queries and keys (DeepSeek's MLA): torch's CPU flash kernel needs
# equal head dims, so its math kernel runs and saves the probabilities, as eager does. (On a GPU the
# memory-efficient kernel takes unequal head dims.)
SDPA_MATH = "sdpa_math"
TRAINING_ATTENTIONS = PACKED_ATTENTIONS + (SDPA_MATH,)  # what training plans, beside the profile's choices


def packed_attention(sdpa_supported: bool, windowed: bool, requested: str, *, on_gpu: bool) -> str:
    """The attention packed rows run with: no seq x seq mask where possible.

    sdpa becomes flex attention on a GPU (torch has no flex backward on CPU) and ``document_sdpa`` on CPU;
    flash-attention-2 already unpacks the rows (``batches.Collator(flatten=True)``). A sliding window
    shorter than the rows, or a model that runs eager (Gemma-2's soft-capping), keeps the model's own mask
    path: for sdpa the 4D block-causal mask (``SDPA_BLOCK_MASK``, planned with its mask and K/V copies)."""
    run = attention_implementation_run(sdpa_supported, requested)
    if run != "sdpa":
        return run
    if windowed:
        return SDPA_BLOCK_MASK
    return FLEX_ATTENTION if on_gpu else DOCUMENT_SDPA


def training_attention(shape, requested: str, padding: str, seq_len: int, *, on_gpu: bool) -> str:
    """The attention a training run of ``shape`` (a ModelShape) runs with: ``packed_attention`` for packed rows
    of ``seq_len`` tokens, else the requested one as the model runs it (``SDPA_MATH`` for MLA's sdpa on CPU)."""
    if padding != "packing":
        run = attention_implementation_run(shape.architecture.sdpa_supported, requested)
        latent = shape.architecture.latent_attention
        unequal_head_dims = latent is not None and latent.v_head_dim != latent.qk_head_dim
        return SDPA_MATH if run == "sdpa" and unequal_head_dims and not on_gpu else run
    windowed = any(window is not None and window < seq_len for window in shape.attention_windows)
    return packed_attention(shape.architecture.sdpa_supported, windowed, requested, on_gpu=on_gpu)


def model_attention(implementation: str) -> str:
    """The attn_implementation to load a model with for a planned path (the fallback and the math kernel: sdpa)."""
    return "sdpa" if implementation in (SDPA_BLOCK_MASK, SDPA_MATH) else implementation


def training_notes(architecture: Architecture) -> list[str]:
    """What a training plan of this architecture tells the user about it."""
    notes = []
    if architecture.moe is not None:
        notes.append(f"mixture of experts: {architecture.moe.experts_per_token} of {architecture.moe.num_experts} "
                     "experts per token; grouped_mm experts run in the weights' dtype (fp32 master weights "
                     "under autocast)")
    return notes


def _kv_cache(text: PretrainedConfig) -> dict:
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    if kv_lora_rank is not None:
        # transformers 5.x DeepseekV2/V3Attention calls past_key_values.update(kv_nope, k_rot): the cache
        # holds the normalized latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim), one
        # "head" each; the per-head keys and values are expanded from it at every step (a transient).
        rope = text.qk_rope_head_dim
        return {"kv_cache_values_per_token_per_layer": kv_lora_rank + rope,
                "kv_cache_explanation": f"compressed latent (kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {rope})"}
    heads = text.num_attention_heads
    key_value_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"kv_cache_values_per_token_per_layer": 2 * key_value_heads * head_dim,
            "kv_cache_explanation": "2 x kv_heads x head_dim"}


def _latent_attention(text: PretrainedConfig) -> LatentAttention | None:
    if getattr(text, "kv_lora_rank", None) is None:
        return None
    return LatentAttention(q_lora_rank=getattr(text, "q_lora_rank", None), kv_lora_rank=text.kv_lora_rank,
                           qk_nope_head_dim=text.qk_nope_head_dim, qk_rope_head_dim=text.qk_rope_head_dim,
                           v_head_dim=text.v_head_dim)


def _experts_block(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's MoE block (transformers 5.x keeps experts as 3-D tensors in ``mlp.experts``)."""
    block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    experts = getattr(block, "experts", None)
    return block if experts is not None and hasattr(experts, "down_proj") else None


def _mixture_of_experts(text: PretrainedConfig, blocks: list[torch.nn.Module]) -> MixtureOfExperts:
    block = blocks[0]
    experts = block.experts
    down = experts.down_proj  # (experts, hidden, intermediate), or transposed
    hidden = text.hidden_size
    intermediate = down.shape[2] if down.shape[1] == hidden else down.shape[1]
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(block.gate, "top_k", 1)
    return MixtureOfExperts(
        num_experts=down.shape[0],
        experts_per_token=top_k,
        expert_intermediate_size=intermediate,
        shared_intermediate_size=shared.down_proj.in_features if shared is not None else 0,
        shared_expert_gate=getattr(block, "shared_expert_gate", None) is not None,
        # Mixtral always renormalizes; Qwen and DeepSeek say so in norm_topk_prob.
        normalizes_top_k=getattr(text, "norm_topk_prob", text.model_type == "mixtral"),
        expert_parameters=sum(p.numel() for block in blocks for p in block.experts.parameters()),
    )
