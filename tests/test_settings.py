"""Settings are built once: each job turns the params into one typed object at its entry, whose
defaults are the schema's; the job past its entry reads that object, never the params again."""

import pytest

from workbook import generation, params
from workbook.generation.engine import GenerationError
from workbook.paths import PARAMS_DIR


def test_the_jobs_settings_are_built_once_with_the_schemas_defaults():
    from workbook.generation.settings import GenerationSettings, field_keys
    from workbook.paths import REPO_ROOT as root
    # No defaults of its own: settings built in code generate as a profile that leaves the key out would.
    defaults = params.defaults()
    assert {key: getattr(GenerationSettings(), key) for key in field_keys()} == {key: defaults[key] for key in field_keys()}
    # Every field comes from its key, and every key it takes is one the generate job declares it reads.
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    built = GenerationSettings.from_params(cpu)
    assert {key: getattr(built, key) for key in field_keys()} == {key: cpu[key] for key in field_keys()}
    assert set(field_keys()) <= set(generation.PARAMS_USED)
    with pytest.raises(GenerationError, match="needs the parameter\\(s\\) seed"):
        GenerationSettings.from_params({key: value for key, value in cpu.items() if key != "seed"})
    # A change reaches the planner's copy of the profile too ('auto' resolved before planning).
    resolved = built.replace(tensor_parallel_size=2)
    assert resolved.tensor_parallel_size == resolved.profile_params["tensor_parallel_size"] == 2
    # The job past its entry reads the settings, never the params again.
    for module in ("lib/workbook/generation/job.py", "lib/workbook/generation/inputs.py"):
        assert 'params["' not in (root / module).read_text() and "params['" not in (root / module).read_text(), module
