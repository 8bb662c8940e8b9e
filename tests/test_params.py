"""Profile files: defaults written once (the schema), a profile holding only what is its own, every key
validated and consumed, errors that name file, line and key."""

import ast
import re
from pathlib import Path

import papermill
import pytest

from workbook import params
from workbook.paths import NOTEBOOKS_DIR, PARAMS_DIR
from workbook.notebook import RUN_DIR_PARAMETER

PROFILES = ["h200", "h100", "h100x8", "a100-80gb", "a100-40gb", "a6000", "v100", "cpu"]


def test_every_profile_exists_and_validates():
    loaded = params.load_all()
    assert sorted(loaded) == sorted(PROFILES)
    for name, values in loaded.items():
        assert set(values) == set(params.SCHEMA), name


def test_every_profile_opens_with_its_command_and_an_override_example():
    for name in PROFILES:
        header = (PARAMS_DIR / f"{name}.yaml").read_text().split("\nprofile:")[0]
        assert f"params/{name}.yaml" in header and "--set " in header, name


def declared_notebook_parameters() -> dict[str, set[str]]:
    return {path.stem: set(papermill.inspect_notebook(str(path)))
            for path in sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))}


def test_every_key_of_every_params_file_is_consumed_by_a_notebook():
    # papermill only warns about a parameter no notebook declares: such a key would do nothing.
    declared = set().union(*declared_notebook_parameters().values())
    for name, values in params.load_all().items():
        unconsumed = set(values) - declared
        assert not unconsumed, f"params/{name}.yaml: no notebook declares {sorted(unconsumed)}"


def test_notebooks_declare_only_known_parameters():
    for notebook, names in declared_notebook_parameters().items():
        unknown = names - set(params.SCHEMA) - {RUN_DIR_PARAMETER}
        assert not unknown, f"{notebook} declares parameters the schema lacks: {sorted(unknown)}"


def write_profile(tmp_path, name="cpu", **changes):
    """params/cpu.yaml with each key's line replaced (or added, where the profile takes the default)."""
    text = (PARAMS_DIR / "cpu.yaml").read_text()
    for key, line in changes.items():
        old = next((l for l in text.splitlines() if l.startswith(f"{key}:")), None)
        text = text.replace(old, line) if old is not None else text + line + "\n"
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_every_notebook_default_is_the_schemas():
    # The parameters cell is no second place for a default: papermill fills in what a profile file
    # leaves out from the cell, so a cell value unlike the schema's would make `papermill -f` and
    # `workbook run` differ silently. Values and types.
    defaults = params.defaults()
    differing = []
    for path in sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")):
        for name, declared in papermill.inspect_notebook(str(path)).items():
            default = ast.literal_eval(declared["default"])
            if name != RUN_DIR_PARAMETER and (default, type(default)) != (defaults[name], type(defaults[name])):
                differing.append(f"{path.name}: {name} = {declared['default']}, the schema's default: "
                                 f"{defaults[name]!r}")
            # Typed, so `papermill --help-notebook` shows each key's type: the schema's ('auto' besides, if it says so).
            kind = params.SCHEMA[name].kind.__name__ if name != RUN_DIR_PARAMETER else "str"
            if declared["inferred_type_name"] != kind or not declared["help"]:
                differing.append(f"{path.name}: {name} is declared {declared['inferred_type_name']}, "
                                 f"the schema says {kind}; or it has no comment")
    assert not differing, "\n".join(differing)


def test_unknown_key_names_file_line_and_suggests_the_right_one(tmp_path):
    path = write_profile(tmp_path, dtype="dtyp: fp32")
    line = path.read_text().splitlines().index("dtyp: fp32") + 1
    with pytest.raises(params.ParamsError, match=rf"cpu.yaml:{line}: unknown parameter 'dtyp'.*'dtype'"):
        params.load(path)


@pytest.mark.parametrize("typed", ["no", "on", "12"])
def test_a_key_yaml_reads_as_a_bool_or_a_number_is_named_as_typed_with_its_line(tmp_path, typed):
    path = write_profile(tmp_path, dtype=f"dtype: fp32\n{typed}: 0")
    line = path.read_text().splitlines().index(f"{typed}: 0") + 1
    with pytest.raises(params.ParamsError, match=rf"cpu.yaml:{line}: unknown parameter '{typed}'"):
        params.load(path)
    # Two spellings of one YAML value are refused, not merged into one key.
    both = write_profile(tmp_path, dtype="dtype: fp32\nno: 0\nfalse: 1")
    with pytest.raises(params.ParamsError, match="two keys YAML reads as the same value"):
        params.load(both)


@pytest.mark.parametrize("line, message", [
    ("gpu_count: eight", r"'gpu_count' is 'eight'; expected an integer"),
    ("gpu_count: true", r"'gpu_count' is True; expected an integer"),
    ("gpu_count: -1", r"'gpu_count' is -1; expected an integer >= 0"),
    ("dtype: float64", r"'dtype' is 'float64'; expected one of 'fp32', 'bf16', 'fp16'"),
    ("supports_bf16: maybe", r"'supports_bf16' is 'maybe'; expected true or false"),
    # bool is an int in Python: `true` must not pass as 1.0 for a number key either.
    ("temperature: true", r"'temperature' is True; expected a finite number >= 0"),
    # 'auto' is for the keys the planner chooses; elsewhere it is a mistake.
    ("gpu_count: auto", r"'gpu_count' is 'auto'; expected an integer >= 0 \("),
    ("seed: auto", r"'seed' is 'auto'; expected an integer >= 0 \("),
    # Blank is no model, and no baseline list is not 'none'.
    ('model: "  "', r"'model' is '  '; expected a non-empty string"),
    ('bench_train_baselines: ""', r"'bench_train_baselines' is ''; expected comma-separated names"),
    ('gpu_name_pattern: "H100("', r"'gpu_name_pattern' is not a valid regular expression"),
])
def test_wrong_values_are_rejected_with_key_and_expectation(tmp_path, line, message):
    key = line.split(":")[0]
    path = write_profile(tmp_path, **{key: line})
    with pytest.raises(params.ParamsError, match=message):
        params.load(path)


def test_missing_key_missing_file_duplicate_key_and_wrong_profile_name(tmp_path):
    with pytest.raises(params.ParamsError, match=r"missing parameter\(s\) profile. Add 'profile: cpu'"):
        params.load(write_profile(tmp_path, profile=""))
    with pytest.raises(params.ParamsError, match=r"no such parameter file.*cpu, h100"):
        params.load(tmp_path / "nope.yaml")
    duplicated = tmp_path / "dup" / "cpu.yaml"
    duplicated.parent.mkdir()
    duplicated.write_text((PARAMS_DIR / "cpu.yaml").read_text() + "dtype: bf16\n")
    with pytest.raises(params.ParamsError, match=r"key 'dtype' appears twice"):
        params.load(duplicated)
    with pytest.raises(params.ParamsError, match=r"'profile' is 'cpu' but the file is other.yaml"):
        params.load(write_profile(tmp_path, name="other"))


def test_invalid_yaml_and_non_mapping_are_reported(tmp_path):
    broken = tmp_path / "cpu.yaml"
    broken.write_text("profile: [cpu\n")
    with pytest.raises(params.ParamsError, match=r"cpu.yaml: not valid YAML"):
        params.load(broken)
    broken.write_text("- a\n- b\n")
    with pytest.raises(params.ParamsError, match=r"expected a mapping"):
        params.load(broken)


def test_overrides_are_typed_and_validated_like_files():
    base = params.load(PARAMS_DIR / "h200.yaml")
    overrides = params.parse_overrides(["dtype=fp16", "gpu_count=2", "usd_per_gpu_hour=3", "model=/models/x"])
    merged = params.apply_overrides(base, overrides)
    assert merged.dtype == "fp16" and merged.gpu_count == 2 and merged.usd_per_gpu_hour == 3.0
    assert merged.model == "/models/x" and base.dtype == "bf16"
    with pytest.raises(params.ParamsError, match=r"--set gpu_count=0.5: 'gpu_count' is 0.5"):
        params.parse_overrides(["gpu_count=0.5"])
    with pytest.raises(params.ParamsError, match=r"expected key=value"):
        params.parse_overrides(["dtype"])


def test_bf16_on_a_gpu_without_bf16_is_refused():
    v100 = params.load(PARAMS_DIR / "v100.yaml")
    with pytest.raises(params.ParamsError, match=r"supports_bf16: false.*dtype: fp16"):
        params.apply_overrides(v100, params.parse_overrides(["dtype=bf16"]))


def test_h100_and_h200_peaks_are_dense_not_sparse():
    # Datasheets print 1,979 TFLOPS "with sparsity"; the dense figure MFU is measured against is half.
    for name in ("h200", "h100", "h100x8"):
        assert params.load(PARAMS_DIR / f"{name}.yaml").peak_bf16_tflops == pytest.approx(989.5)


def test_every_gpu_profile_takes_its_gpus_facts_from_a_spec_table_row_its_pattern_matches():
    # The spec table is the one place for GPU figures: a profile names its row and restates none of them.
    from workbook import gpu
    rows = {spec.name: spec for spec in gpu.GPU_SPECS}
    for name, profile in params.load_all().items():
        if not profile["gpu_name_pattern"]:
            assert profile["gpu_spec"] == "" and profile["gpu_count"] == 0, name
            continue
        row = rows[profile["gpu_spec"]]
        assert re.search(profile["gpu_name_pattern"], row.name), (name, row.name)
        restated = set(params.stated_keys(PARAMS_DIR / f"{name}.yaml")) & set(params.GPU_FACTS)
        assert not restated, f"params/{name}.yaml restates {sorted(restated)}, which its row {row.name!r} holds"
        assert {key: profile[key] for key in params.GPU_FACTS} == \
            {key: getattr(row, field) for key, field in params.GPU_FACTS.items()}, name


def test_each_profile_states_only_its_own_hardware_and_what_differs_from_the_defaults():
    defaults = params.defaults()
    for name in PROFILES:
        path = PARAMS_DIR / f"{name}.yaml"
        loaded = params.load(path)
        same = [key for key in params.stated_keys(path)
                if key not in params.HARDWARE_KEYS and loaded[key] == defaults[key]]
        assert not same, f"params/{name}.yaml states the schema's defaults for {same}: leave them out"


def test_a_key_a_profile_leaves_out_takes_the_schema_default_and_its_gpu_row_the_facts(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("profile: mine\ngpu_spec: H100 PCIe\ngpu_count: 2\nepochs: 5\n")
    loaded = params.load(path)
    assert set(loaded) == set(params.SCHEMA)
    assert loaded.epochs == 5 and loaded.gpu_count == 2
    assert loaded.memory_bandwidth_gbs == 2000 and loaded.peak_bf16_tflops == 756.5 and loaded.supports_bf16 is True
    assert {key: loaded[key] for key in params.SCHEMA if key not in ("profile", "gpu_spec", "gpu_count", "epochs")
            and key not in params.GPU_FACTS} == {key: value for key, value in params.defaults().items()
                                                 if key not in ("profile", "gpu_spec", "gpu_count", "epochs")
                                                 and key not in params.GPU_FACTS}
    # A fact the file states wins over its row (a variant the table lacks), and so does --set over both.
    path.write_text("profile: mine\ngpu_spec: H100 PCIe\nmemory_bandwidth_gbs: 1900\n")
    assert params.load(path).memory_bandwidth_gbs == 1900
    # --set gpu_spec= takes another row's facts.
    h100 = params.load(PARAMS_DIR / "h100.yaml")
    pcie = params.apply_overrides(h100, params.parse_overrides(["gpu_spec=H100 PCIe"]))
    assert pcie.memory_bandwidth_gbs == 2000 and h100.memory_bandwidth_gbs == 3350
    with pytest.raises(params.ParamsError, match=r"--set gpu_spec=H100: 'gpu_spec' is 'H100'; expected one of .*'H100 SXM'"):
        params.parse_overrides(["gpu_spec=H100"])


def test_a_dense_peak_is_the_16_bit_one_and_fp32_has_none():
    from workbook import gpu
    h100 = params.load(PARAMS_DIR / "h100.yaml")
    v100_spec = gpu.spec_for_name("Tesla V100-SXM2-32GB")
    assert gpu.dense_peak_tflops(h100, "bf16") == gpu.dense_peak_tflops(h100, "bfloat16") == 989.5
    assert gpu.dense_peak_tflops(h100, "fp32") == gpu.dense_peak_tflops(h100, "float32") == 0
    assert gpu.dense_peak_tflops(v100_spec, "bf16") == 0 and gpu.dense_peak_tflops(v100_spec, "fp16") == 125
    assert gpu.mfu(flops=989.5e12 * 2, seconds=4.0, peak_tflops=989.5, gpus=1) == 0.5
    assert gpu.mfu(flops=1e12, seconds=1.0, peak_tflops=0) is None


def test_exponent_notation_without_a_dot_is_a_number():
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; users write it that way in files and --set.
    assert params.parse_overrides(["learning_rate=1e-4"]) == {"learning_rate": 1e-4}
    assert params.validate_value("learning_rate", "3E-5", "t") == 3e-5
    with pytest.raises(params.ParamsError, match="'learning_rate' is 'fast'"):
        params.validate_value("learning_rate", "fast", "t")


def test_batch_size_lists_take_one_integer_and_refuse_anything_but_positive_integers():
    # `--set bench_batch_sizes=8` and `bench_batch_sizes: 8` are read as an integer: one batch size.
    assert params.parse_overrides(["bench_batch_sizes=8"])["bench_batch_sizes"] == "8"
    assert params.parse_overrides(["bench_train_micro_batches=4,16"])["bench_train_micro_batches"] == "4,16"
    for bad in ("8,x", "0,8", "8,,16", "-4"):
        with pytest.raises(params.ParamsError, match=rf"bench_batch_sizes={re.escape(bad)}: .*comma-separated positive"):
            params.parse_overrides([f"bench_batch_sizes={bad}"])


FLOAT_KEYS = [key for key, spec in params.SCHEMA.items() if spec.kind is float]
NOT_A_NUMBER = ["nan", ".nan", "NaN", "inf", ".inf", "-inf", "-.inf", "Infinity"]


def test_nan_and_infinity_are_refused_for_every_float_key():
    # NaN compares false to every bound, so a range check alone lets `top_p: .nan` through.
    assert {"top_p", "temperature", "safety_margin", "learning_rate"} <= set(FLOAT_KEYS)
    for key in FLOAT_KEYS:
        for text in NOT_A_NUMBER:
            with pytest.raises(params.ParamsError, match=rf"--set {key}={re.escape(text)}: '{key}' is .*finite"):
                params.parse_overrides([f"{key}={text}"])
        with pytest.raises(params.ParamsError, match=rf"'{key}' is nan; expected a finite number"):
            params.validate_value(key, float("nan"), "t")


@pytest.mark.parametrize("line", ["top_p: .nan", "temperature: .inf", "safety_margin: -.inf",
                                  "learning_rate: .NaN"])
def test_nan_and_infinity_in_a_file_name_the_line(tmp_path, line):
    key = line.split(":")[0]
    path = write_profile(tmp_path, **{key: line})
    number = path.read_text().splitlines().index(line) + 1
    with pytest.raises(params.ParamsError, match=rf"cpu.yaml:{number}: '{key}' is -?(nan|inf); expected a finite"):
        params.load(path)


def test_nan_passed_with_papermill_p_is_refused_by_the_notebook(tmp_path):
    # `papermill ... -p top_p nan` injects `top_p = float('nan')`; the notebook's first cell refuses it.
    from papermill.translators import PythonTranslator
    from workbook import notebook
    injected = "# Parameters\n" + PythonTranslator.codify({"top_p": float("nan"), "run_dir": str(tmp_path)})
    namespace = {"In": ["", injected]}
    exec(injected, namespace)
    with pytest.raises(params.ParamsError, match=r"notebook 02_test parameters: 'top_p' is nan; expected a finite"):
        notebook.start(namespace, "02_test")


def test_a_key_set_twice_takes_its_last_value():
    assert params.parse_overrides(["seed=1", "seed=2"]) == {"seed": 2}


def test_every_key_has_a_valid_default():
    # A default the schema itself would refuse would surface deep inside a job, not at load.
    for key, value in params.defaults().items():
        assert params.validate_value(key, value, "default") == value and type(value) in (params.SCHEMA[key].kind, str), key


def test_a_key_given_twice_names_both_lines(tmp_path):
    path = tmp_path / "cpu.yaml"
    path.write_text((PARAMS_DIR / "cpu.yaml").read_text() + "dtype: bf16\n")
    lines = path.read_text().splitlines()
    first = next(number for number, line in enumerate(lines, 1) if line.startswith("dtype:"))
    second = len(lines)  # the appended line
    with pytest.raises(params.ParamsError,
                       match=rf"cpu.yaml:{second}: key 'dtype' appears twice \(first on line {first}\)"):
        params.load(path)


def test_a_profile_name_that_disagrees_with_its_file_names_the_line(tmp_path):
    path = write_profile(tmp_path, name="mine")
    line = path.read_text().splitlines().index("profile: cpu") + 1
    with pytest.raises(params.ParamsError, match=rf"mine.yaml:{line}: 'profile' is 'cpu' but the file is mine.yaml"):
        params.load(path)


def test_a_single_batch_size_in_a_file_reads_as_a_list_of_one(tmp_path):
    # YAML reads `bench_batch_sizes: 8` as an integer; it means the one batch size 8.
    path = write_profile(tmp_path, bench_batch_sizes="bench_batch_sizes: 8",
                         bench_train_micro_batches="bench_train_micro_batches: 4")
    loaded = params.load(path)
    assert (loaded.bench_batch_sizes, loaded.bench_train_micro_batches) == ("8", "4")


def test_batch_size_lists_may_have_spaces_after_the_commas():
    assert params.parse_overrides(["bench_batch_sizes=8, 32, auto"])["bench_batch_sizes"] == "8, 32, auto"


def test_the_cpu_profiles_own_override_example_dtype_bf16_is_accepted():
    # params/cpu.yaml's header suggests `--set dtype=bf16`; the no-bf16 rule is for GPUs only.
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    assert not cpu.supports_bf16
    assert params.apply_overrides(cpu, params.parse_overrides(["dtype=bf16"])).dtype == "bf16"


def test_a_yml_file_given_as_params_is_a_path_not_a_profile_name():
    assert params.profile_path("mine.yml") == Path("mine.yml")
    assert params.profile_path("h200") == PARAMS_DIR / "h200.yaml"
