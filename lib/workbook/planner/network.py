"""What crosses the network between nodes (``num_nodes`` machines of the profile's ``gpu_count``
GPUs each): bytes per training step, and none per token for data-parallel generation.

Volumes, not times: the profile holds no network bandwidth, so a time would be a guess. They are
the bytes the collectives must move, counted as NCCL's tests count "bus bytes" (nccl-tests,
doc/PERFORMANCE.md): an all-reduce of S bytes over P ranks moves 2(P-1)/P x S through every rank's
links, an all-gather or a reduce-scatter (P-1)/P x S. Ring collectives spanning nodes (NCCL's
default between them) pass that volume through each node's network links too, so the bytes per
node equal the bytes per GPU whenever there is more than one node.
"""

from __future__ import annotations

from workbook.planner.plans import Plan
from workbook.units import format_bytes


def gradient_bytes_per_parameter(plan: Plan) -> int:
    """Bytes of one gradient as the trainer holds it: fp32 under mixed precision (fp32 master
    weights), for LoRA adapters (fp32, PEFT's default) and in fp32 training; else the dtype's 2."""
    settings = plan.settings
    return 4 if settings.get("mixed_precision") or settings.get("lora_rank") or plan.dtype == "fp32" else 2


def network_traffic(plan: Plan, num_nodes: int, gpus_per_node: int) -> dict:
    """The traffic of ``plan`` over ``num_nodes`` nodes: the data-parallel processes, bytes per GPU
    and per node per optimizer step (training), and a sentence saying what crosses the network."""
    gpus_per_node = max(gpus_per_node, 1)  # the cpu profile: one process per node
    processes = num_nodes * gpus_per_node
    traffic = {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node, "processes": processes}
    if plan.mode == "generate":
        tensor_parallel = max(plan.tensor_parallel_size, 1)
        copies = (f"{processes // tensor_parallel} copies of the model, each sharded over {tensor_parallel} GPUs of "
                  "one node" if tensor_parallel > 1 else "every process holds the whole model")
        return {**traffic, "counted_per": "token", "bytes_per_gpu_per_step": 0, "network_bytes_per_node_per_step": 0, "explanation": (
            f"data-parallel generation: {copies}, so nothing crosses the network per token; once, at the end, "
            "nodes that do not share the output's filesystem send their finished records (about the output "
            "file's size) to the first node")}
    gradients = plan.trainable_params * gradient_bytes_per_parameter(plan)
    if processes == 1:
        return {**traffic, "counted_per": "optimizer step", "gradient_bytes": gradients, "bytes_per_gpu_per_step": 0,
                "network_bytes_per_node_per_step": 0,
                "explanation": "one process: no gradients are exchanged (data parallelism needs two or more)"}
    if plan.settings.get("sharding") == "fsdp":
        # Full sharding over every GPU of every node: each micro-batch all-gathers the weights twice
        # (forward, backward) in the compute precision and reduce-scatters the gradients.
        weights = plan.params * (4 if plan.dtype == "fp32" else 2)
        counted_per = "micro-batch"
        per_gpu = (2 * weights + gradients) * (processes - 1) // processes
        how = (f"FSDP over {processes} GPUs: per micro-batch, two all-gathers of the {format_bytes(weights)} of "
               f"weights (compute precision) and a reduce-scatter of the {format_bytes(gradients)} of gradients, "
               "(P-1)/P of each per GPU")
    else:
        counted_per = "optimizer step"
        per_gpu = 2 * (processes - 1) * gradients // processes
        how = (f"DDP: per optimizer step (gradient accumulation syncs once), an all-reduce of the "
               f"{format_bytes(gradients)} of gradients ({plan.trainable_params:,} trainable parameters x "
               f"{gradient_bytes_per_parameter(plan)} bytes), 2(P-1)/P of it per GPU")
    crossing = (f"about {format_bytes(per_gpu)} per node per {counted_per} crosses the network" if num_nodes > 1
                else "nothing crosses a network (one node)")
    return {**traffic, "counted_per": counted_per, "gradient_bytes": gradients, "bytes_per_gpu_per_step": per_gpu,
            "network_bytes_per_node_per_step": per_gpu if num_nodes > 1 else 0,
            "explanation": f"{how}; {crossing}"}


def traffic_line(traffic: dict) -> str:
    """One line for the plan's text: the layout and what crosses the network."""
    return (f"network: {traffic['num_nodes']} node(s) x {traffic['gpus_per_node']} process(es), one per GPU = "
            f"{traffic['processes']} processes; {traffic['explanation']}")
