"""The tiny default model: a small Llama trained on CPU in under a minute, built locally, cached.

The ``cpu`` profile and the tests use it instead of a downloaded model. It is saved in Hugging Face
format, so it loads like any user's model::

    path = ensure_tiny_model()            # builds once (~45 s on 2 CPU cores), then cached
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

It is trained on the arithmetic task (``workbook.arithmetic``): given "What is 23 + 45?" it writes
" 68" and then end of text, so notebooks can report a real accuracy on the shipped sample prompts,
which are held out from training. It is trained on each problem both as a chat and as plain text,
so prompts work with or without the template.

Real in everything but size, so that what the checkpoints users bring do is tested here too: a
byte-level BPE tokenizer (trained locally on the task's text, nothing downloaded) with Llama 3's
special tokens, a chat template with role headers, two end ids in the generation config (end of
text, end of turn: generation stops at either) and no pad token.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from workbook import arithmetic, decoding, prompt_format
from workbook.paths import MODELS_DIR

TINY_MODEL_NAME = "tiny"  # what users write as `model: tiny` in a params file
RECIPE_VERSION = 3  # bump when the build changes in a way the hashed values below do not show
DEFAULT_CACHE_ROOT = MODELS_DIR  # git-ignored
BUILD_INFO_FILE = "workbook_tiny.json"  # written last: its presence marks a complete build

# Tokenizer: byte-level BPE trained here on the task's own text, with Llama 3's special tokens and no
# pad token (the checkpoints users bring have none either: padding uses an end id, see decoding).
# Special tokens first, so their ids are 0..4.
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
BOS_ID, EOS_ID, START_HEADER_ID, END_HEADER_ID, EOT_ID = range(len(SPECIAL_TOKENS))
END_IDS = (EOS_ID, EOT_ID)  # a generation stops at either: end of text (plain) or end of turn (chat)
# Llama 3's pre-tokenizer split, except that numbers split into single digits (as Qwen's do): the
# tiny model learns to add digit by digit, not 200 number tokens.
PRE_TOKENIZER_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's chat template, shortened: each turn is a role header, a blank line, the trimmed content
# and <|eot_id|>; the generation prompt is the assistant's header. The reply's tokens are the
# content and <|eot_id|>; the headers carry no loss (training.examples).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant")

# Architecture: Llama with grouped-query attention (4 query heads share 2 key/value heads).
ARCHITECTURE = {
    # The embedding rounds the tokenizer's ~290 ids up, as real checkpoints do (Qwen: 151,936 rows
    # for 151,665 tokens); the BPE training stops at this size.
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 352,  # ~2.75 x hidden, as in Llama's SwiGLU sizing
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    # Weight init std. With Llama's 0.02, held-out accuracy jumped only after ~1,500 steps;
    # with 0.06 (measured) it jumps after ~700, leaving margin within the step budget.
    "initializer_range": 0.06,
}

# Training: about 40 s on 2 CPU cores. On CPU an example costs the same at any batch size, so
# small batches buy more updates: for 64k examples, batch 128 reached 52% held-out accuracy,
# batch 64 88%, batch 32 96% (with init 0.02; see initializer_range). Since recipe 3 each problem is
# seen as a chat and as plain text, so the same 1,500 steps see each form half as often: 89% held out
# in either form (measured); more steps are the lever if that matters more than the build's minute.
TRAINING = {
    "seed": 0,  # weight init and data order
    "steps": 1500,
    "batch_size": 32,  # examples per step
    "learning_rate": 1e-3,  # peak, after a linear warmup; 2e-3 generalized later (79% vs 96%)
    "adam_betas": (0.9, 0.95),  # beta2 0.95, as usual for short transformer runs
    "warmup_steps": 30,
    "final_learning_rate_fraction": 0.1,  # cosine decay ends at this fraction of the peak
    "weight_decay": 0.0,
}
MAX_THREADS = 8  # torch threads for the build; more do not speed up matrices this small
EVAL_BATCH_SIZE = 100  # prompts per greedy generate() call when measuring held-out accuracy
MAX_NEW_TOKENS = 6  # " ", "1", "9", "8" (a token each) plus end of text, with room for one stray token
PROGRESS_SECONDS = 5.0  # a training progress line at most this often: the build is a minute of waiting


def _progress(message: str) -> None:
    """One line of build progress on stderr (stdout stays the caller's: JSON, tables)."""
    print(f"tiny model: {message}", file=sys.stderr, flush=True)


def tiny_config() -> LlamaConfig:
    """The tiny model's architecture. Needs no weights: the memory planner counts from it."""
    return LlamaConfig(**ARCHITECTURE, bos_token_id=BOS_ID, eos_token_id=list(END_IDS), pad_token_id=None)


def tokenizer_corpus() -> list[str]:
    """The text the BPE is trained on: every problem in every question style with its answer, and
    the chat template's role names. Fixed by the task, so the same merges come out every time."""
    texts = [arithmetic.question_text(problem.left, problem.right, style)
             + arithmetic.completion_text(arithmetic.answer_text(problem.answer))
             for problem in arithmetic.all_problems() for style in arithmetic.QUESTION_STYLES]
    return texts + [f"{role}\n\n" for role in ROLES]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes; decoding restores it exactly) trained on
    ``tokenizer_corpus()``, with Llama 3's special tokens, its <|begin_of_text|> prepended to plain
    text, the chat template above, and no pad token. Under a second on one core."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=ARCHITECTURE["vocab_size"], special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer)
    # Plain text starts with <|begin_of_text|> like Llama 3's; chat templates write it themselves and are
    # tokenized without special tokens.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A", pair=f"{SPECIAL_TOKENS[BOS_ID]} $A {SPECIAL_TOKENS[BOS_ID]} $B",
        special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],  # plain formatting ends a response with it; chat with <|eot_id|>
        additional_special_tokens=[SPECIAL_TOKENS[START_HEADER_ID], SPECIAL_TOKENS[END_HEADER_ID],
                                   SPECIAL_TOKENS[EOT_ID]],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep spaces exactly as generated
        model_max_length=ARCHITECTURE["max_position_embeddings"],
    )


def recipe_hash() -> str:
    """8 hex digits identifying the recipe; the cache directory name includes it."""
    recipe = {
        "version": RECIPE_VERSION,
        "architecture": ARCHITECTURE,
        "training": TRAINING,
        "special_tokens": SPECIAL_TOKENS,
        "pre_tokenizer_split": PRE_TOKENIZER_SPLIT,
        "tokenizer_corpus": hashlib.sha256("\n".join(tokenizer_corpus()).encode()).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
        # The task: operand range, held-out sample, and how questions and answers are written.
        "operand_max": arithmetic.OPERAND_MAX,
        "held_out": arithmetic.sample_records(),
        "example": arithmetic.question_text(12, 34) + arithmetic.completion_text("46"),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]


def build_tiny_model(path: str | Path) -> Path:
    """Train the tiny model and save model, tokenizer and generation config to ``path``.

    Also writes ``workbook_tiny.json``: recipe version and hash, training steps, build seconds,
    final training loss, held-out accuracy (greedy, on the shipped sample prompts) and the torch
    version. Takes about 45 s on 2 CPU cores; the caller's torch random state and thread count
    are left as they were.
    """
    path = Path(path)
    started = time.perf_counter()
    threads = min(_available_cpus(), MAX_THREADS)
    with _torch_threads(threads), torch.random.fork_rng():
        torch.manual_seed(TRAINING["seed"])
        tokenizer = build_tokenizer()
        model = LlamaForCausalLM(tiny_config())
        final_loss = _train(model, tokenizer, threads)
        train_seconds = time.perf_counter() - started
        # Two end ids, as Llama 3 Instruct's generation config lists them; no pad id.
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=list(END_IDS), do_sample=False)
        records = arithmetic.sample_records()
        _progress(f"measuring held-out accuracy on {len(records)} prompts, chat and plain")
        held_out_accuracy = arithmetic.accuracy(records, greedy_answers(model, tokenizer, records))
        plain_accuracy = arithmetic.accuracy(records, greedy_answers(model, tokenizer, records,
                                                                     use_chat_template=False))
    _progress(f"saving to {path}")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    info = {
        "name": TINY_MODEL_NAME,
        "recipe_version": RECIPE_VERSION,
        "recipe_hash": recipe_hash(),
        "task": arithmetic.DOMAIN,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "training_steps": TRAINING["steps"],
        "training_examples_seen": TRAINING["steps"] * TRAINING["batch_size"],
        "threads": threads,
        "train_seconds": round(train_seconds, 2),
        "build_seconds": round(time.perf_counter() - started, 2),
        "final_loss": round(final_loss, 4),
        "held_out_accuracy": held_out_accuracy,  # chat template, the default
        "held_out_accuracy_plain": plain_accuracy,  # use_chat_template: false
        "held_out_prompts": len(records),
        "torch_version": torch.__version__,
    }
    (path / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    _progress(f"built in {info['build_seconds']:.0f} s: held-out accuracy {held_out_accuracy:.0%}, "
              f"final loss {info['final_loss']}")
    return path


def _train(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, threads: int) -> float:
    """Train on every non-held-out problem; returns the mean loss over the last 20 steps."""
    _progress("tokenizing the training problems")
    input_ids, labels = _training_tensors(tokenizer)
    steps = TRAINING["steps"]
    _progress(f"training {steps} steps of {TRAINING['batch_size']} examples on {threads} CPU thread(s) "
              f"({len(input_ids):,} problems)")
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=TRAINING["learning_rate"],
        betas=TRAINING["adam_betas"],
        weight_decay=TRAINING["weight_decay"],
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _learning_rate_factor)
    generator = torch.Generator().manual_seed(TRAINING["seed"])
    order = torch.randperm(len(input_ids), generator=generator)
    cursor = 0
    recent_losses = collections.deque(maxlen=20)
    began = last_report = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        if cursor + TRAINING["batch_size"] > len(order):  # next epoch, new shuffle
            order = torch.randperm(len(input_ids), generator=generator)
            cursor = 0
        batch = order[cursor : cursor + TRAINING["batch_size"]]
        cursor += TRAINING["batch_size"]
        # Right padding needs no attention mask: causal attention never looks at later positions.
        loss = model(input_ids=input_ids[batch], labels=labels[batch]).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent_losses.append(loss.item())
        now = time.perf_counter()
        if now - last_report >= PROGRESS_SECONDS and step < steps:
            last_report = now
            left = (now - began) / step * (steps - step)
            _progress(f"step {step}/{steps}, loss {sum(recent_losses) / len(recent_losses):.3f}, "
                      f"{now - began:.0f} s so far, about {left:.0f} s left")
    model.eval()
    return sum(recent_losses) / len(recent_losses)


def _training_tensors(tokenizer: PreTrainedTokenizerFast) -> tuple[torch.Tensor, torch.Tensor]:
    """Every problem twice, right-padded: as a chat (role headers, reply "68<|eot_id|>") and as plain
    text ("<|begin_of_text|>What is 23 + 45? 68<|end_of_text|>"), so the model answers with or without
    the template (use_chat_template). Labels count only the reply and its end token."""
    problems = arithmetic.training_problems()
    questions = [problem.question for problem in problems]
    answers = [arithmetic.answer_text(problem.answer) for problem in problems]
    prompts = (prompt_format.prompt_token_ids(tokenizer, questions, use_chat_template=True)
               + prompt_format.prompt_token_ids(tokenizer, questions, use_chat_template=False))
    replies = ([ids + [EOT_ID] for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
               + [ids + [EOS_ID] for ids in tokenizer([arithmetic.completion_text(answer) for answer in answers],
                                                      add_special_tokens=False)["input_ids"]])
    length = max(len(prompt) + len(reply) for prompt, reply in zip(prompts, replies))
    # Padding positions carry no loss and come after the sequence, so any id serves.
    input_ids = torch.full((len(prompts), length), EOS_ID, dtype=torch.long)
    labels = torch.full((len(prompts), length), -100, dtype=torch.long)  # -100: no loss
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        sequence = prompt + reply
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(reply)
    return input_ids, labels


def _learning_rate_factor(step: int) -> float:
    """Linear warmup to the peak, then cosine decay to ``final_learning_rate_fraction``."""
    warmup, steps = TRAINING["warmup_steps"], TRAINING["steps"]
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    floor = TRAINING["final_learning_rate_fraction"]
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def greedy_answers(model, tokenizer, records: list[dict], use_chat_template: bool = True) -> list[str]:
    """The model's greedy continuation of each record's ``input`` (a chat's user turn, or plain text),
    special tokens removed."""
    prompts = prompt_format.prompt_token_ids(tokenizer, [record["input"] for record in records],
                                             use_chat_template=use_chat_template)
    return decoding.greedy_completions(model, tokenizer, prompts, MAX_NEW_TOKENS, batch_size=EVAL_BATCH_SIZE)


def ensure_tiny_model(cache_root: str | Path | None = None) -> Path:
    """The cached tiny model directory, built first if missing (about 45 s on 2 CPU cores).

    ``cache_root`` defaults to ``<repo>/outputs/models``. The directory is ``tiny-<recipe hash>``,
    so a changed recipe builds a new one. The build happens in a temporary sibling directory that
    is renamed into place, so no process ever sees a half-written model. One process builds while the
    others wait on a lock on the cache folder (flock: the kernel releases it if the builder is killed) and then
    use its model: ten processes starting at once on 2 cores would otherwise each build their own,
    ten times slower.
    """
    cache_root = Path(cache_root) if cache_root is not None else DEFAULT_CACHE_ROOT
    final = cache_root / f"{TINY_MODEL_NAME}-{recipe_hash()}"
    if final.exists():
        return _check_complete(final)
    cache_root.mkdir(parents=True, exist_ok=True)
    lock = os.open(cache_root, os.O_RDONLY)  # the cache folder itself: no lock file left behind
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():  # built by the process that held the lock
            return _check_complete(final)
        return _build_into(final, cache_root)
    finally:
        os.close(lock)  # closing releases the lock


def _build_into(final: Path, cache_root: Path) -> Path:
    """Build the model in a private staging folder and rename it to ``final``."""
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=cache_root))
    _progress(f"not built yet: building {final} once (about a minute on 2 CPU cores; later runs reuse it)")
    try:
        build_tiny_model(staging)
    except BaseException:  # Ctrl-C included: never leave a half-written model behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # mkdtemp and safetensors make private files; make the cache readable like any model.
    staging.chmod(0o755)
    for file in staging.iterdir():
        file.chmod(0o644)
    try:
        os.rename(staging, final)  # atomic on one file system
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not final.exists():
            raise
        # Another process finished first: use its model.
    return _check_complete(final)


def _check_complete(directory: Path) -> Path:
    if not (directory / BUILD_INFO_FILE).is_file():
        raise RuntimeError(
            f"the tiny model cache {directory} is incomplete (no {BUILD_INFO_FILE}); "
            "delete that directory and the model will be rebuilt"
        )
    return directory


def resolve_model_path(model: str) -> str:
    """Where to load ``model`` from: "tiny" builds or reuses the tiny model; a local directory is
    returned as is. Nothing is ever downloaded."""
    if model == TINY_MODEL_NAME:
        return str(ensure_tiny_model())
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    raise ValueError(
        f"model {model!r} is not {TINY_MODEL_NAME!r} and not an existing local directory; "
        "the workbook downloads nothing. Point `model` at a local Hugging Face model directory "
        f"(with config.json and the weights) or use `model: {TINY_MODEL_NAME}`."
    )


def _available_cpus() -> int:
    """CPU cores this process may run on (respects affinity masks, e.g. in containers)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def _torch_threads(count: int):
    """Run with ``count`` torch threads, restoring the caller's setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
