"""How a prompt becomes token ids, in one place for both jobs: the teacher's generation and the
student's training must format a prompt identically, or the student learns replies to a prompt it
will never see at inference."""

from __future__ import annotations

from workbook.jsonl import DataError


def prompt_token_ids(tokenizer, prompts: list[str], *, use_chat_template: bool,
                     system_prompt: str = "") -> list[list[int]]:
    """Token ids of each prompt, formatted as the teacher's generation and the student's training
    both format it: one user turn of the chat template (with the generation prompt), or plain text
    with the special tokens the tokenizer adds (e.g. BOS). A ``system_prompt`` goes first, as the
    template's system turn or, in plain text, as its own paragraph."""
    if not use_chat_template:
        texts = [f"{system_prompt}\n\n{prompt}" if system_prompt else prompt for prompt in prompts]
        return [list(ids) for ids in tokenizer(texts)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"use_chat_template is true but the tokenizer ({tokenizer.name_or_path}) has no chat "
                        "template; set use_chat_template: false (plain prompts, e.g. for a base model) or use an "
                        "instruct model's tokenizer.")
    texts = [chat_prompt_text(tokenizer, prompt, system_prompt) for prompt in prompts]
    # The rendered template already holds BOS and the other special tokens.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def chat_messages(prompt: str, system_prompt: str = "") -> list[dict]:
    """The conversation a prompt is: its system turn (if any), then the prompt as the user's turn."""
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]


def chat_prompt_text(tokenizer, prompt: str, system_prompt: str = "") -> str:
    """The prompt rendered by the chat template, ending with the generation prompt the reply follows."""
    return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True)
