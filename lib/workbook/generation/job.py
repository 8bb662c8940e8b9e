"""The generation job: from params to outputs on disk, for one process or one of several.

The params become one typed ``GenerationSettings`` at the entry (``run_job``, or the launcher,
which passes it to ``run``), which every step reads. Lock the output, read and check the prompts and
what the output already holds (all before any model loads), load the model, skip what is written,
take this process's share, generate it through the engine, write each batch, and (first process)
merge and audit::

    summary = run_job(params, "out/teacher.jsonl")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from workbook import decoding, job_keys, jsonl, models, process_group, prompt_format, recorded_forecast, runtime
from workbook.generation import nodes, records, tensor_parallel, verify
from workbook.generation.backends import choose_backend, make_backend
from workbook.generation.engine import (
    FINISH_EOS, BatchStats, Completion, DecodingSettings, GenerationError, Outcome, Prompt, run_batches, summarize,
)
from workbook.generation.files import OutputFiles, lock_output, merge_and_audit, write_summary
from workbook.generation.inputs import (
    Inputs, bad_line_failure, output_settings, read_inputs, system_prompt_text,
)
from workbook.generation.settings import GenerationSettings
from workbook.generation.progress import planned_by_prompt
from workbook.params import SCHEMA
from workbook.planner import profile

PARAMS_USED = job_keys.GENERATE


@dataclass(frozen=True)
class Rank:
    """This process's place in a data-parallel job (index 0 of 1 when alone); with tensor
    parallelism, consecutive groups of ``tensor_parallel_size`` processes share one copy of the model."""

    index: int
    count: int
    device: torch.device
    state: Any = None  # accelerate's PartialState when there are several processes
    tensor_parallel_size: int = 1

    @property
    def share(self) -> "Rank":
        """The data-parallel share this process computes: its group's (itself without tensor parallelism)."""
        size = self.tensor_parallel_size
        return Rank(self.index // size, self.count // size, self.device) if size > 1 else self

    @property
    def writes(self) -> bool:
        """Only the first process of a tensor-parallel group writes; the others compute the same tokens."""
        return self.index % self.tensor_parallel_size == 0

    def gather(self, value) -> list:
        if self.state is None:
            return [value]
        from accelerate.utils import gather_object
        return gather_object([value])

    def leave(self) -> None:
        """Tear this process's process group down once it has nothing more to exchange
        (``process_group.leave_group``): left to the interpreter's exit, a gloo rank could abort there."""
        if self.state is not None and torch.distributed.is_initialized():
            process_group.leave_group()


def current_rank(tensor_parallel_size: int = 1,
                 peer_timeout_seconds: float = SCHEMA["peer_timeout_seconds"].default) -> Rank:
    if runtime.launched_processes() > 1:
        from accelerate import PartialState
        state = PartialState(cpu=not torch.cuda.is_available(),  # gloo on CPU, NCCL on GPUs
                             **process_group.init_options(peer_timeout_seconds))
        return Rank(state.process_index, state.num_processes, state.device, state, tensor_parallel_size)
    return Rank(0, 1, runtime.default_device())


def load_model(model: str, dtype: str, device, sharding: dict | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from 'tiny' or a local Hugging Face directory; nothing is downloaded. A
    preset architecture is refused: its random weights have no tokenizer and write no text."""
    try:
        if models.is_preset(model):
            raise GenerationError(f"model {model!r} is a preset architecture (random weights, no tokenizer): the "
                                  "generation job writes text, so point model at a local Hugging Face directory or "
                                  "use 'tiny'. The benchmark (workbook bench) times presets; to time this job on the "
                                  f"architecture, save it with random weights first: workbook random-weights "
                                  f"--preset {model} --out <dir>, then model=<dir>.")
        loaded = models.load_model(model, dtype, device, sharding=sharding)
        return loaded.model, models.load_tokenizer(model)
    except ValueError as error:  # an unknown name: neither a preset nor a directory
        raise GenerationError(str(error)) from None


def tokenize_prompts(tokenizer, prompts: list[str], use_chat_template: bool,
                     system_prompt: str = "", on_no_system_role: str = "fail") -> list[list[int]]:
    """Token ids of each prompt, formatted as training formats them (prompt_format)."""
    return prompt_format.prompt_token_ids(tokenizer, prompts, use_chat_template=use_chat_template,
                                          system_prompt=system_prompt, on_no_system_role=on_no_system_role)


def decoding_settings(settings: GenerationSettings, model, tokenizer) -> DecodingSettings:
    if settings.do_sample and settings.temperature <= 0:
        raise GenerationError(f"do_sample is true and temperature is {settings.temperature}; sampling needs "
                              "temperature > 0 (or set do_sample: false for greedy decoding).")
    if settings.do_sample and settings.top_p <= 0:
        raise GenerationError("do_sample is true and top_p is 0, which keeps no token; use 0 < top_p <= 1.")
    return DecodingSettings(max_new_tokens=settings.max_new_tokens,
                            eos_token_ids=decoding.eos_token_ids(model, tokenizer),
                            pad_token_id=decoding.pad_token_id(model, tokenizer), do_sample=settings.do_sample,
                            temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed)


@contextlib.contextmanager
def output_locked(files: OutputFiles, rank: Rank, *, held_by_parent: bool):
    """The output's lock, held by one process for the whole job. Under ``notebook_launcher`` the
    parent took it before forking the processes (``held_by_parent``), which then share it. Under
    ``accelerate launch`` or torchrun the processes are siblings: the first takes it, since it
    lives longest (it merges once the others are done); every process learns through a gather
    whether it got it, so that the processes of a refused job all stop before writing anything."""
    if held_by_parent:
        yield
        return
    lock = refusal = None
    if rank.index == 0:
        try:
            lock = lock_output(files)
        except GenerationError as error:
            refusal = str(error)
    refusals = [text for text in rank.gather(refusal) if text]
    try:
        if refusals:
            raise GenerationError(refusals[0])
        yield
    finally:
        if lock is not None:
            lock.release()


def progress_bar(total: int, interactive: bool):
    """tqdm: the notebook widget when ``interactive`` (JupyterLab), else text on stderr (terminals,
    papermill), redrawn at most once a second so a saved notebook stays small. tqdm's own time left
    (examples left at the rate so far) is left out: the engine's ETA in the postfix knows that the
    longest prompts run first."""
    bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    if interactive:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc="generating", unit="example", bar_format=bar_format)
    from tqdm.std import tqdm
    return tqdm(total=total, desc="generating", unit="example", mininterval=1.0, file=sys.stderr,
                bar_format=bar_format)


@dataclass
class Share:
    """What one process generates: its prompts, the ones too long for the model, and how."""

    examples: list[records.Example]  # every example of the input (all processes read them all)
    bad_lines: list[jsonl.BadLine]
    token_ids: list[list[int]]  # per example
    prompts: list[Prompt]  # this process's candidates (example, sample), still to generate
    too_long: list[tuple[int, int]]  # this process's candidates whose prompt leaves no room in the context
    backend: Any
    batch_size: int
    model: Any
    tokenizer: Any
    settings: DecodingSettings
    prompts_path: Path
    backend_choice: str = ""  # why this backend (backend: auto says what it measured)


def prepare_share(settings: GenerationSettings, inputs: Inputs, files: OutputFiles, rank: Rank, *, model=None, tokenizer=None,
                  log: Callable[[str], None] = print) -> Share:
    """Load the model, tokenize, skip what is written, and pick this process's share."""
    prompts_path, examples, bad_lines = inputs.prompts_path, inputs.examples, inputs.bad_lines
    if model is None:
        profile.refuse_over_ram(settings.profile_params, "generate")  # before the weights fill the RAM
        if rank.device.type == "cpu" and rank.count > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.count))
        layout = tensor_parallel.Layout(rank.tensor_parallel_size, rank.count // rank.tensor_parallel_size)
        model, tokenizer = load_model(settings.model, settings.dtype, rank.device,
                                      tensor_parallel.sharding_arguments(layout))
    sampling = decoding_settings(settings, model, tokenizer)
    backend_name, backend_choice = choose_backend(settings)
    batch_size = profile.resolve_batch_size({**settings.profile_params, "backend": backend_name},  # continuous: paged plan
                                            "generate")
    backend = make_backend(backend_name, model, sampling, batch_size)
    token_ids = tokenize_prompts(tokenizer, [example.prompt for example in examples], settings.use_chat_template,
                                 system_prompt_text(settings), settings.on_no_system_role)
    # A candidate is one sample of one example; batch_size counts candidates (sequences), so a batch
    # holds batch_size / samples_per_prompt prompts. Each is its own row: no backend here shares a
    # prompt's prefill between its samples (generate's num_return_sequences copies the prompt
    # before prefill too), which costs prefill compute, not memory the planner did not count.
    samples = settings.samples_per_prompt
    pending = [(i, s) for i in range(len(examples)) for s in range(samples)
               if (examples[i].example_id, s) not in inputs.done]
    room = _room_check(settings, model, examples, token_ids, sorted({i for i, _ in pending}), prompts_path)
    # Every process sorts all candidates alike and takes every count-th: shares of equal length mix,
    # fixed by the input alone, so a process never takes a candidate another one owns.
    by_length = sorted(((i, s) for i in range(len(examples)) for s in range(samples)),
                       key=lambda candidate: (-len(token_ids[candidate[0]]), *candidate))
    pending_set = set(pending)
    share = rank.share  # a tensor-parallel group computes one share together
    mine = [candidate for candidate in nodes.shard(by_length, share.index, share.count) if candidate in pending_set]
    longest = max((len(token_ids[i]) for i, _ in pending), default=0)
    if settings.batch_size == "auto" and longest > settings.prompt_len:
        log(f"note: the longest prompt has {longest} tokens but batch_size 'auto' was planned for prompt_len "
            f"{settings.prompt_len}; a batch that runs out of memory is split and retried (nothing is lost), "
            "but raising prompt_len gives a batch size that fits from the start.")
    if rank.index == 0:
        each = f" x {samples} samples" if samples > 1 else ""
        log(f"{len(examples)} examples{each} in {prompts_path}; {len(examples) * samples - len(pending)} already in "
            f"{files.output}; {len(pending)} to generate with {settings.model} ({backend.name}, batch {batch_size}, "
            f"{rank.count} process{'es' if rank.count > 1 else ''}{_layout_text(rank)}); {len(bad_lines)} bad input "
            "lines skipped")
        if settings.backend == "auto":
            log(backend_choice)
    return Share(examples, bad_lines, token_ids,
                 prompts=[Prompt(i, token_ids[i], room[i], s) for i, s in mine if room[i] > 0],
                 too_long=[(i, s) for i, s in mine if room[i] <= 0], backend=backend, batch_size=batch_size,
                 model=model, tokenizer=tokenizer, settings=sampling, prompts_path=prompts_path,
                 backend_choice=backend_choice)


def generate_share(settings: GenerationSettings, share: Share, files: OutputFiles, rank: Rank, *, log: Callable[[str], None] = print,
                   sort_by_length: bool = True, show_progress: bool = True) -> list[BatchStats]:
    """Generate this process's prompts into its part of the output; failures into its failures part.
    A record that cannot be written fails alone (stage "write"); a full disk stops the job with
    what is safe and how to resume."""
    examples, teacher, generation_params = share.examples, settings.model, share.settings.recorded()
    made = output_settings(settings)  # once: with system_prompt '@path' it reads that file
    fingerprint, system_prompt = records.settings_fingerprint(made), made.get("system_prompt")

    def sample_index(sample: int) -> int | None:  # recorded only with several samples: one-sample records unchanged
        return sample if settings.samples_per_prompt > 1 else None

    if settings.do_sample:  # the ranks of a tensor-parallel group must draw the same tokens
        torch.manual_seed(share.settings.seed + rank.share.index)
    if not rank.writes:  # its group's first rank writes what this one computes too
        return run_batches(share.backend, share.prompts, write=lambda outcome: None, sort_by_length=sort_by_length,
                           log=lambda line: None, log_every_batches=0, rank=rank.index)
    bar = progress_bar(len(share.prompts), settings.interactive) if show_progress and rank.index == 0 else None
    try:
        fsync_every = getattr(share.backend, "fsync_every", None)  # continuous: one line per call, synced by count/time
        with jsonl.LineAppender(files.output_part(rank.share), fsync_every) as outputs, \
                jsonl.LineAppender(files.failures_part(rank.share), fsync_every) as failures:
            if outputs.repaired_bytes:
                log(f"{outputs.path}: cut its torn last line ({outputs.repaired_bytes} bytes: a record a kill cut "
                    "short); that example is generated again")
            if rank.index == 0:
                failures.write(bad_line_failure(bad) for bad in share.bad_lines)
            failures.write(records.failure_record(example_id=examples[i].example_id, line=examples[i].line,
                                                  stage="prompt_too_long", sample_index=sample_index(s),
                                                  error=_too_long_text(share.token_ids[i], share.model))
                           for i, s in share.too_long)

            def failure(prompt: Prompt, stage: str, error: str) -> dict:
                example = examples[prompt.index]
                return records.failure_record(example_id=example.example_id, line=example.line, stage=stage,
                                              error=error, sample_index=sample_index(prompt.sample))

            def write(outcome: Outcome) -> None:
                made = [_output_record(examples[prompt.index], completion, share.tokenizer, settings, teacher,
                                       generation_params, len(prompt.token_ids), fingerprint,
                                       sample_index(prompt.sample), system_prompt)
                        for prompt, completion in outcome.completed]
                rejected = dict(outputs.write_encodable(made))  # position -> why; its neighbours are written
                unwritten = [(outcome.completed[position][0], f"cannot write its output record: {reason}")
                             for position, reason in rejected.items()]
                failures.write([failure(prompt, "generation", error) for prompt, error in outcome.failed]
                               + [failure(prompt, "write", error) for prompt, error in unwritten])
                # The batch's statistics then count an unwritten record as failed, not generated.
                outcome.completed = [pair for position, pair in enumerate(outcome.completed)
                                     if position not in rejected]
                outcome.failed += unwritten

            return run_batches(share.backend, share.prompts, write=write, sort_by_length=sort_by_length,
                               progress=bar, log=log, log_every_batches=settings.log_every_batches,
                               rank=rank.index, planned_seconds=planned_by_prompt(
                                   recorded_forecast.eta_plan(recorded_forecast.generation_file(files.output))))
    except OSError as error:  # from the appenders, which name the file: a full disk, or one gone read-only
        raise GenerationError(_write_failed_text(error, files, len(examples))) from None
    finally:
        if bar is not None:
            bar.close()


def _layout_text(rank: Rank) -> str:
    size = rank.tensor_parallel_size
    return f": tensor parallel {size} x data parallel {rank.count // size}" if size > 1 else ""


def _write_failed_text(error: OSError, files: OutputFiles, total: int) -> str:
    safe = len(jsonl.scan_ids([files.output, *files.output_parts()], records.output_record_id))
    where = f"{files.output}" + (" and its part files" if files.output_parts() else "")
    full = jsonl.is_disk_full(error)
    return (f"{'the disk is full' if full else 'cannot write'} ({error.strerror}: {error.filename or files.output}): "
            f"stopped with {safe} of {total} outputs safely written to {where}. "
            f"{'Free some space' if full else 'Fix that'} and rerun the same command: it resumes after them.")


def run_job(params, output_path: str | Path, **options) -> dict | None:
    """``run`` from a validated params profile: the settings are built here, once."""
    return run(GenerationSettings.from_params(params), output_path, **options)


def run(settings: GenerationSettings, output_path: str | Path, *, model=None, tokenizer=None,
        log: Callable[[str], None] = print, sort_by_length: bool = True, show_progress: bool = True,
        lock_held_by_parent: bool = False) -> dict | None:
    """This process's share of the job (all of it when alone). Returns the job's summary in the
    first process (which merges the parts and writes ``<output>.summary.json``), None in the others.

    ``model``/``tokenizer`` preloaded skip loading the model (tests, the benchmark).
    ``lock_held_by_parent``: the process that started this one holds the output's lock (``launch``).
    """
    verifier = _verifier(settings)  # a mistyped verifier stops the job before hours of generation
    layout = tensor_parallel.launched_layout(settings)  # a size the model or launcher cannot run stops here
    settings = settings.replace(tensor_parallel_size=layout.tensor_parallel_size)  # 'auto' resolved, for the planner
    rank = current_rank(layout.tensor_parallel_size, settings.peer_timeout_seconds)
    files = OutputFiles(Path(output_path))
    began = time.perf_counter()
    with output_locked(files, rank, held_by_parent=lock_held_by_parent):
        inputs = nodes.in_step(rank, lambda: read_inputs(settings, files, record_skipped=rank.index == 0))
        shared = nodes.output_folder_shared(files, rank)  # False: a node with its own disk (several nodes)
        inputs.done = nodes.written_anywhere(inputs.done, rank)
        share = nodes.in_step(rank, lambda: prepare_share(settings, inputs, files, rank, model=model,
                                                          tokenizer=tokenizer, log=log))
        engine_began = time.perf_counter()
        batches = generate_share(settings, share, files, rank, log=log, sort_by_length=sort_by_length,
                                 show_progress=show_progress)
        counts = {"rank": rank.index, **summarize(batches, time.perf_counter() - engine_began),
                  "too_long": len(share.too_long), "setup_seconds": round(engine_began - began, 3),
                  "batch_list": [dataclasses.asdict(b) for b in batches]}
        # A collective: the first process passes it only when every process has closed its part. A
        # tensor-parallel rank that wrote nothing sends nothing: its group's writer counted its work.
        every_process = [each for each in rank.gather(counts if rank.writes else None) if each is not None]
        over_network = nodes.bring_parts_to_first(files, rank, shared)
        rank.leave()  # the last collective: what follows is the first process's alone
        if rank.index != 0:
            return None
        summary = merge_and_audit(files, share.examples, share.bad_lines, every_process,
                                  samples=settings.samples_per_prompt, log=log)
        # The attention the model ran (continuous: what transformers' manager switched to, when it ran).
        attention = getattr(share.backend, "attention", None) or getattr(share.model.config, "_attn_implementation", None)
        summary.update(backend=share.backend.name, backend_choice=share.backend_choice, batch_size=share.batch_size,
                       attention_implementation=attention,
                       processes=rank.count, tensor_parallel_size=rank.tensor_parallel_size,
                       nodes=runtime.launched_nodes(), parts_sent_over_network_by_ranks=over_network,
                       model=settings.model, prompts_path=str(share.prompts_path),
                       generation_params=share.settings.recorded(), device=str(rank.device), dtype=settings.dtype)
        if verifier is not None and summary["in_output"]:
            summary["verification"] = _verify(files, settings, verifier, log)
        summary["forecast"] = recorded_forecast.beside_measured(  # the forecast this run started with, if any
            recorded_forecast.generation_file(files.output), runtime.process_age_seconds(),
            "this process's start to its summary (start-up included, as forecast)", after_pilot=bool(inputs.done))
        write_summary(files, summary, log=log)
        return summary


def _verify(files: OutputFiles, settings: GenerationSettings, verifier, log: Callable[[str], None]) -> dict | None:
    """The verification of a finished job; a full disk makes it a warning (every output is safe, and
    `workbook verify` redoes it), not the job's failure."""
    try:
        return verify.verify_output(files.output, settings.verifier, settings.max_accepted_per_prompt,
                                    verifier=verifier)
    except OSError as error:
        if not jsonl.is_disk_full(error):
            raise
        log(f"warning: the disk is full ({error.strerror}), so the verified outputs were not written; free some "
            f"space and run: workbook verify --params ... --set output_path={files.output} "
            f"verifier={settings.verifier}")
        return None


def _verifier(settings: GenerationSettings):
    try:
        return verify.load_verifier(settings.verifier)
    except verify.VerifyError as error:
        raise GenerationError(str(error)) from None


def _room_check(settings: GenerationSettings, model, examples, token_ids, pending, prompts_path) -> dict[int, int]:
    """New tokens each pending example may have; a prompt that leaves no room fails the run
    ('fail', checked before anything is generated) or is listed in the failures file ('skip')."""
    context = decoding.context_length(model)
    room = {}
    for i in pending:
        left = context - len(token_ids[i]) if context else settings.max_new_tokens
        room[i] = min(settings.max_new_tokens, left)
        if room[i] <= 0:
            problem = jsonl.BadLine(str(prompts_path), examples[i].line, _too_long_text(token_ids[i], model),
                                   examples[i].example_id)
            jsonl.handle_bad_line(problem, settings.on_long_prompt, "on_long_prompt")
    return room


def _too_long_text(ids: list[int], model) -> str:
    return (f"prompt of {len(ids)} tokens leaves no room to generate in the model's context of "
            f"{decoding.context_length(model)} tokens")


def _output_record(example, completion: Completion, tokenizer, settings: GenerationSettings, teacher, generation_params,
                   prompt_tokens: int, settings_fingerprint: str, sample_index: int | None,
                   system_prompt: dict | None) -> dict:
    ids = completion.token_ids[:-1] if completion.finish_reason == FINISH_EOS else completion.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
    return records.output_record(example, output=text, prompt_field=settings.prompt_field, teacher_model=teacher,
                                 generation_params=generation_params, prompt_tokens=prompt_tokens,
                                 output_tokens=len(completion.token_ids), finish_reason=completion.finish_reason,
                                 settings_fingerprint=settings_fingerprint, sample_index=sample_index,
                                 system_prompt=system_prompt)
