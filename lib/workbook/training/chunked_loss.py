"""The next-token loss without every position's logits at once (``loss_chunk_tokens``).

The full loss holds batch x seq x vocab logits (and, in backward, their fp32 log-softmax and its
gradient): for a 128k vocabulary at 8 x 2048 tokens that is the largest single term of a plan.
Here the model runs with its output head fed an empty slice (a forward pre-hook captures the
head's input), and ``ChunkedCrossEntropy`` computes the loss over chunks of N of the positions that
carry loss (none for prompt tokens or padding), keeping only the head's input: backward recomputes
one chunk's logits at a time. torchtune's chunked
cross-entropy and Liger-Kernel's fused linear cross-entropy do the same; Liger's Triton kernel is
used on CUDA when it is installed (``liger_kernel``), this pure-PyTorch path everywhere else.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from workbook.training.examples import IGNORE_INDEX


def loss_sum_chunked(model, input_ids, position_ids, targets, chunk_tokens: int) -> torch.Tensor:
    """Sum of the next-token cross-entropy, in float32, computed ``chunk_tokens`` positions at a time.

    Equal in value and gradient to cross-entropy over the full logits (tests/test_train.py)."""
    head = _output_head(model)
    captured = {}

    def capture(module, args):
        hidden, device_type = args[0], args[0].device.type
        captured["hidden"] = hidden
        # accelerate's autocast covers the model's forward only: note its dtype for the chunks.
        captured["dtype"] = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                             else hidden.dtype)
        # The head computes no logits (the model returns 0 positions) and, fed a detached input,
        # saves nothing for backward.
        return (hidden[..., :0, :].detach(),)

    handle = head.register_forward_pre_hook(capture)
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    hidden = captured["hidden"].flatten(0, -2)
    targets = targets.flatten()
    # Gemma-2 soft-caps its logits (cap x tanh(logits / cap)) after the head: the chunks do the same.
    softcap = getattr(_unwrapped(model).config, "final_logit_softcapping", None) or 0.0
    if hidden.device.type == "cuda" and liger_available() and not softcap:
        return _liger_loss()(head.weight, hidden, targets).float()
    return ChunkedCrossEntropy.apply(hidden, head.weight, targets, chunk_tokens, captured["dtype"], softcap)


def liger_available() -> bool:
    """Whether Liger-Kernel (its fused linear cross-entropy, CUDA/Triton) is installed."""
    return importlib.util.find_spec("liger_kernel") is not None


def loss_description(chunk_tokens: int, device_type: str) -> str:
    """How the loss is computed, for the training report."""
    if chunk_tokens <= 0:
        return "full logits (cross-entropy over every position at once)"
    if device_type == "cuda" and liger_available():
        return "Liger-Kernel fused linear cross-entropy (installed; logits never materialised)"
    return (f"chunked cross-entropy, {chunk_tokens} loss positions per chunk, no logits where no target carries "
            "loss (pure PyTorch"
            + ("; Liger-Kernel is not installed)" if device_type == "cuda" else ")"))


@functools.cache
def _liger_loss():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def _output_head(model) -> torch.nn.Module:
    """The output embedding (lm_head) through DDP / torch.compile / PEFT wrappers."""
    return _unwrapped(model).get_output_embeddings()


def _unwrapped(model) -> torch.nn.Module:
    from accelerate.utils import extract_model_from_parallel
    return extract_model_from_parallel(model)


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over positions of cross_entropy(hidden @ weight.T, targets), one chunk of logits at a time,
    computed only at the positions that carry loss.

    A position whose target is ignored (a prompt token, padding, an example's last token) adds nothing
    to the loss or the gradient, so its logits are never computed: the chunks run over the loss
    positions alone (as TRL's fused LM head does), which saves the head's FLOPs on every prompt token,
    a fifth of a Llama-3.2-1B step's FLOPs per such token. Forward saves only the head's input (in the
    compute dtype: what the head's Linear itself would save, so the plan's activations are unchanged),
    the targets and the loss positions' indices; backward recomputes each chunk's logits in float32 and
    accumulates the input and weight gradients. Matmuls run in ``dtype`` (the autocast dtype the head
    ran under), like the head they replace; its weight copy in that dtype is kept until backward, as
    autocast's own copy would be.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, dtype, softcap=0.0):
        compute_weight = weight.to(dtype)
        compute_hidden = hidden.to(dtype)
        positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # one host sync per step, not per chunk
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for start in range(0, positions.shape[0], chunk_tokens):
            rows = positions[start:start + chunk_tokens]
            logits = _capped(compute_hidden.index_select(0, rows) @ compute_weight.T, softcap)
            total += torch.nn.functional.cross_entropy(logits.float(), targets.index_select(0, rows), reduction="sum")
        ctx.save_for_backward(compute_hidden, compute_weight, targets, positions)
        ctx.chunk_tokens, ctx.hidden_dtype, ctx.weight_dtype = chunk_tokens, hidden.dtype, weight.dtype
        ctx.softcap = softcap
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets, positions = ctx.saved_tensors
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=ctx.hidden_dtype)
        # Summed in the weight's own dtype: fp32 master weights (mixed precision) get an fp32 sum; pure bf16
        # weights a bf16 one, as autograd sums a bf16 head's gradients. An fp32 sum beside a bf16 weight
        # would hold 4 B x vocab x hidden the plan does not (1 GB at Llama-3.2-1B) while every activation lives.
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=ctx.weight_dtype)
        for start in range(0, positions.shape[0], ctx.chunk_tokens):
            rows = positions[start:start + ctx.chunk_tokens]
            h, t = hidden.index_select(0, rows), targets.index_select(0, rows)
            # d(sum of CE)/d(logits) = softmax - one_hot(target): every row here carries loss.
            capped = _capped(h @ weight.T, ctx.softcap).float()
            grad_logits = torch.softmax(capped, dim=-1)
            grad_logits[torch.arange(t.shape[0], device=t.device), t] -= 1
            grad_logits *= grad_total
            if ctx.softcap:  # d(cap tanh(x / cap))/dx = 1 - tanh(x / cap)^2
                grad_logits *= 1 - (capped / ctx.softcap) ** 2
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden.index_copy_(0, rows, (grad_logits @ weight).to(ctx.hidden_dtype))
            grad_weight += grad_logits.T @ h
        return grad_hidden, grad_weight, None, None, None, None


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(logits / softcap) if softcap else logits
