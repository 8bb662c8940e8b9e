"""How a prompt becomes token ids, in one place for both jobs: the teacher's generation and the
student's training must format a prompt identically, or the student learns replies to a prompt it
will never see at inference."""

from __future__ import annotations

from workbook.jsonl import DataError


def prompt_token_ids(tokenizer, prompts: list[str], *, use_chat_template: bool,
                     system_prompt: str = "", on_no_system_role: str = "fail") -> list[list[int]]:
    """Token ids of each prompt, formatted as the teacher's generation and the student's training
    both format it: one user turn of the chat template (with the generation prompt), or plain text
    with the special tokens the tokenizer adds (e.g. BOS). A ``system_prompt`` goes first, as the
    template's system turn or, in plain text, as its own paragraph. A template that refuses a system
    turn (Gemma's) stops with a DataError, or with ``on_no_system_role: fold`` gets the system prompt
    as the first paragraph of the user's turn."""
    if not use_chat_template:
        texts = [f"{system_prompt}\n\n{prompt}" if system_prompt else prompt for prompt in prompts]
        return [list(ids) for ids in tokenizer(texts)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"use_chat_template is true but the tokenizer ({tokenizer.name_or_path}) has no chat "
                        "template; set use_chat_template: false (plain prompts, e.g. for a base model) or use an "
                        "instruct model's tokenizer.")
    fold = system_prompt and not accepts_system_role(tokenizer, on_no_system_role)
    texts = [chat_prompt_text(tokenizer, f"{system_prompt}\n\n{prompt}") if fold
             else chat_prompt_text(tokenizer, prompt, system_prompt) for prompt in prompts]
    # The rendered template already holds BOS and the other special tokens.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


ON_NO_SYSTEM_ROLE = ("fail", "fold")  # the params key's choices


def accepts_system_role(tokenizer, on_no_system_role: str = "fail") -> bool:
    """True when the chat template renders a system turn. When it raises instead (Gemma's "System role
    not supported"), False for ``on_no_system_role: fold``, else a DataError saying the two ways out."""
    from jinja2.exceptions import TemplateError  # transformers renders templates with jinja2

    try:
        chat_prompt_text(tokenizer, "user text", "system text")
        return True
    except TemplateError as error:
        if on_no_system_role == "fold":
            return False
        raise DataError(f"the chat template of {tokenizer.name_or_path} refuses a system turn ({error}), and "
                        "system_prompt is set; set on_no_system_role: fold to put the system prompt at the start of "
                        "the user's turn, or system_prompt: '' for none") from None


def chat_messages(prompt: str, system_prompt: str = "") -> list[dict]:
    """The conversation a prompt is: its system turn (if any), then the prompt as the user's turn."""
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]


def chat_prompt_text(tokenizer, prompt: str, system_prompt: str = "") -> str:
    """The prompt rendered by the chat template, ending with the generation prompt the reply follows."""
    return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True)
