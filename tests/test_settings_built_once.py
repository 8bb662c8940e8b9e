"""Each job's settings are built once, at its entry, into a typed object: below the entry nothing reads
the params again, and each job's list of the keys it reads is its settings' fields, written once."""

import ast
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import workbook
from workbook import job_keys, job_settings
from workbook.params import SCHEMA

PACKAGE = Path(workbook.__file__).parent

# Where params may still be read: the schema itself, and the builders that turn params into a typed
# settings object at a job's entry (module -> its functions, by qualified name).
BUILDERS = {
    "params.py": {"*"},  # the schema, loading, validation, and settings_of (the generic builder)
    "generation/settings.py": {"GenerationSettings.from_params"},
    "training/config.py": {"config_from_params"},  # TrainConfig: its paths are resolved in the run folder
    # The run folder is chosen before a TrainConfig can exist (its paths lie in the folder).
    "training/run_folder.py": {"FolderSettings.from_params", "training_settings"},
    "planner/profile.py": {"PlanSettings.from_params"},  # plan() takes a whole profile: 'auto' resolved there
    # The forecast's entry: a notebook's params completed from its profile, and the job as each profile runs it.
    "forecast/roofline.py": {"job_params"},
    "forecast/settings.py": {"jobs_on_profiles", "profiles_hardware"},
    "bench/settings.py": {"BenchSettings.from_params"},  # workbook bench and notebook 04
    # ``workbook run`` resolves the params, records them in the manifest and injects them into the
    # notebooks, each of which builds its own settings (notebook.start).
    "runner.py": {"_new_manifest", "notebook_parameters", "run"},
}
# Modules being moved onto typed settings: their reads are allowed until that is done, when
# their builders join the list above.
BEING_CONVERTED: tuple[str, ...] = ()


def params_reads(path: Path) -> list[tuple[str, int, str]]:
    """Every read of a variable named ``params`` in ``path``: ``params[...]``, ``params.get(...)`` and
    ``params.<schema key>`` (Params allows attribute reads), as (enclosing function, line, what)."""
    found = []

    def is_params(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "params"

    def visit(node, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Subscript) and is_params(child.value):
                found.append((scope, child.lineno, f"params[{ast.unparse(child.slice)}]"))
            elif isinstance(child, ast.Attribute) and is_params(child.value) and child.attr == "get":
                found.append((scope, child.lineno, "params.get(...)"))
            elif isinstance(child, ast.Attribute) and is_params(child.value) and child.attr in SCHEMA:
                found.append((scope, child.lineno, f"params.{child.attr}"))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_params_are_read_only_where_a_job_builds_its_settings():
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith(BEING_CONVERTED):
            continue
        allowed = BUILDERS.get(module, set())
        stray += [f"lib/workbook/{module}:{line} in {scope or 'the module'}: {what}"
                  for scope, line, what in params_reads(path) if "*" not in allowed and scope not in allowed]
    assert not stray, ("params read outside the builders of a job's settings (build the typed object at the "
                       "entry and pass it down, or read a field of it):\n" + "\n".join(stray))


def test_every_builder_listed_still_reads_params():
    # A builder that no longer reads params leaves the list: so the list says where params are read.
    for module, allowed in BUILDERS.items():
        scopes = {scope for scope, _, _ in params_reads(PACKAGE / module)}
        assert "*" in allowed or allowed <= scopes, (module, allowed - scopes)


def test_the_scan_sees_each_kind_of_read(tmp_path):
    path = tmp_path / "job.py"
    path.write_text("def entry(params):\n"
                    "    return params['model'], params.get('seed'), params.dtype, params.items()\n")
    assert [what for _, _, what in params_reads(path)] == ["params['model']", "params.get(...)", "params.dtype"]


def test_each_jobs_keys_are_its_settings_fields_written_once():
    from workbook.generation.settings import GenerationSettings, field_keys
    from workbook.planner.profile import Budget
    from workbook.training import config as train_config
    # The planner's memory budget is the one set of keys both jobs add to their own.
    assert tuple(f.name for f in fields(Budget)) == job_settings.BUDGET_KEYS
    assert set(job_keys.GENERATE) == set(field_keys()) | set(job_settings.BUDGET_KEYS)
    assert set(field_keys()) == {f.name for f in fields(GenerationSettings)} - {"profile_params"}
    taken = set(train_config.params_fields().values()) | set(train_config.RESOLVED_FIELDS)
    assert set(job_keys.TRAIN) == taken | set(job_settings.BUDGET_KEYS) | set(job_settings.TRAIN_PATH_KEYS)
    for keys in (job_keys.GENERATE, job_keys.TRAIN):
        assert len(keys) == len(set(keys)) and set(keys) <= set(SCHEMA)


def test_the_job_keys_are_listed_without_importing_torch():
    probe = "import sys, workbook.job_keys; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_planners_settings_start_at_the_schemas_defaults():
    # plan() takes a whole profile; a key the profile does not hold is planned at the schema's default
    # (no default of its own written beside the read), a key it holds at its own value.
    from dataclasses import replace

    from workbook.params import defaults
    from workbook.planner.profile import PlanSettings
    schema_defaults, built = defaults(), PlanSettings()
    assert {f.name: getattr(built, f.name) for f in fields(PlanSettings) if f.name in SCHEMA} == \
        {f.name: schema_defaults[f.name] for f in fields(PlanSettings) if f.name in SCHEMA}
    assert PlanSettings.from_params({"lora_rank": 8, "sharding": "fsdp", "bench_examples": 3}) == \
        replace(built, lora_rank=8, sharding="fsdp")
