"""Run by tests/test_tensor_parallel.py under torchrun: the generation job over the tiny model sharded
over the processes, where generate() raises CUDA's out-of-memory error above a number of rows on every
rank alike (as a real one does when the shards are equal). Each rank writes the batch sizes it tried to
argv[3].rank<N>.json.

    torchrun --nproc_per_node 2 tests/tensor_parallel_oom_worker.py PROMPTS OUTPUT SIZES_PREFIX LIMIT
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test_generate's helpers
from test_generate import OutOfMemoryAbove, job_params  # noqa: E402

from workbook.generation import job, tensor_parallel  # noqa: E402

prompts, output, sizes_prefix, limit = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
params = job_params(prompts, output, batch_size=8, max_new_tokens=6, tensor_parallel_size=2)
rank = job.current_rank(tensor_parallel_size=2)
sharded, tokenizer = job.load_model("tiny", "fp32", rank.device,
                                    tensor_parallel.sharding_arguments(tensor_parallel.Layout(2, rank.count // 2)))
wrapped = OutOfMemoryAbove(sharded, limit=limit)
job.run_job(params, output, model=wrapped, tokenizer=tokenizer, log=lambda line: None, show_progress=False)
Path(f"{sizes_prefix}.rank{rank.index}.json").write_text(json.dumps(wrapped.batch_sizes))
