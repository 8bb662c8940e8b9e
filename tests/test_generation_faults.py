"""The faults a long generation run meets: text that is not Unicode, a second job on the same output,
no prompts, a folder it cannot write, a full disk, edited prompts or settings under resume. Each ends
in one clear error (or a recorded failure) with nothing lost."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbook import arithmetic, cli, generation, jsonl, runtime
from workbook.generation import job, records
from workbook.paths import REPO_ROOT

from test_generate import GREEDY_SET, job_params, read_records, write_prompts

QUIET = dict(log=lambda line: None, show_progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return generation.load_model(str(tiny_model_path), "fp32", "cpu")


def run(tiny, prompts, output, **changes):
    return generation.run_job(job_params(prompts, output, **changes), output, model=tiny[0], tokenizer=tiny[1],
                              **QUIET)


def ids_in(path):
    return [r["metadata"]["example_id"] for r in read_records(path)]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if the job gets as far as loading a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the problem was found")
    monkeypatch.setattr(job, "load_model", refuse)


# ----------------------------------------------------------------------------------------------
# Text that is not valid Unicode: a bad line when read, a failure of its own record when written.

SURROGATE_LINES = ['{"id": "s1", "input": "What is 1 + 1?\\ud800"}',
                   '{"id": "s2", "input": "What is 2 + 2?", "meta": {"tags": ["ok", "\\udc80"]}}']


def test_text_that_is_not_unicode_is_a_bad_line_by_the_policy_not_a_blocked_batch(tmp_path, tiny):
    good = arithmetic.sample_records()[:4]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join([json.dumps(good[0]), *SURROGATE_LINES, *map(json.dumps, good[1:])]) + "\n")
    output = tmp_path / "out.jsonl"
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:2: field 'input' holds an unpaired surrogate"):
        run(tiny, prompts, output)
    summary = run(tiny, prompts, output, on_bad_line="skip")
    assert ids_in(output) == [r["id"] for r in good] and summary["unaccounted"] == 0
    failures = {f["line"]: f for f in read_records(tmp_path / "out.failures.jsonl")}
    assert sorted(failures) == [2, 3] and {f["stage"] for f in failures.values()} == {"input"}
    assert "field 'meta.tags[1]'" in failures[3]["error"]


def test_a_record_that_cannot_be_written_fails_alone_and_its_batch_is_written(tmp_path, tiny, monkeypatch):
    good = arithmetic.sample_records()[:6]
    prompts = write_prompts(tmp_path / "in.jsonl", good)
    output = tmp_path / "out.jsonl"
    unwritable_id = good[2]["id"]
    real_output_record = records.output_record

    def with_a_lone_surrogate(example, **fields):
        record = real_output_record(example, **fields)
        if example.example_id == unwritable_id:
            record["output"] += "\udc80"  # e.g. a decoder that split a character
        return record

    monkeypatch.setattr(records, "output_record", with_a_lone_surrogate)
    summary = run(tiny, prompts, output, batch_size=6)
    assert sorted(ids_in(output)) == sorted(r["id"] for r in good if r["id"] != unwritable_id)
    failure, = read_records(tmp_path / "out.failures.jsonl")
    assert failure["example_id"] == unwritable_id and failure["stage"] == "write"
    assert "cannot write its output record" in failure["error"]
    assert summary["failed"] == 1 and summary["generated"] == 5 and summary["unaccounted"] == 0
    monkeypatch.setattr(records, "output_record", real_output_record)
    assert run(tiny, prompts, output)["generated"] == 1  # the rerun retries it
    assert ids_in(output) == [r["id"] for r in good] and not (tmp_path / "out.failures.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# One job per output: a second one is refused, naming the holder.

HOLDER_SCRIPT = """
import os, sys, time
from workbook import generation, params
from workbook.paths import PARAMS_DIR

prompts, output, release = sys.argv[1:4]
values = params.load(PARAMS_DIR / "cpu.yaml")
values.update(prompts_path=prompts, output_path=output, log_every_batches=0, batch_size=2, do_sample=False,
              samples_per_prompt=1, max_accepted_per_prompt=0)
model, tokenizer = generation.load_model(values["model"], "fp32", "cpu")


class WaitsForRelease:
    # The model, except that it generates only once the test has made the release file.
    def generate(self, *args, **kwargs):
        while not os.path.exists(release):
            time.sleep(0.05)
        return model.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(model, name)


summary = generation.run_job(values, output, model=WaitsForRelease(), tokenizer=tokenizer, show_progress=False)
print("in_output", summary["in_output"])
"""


@pytest.mark.multiprocess
def test_a_second_job_on_the_same_output_is_refused_naming_the_first(tmp_path, capsys):
    records_in = arithmetic.sample_records()[:6]
    prompts = write_prompts(tmp_path / "in.jsonl", records_in)
    output, release, lock = tmp_path / "out.jsonl", tmp_path / "release", tmp_path / "out.lock"
    first = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, str(prompts), str(output), str(release)],
                             cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while f'"pid": {first.pid}' not in (lock.read_text() if lock.exists() else "") and first.poll() is None:
            assert time.monotonic() < deadline, "the first job never took the lock"
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-2000:]
        # The second job: this process, through the CLI.
        code = cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}", f"output_path={output}",
                         "log_every_batches=0", *GREEDY_SET])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and error.startswith(f"error: another job is writing {output}: its lock {lock} is held "
                                              f"by process {first.pid} on host ")
        assert "set output_path to another file" in error
        assert not output.exists() or output.read_text() == ""  # the refused job wrote nothing
    finally:
        release.touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert "in_output 6" in out and ids_in(output) == [r["id"] for r in records_in]
    assert not lock.exists()  # released and removed


@pytest.mark.multiprocess
def test_sibling_processes_of_one_job_share_its_lock_and_all_stop_when_another_job_holds_it(tmp_path):
    # torchrun starts the processes side by side, as accelerate launch does: none is the other's parent.
    records_in = arithmetic.sample_records()[:12]
    prompts = write_prompts(tmp_path / "in.jsonl", records_in)
    output = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "workbook.generation", "--params", "cpu", "--set", f"prompts_path={prompts}",
               f"output_path={output}", "batch_size=4", "log_every_batches=0", "interactive=false", "verifier=", *GREEDY_SET]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}
    with runtime.ExclusiveLock(tmp_path / "out.lock"):  # another job's
        refused = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and refused.stderr.count(f"error: another job is writing {output}") >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no process wrote anything
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ids_in(output) == [r["id"] for r in records_in]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl", "out.summary.json"]


def test_a_lock_left_by_a_killed_job_blocks_nothing_and_is_refused_only_while_held(tmp_path):
    path = tmp_path / "out.lock"
    path.write_text('{"pid": 999999, "host": "gone", "since": "2025-01-01T00:00:00+00:00"}\n')  # after kill -9
    with runtime.ExclusiveLock(path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(runtime.LockHeldError) as held:
            runtime.ExclusiveLock(path).acquire()
        assert f"process {os.getpid()} on host " in held.value.holder
    assert not path.exists()


# ----------------------------------------------------------------------------------------------
# No prompts at all.

@pytest.mark.parametrize("content, reason", [("", "the file is empty"), ("\n  \n\n", "it holds only blank lines")])
def test_an_empty_prompts_file_says_there_is_nothing_to_generate(tmp_path, content, reason, no_model_loading):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(content)
    with pytest.raises(generation.GenerationError, match=rf"no prompts to generate in .*in.jsonl: {reason}\. "):
        generation.run_job(job_params(prompts, tmp_path / "out.jsonl"), tmp_path / "out.jsonl", **QUIET)


def test_all_bad_lines_are_listed_before_saying_there_is_nothing_to_generate(tmp_path, capsys, no_model_loading):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"text": "no prompt"}\n{broken\n\n{"input": ""}\n')
    output = tmp_path / "out.jsonl"
    settings = ["--set", f"prompts_path={prompts}", f"output_path={output}", "on_bad_line=skip"]
    for _ in range(2):  # a rerun lists each line once
        assert cli.main(["generate", "--params", "cpu", *settings]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith(f"error: no prompts to generate in {prompts}: all 3 of its lines are bad and were "
                                f"skipped (listed in {tmp_path / 'out.failures.jsonl'})")
        assert [(f["line"], f["stage"]) for f in read_records(tmp_path / "out.failures.jsonl")] == [
            (1, "input"), (2, "input"), (4, "input")]


# ----------------------------------------------------------------------------------------------
# Where the output goes: checked before the model loads.

@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs to fill (mounting needs root), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is tested on a small tmpfs, and mounting one needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill the disk but ``leave_bytes`` (whole 4 KiB pages) with one file, returned."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    with filler.open("ab") as handle:
        handle.write(b"x" * (stats.f_bavail * stats.f_frsize - leave_bytes))
    return filler


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes whatever the mode says: a read-only mount is the real thing
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
        yield folder
        subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, read_only_folder, capsys,
                                                                             no_model_loading):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:2])
    (tmp_path / "a-file").write_text("")
    cases = {tmp_path: f"output_path {tmp_path} is a folder; set it to a file in it, e.g. "
                       f"output_path={tmp_path / 'generations.jsonl'}",
             tmp_path / "a-file" / "out.jsonl": f"is inside {tmp_path / 'a-file'}, which is a file, not a folder",
             read_only_folder / "out.jsonl": f"cannot write in {read_only_folder} (creating the lock file out.lock: "}
    for output, message in cases.items():
        assert cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}",
                         f"output_path={output}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("error: ") and message in lines[-1], lines


def test_output_path_naming_the_prompts_or_another_file_is_refused_by_name(tmp_path, no_model_loading):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:3])
    other = write_prompts(tmp_path / "other.jsonl", arithmetic.sample_records()[3:5])
    with pytest.raises(generation.GenerationError, match=r"output_path .*in.jsonl would overwrite the prompts file"):
        generation.run_job(job_params(prompts, prompts), prompts, **QUIET)
    with pytest.raises(generation.GenerationError, match=r"other.jsonl:1 is not an output record .*set output_path "
                                                         r"to a new file"):
        generation.run_job(job_params(prompts, other), other, **QUIET)
    assert other.read_text().count("\n") == 2  # untouched
    # The prompts named as a file the job writes beside its output (the verifier's accepted records replaced
    # them, and the job exited 0), before or after that file exists.
    accepted = write_prompts(tmp_path / "out.accepted.jsonl", arithmetic.sample_records()[:3])
    before = accepted.read_text()
    with pytest.raises(generation.GenerationError, match=r"as out.accepted.jsonl, a file this job writes"):
        generation.run_job(job_params(accepted, tmp_path / "out.jsonl"), tmp_path / "out.jsonl", **QUIET)
    assert accepted.read_text() == before
    summary = tmp_path / "run.summary.json"
    summary.write_text(before)
    with pytest.raises(generation.GenerationError, match=r"as run.summary.json"):
        generation.run_job(job_params(summary, tmp_path / "run.json"), tmp_path / "run.json", **QUIET)
    assert summary.read_text() == before


def test_a_full_disk_stops_the_run_with_what_is_safe_and_a_rerun_finishes_it(tmp_path, tiny, small_disk):
    good = arithmetic.sample_records()[:20]
    prompts = write_prompts(tmp_path / "in.jsonl", good)
    output = small_disk / "out.jsonl"
    filler = fill(small_disk, leave_bytes=2 * 4096)  # a page for the lock's note, one for a few records
    with pytest.raises(generation.GenerationError) as stopped:
        run(tiny, prompts, output, batch_size=2)
    written = ids_in(output)
    assert 0 < len(written) < 20 and output.read_text().endswith("\n")  # whole lines only
    assert f"the disk is full (No space left on device: {output}): stopped with {len(written)} of 20 outputs " \
           f"safely written to {output}. Free some space and rerun the same command" in str(stopped.value)
    filler.unlink()
    assert run(tiny, prompts, output, batch_size=2)["generated"] == 20 - len(written)
    assert ids_in(output) == [r["id"] for r in good]


def test_a_merge_without_room_keeps_every_record_and_does_not_fail_the_rerun(tmp_path, tiny, small_disk):
    good = arithmetic.sample_records()[:20]
    prompts = write_prompts(tmp_path / "in.jsonl", good)
    output = small_disk / "out.jsonl"
    run(tiny, prompts, output)
    ordered = output.read_text()
    unordered = "".join(reversed(ordered.splitlines(keepends=True)))  # as a killed run leaves it: unmerged
    output.write_text(unordered)
    filler = fill(small_disk, leave_bytes=4096)  # less than a second copy of the output
    for _ in range(2):
        lines = []
        summary = generation.run_job(job_params(prompts, output), output, model=tiny[0], tokenizer=tiny[1],
                                     log=lines.append, show_progress=False)
        assert summary["merged"] is False and summary["in_output"] == 20 and summary["unaccounted"] == 0
        assert any(line.startswith("warning: the disk is full") and "all 20 outputs are safe" in line for line in lines)
        assert output.read_text() == unordered and sorted(os.listdir(small_disk)) == ["filler", "out.jsonl",
                                                                                    "out.summary.json"]
    filler.unlink()
    assert run(tiny, prompts, output)["merged"] is True and output.read_text() == ordered
    fill(small_disk, leave_bytes=0)
    assert run(tiny, prompts, output)["merged"] is True  # in order already: nothing to rewrite, no room needed
    assert output.read_text() == ordered


# ----------------------------------------------------------------------------------------------
# Resume matches prompts and settings, not only ids.

def test_resume_refuses_an_edited_prompt_or_other_settings_by_name(tmp_path, tiny):
    good = arithmetic.sample_records()[:6]
    prompts = write_prompts(tmp_path / "in.jsonl", good)
    output = tmp_path / "out.jsonl"
    run(tiny, prompts, output, max_new_tokens=4)
    written = output.read_text()
    assert len({r["metadata"]["settings_fingerprint"] for r in read_records(output)}) == 1
    edited = [dict(r) for r in good]
    edited[3]["input"] = "What is 40 + 2?"
    write_prompts(prompts, edited)
    with pytest.raises(generation.GenerationError, match=rf"1 prompt\(s\) in .*in.jsonl changed since their outputs "
                                                         rf"were written to .*out.jsonl: id '{good[3]['id']}'\. .*set "
                                                         r"output_path to a new file, or delete those ids' lines"):
        run(tiny, prompts, output, max_new_tokens=4)
    write_prompts(prompts, good)
    changes = {"'max_new_tokens': 5": dict(max_new_tokens=5),
               "this run: tiny with {'temperature': 0.7": dict(do_sample=True, temperature=0.7, max_new_tokens=4),
               "so dtype, use_chat_template or system_prompt differ": dict(use_chat_template=False, max_new_tokens=4),
               "this run: " + str(tmp_path) + " with": dict(model=str(tmp_path), max_new_tokens=4),  # another teacher
               "the same model and decoding (tiny with": dict(dtype="bf16", max_new_tokens=4),
               "system_prompt differ": dict(system_prompt="You add numbers.", max_new_tokens=4)}
    for shown, change in changes.items():
        with pytest.raises(generation.GenerationError, match=r"out.jsonl holds 6 output\(s\) made with other "
                                                             r"settings than this run's.*new file for these settings"
                           ) as refused:
            run(tiny, prompts, output, **change)
        assert shown in str(refused.value)
    assert output.read_text() == written  # nothing was mixed in
    assert run(tiny, prompts, output, max_new_tokens=4)["generated"] == 0


def test_outputs_written_before_fingerprints_are_checked_on_what_they_record(tmp_path, tiny):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:4])
    output = tmp_path / "out.jsonl"
    run(tiny, prompts, output, max_new_tokens=4)
    older = read_records(output)
    for record in older:
        del record["metadata"]["settings_fingerprint"]
    write_prompts(output, older)
    assert run(tiny, prompts, output, max_new_tokens=4)["generated"] == 0
    with pytest.raises(generation.GenerationError, match="made with other settings"):
        run(tiny, prompts, output, max_new_tokens=5)
