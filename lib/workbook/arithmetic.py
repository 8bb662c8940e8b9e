"""The checkable task behind the tiny model: two-digit addition questions with integer answers.

One place for the task: which problems exist, how a question and an answer are written, which
problems are held out as the shipped sample prompts, and how a generated answer is scored.

A problem is ``left + right`` with operands 0..99. (Mixing in subtraction was tried: in the tiny
model's ~40 s of training it reached 39-93% held-out accuracy depending on learning rate and
initialization, against 97-100% for addition alone, so the task is addition only.) A record (one
line of the sample file) uses the seed format of teacher-output pipelines::

    {"id": "arith-0000", "input": "What is 23 + 45?", "output": "68",
     "difficulty": "easy", "domain": "arithmetic"}

``output`` is the reference answer. ``difficulty`` is "hard" when the ones column carries into the
tens (27 + 45), else "easy" (23 + 45, 50 + 60): about 45% of problems are hard.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

OPERAND_MAX = 99  # operands are 0..OPERAND_MAX: answers have at most 3 digits (99 + 99 = 198)
DOMAIN = "arithmetic"
SAMPLE_SIZE = 300  # records in the shipped sample file, held out from the tiny model's training
SAMPLE_SEED = 1234  # picks which problems are held out; changing it changes the sample file
SAMPLE_PROMPTS_PATH = Path(__file__).parent / "data" / "arithmetic_prompts.jsonl"
# One round of rejection-sampling fine-tuning (the cpu profile's run, bench/rejection_sampling.py):
# questions asked in words the tiny model never saw ("What's 22 + 70?"), which it answers right
# only now and then. A pool to sample training data from and held-out questions to score, disjoint
# from each other and from the sample file, shipped so the profile can name them.
VARIANT_STYLE = "contraction"
VARIANT_POOL_SIZE, VARIANT_HELD_OUT_SIZE = 1500, 300
VARIANT_POOL_SEED, VARIANT_HELD_OUT_SEED = 2, 1
VARIANT_POOL_PATH = SAMPLE_PROMPTS_PATH.with_name("arithmetic_contraction_pool.jsonl")
VARIANT_HELD_OUT_PATH = SAMPLE_PROMPTS_PATH.with_name("arithmetic_contraction_held_out.jsonl")

# The first integer in a generated text, with an optional minus sign ("-3", " 68</s>", "68.").
_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, order=True)
class Problem:
    """One question: ``left + right``."""

    left: int
    right: int

    @property
    def answer(self) -> int:
        return self.left + self.right

    @property
    def question(self) -> str:
        return question_text(self.left, self.right)

    @property
    def difficulty(self) -> str:
        """ "hard" if the ones column carries into the tens, else "easy"."""
        return "hard" if self.left % 10 + self.right % 10 >= 10 else "easy"


# How a question is written. The tiny model is trained on "plain" only; "contraction" is the
# harder variant it gets only partly right (about 1 in 12), which rejection-sampling fine-tuning
# (sample, verify, keep the right answers, train on them) can teach it.
QUESTION_STYLES = {"plain": "What is {left} + {right}?", "contraction": "What's {left} + {right}?"}
_QUESTION = re.compile(r"^(?:What is|What's) (\d+) \+ (\d+)\?$")


def question_text(left: int, right: int, style: str = "plain") -> str:
    """The prompt a model sees, e.g. "What is 23 + 45?" (plain) or "What's 23 + 45?" (contraction)."""
    return QUESTION_STYLES[style].format(left=left, right=right)


def parse_question(text: str) -> Problem | None:
    """The problem a question of any style asks, or None when ``text`` is not one of the task's."""
    match = _QUESTION.match(text.strip()) if isinstance(text, str) else None
    if not match:
        return None
    left, right = int(match.group(1)), int(match.group(2))
    return Problem(left, right) if max(left, right) <= OPERAND_MAX else None


def answer_text(value: int) -> str:
    """The reference answer as written in a record's ``output``, e.g. "68"."""
    return str(value)


def completion_text(answer: str) -> str:
    """What a model trained on this task writes after the question: a space, then the answer.

    The tiny model is trained to continue "What is 23 + 45?" with " 68" and then end of text.
    """
    return " " + answer


def all_problems() -> list[Problem]:
    """Every problem of the task, in a fixed order: 100 x 100 = 10,000 additions."""
    operands = range(OPERAND_MAX + 1)
    return [Problem(left, right) for left in operands for right in operands]


def sample_problems() -> list[Problem]:
    """The held-out problems of the shipped sample file, chosen by ``SAMPLE_SEED``."""
    return random.Random(SAMPLE_SEED).sample(all_problems(), SAMPLE_SIZE)


def training_problems() -> list[Problem]:
    """Every problem except the held-out sample, so accuracy on the sample file is honest."""
    held_out = set(sample_problems())
    return [problem for problem in all_problems() if problem not in held_out]


def make_record(problem: Problem, index: int) -> dict:
    """A record in the teacher-output seed format (see the module docstring)."""
    return {
        "id": f"arith-{index:04d}",
        "input": problem.question,
        "output": answer_text(problem.answer),
        "difficulty": problem.difficulty,
        "domain": DOMAIN,
    }


def variant_records(style: str, count: int, seed: int, exclude: set[Problem] = frozenset()) -> list[dict]:
    """``count`` records of problems drawn by ``seed`` (none of ``exclude``), asked in ``style``."""
    problems = [problem for problem in all_problems() if problem not in exclude]
    chosen = random.Random(seed).sample(problems, count)
    return [{**make_record(problem, index), "id": f"arith-{style}-{index:04d}",
             "input": question_text(problem.left, problem.right, style)} for index, problem in enumerate(chosen)]


def variant_task_records(pool_size: int = VARIANT_POOL_SIZE,
                         held_out_size: int = VARIANT_HELD_OUT_SIZE) -> tuple[list[dict], list[dict]]:
    """(pool, held-out) records of the rejection-sampling task: disjoint from each other and from
    the sample file's problems."""
    seen = set(sample_problems())
    held_out = variant_records(VARIANT_STYLE, held_out_size, VARIANT_HELD_OUT_SEED, exclude=seen)
    seen |= {parse_question(record["input"]) for record in held_out}
    return variant_records(VARIANT_STYLE, pool_size, VARIANT_POOL_SEED, exclude=seen), held_out


def sample_records() -> list[dict]:
    """The records of the shipped sample file, as the generator produces them."""
    return [make_record(problem, index) for index, problem in enumerate(sample_problems())]


def write_records(path: str | Path, records: list[dict]) -> Path:
    """Write ``records`` as JSON lines to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def write_sample_prompts(path: str | Path = SAMPLE_PROMPTS_PATH) -> Path:
    """Write the sample records as JSON lines to ``path`` (default: the shipped file)."""
    return write_records(path, sample_records())


def write_variant_task(pool_path: str | Path = VARIANT_POOL_PATH,
                       held_out_path: str | Path = VARIANT_HELD_OUT_PATH) -> tuple[Path, Path]:
    """Write the rejection-sampling task's pool and held-out files (default: the shipped ones)."""
    pool, held_out = variant_task_records()
    return write_records(pool_path, pool), write_records(held_out_path, held_out)


def load_prompts(path: str | Path = SAMPLE_PROMPTS_PATH) -> list[dict]:
    """Read prompt records from a JSON-lines file (default: the shipped sample file)."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number}: not valid JSON ({error.msg}); "
                    "each line must be one JSON object"
                ) from None
    return records


def parse_answer(generated_text: str) -> int | None:
    """The first integer in ``generated_text`` (sign included), or None if it has none."""
    match = _FIRST_INTEGER.search(generated_text)
    return int(match.group()) if match else None


def score(prompt_record: dict, generated_text: str) -> bool:
    """True if the first integer of ``generated_text`` equals the record's ``output``.

    ``generated_text`` is the model's continuation only (not the prompt, whose numbers would be
    parsed first).
    """
    reference = prompt_record.get("output")
    try:
        expected = int(str(reference).strip())
    except ValueError:
        raise ValueError(
            f"record {prompt_record.get('id')!r}: output {reference!r} is not an integer; "
            "score() only checks records of the arithmetic task"
        ) from None
    return parse_answer(generated_text) == expected


def accuracy(prompt_records: list[dict], generated_texts: list[str]) -> float:
    """Fraction of records whose generated text is scored correct (0.0 to 1.0)."""
    if len(prompt_records) != len(generated_texts):
        raise ValueError(
            f"got {len(prompt_records)} records but {len(generated_texts)} generated texts; "
            "pass one generated text per record, in the same order"
        )
    if not prompt_records:
        raise ValueError("no records to score; pass at least one record")
    correct = sum(score(record, text) for record, text in zip(prompt_records, generated_texts))
    return correct / len(prompt_records)
