"""The params keys each job reads: one list per job, in one torch-free place, so `--help` lists them
without importing the job, `--set` can say when a key changes nothing, and a job checks its params
hold every key before it starts. Each notebook's parameters cell declares its job's keys."""

from workbook import job_settings
from workbook.bench import settings as bench_settings

# workbook generate (notebook 02): its settings' fields, and the memory budget its planner reads
GENERATE = job_settings.generation_keys()

# workbook train (notebook 03): the fields its config is built from, the memory budget, and the keys of
# the paths it resolves (the training data, notebook 02's outputs and verifier, the training folder)
TRAIN = job_settings.train_keys()

# workbook bench (notebook 04): the fields of its settings (torch-free, as this module must stay)
BENCH = bench_settings.field_keys()

# workbook verify: an existing output through a verifier
VERIFY = ("profile", "output_path", "verifier", "max_accepted_per_prompt")

# workbook forecast pilots either job (generate or train), so it reads both jobs' keys, and besides
# them the profile's bandwidth for the simulated rows, plan_mode (its default --mode), the node count
# (the job's global split), seq_len and the outputs' expected length (the forecast without a pilot).
FORECAST = tuple(dict.fromkeys(GENERATE + TRAIN + ("memory_bandwidth_gbs", "plan_mode", "num_nodes", "seq_len",
                                                   "expected_new_tokens")))

READ_BY = {"generate": GENERATE, "train": TRAIN, "bench": BENCH, "forecast": FORECAST, "verify": VERIFY}

NOTEBOOKS = {"generate": "notebooks/02_batched_generation", "train": "notebooks/03_training",
             "bench": bench_settings.NOTEBOOK}


def missing(params, job: str) -> str | None:
    """Why ``params`` cannot run ``job`` (the keys it lacks, and where to declare them), or None."""
    absent = [key for key in READ_BY[job] if key not in params]
    if not absent:
        return None
    where = f" (see {NOTEBOOKS[job]})" if job in NOTEBOOKS else ""  # forecast and verify have no notebook of their own
    return (f"workbook {job} needs the parameter(s) {', '.join(absent)}; a notebook that runs it must declare them "
            f"in its parameters cell{where}, or add them to the params file")
