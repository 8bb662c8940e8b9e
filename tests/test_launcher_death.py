"""A launcher killed hard (kill -9, the out-of-memory killer, a preempted job) takes its workers with
it within seconds, whatever they were doing, and leaves what the same command, run again, finishes:
every id exactly once, the training run continued. A worker whose peer is gone or silent stops after
peer_timeout_seconds, naming the peer's rank.

The workers are the tiny model's architecture with untrained weights, built here in a second: what
is proven is the processes' lives and the files they leave, not the text (greedy, so still the same
every run)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from workbook import arithmetic, runtime
from workbook.paths import REPO_ROOT

from process_tree import descendants, kill_all, kill_tree

pytestmark = pytest.mark.multiprocess

GONE_WITHIN_SECONDS = 10.0  # the watch polls every 0.2 s; the rest is a loaded shared machine's slack
START_SECONDS = 240  # a launch's imports and model load, on two cores other jobs use too
GENERATE = ["-m", "workbook.generation", "--params", "cpu", "--set", "prompts_path=in.jsonl",
            "output_path=out/teacher.jsonl", "log_every_batches=0", "interactive=false", "verifier=",
            "do_sample=false", "samples_per_prompt=1", "max_new_tokens=8", "batch_size=2"]
TRAIN = ["-m", "workbook.training", "--params", "cpu", "--set", "train_data_path=pairs.jsonl", "validation_fraction=0",
         "micro_batch_size=2", "learning_rate=1e-3", "max_steps=12", "warmup_steps=0", "save_every_steps=1",
         "train_processes=2", "eval_prompts_path=", "--run-dir", "run"]


@pytest.fixture(scope="module")
def untrained_tiny(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from workbook import tiny_model
    folder = tmp_path_factory.mktemp("models") / "untrained-tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_model.tiny_config()).save_pretrained(folder)
    tiny_model.build_tokenizer().save_pretrained(folder)
    return folder


def torchrun(*arguments):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *arguments]


def start(command, folder):
    """The command in ``folder``, its output in a file (a pipe no one reads would stall the workers)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib"), "OMP_NUM_THREADS": "1"}
    log = open(folder / "launch.log", "a")
    try:
        return subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    finally:
        log.close()


def running(pid):
    """Whether any thread of the process still runs. Its main thread alone can read as a zombie while
    another one, in an fsync say, has not ended yet: the process's files (the output's lock) stay open
    until the last thread ends."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            state = open(f"/proc/{pid}/task/{task}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def wait_until(condition, what, launcher, seconds=START_SECONDS, folder=None):
    deadline = time.monotonic() + seconds
    while not condition():
        log = (folder / "launch.log").read_text()[-3000:] if folder else ""
        assert launcher.poll() is None, f"the launch ended before {what}:\n{log}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s:\n{log}"
        time.sleep(0.02)


def kill_launcher(launcher, workers):
    """SIGKILL the launcher alone, as the out-of-memory killer would; seconds until its last worker ended."""
    assert workers and all(running(pid) for pid in workers), "the workers were not running at the kill"
    os.kill(launcher.pid, signal.SIGKILL)
    killed = time.monotonic()
    launcher.wait()
    while any(running(pid) for pid in workers):
        if time.monotonic() - killed > 60:
            kill_all(workers)  # leave nothing behind, then fail
            pytest.fail(f"workers {[pid for pid in workers if running(pid)]} still ran 60 s after their launcher's kill")
        time.sleep(0.02)
    return time.monotonic() - killed


def finish(command, folder, timeout=420):
    launcher = start(command, folder)
    try:
        launcher.wait(timeout=timeout)
    finally:
        kill_tree(launcher.pid)
    assert launcher.returncode == 0, (folder / "launch.log").read_text()[-4000:]


def lines_in(paths):
    return sum(path.read_bytes().count(b"\n") for path in paths if path.exists())


def ids_in(path):
    return [json.loads(line)["metadata"]["example_id"] for line in path.read_text().splitlines()]


def lock_is_free(path):
    with runtime.ExclusiveLock(path):  # raises LockHeldError while any process holds it
        return True


def prompts_in(folder, count):
    folder.mkdir(exist_ok=True)
    records = arithmetic.sample_records()[:count]
    (folder / "in.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return [record["id"] for record in records]


def start_then_kill(command, folder, kill_when, workers_expected=2):
    """Start ``command`` in ``folder``, SIGKILL its launcher once ``kill_when()`` holds, and return the
    seconds until its last worker ended (the launcher's descendants at the kill)."""
    launcher = start(command, folder)
    wait_until(lambda: len(descendants(launcher.pid)) >= workers_expected, "workers", launcher, folder=folder)
    wait_until(kill_when, "phase to kill in", launcher, folder=folder)
    return kill_launcher(launcher, descendants(launcher.pid))


def record_seconds(case, seconds):
    """Print the measurement (pytest -s shows it; outputs/reference/cpu/launcher_death.md quotes a run)."""
    print(f"\n{case}: last worker ended {seconds:.2f} s after the launcher's SIGKILL")


@pytest.mark.parametrize("layout", ["tensor_parallel_size=2", "tensor_parallel_size=1"])
def test_generation_workers_end_with_a_killed_torchrun_and_the_rerun_writes_every_id_once(tmp_path, untrained_tiny,
                                                                                        layout):
    ids = prompts_in(tmp_path, 120)
    command = torchrun(*GENERATE, f"model={untrained_tiny}", layout)
    out = tmp_path / "out"
    written = lambda: lines_in(out.glob("teacher*.jsonl"))  # the output, or the data-parallel parts
    # Start-up: the workers exist, nothing is generated yet (importing, loading, joining the group).
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: True)
    record_seconds(f"generation {layout}, start-up", seconds)
    assert seconds < GONE_WITHIN_SECONDS and written() == 0
    # Loaded: the model is in every worker, the group joined, generation about to start.
    log = tmp_path / "launch.log"
    starts = log.read_text().count(" to generate with ")
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: log.read_text().count(" to generate with ") > starts)
    record_seconds(f"generation {layout}, loaded", seconds)
    assert seconds < GONE_WITHIN_SECONDS
    # Mid-run: a few batches written.
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: written() >= 4)
    record_seconds(f"generation {layout}, mid-run", seconds)
    assert seconds < GONE_WITHIN_SECONDS
    before_rerun = written()
    assert 4 <= before_rerun < len(ids)
    assert lock_is_free(out / "teacher.lock")
    finish(command, tmp_path)
    assert ids_in(out / "teacher.jsonl") == ids  # each exactly once, in input order
    summary = json.loads((out / "teacher.summary.json").read_text())
    assert summary["in_output"] == len(ids) and summary["unaccounted"] == 0
    assert summary["generated"] == len(ids) - before_rerun  # what was written before the kill is not generated again
    assert not list(out.glob("teacher.part-*"))


def test_notebook_launchers_forked_workers_end_with_it_and_release_the_output_lock(tmp_path, untrained_tiny):
    """`workbook generate` with data_parallel_processes=2 forks its workers (accelerate's notebook_launcher)
    and holds the output's lock for them: killed, it must leave no worker holding it."""
    ids = prompts_in(tmp_path, 120)
    command = [sys.executable, *GENERATE, f"model={untrained_tiny}", "data_parallel_processes=2"]
    out = tmp_path / "out"
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: lines_in(out.glob("teacher*.jsonl")) >= 4)
    record_seconds("generation notebook_launcher x2, mid-run", seconds)
    assert seconds < GONE_WITHIN_SECONDS
    assert lock_is_free(out / "teacher.lock")
    finish(command, tmp_path)
    assert ids_in(out / "teacher.jsonl") == ids


@pytest.mark.parametrize("launcher", ["torchrun", "notebook_launcher"])
def test_training_workers_end_with_their_killed_launcher_and_the_rerun_continues_the_same_run(tmp_path, untrained_tiny,
                                                                                            launcher):
    pairs = "".join(json.dumps({"input": f"What is {i} + {2 * i}?", "output": str(3 * i)}) + "\n" for i in range(60))
    (tmp_path / "pairs.jsonl").write_text(pairs)
    train = [*TRAIN[:5], f"model={untrained_tiny}", *TRAIN[5:]]
    # torchrun starts both processes; `workbook train` forks them itself (accelerate's notebook_launcher).
    command = torchrun(*train) if launcher == "torchrun" else [sys.executable, *train]
    saved = lambda: sorted((tmp_path / "run" / "training" / "checkpoints").glob("step-*/workbook_state.json"))
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: True)
    record_seconds(f"training {launcher} x2, start-up", seconds)
    assert seconds < GONE_WITHIN_SECONDS and not saved()
    seconds = start_then_kill(command, tmp_path, kill_when=lambda: len(saved()) >= 2)
    record_seconds(f"training {launcher} x2, mid-run", seconds)
    assert seconds < GONE_WITHIN_SECONDS
    resumable = json.loads(saved()[-1].read_text())["step"]
    assert 2 <= resumable < 12
    finish(command, tmp_path)
    metrics = json.loads((tmp_path / "run" / "training_metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["settings"]["processes"] == 2
    assert metrics["steps"]["reached"] == 12 and resumable <= metrics["steps"]["resumed_from"] < 12
    assert [record["step"] for record in metrics["history"]] == list(range(1, 13))  # one run's curve, no step twice
    assert (tmp_path / "run" / "training" / "final" / "config.json").is_file()


def test_a_silent_tensor_parallel_peer_stops_the_other_within_the_timeout_naming_its_rank(tmp_path, untrained_tiny):
    """A peer that hangs (stopped, as a machine that stops answering) holds the other at its next
    exchange for peer_timeout_seconds, not torch's 30 minutes; the error names the rank."""
    prompts_in(tmp_path, 120)
    timeout = 15
    command = torchrun(*GENERATE, f"model={untrained_tiny}", "tensor_parallel_size=2", f"peer_timeout_seconds={timeout}")
    launcher = start(command, tmp_path)
    rank_one = None
    try:
        wait_until(lambda: lines_in([tmp_path / "out" / "teacher.jsonl"]) >= 4, "output", launcher, folder=tmp_path)
        (rank_one,) = [pid for pid in descendants(launcher.pid)
                       if b"\0RANK=1\0" in b"\0" + open(f"/proc/{pid}/environ", "rb").read()]
        os.kill(rank_one, signal.SIGSTOP)
        stopped = time.monotonic()
        log = tmp_path / "launch.log"
        while "error: rank 0 of 2 stopped: rank 1 of 2 stopped answering" not in log.read_text():
            assert time.monotonic() - stopped < timeout + 60, log.read_text()[-3000:]
            time.sleep(0.1)
        waited = time.monotonic() - stopped
        print(f"\nrank 0 named the silent rank 1 {waited:.1f} s after it stopped (peer_timeout_seconds {timeout})")
        assert timeout - 1 < waited < timeout + 45
        assert f"peer_timeout_seconds ({timeout} s" in log.read_text()
    finally:
        kill_tree(launcher.pid)
        launcher.wait()


def test_a_child_the_workbook_starts_ends_with_it_even_when_another_process_is_its_parent(tmp_path):
    """The forecast's pilot and the benchmark's steps start their children with
    launcher_watch.child_environment: such a child ends when the process that named itself in it dies,
    here a grandparent, and at once when it is already gone before the child looks."""
    from workbook import launcher_watch
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}
    marker = tmp_path / "child.pid"
    child = (f"import os, time, workbook; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    middle = (f"import subprocess, sys, time; from workbook import launcher_watch; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}], env=launcher_watch.child_environment()); "
              f"time.sleep(120)")
    launcher = subprocess.Popen([sys.executable, "-c", middle], env=env)
    wait_until(lambda: marker.exists() and marker.read_text(), "child", launcher, seconds=120)
    grandchild = int(marker.read_text())
    assert kill_launcher(launcher, [grandchild]) < GONE_WITHIN_SECONDS
    # Named launcher already dead: the child stops at its first import of workbook.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    named = {**env, launcher_watch.LAUNCHER_VARIABLE: f"{gone.pid}:1"}
    done = subprocess.run([sys.executable, "-c", "import workbook; print('still here')"], env=named,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and "still here" not in done.stdout
    # A process nobody launched is left alone.
    alone = {key: value for key, value in env.items() if key not in ("LOCAL_RANK", launcher_watch.LAUNCHER_VARIABLE)}
    done = subprocess.run([sys.executable, "-c", "import workbook; print('still here')"], env=alone,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "still here" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_killed_launchers_workers_give_the_gpus_memory_back(tmp_path, untrained_tiny):
    """torchrun on one or two GPUs, killed mid-run: the memory its workers held is free again within
    seconds (read through NVML, as nvidia-smi reads it), and the rerun finishes the job."""
    import pynvml
    processes = min(2, torch.cuda.device_count())
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(processes)]
    used = lambda: [pynvml.nvmlDeviceGetMemoryInfo(handle).used for handle in handles]
    before = used()
    ids = prompts_in(tmp_path, 400)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               *GENERATE, f"model={untrained_tiny}", "max_new_tokens=32"]
    out = tmp_path / "out"
    mebibyte = 1 << 20
    launcher = start(command, tmp_path)
    wait_until(lambda: lines_in(out.glob("teacher*.jsonl")) >= 4, "output", launcher, folder=tmp_path)
    held = used()
    assert all(now > then + 100 * mebibyte for now, then in zip(held, before)), (before, held)  # CUDA contexts
    seconds = kill_launcher(launcher, descendants(launcher.pid))
    record_seconds(f"generation torchrun x{processes} on GPU, mid-run", seconds)
    assert seconds < GONE_WITHIN_SECONDS
    deadline = time.monotonic() + GONE_WITHIN_SECONDS
    while any(now > then + 64 * mebibyte for now, then in zip(used(), before)):
        assert time.monotonic() < deadline, f"GPU memory used {used()} bytes, {before} before the launch"
        time.sleep(0.1)
    print(f"GPU memory back to its level before the launch {time.monotonic() - deadline + GONE_WITHIN_SECONDS:.2f} s "
          f"after the last worker ended (held {[h // mebibyte for h in held]} MiB mid-run)")
    finish(command, tmp_path)
    assert ids_in(out / "teacher.jsonl") == ids
