"""Token-level facts of a loaded model and its tokenizer, and the plain greedy decode that accuracy
checks use: the end-of-sequence ids, the pad id, the context length, left padding.

They sit below ``models`` (loading) and ``tiny_model`` (the local model's recipe), which both use
them; the generation job has its own engine (``workbook.generation.engine``)."""

from __future__ import annotations

import torch


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
