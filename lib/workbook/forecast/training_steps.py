"""The training forecast's steps: which of the run's steps the pilot times, the pilot's run, and
every step of the run priced by what it holds.

A step's cost follows its rows' content, not its place in the run: a packed row of a few long
examples costs more attention than a row of many short ones, and each epoch deals the rows out in
another order. So the pilot times steps drawn across the whole run, every epoch it spans in
proportion (``pick_steps``), in pairs so that a step which starts an epoch's loader (the loader's
start and the first step's warm-up fall in it, in the run as in the pilot) always has a neighbour
that does not. They run through the training loop itself, each with the rows the run gives it, in a
fresh process that does nothing else (``run_alone``). A step's seconds are then fitted as
``c + a * tokens + b * attention pairs`` (the sum of each document's length squared: attention within
each document) by nonnegative least squares (``fit``), so that each of the run's steps, timed or
not, is priced by its content::

    contents = run_step_contents(rows, lengths, "packing", run, seed=0)
    chosen = pick_steps(run.total_steps, run.steps_per_epoch, count=120)
    model = fit([contents[s] for s in timed], seconds)
    model.seconds(contents[700])
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workbook.forecast import regression
from workbook.training import batches
from workbook.training.config import RESULT_FILE, TrainError
from workbook.training.processes import launch

PILOT_CLOCKS_FILE = "pilot_clocks.json"  # the pilot's run: wall and CPU seconds of its training, from its own process
PHASES = {"first tenth": (0.0, 0.1), "middle tenth": (0.45, 0.55), "last tenth": (0.9, 1.0)}  # shares of the run's steps


@dataclass(frozen=True)
class StepContent:
    """What one optimizer step holds over its accumulated micro-batches, per process: the processes
    share a step's rows, so a run over more processes prices a step by its share of one."""

    tokens: float  # the documents' tokens
    attention_pairs: float  # sum over its documents of length^2: what attention within each document scores


@dataclass
class StepModel:
    """Seconds of one optimizer step from what it holds."""

    seconds_per_step: float
    seconds_per_token: float
    seconds_per_attention_pair: float
    fit_error: float = 0.0  # relative RMS of the timed steps' residuals (the steps' own noise, unexplained)

    def seconds(self, content: StepContent) -> float:
        return (self.seconds_per_step + self.seconds_per_token * content.tokens
                + self.seconds_per_attention_pair * content.attention_pairs)

    def to_dict(self) -> dict:
        return asdict(self)


def run_step_contents(rows: list[tuple[int, ...]], lengths: list[int], padding: str, run, seed: int) -> list[StepContent]:
    """Every step of the run (``run``: its ``RunPlan``), in order: the micro-batches the loop serves
    it (each epoch's ``batches.epoch_micro_batches``, step s taking micro-batches s x A x W to
    (s + 1) x A x W - 1 over A accumulation steps and W processes), summed, over W."""
    per_step = run.gradient_accumulation_steps * run.processes
    contents: list[StepContent] = []
    for epoch in range(math.ceil(run.total_steps / run.steps_per_epoch)):
        micro_batches = batches.epoch_micro_batches(rows, lengths, padding, micro_batch_size=run.micro_batch_size,
                                                    seed=seed, epoch=epoch)
        for step in range(min(run.steps_per_epoch, run.total_steps - len(contents))):
            documents = [lengths[i] for micro in micro_batches[step * per_step:(step + 1) * per_step]
                         for row in micro for i in row]
            contents.append(StepContent(sum(documents) / run.processes, sum(n * n for n in documents) / run.processes))
    return contents


def pick_steps(total_steps: int, steps_per_epoch: int, count: int) -> list[int]:
    """``count`` steps of the run (at least two, at most all but the last), in pairs of neighbours
    within one epoch, the pairs spread evenly over the run: each stands for an equal share of the
    steps, as the run meets them. The run's last step is left out: reaching it would end the
    pilot's run as finished, saving a final model the forecast does not time as a step."""
    last = total_steps - 2  # the latest step the pilot may run
    if last < 0:
        return [0] if total_steps == 1 else []
    pairs = max(1, min(count, last + 1) // 2)
    chosen: set[int] = set()
    for i in range(pairs):
        first = min(math.floor((i + 0.5) * (last + 1) / pairs), last)
        # Its neighbour in the same epoch: the next step, or the one before at an epoch's (or the range's) end.
        second = first + 1 if first + 1 <= last and (first + 1) % steps_per_epoch else first - 1
        chosen.update(step for step in (first, second) if 0 <= step <= last)
    return sorted(chosen)


def loader_starts(steps: list[int], steps_per_epoch: int) -> list[bool]:
    """For each of ``steps`` (run in order), whether it is the first its epoch's loader serves: the
    loader's start and, for the first, the process's warm-up fall in its time."""
    seen: set[int] = set()
    starts = []
    for step in steps:
        epoch = step // steps_per_epoch
        starts.append(epoch not in seen)
        seen.add(epoch)
    return starts


def fit(contents: list[StepContent], seconds: list[float]) -> StepModel:
    """The step model through the timed steps (``contents[i]`` took ``seconds[i]``): nonnegative
    least squares of seconds on (1, tokens, attention pairs), keeping their total; one step, or
    steps of one content, price every step at their mean."""
    if not seconds:
        raise ValueError("no timed step to fit the step model to")
    columns = [[1.0] * len(contents), [float(c.tokens) for c in contents], [float(c.attention_pairs) for c in contents]]
    per_step, per_token, per_pair = regression.fit_nonnegative(columns, seconds)
    model = StepModel(per_step, per_token, per_pair)
    mean = statistics.fmean(seconds)
    residuals = [model.seconds(c) - s for c, s in zip(contents, seconds)]
    model.fit_error = math.sqrt(statistics.fmean(r * r for r in residuals)) / mean if mean > 0 else 0.0
    return model


def phase_means(values: list[float]) -> dict[str, float | None]:
    """The mean of per-step ``values`` (None for a step left out) over each of ``PHASES``."""
    means = {}
    for name, (begin, end) in PHASES.items():
        inside = [v for v in values[math.floor(begin * len(values)):math.ceil(end * len(values))] if v is not None]
        means[name] = statistics.fmean(inside) if inside else None
    return means


def run_alone(config, prepared) -> tuple[dict, float, float]:
    """The pilot's run (``config``: its ``run_only_steps``) in a fresh interpreter that does nothing
    else, as `workbook train`'s process does: not in the forecast's own, which has read, packed and
    priced the data and holds what that left behind. Returns its result (what the loop wrote in its
    output folder), the wall seconds of it all (the interpreter's start included), and the CPU
    seconds (user + system) per wall second of its training alone, the interpreter's start left out."""
    context = multiprocessing.get_context("spawn")  # a fork would carry this process's state over
    child = context.Process(target=_train_alone, args=(config, prepared), name="forecast-pilot")
    began = time.perf_counter()
    child.start()
    child.join()
    wall = time.perf_counter() - began
    result_file, clocks_file = Path(config.output_dir) / RESULT_FILE, Path(config.output_dir) / PILOT_CLOCKS_FILE
    if child.exitcode != 0 or not result_file.is_file() or not clocks_file.is_file():
        raise TrainError(f"the forecast's pilot run failed (exit code {child.exitcode}; its traceback is printed "
                         "above): fix what it names, or run `workbook train` with the same settings to see it")
    clocks = json.loads(clocks_file.read_text())
    return json.loads(result_file.read_text()), wall, clocks["cpu_seconds"] / clocks["wall_seconds"]


def _train_alone(config, prepared) -> None:
    began, cpu_began = time.perf_counter(), _cpu_seconds()
    with contextlib.redirect_stdout(sys.stderr):  # the loop's progress; the forecast's --json owns stdout
        launch(config, prepared)
    (Path(config.output_dir) / PILOT_CLOCKS_FILE).write_text(json.dumps(
        {"wall_seconds": time.perf_counter() - began, "cpu_seconds": _cpu_seconds() - cpu_began}))


def _cpu_seconds() -> float:
    """This process's CPU seconds and its finished children's (several training processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
