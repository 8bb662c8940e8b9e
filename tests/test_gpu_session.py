"""The lent GPU's planned calls: a step that overruns is stopped inside the budget, a failed step
does not stop the next, a step that cannot finish is skipped, results in outputs/ are kept; and
every command of every call names options and params keys that exist, so a typo fails here and
not in the GPU's minutes. The measured ceilings run on this CPU."""

import json
import os
import re
import sys
import time

import pytest
import torch

from workbook import ceilings, params
from workbook.hardware import Hardware
from workbook.bench import gpu_session
from workbook.paths import REPO_ROOT
from workbook.planner import calibration, overhead_probe


def python_step(name: str, code: str, needs: int = 0, budget_flag=None) -> gpu_session.Step:
    return gpu_session.Step(name, ["-c", code], needs, budget_flag)


@pytest.mark.multiprocess
def test_a_call_keeps_to_its_budget_and_runs_every_step_it_can(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_session, "RESERVE_SECONDS", 0)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    steps = [
        python_step("fails", "import sys; print('broken'); sys.exit(4)"),
        python_step("writes a run folder", f"import pathlib; p = pathlib.Path({str(outputs)!r}) / 'bench-run'; "
                                           "p.mkdir(); (p / 'benchmark.json').write_text('{}'); "
                                           "m = p.parent / 'models' / 'tiny-1'; m.mkdir(parents=True); "
                                           "(m / 'model.safetensors').write_text('weights'); print('done')"),
        python_step("told its budget", "import sys; print('budget', sys.argv[-1])", budget_flag="--time-budget-seconds"),
        python_step("overruns", "import time; print('started', flush=True); time.sleep(60)"),
        python_step("needs more than is left", "print('never')", needs=1000),
    ]
    out = tmp_path / "out"
    out.mkdir()
    records = gpu_session.run_call(steps, out, out / "call.log", budget_seconds=8, outputs=outputs, say=lambda line: None)

    statuses = [record["status"] for record in records]
    assert statuses[:3] == ["failed (exit 4)", "ok", "ok"]
    assert records[0]["last_line"] == "broken"
    assert (out / "bench-run" / "benchmark.json").is_file()  # the step's run folder, copied into the results
    assert records[1]["run_folders"] == [str(out / "bench-run")]  # not the model cache a fresh machine built
    budget_given = int(records[2]["last_line"].split()[-1])
    assert 0 < budget_given <= 8
    assert statuses[3].startswith("stopped: the budget ran out") and records[3]["seconds"] < 9
    assert statuses[4].startswith("skipped") and "it needs 1000 s" in statuses[4]
    log = (out / "call.log").read_text()
    assert "===== overruns" in log and "started" in log and "never" not in log
    assert "| fails | failed (exit 4) |" in gpu_session.table("smoke", records)


@pytest.mark.multiprocess
def test_a_step_that_would_take_all_it_is_given_leaves_the_later_steps_their_reserve(tmp_path, monkeypatch):
    # The training call's first step stops itself at its budget; the steps after it must still get theirs.
    monkeypatch.setattr(gpu_session, "RESERVE_SECONDS", 0)
    greedy = gpu_session.Step("takes all it is given", ["-c", "import sys, time; print('budget', sys.argv[-1], "
                                                              "flush=True); time.sleep(60)"], 0,
                              "--time-budget-seconds", reserve_seconds=5)
    later = python_step("later", "print('ran')")
    records = gpu_session.run_call([greedy, later], tmp_path, tmp_path / "call.log", budget_seconds=9,
                                   outputs=tmp_path / "none", say=lambda line: None)
    assert int(records[0]["last_line"].split()[-1]) <= 4  # 9 s less the 5 kept back for later
    assert records[0]["status"].startswith("stopped: the budget ran out") and records[0]["seconds"] < 5.5
    assert records[1]["status"] == "ok" and records[1]["last_line"] == "ran"


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_every_command_of_every_call_names_options_and_keys_that_exist(profile, tmp_path):
    cli_source = "".join((REPO_ROOT / "lib/workbook" / name).read_text() for name in ("cli.py", "arguments.py"))
    profile_params = params.load(params.profile_path(profile))
    for call, steps in gpu_session.calls(profile, tmp_path).items():
        for step in steps:
            assert step.argv[0] == "-m", step.name
            module = step.argv[1]
            source = cli_source if module == "workbook" else \
                (REPO_ROOT / "lib" / (module.replace(".", "/") + ".py")).read_text()
            for flag in [a for a in step.argv if a.startswith("--")] + ([step.budget_flag] if step.budget_flag else []):
                assert f'"{flag}"' in source, f"{call}/{step.name}: {module} has no option {flag}"
            if "--set" in step.argv:  # the overrides are valid keys and values of this profile
                overrides = params.parse_overrides(step.argv[step.argv.index("--set") + 1:])
                params.apply_overrides(profile_params, overrides)
            if "--overhead-from" in step.argv:  # the probe's file, written by an earlier step of the same call
                probe = [s for s in steps[:steps.index(step)] if s.argv[1] == "workbook.planner.overhead_probe"]
                written = tmp_path / overhead_probe.RESULT_FILE
                assert probe and step.argv[step.argv.index("--overhead-from") + 1] == str(written)
            if "--only" in step.argv:  # the smoke cases exist in this GPU's grid
                beginnings = step.argv[step.argv.index("--only") + 1].split(",")
                chosen = calibration.chosen_cases(calibration.calibration_grid(profile), beginnings)
                assert [case.mode for case in chosen] == ["generate", "train"]


def test_a_call_comes_back_as_a_pack_the_device_returns_whole_and_unpacks_as_written(tmp_path, monkeypatch):
    # The device returns 8 files of 16 MiB at most, none more than two folders down: a call's results
    # (run folders three levels deep among them) must come back in full, in a few files under the limits.
    monkeypatch.setattr(gpu_session, "PART_BYTES", 40_000)
    monkeypatch.setattr(gpu_session, "LARGEST_MEMBER_BYTES", 60_000)
    folder, out = tmp_path / "out" / "smoke", tmp_path / "out"
    written = {"smoke.json": b"{}", "ceilings.json": b"{}",
               "2026-bench-cuda/benchmark.json": b"{}", "2026-bench-cuda/plots/bench_mfu.png": os.urandom(50_000),
               "forecast/deep/er/points.jsonl": os.urandom(30_000)}
    for name, data in written.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "checkpoint.safetensors").write_bytes(os.urandom(70_000))  # over the largest member

    packed = gpu_session.pack(folder, out, "smoke")

    returned = sorted(path for path in out.rglob("*") if path.is_file())
    assert not folder.exists() and len(returned) == len(packed["files"]) >= 2  # split: over PART_BYTES
    assert len(returned) <= gpu_session.MOST_PARTS and all(path.parent == out for path in returned)
    assert all(path.stat().st_size <= gpu_session.PART_BYTES for path in returned)
    assert packed["left_out"] == ["checkpoint.safetensors (0 MiB: over 0 MiB)"]
    into = tmp_path / "reference" / "h100"
    assert gpu_session.unpack(out, into) == ["smoke"]
    assert {str(path.relative_to(into)): path.read_bytes() for path in into.rglob("*") if path.is_file()} == written


def test_the_session_lists_its_commands_without_running_them(capsys, tmp_path):
    assert gpu_session.main(["--call", "smoke", "--profile", "h100", "--out", str(tmp_path / "out"), "--list"]) == 0
    listed = capsys.readouterr().out
    assert "python3 -m workbook.ceilings --profile h100" in listed
    assert not (tmp_path / "out").exists()


def test_a_call_runs_with_the_profile_of_the_gpu_at_hand():
    """The device lends an H200 where no H100 opens: a call named for h100 plans with h200's memory."""
    h200 = [{"name": "NVIDIA H200", "memory_total_bytes": int(140.4 * 2**30)}]
    assert gpu_session.call_profile("h100", h200)[0] == "h200"
    assert "not h100 as named" in gpu_session.call_profile("h100", h200)[1]
    assert gpu_session.call_profile("auto", h200)[0] == "h200"
    assert gpu_session.call_profile("h100", [])[0] == "h100"  # no GPU here: listing the commands of a named one


def test_calibration_only_refuses_a_case_name_the_grid_lacks():
    with pytest.raises(SystemExit, match="no case of this profile's grid starts with 'llama-9b/generate'"):
        calibration.chosen_cases(calibration.calibration_grid("h100"), ["llama-9b/generate"])


def test_ceilings_are_measured_and_set_beside_the_datasheet(tmp_path):
    measured = ceilings.measure(torch.device("cpu"), copy_bytes=8 * 2 ** 20, matmul_size=256, repeats=2)
    assert measured.copy_bytes_per_second > 1e8 and measured.matmul_flops_per_second > 1e8
    assert "8 MiB device-to-device copy" in measured.how and "256^3 float32 matmul, best of 2" in measured.how
    cpu = ceilings.against_datasheet(measured, Hardware.from_params(params.load(params.profile_path("cpu"))))
    assert cpu["copy_share_of_datasheet"] is None  # the cpu profile states no datasheet figure
    h100 = params.load(params.profile_path("h100"))
    fake_bf16 = ceilings.Ceilings(3.0e12, 800e12, "bfloat16", 2 ** 31, 8192, 5, "H100")
    shares = ceilings.against_datasheet(fake_bf16, Hardware.from_params(h100))
    assert shares["copy_share_of_datasheet"] == pytest.approx(3000 / h100["memory_bandwidth_gbs"])
    assert shares["matmul_share_of_datasheet"] == pytest.approx(800 / h100["peak_bf16_tflops"])


def test_the_ceilings_command_writes_its_record(tmp_path):
    assert ceilings.main(["--profile", "cpu", "--out", str(tmp_path), "--copy-mib", "8", "--matmul-size", "256",
                          "--repeats", "2"]) == 0
    record = json.loads((tmp_path / "ceilings.json").read_text())
    assert record["command"] == "workbook ceilings --profile cpu --out " + str(tmp_path) + \
        " --copy-mib 8 --matmul-size 256 --repeats 2"
    assert record["measured"]["copy_gb_per_second"] > 0.1 and record["hardware"]
    assert ceilings.load(tmp_path) == record
    assert re.search(r"\| copy bandwidth \(read \+ write\) \| [\d,]+ GB/s \| n/a GB/s \| n/a", (tmp_path / "ceilings.md").read_text())


def test_a_ceiling_sample_times_runs_back_to_back_and_reports_one_runs_seconds():
    """A GPU's 1.5 ms copy timed alone would carry a launch and a synchronization: several runs a sample."""
    calls = []
    seconds = ceilings._best_seconds(lambda: calls.append(time.sleep(0.002)), torch.device("cpu"), repeats=2, runs=3)
    assert len(calls) == 1 + 2 * 3 and 0.002 <= seconds < 0.02


@pytest.mark.multiprocess
def test_a_step_stopped_by_the_budget_takes_its_detached_children_with_it(tmp_path):
    # The forecast check starts each job in a session of its own; a step killed at the budget must not
    # leave such a job running (on the device it would hold the GPU through the later steps).
    import psutil
    child_pid = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    log_path = tmp_path / "log.txt"
    with log_path.open("w+") as log:
        began = time.monotonic()
        # 10 s: time for a busy machine to start both interpreters before the budget stops them.
        status, _ = gpu_session._run([sys.executable, "-c", script], dict(os.environ), log, log_path, timeout=10)
    assert status.startswith("stopped: the budget ran out") and time.monotonic() - began < 40
    pid = int(child_pid.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_overrides_given_to_the_session_reach_every_benchmark_step_after_its_own(capsys, tmp_path):
    # A path that fails on the lent GPU (flex attention) is routed around without editing the calls.
    assert gpu_session.main(["--call", "training", "--profile", "h100", "--out", str(tmp_path / "out"), "--list",
                             "--set", "attn_implementation=eager", "bench_train_steps=6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    benches = [line for line in lines if "-m workbook bench" in line]
    assert len(benches) == 2 and all(line.endswith("attn_implementation=eager bench_train_steps=6") for line in benches)
    assert all("attn_implementation" not in line for line in lines if "continuous_batching" in line)
