"""Several nodes, proven on one machine: two ``torchrun --nnodes 2`` invocations on a loopback
rendezvous (gloo), each node in its own working directory, so that no file is shared between them."""

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from workbook import arithmetic, generation, runtime
from workbook.paths import REPO_ROOT

from process_tree import kill_tree

def start_nodes(tmp_path, module_and_args, port=None, launcher="torchrun"):
    """Node 0 and node 1, each a torchrun (or an ``accelerate launch``, with the README's flags) of one
    process in tmp_path/node0 and tmp_path/node1."""
    port = port or runtime.free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib"), "OMP_NUM_THREADS": "1"}
    nodes = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir(exist_ok=True)
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                       "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                       "-m", *module_and_args]
        else:  # --num_processes counts every process of every machine
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                       "--machine_rank", str(node), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                       "--main_process_port", str(port), "-m", *module_and_args]
        nodes.append(subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return nodes


def finish(nodes, timeout=300):
    results = [node.communicate(timeout=timeout) for node in nodes]
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    return results


def kill(node):
    """kill -9 a node's launcher and its workers, as a machine that dies (torchrun starts each worker
    in a session of its own, so killing the launcher's group would leave them running)."""
    kill_tree(node.pid)
    node.communicate()


def lines_in(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


GENERATE = ["workbook.generation", "--params", "cpu", "--set", "prompts_path=in.jsonl",
            "output_path=out/teacher.jsonl", "log_every_batches=0", "interactive=false", "verifier=",
            "do_sample=false", "samples_per_prompt=1"]  # one greedy output per prompt


def write_prompts_on_each_node(tmp_path, records):
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir(exist_ok=True)
        (tmp_path / f"node{node}" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def ids_in(path):
    return [json.loads(line)["metadata"]["example_id"] for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
def test_two_nodes_without_a_shared_disk_write_every_id_once_on_the_first_as_one_process_does(tmp_path):
    records = arithmetic.sample_records()[:12]
    write_prompts_on_each_node(tmp_path, records)
    single = tmp_path / "single.jsonl"
    generation.launch(generation_params(tmp_path / "node0" / "in.jsonl", single, batch_size=4), log=lambda line: None)
    finish(start_nodes(tmp_path, [*GENERATE, "batch_size=4"]))
    output = tmp_path / "node0" / "out" / "teacher.jsonl"
    assert output.read_text() == single.read_text()  # greedy: the same records, in the same order, byte for byte
    summary = json.loads((tmp_path / "node0" / "out" / "teacher.summary.json").read_text())
    assert summary["nodes"] == 2 and summary["processes"] == 2 and summary["parts_sent_over_network_by_ranks"] == [1]
    assert summary["in_output"] == 12 and summary["unaccounted"] == 0
    assert [share["generated"] for share in summary["per_process"]] == [6, 6]
    assert sorted(p.name for p in (tmp_path / "node0" / "out").iterdir()) == ["teacher.jsonl", "teacher.summary.json"]
    assert list((tmp_path / "node1" / "out").iterdir()) == []  # node 1's part went to node 0, then was deleted


@pytest.mark.multiprocess
def test_the_readmes_accelerate_launch_over_two_machines_writes_every_id_on_the_first(tmp_path):
    """`accelerate launch --multi_gpu --num_machines 2 ...` as the README gives it (on CPU accelerate
    starts torchrun's agent all the same, and the processes use gloo)."""
    write_prompts_on_each_node(tmp_path, arithmetic.sample_records()[:8])
    finish(start_nodes(tmp_path, [*GENERATE, "batch_size=4"], launcher="accelerate"))
    summary = json.loads((tmp_path / "node0" / "out" / "teacher.summary.json").read_text())
    assert (summary["nodes"], summary["processes"], summary["in_output"], summary["unaccounted"]) == (2, 2, 8, 0)
    assert summary["parts_sent_over_network_by_ranks"] == [1]  # node 1's records came over the process group


@pytest.mark.multiprocess
def test_a_node_that_cannot_start_stops_every_node_with_its_error(tmp_path):
    write_prompts_on_each_node(tmp_path, arithmetic.sample_records()[:4])
    (tmp_path / "node1" / "in.jsonl").unlink()  # forgotten on node 1
    failed = start_nodes(tmp_path, [*GENERATE, "batch_size=4"])
    errors = [node.communicate(timeout=300)[1] for node in failed]
    assert all(node.returncode != 0 for node in failed)
    assert "error: in.jsonl: no such file." in errors[1]
    assert "error: process 1 of 2 stopped: in.jsonl: no such file." in errors[0]  # node 0 says why, not a broken pipe
    assert not (tmp_path / "node0" / "out" / "teacher.jsonl").exists()


@pytest.mark.multiprocess
def test_two_nodes_resume_after_one_is_killed_with_every_id_exactly_once(tmp_path):
    records = arithmetic.sample_records()[:120]  # enough that node 1 is mid-run when killed
    write_prompts_on_each_node(tmp_path, records)
    part = tmp_path / "node1" / "out" / "teacher.part-1.jsonl"
    nodes = start_nodes(tmp_path, [*GENERATE, "batch_size=2"])
    deadline = time.monotonic() + 180
    while lines_in(part) < 4 and nodes[1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nodes[1].poll() is None, "node 1 ended before it could be killed"
    kill(nodes[1])
    kill(nodes[0])  # its collectives would wait for node 1 (as a user stops the other node)
    written_on_node1 = lines_in(part)
    assert 0 < written_on_node1 < 60, written_on_node1
    (_, node0_err), _ = finish(start_nodes(tmp_path, [*GENERATE, "batch_size=2"]))
    output = tmp_path / "node0" / "out" / "teacher.jsonl"
    assert ids_in(output) == [r["id"] for r in records]  # each exactly once, in input order
    summary = json.loads((tmp_path / "node0" / "out" / "teacher.summary.json").read_text())
    assert summary["in_output"] == 120 and summary["unaccounted"] == 0
    # Node 1 resumed its own shard: what it wrote before the kill was not generated again.
    assert summary["per_process"][1]["generated"] == 60 - written_on_node1
    assert not part.exists()


def generation_params(prompts, output, **changes):
    from workbook import params
    from workbook.paths import PARAMS_DIR
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(prompts_path=str(prompts), output_path=str(output), log_every_batches=0, verifier="",
                  interactive=False, do_sample=False, samples_per_prompt=1, **changes)  # one greedy output per prompt
    return values


TRAIN_SETTINGS = ["train_data_path=pairs.jsonl", "validation_fraction=0", "micro_batch_size=2", "learning_rate=1e-3",
                  "max_steps=12", "warmup_steps=0", "save_every_steps=1"]


@pytest.mark.multiprocess
def test_two_nodes_train_as_one_process_with_the_same_global_batch_and_resume_after_a_kill(tmp_path):
    from workbook import runner, training
    pairs = "".join(json.dumps({"input": f"What is {i} + {2 * i}?", "output": str(3 * i)}) + "\n" for i in range(60))
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "pairs.jsonl").write_text(pairs)
    os.chdir(tmp_path / "node0")  # the one-process reference reads the same relative data path
    try:
        params = runner.resolve_params("cpu", [*TRAIN_SETTINGS, "gradient_accumulation_steps=2"])[0]
        one = training.launch(training.config_from_params(params, tmp_path / "one"))
    finally:
        os.chdir(REPO_ROOT)
    command = ["workbook.training", "--params", "cpu", "--set", *TRAIN_SETTINGS, "--run-dir", "run"]
    nodes = start_nodes(tmp_path, command)
    node1_checkpoints = tmp_path / "node1" / "run" / "training" / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(node1_checkpoints.glob("step-*/workbook_state.json")) and nodes[1].poll() is None:
        assert time.monotonic() < deadline, "node 1 never saved a checkpoint"
        time.sleep(0.01)
    kill(nodes[1])
    kill(nodes[0])
    # A forecast left in the training folder (as `workbook forecast --mode train` leaves it) is set
    # beside what the launched run measured, as a one-process run sets it.
    made = {"predicted_wall_seconds": 30.0, "predicted_wall_seconds_range": [20.0, 40.0],
            "pilot": {"share_of_job_steps": 0.1}}
    (tmp_path / "node0" / "run" / "training" / "forecast.json").write_text(json.dumps(made))
    finish(start_nodes(tmp_path, command))
    two = json.loads((tmp_path / "node0" / "run" / "training_metrics.json").read_text())
    assert two["forecast"]["predicted_wall_seconds"] == 30.0 and two["forecast"]["measured_wall_seconds"] > 0
    assert "launched: this rank's start" in two["forecast"]["measured"]
    assert 0 < two["steps"]["resumed_from"] < 12 and two["steps"]["reached"] == 12
    assert two["settings"]["processes"] == 2 and two["plan"]["effective_batch_rows"] == one["plan"]["effective_batch_rows"]
    # Steps before the kill come from the checkpoint's history, the rest from the resumed run: one
    # curve, equal to one process's up to the order of floating-point sums.
    assert [r["loss"] for r in two["history"]] == pytest.approx([r["loss"] for r in one["history"]], rel=1e-4)
    # Each node kept a full copy of its checkpoints (no shared disk); the final model is on the first.
    newest = sorted(node1_checkpoints.glob("step-*"))[-1]
    assert {"model.safetensors", "optimizer.bin", "random_states_1.pkl", "workbook_state.json"} <= {
        p.name for p in newest.iterdir()}
    assert (tmp_path / "node0" / "run" / "training" / "final" / "config.json").is_file()


# ----------------------------------------------------------------------------------------------
# The planner: what crosses the network (no processes started).

def plan_json(*arguments, capsys):
    from workbook import cli
    code = cli.main(["plan", "--json", *arguments])
    assert code in (0, 1), capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_the_plan_counts_the_gradient_all_reduce_that_crosses_the_network_per_step(num_nodes, capsys):
    plan = plan_json("--model", "llama-3.2-1b", "--profile", "h100x8", "--mode", "train", "--batch-size", "1",
                     "--num-nodes", str(num_nodes), capsys=capsys)
    processes = 8 * num_nodes
    gradients = plan["trainable_params"] * 4  # fp32 gradients of the fp32 master weights (bf16 mixed precision)
    network = plan["network"]
    assert (network["processes"], network["gradient_bytes"]) == (processes, gradients)
    assert network["bytes_per_gpu_per_step"] == 2 * (processes - 1) * gradients // processes  # ring all-reduce
    assert network["network_bytes_per_node_per_step"] == (network["bytes_per_gpu_per_step"] if num_nodes > 1 else 0)


def test_fsdp_over_two_nodes_shards_over_every_gpu_and_generation_sends_nothing_per_token(capsys):
    one = plan_json("--model", "llama-3.1-8b", "--profile", "h100x8", "--mode", "train", "--batch-size", "1",
                    "--sharding", "fsdp", capsys=capsys)
    two = plan_json("--model", "llama-3.1-8b", "--profile", "h100x8", "--mode", "train", "--batch-size", "1",
                    "--sharding", "fsdp", "--num-nodes", "2", capsys=capsys)
    assert (one["gpu_count"], two["gpu_count"]) == (8, 16)
    assert two["weights_bytes"] < one["weights_bytes"]  # each GPU holds a 16th, not an 8th
    assert two["network"]["counted_per"] == "micro-batch" and two["network"]["network_bytes_per_node_per_step"] > 0
    generate = plan_json("--model", "llama-3.1-8b", "--profile", "h100x8", "--mode", "generate", "--batch-size", "1",
                         "--num-nodes", "2", capsys=capsys)
    assert generate["network"]["network_bytes_per_node_per_step"] == 0
    assert "nothing crosses the network per token" in generate["network"]["explanation"]


# ----------------------------------------------------------------------------------------------
# Checkpoints over nodes without a shared disk (the collectives faked: what each process would see).

class FakeAccelerator:
    num_processes, process_index = 2, 0

    def __init__(self):
        self.project_configuration = type("ProjectConfiguration", (), {"save_on_each_node": False})()


def test_fsdp_checkpoints_on_an_unshared_folder_stop_at_start_up_and_ddp_keeps_a_copy_per_node(tmp_path, monkeypatch):
    from workbook.training import TrainError, checkpoints
    monkeypatch.setattr(runtime, "folder_shared_with_first", lambda folder, index, gather: [True, False])
    with pytest.raises(TrainError, match=r"FSDP checkpoints are sharded .* process\(es\) \[1\] do not see the first "
                                         r"process's checkpoint folder .* put train_output_dir \(or --run-dir\) on a "
                                         r"filesystem every node mounts"):
        checkpoints.choose_where_to_save(FakeAccelerator(), tmp_path, fsdp=True, saves_checkpoints=True)
    ddp = FakeAccelerator()
    assert checkpoints.choose_where_to_save(ddp, tmp_path, fsdp=False, saves_checkpoints=True) is False
    assert ddp.project_configuration.save_on_each_node  # each node's first process saves a full copy


def test_nodes_resume_from_the_newest_checkpoint_they_all_hold_or_say_which_lacks_one(tmp_path, monkeypatch):
    from workbook.training import TrainError, checkpoints
    views = {}
    monkeypatch.setattr(checkpoints, "_all_gather", lambda mine: [mine, views["other"]])
    for step in (2, 4):
        (checkpoints.checkpoint_dir(tmp_path, step)).mkdir(parents=True)
        (checkpoints.checkpoint_dir(tmp_path, step) / checkpoints.STATE_FILE).write_text("{}")
    views["other"] = ["step-00000002"]  # the kill came before the other node finished step 4
    assert checkpoints.agreed_checkpoint(FakeAccelerator(), tmp_path) == checkpoints.checkpoint_dir(tmp_path, 2)
    views["other"] = []
    with pytest.raises(TrainError, match=r"do not hold a common checkpoint .*\{0: 'step-00000004', 1: 'none'\}.* "
                                         r"copy the newest checkpoint folder"):
        checkpoints.agreed_checkpoint(FakeAccelerator(), tmp_path)


def test_fsdp_without_a_gpu_stops_before_training_instead_of_silently_training_ddp(tmp_path, monkeypatch):
    """accelerate shards with FSDP only from a GPU process group; on CPU (gloo) it would keep DDP."""
    import torch
    from workbook import params
    from workbook.paths import PARAMS_DIR
    from workbook.training import TrainError, config_from_params, train
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` sets
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, and any without a GPU
    config = config_from_params(params.load(PARAMS_DIR / "cpu.yaml"), tmp_path)
    with pytest.raises(TrainError, match=r"FSDP was asked for .* no GPU: .* launch without --use_fsdp"):
        train(config)
    assert not any(tmp_path.iterdir())  # stopped before anything was written


def test_what_any_node_wrote_is_skipped_by_every_node():
    # Each node sees only its own disk: the union of what all of them wrote is what a rerun skips.
    from types import SimpleNamespace
    from workbook.generation import nodes
    alone = SimpleNamespace(count=1)
    assert nodes.written_anywhere({("a", 0)}, alone) == {("a", 0)}
    two = SimpleNamespace(count=2, gather=lambda done: [done, {("b", 0)}])
    assert nodes.written_anywhere({("a", 0)}, two) == {("a", 0), ("b", 0)}


# ----------------------------------------------------------------------------------------------
# Bringing a node's parts to the first one, in one process: two threads stand for the two nodes,
# each with its own folder, and a barrier stands for the process group's collectives.


class ThreadGroup:
    """The collectives bring_parts_to_first uses (gather to all, gather to the first), over threads."""

    def __init__(self, count):
        self.count, self.slots = count, [None] * count
        self.barrier = threading.Barrier(count, timeout=20)

    def rank(self, index):
        return SimpleNamespace(index=index, count=self.count, gather=lambda value: self.gather(index, value))

    def gather(self, index, value):
        self.slots[index] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every thread has read them all
        return values


def bring_parts_over_threads(tmp_path, monkeypatch):
    """Run nodes.bring_parts_to_first on node 0 and node 1 (whose folder node 0 cannot see); returns
    each node's OutputFiles and what each call returned or raised."""
    from workbook.generation import nodes
    from workbook.generation.files import OutputFiles
    group = ThreadGroup(2)

    def gather_to_first(message, rank):
        received = rank.gather(message)  # every thread takes part, as in the collective
        return received if rank.index == 0 else None

    monkeypatch.setattr(nodes, "_gather_to_first", gather_to_first)
    files = [OutputFiles(tmp_path / f"node{node}" / "out.jsonl") for node in (0, 1)]
    outcomes = [None, None]

    def node(index):
        try:
            outcomes[index] = nodes.bring_parts_to_first(files[index], group.rank(index), [True, False])
        except Exception as error:  # noqa: BLE001 - handed to the test thread
            outcomes[index] = error

    threads = [threading.Thread(target=node, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return files, outcomes


def test_a_node_without_the_shared_disk_sends_every_record_over_in_several_messages(tmp_path, monkeypatch):
    from workbook.generation import nodes
    monkeypatch.setattr(nodes, "RECORDS_PER_MESSAGE", 2)  # 5 outputs: 3 messages, the last one short
    sender = tmp_path / "node1"
    sender.mkdir(parents=True)
    (sender / "out.part-1.jsonl").write_text("".join(json.dumps({"n": n}) + "\n" for n in range(5)))
    (sender / "out.failures.part-1.jsonl").write_text(json.dumps({"line": 9}) + "\n")
    files, outcomes = bring_parts_over_threads(tmp_path, monkeypatch)
    assert outcomes == [[1], [1]]
    first = files[0].output.parent
    assert [json.loads(line)["n"] for line in (first / "out.part-1.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert (first / "out.failures.part-1.jsonl").read_text() == '{"line": 9}\n'
    assert not any(sender.iterdir())  # the sender's copies go once the first node has them on disk


def test_a_node_keeps_its_parts_when_the_first_node_cannot_store_them(tmp_path, monkeypatch):
    # The first node's disk is full: the records' only copy is the sender's, which a rerun reads.
    import errno
    from workbook import jsonl

    def full(self, records):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(jsonl.LineAppender, "write", full)
    sender = tmp_path / "node1"
    sender.mkdir(parents=True)
    (sender / "out.part-1.jsonl").write_text('{"n": 0}\n{"n": 1}\n')
    files, outcomes = bring_parts_over_threads(tmp_path, monkeypatch)
    assert isinstance(outcomes[0], OSError) and outcomes[0].errno == errno.ENOSPC
    assert outcomes[1] == [1]
    assert (sender / "out.part-1.jsonl").read_text() == '{"n": 0}\n{"n": 1}\n'
