"""Batched generation of teacher outputs: JSONL in, JSONL out, fast, resumable, and nothing lost.

The job behind notebook 02 and ``workbook generate``::

    summary = launch(params, run_dir=session.run_dir)          # notebook 02
    workbook generate --params h200 --set prompts_path=data.jsonl output_path=out/teacher.jsonl
    accelerate launch --multi_gpu --num_processes 8 -m workbook.generation --params h100x8 \
        --set output_path=out/teacher.jsonl

What it does, and why each way:

- Prompts are tokenized once and sorted by length, longest first: a batch then holds prompts of
  similar length (little padding), and the batch most likely to run out of memory runs first.
- Left padding, and the generated tokens are sliced at the padded prompt length. (Seed 000 sliced
  each row at its count of non-pad tokens, which under left padding keeps the prompt's tail in the
  response.) Every end-of-sequence id of the model ends a row (Llama 3 instruct has three).
- Out of memory (recognised as accelerate does): the batch is split in halves and retried, down to
  one example; an example that fails alone goes to the failures file with its error and the run
  goes on. Other errors are isolated the same way, but several single examples failing in a row
  with one stop the run: that is a broken setup, not a bad example.
- Each batch's records are appended as whole lines, flushed and fsynced before the next batch; a
  rerun with the same output skips every id already written (``workbook.jsonl`` explains the torn
  last line a kill can leave). At the end the output is rewritten ordered by input position (not
  when it already is, so a rerun needs no room for a second copy; a full disk leaves the parts in
  place, read like the output, and says so).
- One job per output: an exclusive lock on ``<output stem>.lock`` (flock, released by the kernel
  if the job is killed); a second job on the same output stops at once, naming the holder.
- Before any model loads: the output must be writable, hold only this job's records, and those
  made from the same prompts (by id) and settings (``metadata.settings_fingerprint``: model,
  dtype, chat template use, decoding), else one error naming the file, ids and the way out.
- Text that is not valid Unicode is a bad line when read; a record that still cannot be written
  fails alone (stage "write"); a full disk stops the run with what is safe and how to resume.
- Data parallel: N processes, each with the whole model on its own GPU, take every N-th prompt of
  the length-sorted list, write their own part, and the first merges the parts (deduplicated,
  ordered). The launcher is accelerate's ``notebook_launcher`` (or ``accelerate launch``), so
  nothing here touches CUDA before the processes exist.
- New tokens per example are ``min(max_new_tokens, model context - prompt tokens)``, as vLLM
  does; a prompt that leaves no room at all is handled by ``on_long_prompt``.

Backends (``backend`` in params): ``static`` is Hugging Face ``generate`` with a dynamic KV cache;
``static-compiled`` uses a static KV cache and ``torch.compile`` (on CUDA Hugging Face's default,
CUDA graphs included; elsewhere dynamic shapes, which exists for testing); ``continuous``
(``continuous``) is transformers' continuous batching, one manager for the whole job (paged
attention, a finished request's slot refilled at once, each output written as it finishes), with
``batch_size`` requests in flight and a paged cache the planner sizes; ``auto`` picks continuous or
static from the profile's measurement (``backends.resolve_backend``). With greedy decoding all
give the tokens one-at-a-time generation gives (tests/test_generate.py).

Where each part lives: ``engine`` (batches, split-and-retry, statistics), ``backends`` (static,
static-compiled, the choice for auto), ``continuous`` (the streaming continuous backend; refused
under tensor parallelism), ``records`` (examples in, output and failure records out), ``files``
(the output's files, merge and audit), ``job`` (params to outputs, one process's share),
``tensor_parallel`` (T x D layouts), ``nodes`` (several nodes), ``processes`` (data parallel: ranks
and the launch), ``cli`` (``workbook generate``).
"""

from workbook.generation.cli import summary_lines, task_accuracy
from workbook.generation.engine import (
    BatchStats, Completion, DecodingSettings, GenerationError, Outcome, Prompt, finish, generate_with_split,
    run_batches, sort_longest_first, summarize,
)
from workbook.generation.backends import BACKENDS, ContinuousBackend, StaticBackend, make_backend, resolve_backend
from workbook.generation.files import OutputFiles, read_outputs, resolve_input_path, resolve_output_path
from workbook.generation.job import PARAMS_USED, decoding_settings, load_model, run_job, tokenize_prompts
from workbook.generation.processes import launch

__all__ = [
    "BACKENDS", "BatchStats", "Completion", "ContinuousBackend", "DecodingSettings", "GenerationError", "Outcome",
    "OutputFiles", "PARAMS_USED", "Prompt", "StaticBackend", "decoding_settings", "finish", "generate_with_split",
    "launch", "load_model", "make_backend", "read_outputs", "resolve_backend", "resolve_input_path",
    "resolve_output_path", "run_batches", "run_job",
    "sort_longest_first", "summarize", "summary_lines", "task_accuracy", "tokenize_prompts",
]
