"""Profile -> plan: 'auto' batch sizes, the max-batch table, and the `workbook plan` CLI."""

import json
from types import SimpleNamespace

import pytest

from workbook import cli, params, planner
from workbook.planner import profile
from workbook.paths import PARAMS_DIR


def load_profile(name, **changes):
    return {**params.load(PARAMS_DIR / f"{name}.yaml"), **changes}


def test_auto_batch_is_the_largest_that_fits():
    h200 = load_profile("h200", model="llama-3.1-8b")
    chosen = profile.resolve_batch_size(h200, "generate")
    assert chosen == profile.plan(h200, mode="generate").batch_size > 32
    assert profile.plan(h200, mode="generate", batch_size=chosen).fits
    assert not profile.plan(h200, mode="generate", batch_size=chosen + 1).fits
    assert profile.resolve_batch_size(load_profile("h200", batch_size=48), "generate") == 48


def test_auto_batch_refuses_a_model_that_does_not_fit_and_says_what_to_change():
    with pytest.raises(planner.DoesNotFitError, match=r"does not fit even at batch 1.*Try: .*LoRA"):
        profile.resolve_batch_size(load_profile("a100-40gb", model="llama-3.1-70b"), "train")


def test_cpu_profile_plans_against_this_machines_ram():
    import psutil
    assert profile.capacity_bytes(load_profile("cpu")) == psutil.virtual_memory().total


def test_max_batch_table_grows_with_gpu_memory():
    profiles = {name: params.load(PARAMS_DIR / f"{name}.yaml") for name in ("a100-40gb", "h100", "h200", "cpu")}
    rows = profile.max_batch_table(profiles, ["llama-3.1-8b", "qwen2.5-7b"], "generate")
    assert [row["model"] for row in rows] == ["llama-3.1-8b", "qwen2.5-7b"]
    for row in rows:
        assert "cpu" not in row and 0 < row["a100-40gb"] < row["h100"] < row["h200"]


def test_batch_size_accepts_auto_or_a_positive_integer_only():
    assert params.validate_value("batch_size", "auto", "t") == "auto"
    for bad in (0, "Auto", "32", 2.5):
        with pytest.raises(params.ParamsError, match="expected an integer >= 1 or 'auto'"):
            params.validate_value("batch_size", bad, "t")
    with pytest.raises(params.ParamsError, match=r"'safety_margin' is 0.9; expected a finite number >= 0 and <= 0.5"):
        params.validate_value("safety_margin", 0.9, "t")


@pytest.fixture
def workbook(capsys):
    """Run the `workbook` CLI in-process (a subprocess would spend seconds importing torch each time)."""
    def run(*args):
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:  # argparse rejects bad choices this way
            code = exit_.code
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)
    return run


def test_cli_plan_json_has_what_scripts_read(workbook):
    result = workbook("plan", "--model", "llama-3.1-8b", "--profile", "h200", "--mode", "generate",
                      "--prompt-len", "512", "--new-tokens", "2048", "--batch-size", "32", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["params"] == 8_030_261_248 and plan["weights_bytes"] == 2 * 8_030_261_248
    assert plan["kv_cache_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # layers x kv heads x head dim x bf16
    assert plan["batch_size"] == 32 and plan["fits"] and plan["max_batch_size"] > 32
    assert sum(term["bytes"] for term in plan["breakdown"]) == plan["total_bytes"]
    assert all(term["explanation"] for term in plan["breakdown"])


def test_cli_plan_train_human_output_and_exit_codes(workbook):
    ok = workbook("plan", "--model", "llama-3.2-1b", "--profile", "h100", "--mode", "train", "--seq-len", "2048",
                  "--grad-checkpointing")
    assert ok.returncode == 0 and "FITS" in ok.stdout and "largest batch that fits" in ok.stdout
    too_big = workbook("plan", "--model", "llama-3.2-1b", "--profile", "h100", "--mode", "train", "--batch-size", "4096")
    assert too_big.returncode == 1 and "DOES NOT FIT" in too_big.stdout
    never = workbook("plan", "--model", "llama-3.1-70b", "--profile", "h100", "--mode", "train")
    assert never.returncode == 3 and "does not fit even at batch 1" in never.stderr
    unknown = workbook("plan", "--model", "llama-9b", "--profile", "h100")
    assert unknown.returncode == 2 and "unknown model 'llama-9b'" in unknown.stderr
    negative = workbook("plan", "--model", "tiny", "--profile", "h100", "--prompt-len", "-5")
    assert negative.returncode == 2 and "'prompt_len' is -5" in negative.stderr
    bad_dtype = workbook("plan", "--model", "tiny", "--profile", "h100", "--dtype", "fp8")
    assert bad_dtype.returncode == 2 and "invalid choice: 'fp8'" in bad_dtype.stderr
