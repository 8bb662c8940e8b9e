"""What the generation job reads before any model loads: the prompts (checked against what the
output already holds), the settings that make an output what it is, and the system prompt."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from workbook import jsonl
from workbook.generation import records
from workbook.generation.engine import DecodingSettings, GenerationError
from workbook.generation.files import OutputFiles, check_resume, resolve_input_path, written_outputs
from workbook.generation.settings import GenerationSettings


def output_settings(settings: GenerationSettings) -> dict:
    """Everything besides its prompt that makes an output what it is, from the settings alone (so that
    a resume is checked before the model loads): the model, its dtype, the chat template's use and
    the decoding settings as recorded (the model's own token ids follow from the model)."""
    decoding = DecodingSettings(max_new_tokens=settings.max_new_tokens, eos_token_ids=(), pad_token_id=0,
                                do_sample=settings.do_sample, temperature=float(settings.temperature),
                                top_p=float(settings.top_p), seed=settings.seed)  # float: 1 and 1.0 alike
    made = {"teacher_model": settings.model, "dtype": settings.dtype,
            "use_chat_template": settings.use_chat_template, "generation_params": decoding.recorded()}
    if settings.system_prompt:  # only when set: outputs written without one keep their fingerprint
        made["system_prompt"] = system_prompt_record(settings)
    return made


def system_prompt_text(settings: GenerationSettings) -> str:
    """The system prompt the teacher sees (prompt distillation): the setting's text, or the file it
    names as ``@path`` (relative: the working directory, else the repository root); '' for none."""
    value = settings.system_prompt
    if not value.startswith("@"):
        return value
    path = resolve_input_path(value[1:])
    if path.is_dir():
        raise GenerationError(f"system_prompt {value!r}: {path} is a folder, not a file")
    if not path.is_file():
        raise GenerationError(f"system_prompt {value!r}: no such file; give the text itself or @path to a file")
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as error:
        raise GenerationError(f"system_prompt {value!r}: {path} is not UTF-8 text (at byte offset {error.start}: "
                              f"{error.reason}); save it as UTF-8") from error


def system_prompt_record(settings: GenerationSettings) -> dict:
    """What each output records of its system prompt: where it came from and a digest, never the
    text in ``input`` (the student is trained on the input without it)."""
    text = system_prompt_text(settings)
    source = settings.system_prompt if settings.system_prompt.startswith("@") else "inline (params)"
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()[:16], "source": source, "characters": len(text)}


@dataclass
class Inputs:
    """The prompts as read, checked against what the output already holds."""

    prompts_path: Path
    examples: list[records.Example]
    bad_lines: list[jsonl.BadLine]
    done: set  # (id, sample) of every output already in the output or its parts


def read_inputs(settings: GenerationSettings, files: OutputFiles, *, record_skipped: bool) -> Inputs:
    """Read the prompts and check them against the output, before any model loads: no prompt at all,
    output_path naming the prompts (or any file this job did not write), and outputs made from
    other prompts or settings each stop with one GenerationError. ``record_skipped``: this process
    (the first) lists the skipped lines in the failures file when no prompt is left."""
    if settings.samples_per_prompt > 1 and not settings.do_sample:
        raise GenerationError(f"samples_per_prompt is {settings.samples_per_prompt} but do_sample is false: greedy "
                              "decoding would write the same output every time; set do_sample: true (with a "
                              "temperature) or samples_per_prompt: 1")
    prompts_path = resolve_input_path(settings.prompts_path)
    examples, bad_lines = records.load_examples(prompts_path, prompt_field=settings.prompt_field,
                                                on_bad_line=settings.on_bad_line, max_examples=settings.max_examples)
    # The job writes more than the output (failures, accepted, summary, lock, parts): none may be the prompts.
    clash = next((path for path in files.every_file() if path.resolve() == prompts_path.resolve()
                  or (path.exists() and path.samefile(prompts_path))), None)
    if clash is not None:
        raise GenerationError(f"output_path {files.output} would overwrite the prompts file {prompts_path} (as "
                              f"{clash.name}, a file this job writes); set output_path to another file (the outputs are "
                              "written and resumed there).")
    if not examples:
        raise GenerationError(_no_prompts_text(prompts_path, bad_lines, files, record_skipped))
    made = output_settings(settings)
    written = written_outputs(files)
    check_resume(files, written, examples, prompts_path, settings_fingerprint=records.settings_fingerprint(made),
                 teacher_model=made["teacher_model"], generation_params=made["generation_params"],
                 samples_per_prompt=settings.samples_per_prompt)
    return Inputs(prompts_path, examples, bad_lines, set(written))


def _no_prompts_text(prompts_path: Path, bad_lines: list[jsonl.BadLine], files: OutputFiles, record: bool) -> str:
    if bad_lines:
        if record:
            with jsonl.LineAppender(files.failures) as failures:
                failures.write(bad_line_failure(bad) for bad in bad_lines)
            jsonl.merge_parts(files.failures, [], id_of=lambda r: r["line"], order={}, keep="last")  # one per line
        what = f"all {len(bad_lines)} of its lines are bad and were skipped (listed in {files.failures})"
    else:
        what = "the file is empty" if prompts_path.stat().st_size == 0 else "it holds only blank lines"
    return (f"no prompts to generate in {prompts_path}: {what}. prompts_path must name a JSONL file with one JSON "
            'object per line holding the prompt, e.g. {"id": "q1", "input": "What is 2 + 3?"}.')


def bad_line_failure(bad: jsonl.BadLine) -> dict:
    return records.failure_record(example_id=bad.example_id, line=bad.line, stage="input", error=bad.reason)
