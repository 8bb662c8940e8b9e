"""The batch-size finder: backs off on out-of-memory only, never settles on a batch that failed,
and its probes run the real worst case (full forced generation length; a training step that
leaves the model untouched). Out-of-memory is simulated on CPU by raising the errors PyTorch
raises; peaks are not measured on CPU."""

import json

import pytest
import torch
from accelerate.utils.memory import should_reduce_batch_size
from transformers import AutoModelForCausalLM, AutoTokenizer

from workbook.planner.finder import NoBatchFitsError, ProbeMeasurement, find_batch_size, smaller_batch
from workbook.planner.probes import generation_probe, training_probe


def cpu_out_of_memory():
    return RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")


def cuda_out_of_memory():
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def measurement(batch: int) -> ProbeMeasurement:
    return ProbeMeasurement(batch_size=batch, device="cpu", seconds=0.0, peak_reserved_bytes=None,
                            peak_allocated_bytes=None, non_pytorch_bytes=None, sequence_tokens=16)


def probe_failing_above(threshold: int, make_error, calls: list[int]):
    """A stand-in probe that runs out of memory for any batch above ``threshold``."""

    def probe(batch: int) -> ProbeMeasurement:
        calls.append(batch)
        if batch > threshold:
            raise make_error()
        return measurement(batch)

    return probe


def backoff_sequence(start: int, backoff: float) -> list[int]:
    batches = [start]
    while batches[-1] > 1:
        batches.append(smaller_batch(batches[-1], backoff))
    return batches


# ---------------------------------------------------------------------------------------------
# The search, with stand-in probes.


def test_the_simulated_errors_are_what_accelerate_calls_out_of_memory():
    assert should_reduce_batch_size(cpu_out_of_memory())
    assert should_reduce_batch_size(cuda_out_of_memory())
    assert not should_reduce_batch_size(ValueError("out of memory."))


def test_each_back_off_lowers_the_batch_by_at_least_one():
    assert smaller_batch(100) == 90
    assert smaller_batch(5) == 4  # 4.5 rounds down
    assert smaller_batch(2) == 1  # 1.8 would round back to 2 without the "at least 1" rule
    assert smaller_batch(9, backoff=0.99) == 8
    assert smaller_batch(64, backoff=0.5) == 32
    assert backoff_sequence(12, 0.9) == [12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]


# Each attempt frees memory with a full garbage collection (as accelerate does): ~0.2 s here.
@pytest.mark.slow
@pytest.mark.parametrize("start, threshold, backoff, make_error", [
    (100, 37, 0.9, cpu_out_of_memory),  # 100, 90, 81, 72, 64, 57, 51, 45, 40, 36
    (8, 5, 0.9, cuda_out_of_memory),
    (64, 1, 0.5, cpu_out_of_memory),
    (10, 10, 0.9, cuda_out_of_memory),  # the plan was right: one attempt
    (50, 44, 0.8, cuda_out_of_memory),  # 50, 40: settles below the threshold it cannot reach
])
def test_settles_on_the_largest_reachable_batch_that_fits(start, threshold, backoff, make_error):
    calls = []
    result = find_batch_size(start, probe_failing_above(threshold, make_error, calls),
                             backoff=backoff, log=None)
    sequence = backoff_sequence(start, backoff)
    expected = next(batch for batch in sequence if batch <= threshold)
    assert result.batch_size == expected
    assert calls == sequence[: sequence.index(expected) + 1]  # every attempt, in order
    assert [attempt.batch_size for attempt in result.attempts] == calls
    assert [attempt.outcome for attempt in result.attempts] == ["oom"] * (len(calls) - 1) + ["ok"]
    failed = {attempt.batch_size for attempt in result.attempts if attempt.outcome == "oom"}
    assert all(batch > threshold for batch in failed)
    assert result.batch_size not in failed
    assert result.measurement.batch_size == result.batch_size
    assert result.start_batch == start


def test_records_predictions_and_is_json_ready():
    lines = []
    result = find_batch_size(8, probe_failing_above(6, cuda_out_of_memory, []),
                             predicted_bytes=lambda batch: 1000 * batch, log=lines.append)
    assert [attempt.predicted_bytes for attempt in result.attempts] == [8000, 7000, 6000]
    assert result.predicted_bytes == 6000
    assert result.measured_peak_bytes is None  # CPU: not measured, not faked
    assert "CUDA out of memory" in result.attempts[0].error
    assert len(lines) == 3 and "trying 7" in lines[0]
    record = json.loads(json.dumps(result.to_dict()))
    assert record["batch_size"] == 6 and record["predicted_bytes"] == 6000
    assert [attempt["outcome"] for attempt in record["attempts"]] == ["oom", "oom", "ok"]


@pytest.mark.parametrize("error", [
    ValueError("the prompt has no tokens"),
    RuntimeError("CUDA error: device-side assert triggered"),
])
def test_other_errors_propagate_unchanged(error):
    calls = []

    def probe(batch):
        calls.append(batch)
        raise error

    with pytest.raises(type(error)) as raised:
        find_batch_size(16, probe, log=None)
    assert raised.value is error
    assert calls == [16]  # no back-off for an error that is not out of memory


@pytest.mark.slow
def test_even_batch_one_out_of_memory_says_what_to_change():
    calls = []
    with pytest.raises(NoBatchFitsError, match="even batch size 1") as raised:
        find_batch_size(4, probe_failing_above(0, cpu_out_of_memory, calls),
                        predicted_bytes=lambda batch: 2**30, log=None)
    assert calls == [4, 3, 2, 1]
    message = str(raised.value)
    for advice in ("max_new_tokens", "seq_len", "gradient checkpointing", "LoRA"):
        assert advice in message
    assert "predicted 1.00 GiB" in message
    assert should_reduce_batch_size(raised.value.__cause__)  # the last OOM is chained
    assert not should_reduce_batch_size(raised.value)  # an outer finder must not shrink on it


@pytest.mark.parametrize("start, backoff", [(0, 0.9), (-3, 0.9), (2.5, 0.9), (8, 1.0), (8, 0)])
def test_bad_arguments_are_named(start, backoff):
    with pytest.raises(ValueError, match="start_batch|backoff"):
        find_batch_size(start, lambda batch: measurement(batch), backoff=backoff, log=None)


# ---------------------------------------------------------------------------------------------
# The probes, with the real tiny model on CPU.


@pytest.fixture(scope="module")
def tiny():
    tiny_model = pytest.importorskip("workbook.tiny_model")
    path = tiny_model.ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


PROMPT = "What is 23 + 45?"
FORCED_NEW_TOKENS = 24


def test_generation_probe_forces_the_full_length(tiny):
    model, tokenizer = tiny
    batch = tokenizer([PROMPT] * 2, return_tensors="pt")
    with torch.no_grad():
        free = model.generate(**batch, max_new_tokens=FORCED_NEW_TOKENS, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    stops_at = free.shape[1] - batch["input_ids"].shape[1]
    assert stops_at < FORCED_NEW_TOKENS  # left alone, the model answers and ends the text

    probe = generation_probe(model, tokenizer, PROMPT, FORCED_NEW_TOKENS)
    result = probe(3)
    assert result.generated_tokens == FORCED_NEW_TOKENS
    assert result.prompt_tokens == batch["input_ids"].shape[1]
    assert result.sequence_tokens == result.prompt_tokens + FORCED_NEW_TOKENS
    assert result.batch_size == 3 and result.device == "cpu"
    assert result.peak_bytes is None and result.peak_reserved_bytes is None  # CPU: not measured


def test_generation_probe_takes_token_ids(tiny):
    model, tokenizer = tiny
    ids = tokenizer(PROMPT)["input_ids"]
    result = generation_probe(model, None, ids, 5)(2)
    assert result.generated_tokens == 5 and result.prompt_tokens == len(ids)


@pytest.mark.slow
def test_finder_with_the_real_generation_probe_returns_the_threshold(tiny):
    model, tokenizer = tiny
    real_probe = generation_probe(model, tokenizer, PROMPT, FORCED_NEW_TOKENS)
    threshold, ran = 4, []

    def probe(batch):
        if batch > threshold:
            raise cpu_out_of_memory()
        ran.append(batch)
        return real_probe(batch)

    result = find_batch_size(7, probe, log=None)
    assert result.batch_size == threshold
    assert [attempt.batch_size for attempt in result.attempts] == [7, 6, 5, 4]
    assert ran == [threshold]
    assert result.measurement.generated_tokens == FORCED_NEW_TOKENS


def test_training_probe_leaves_the_model_unchanged(tiny):
    model, _ = tiny
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    optimizers = []

    def adamw_at_lr_zero(parameters):
        optimizers.append(torch.optim.AdamW(parameters, lr=0.0, weight_decay=0.1))
        return optimizers[-1]

    result = training_probe(model, seq_len=32, optimizer_factory=adamw_at_lr_zero)(2)
    assert result.sequence_tokens == 32 and result.peak_bytes is None
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    assert len(optimizers[0].state) == len(trainable)  # the step ran: both moments exist
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert not model.training  # back in the mode it was in (eval)

    training_probe(model, seq_len=16)(1)  # the default optimizer (AdamW, lr=0)
    assert all(torch.equal(before[name], model.state_dict()[name]) for name in before)


# ---------------------------------------------------------------------------------------------
# What the finder records and says, with stand-in probes.


def test_a_measured_peak_is_the_reserved_peak_plus_the_memory_outside_pytorch():
    # On a GPU the attempt and the result carry what the device really needed: the allocator's reserved
    # peak plus the CUDA context and any other process, not the reserved peak alone.
    def probe_on_a_gpu(batch):
        return ProbeMeasurement(batch_size=batch, device="cuda:0", seconds=0.1, peak_reserved_bytes=30 * 2**30,
                                peak_allocated_bytes=28 * 2**30, non_pytorch_bytes=2**30, sequence_tokens=16)

    result = find_batch_size(4, probe_on_a_gpu, log=None)
    assert result.attempts[0].peak_bytes == result.measured_peak_bytes == 31 * 2**30
    assert result.to_dict()["measurement"]["peak_bytes"] == 31 * 2**30


def test_when_nothing_fits_the_message_gives_batch_ones_prediction_and_every_batch_tried():
    with pytest.raises(NoBatchFitsError) as raised:
        find_batch_size(3, probe_failing_above(0, cuda_out_of_memory, []),
                        predicted_bytes=lambda batch: batch * 2**30, log=None)
    message = str(raised.value)
    assert "(the planner predicted 1.00 GiB for it)" in message  # batch 1's figure, not batch 3's
    assert "tried batch sizes 3, 2, 1." in message


def test_a_start_at_batch_one_that_runs_out_of_memory_stops_at_once():
    calls = []

    def probe(batch):
        calls.append(batch)
        if len(calls) > 1:  # a finder that retried batch 1 would loop for ever
            raise AssertionError(f"batch 1 retried: {calls}")
        raise cuda_out_of_memory()

    with pytest.raises(NoBatchFitsError, match="tried batch sizes 1[.]"):
        find_batch_size(1, probe, log=None)
    assert calls == [1]


def test_memory_is_freed_before_the_first_attempt_and_before_every_retry(monkeypatch):
    # The failed attempt's cached blocks must go back to the device before the smaller batch runs, or
    # the retry can run out of memory on memory nothing uses any more.
    from workbook.planner import finder
    events = []
    monkeypatch.setattr(finder, "clear_device_cache",
                        lambda garbage_collection=False: events.append(("free", garbage_collection)))
    find_batch_size(4, probe_failing_above(2, cuda_out_of_memory, events), log=None)
    assert events == [("free", True), 4, ("free", True), 3, ("free", True), 2]


def test_a_long_out_of_memory_message_is_cut_to_the_record_limit():
    from workbook.planner.finder import ERROR_TEXT_LIMIT
    result = find_batch_size(2, probe_failing_above(
        1, lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. " + "x" * 1000), []), log=None)
    error = result.attempts[0].error
    assert len(error) == ERROR_TEXT_LIMIT and error.endswith("...")
    assert error.startswith("OutOfMemoryError: CUDA out of memory. xxx")
