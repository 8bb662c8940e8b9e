"""What one training step holds at each moment, and the largest: the training plan's peak.

A training step's tensors are not all alive at once (``planner.trace`` measures it op by op). With
gradients set to None after each optimizer step (``training.loop.optimizer_step``):
- at the start of backward (the loss's own backward) every saved activation, autocast weight copy and
  the loss's fp32 tensors are alive, and no gradient is yet;
- through the layers' backward, activations are freed layer by layer while gradients appear layer by
  layer; under checkpointing each layer's saved tensors are made again, one layer at a time;
- at the end of backward and in the optimizer step every gradient is alive, and no activation.
Gradient accumulation keeps the gradients of the earlier micro-batches alive under the next one's
activations. The peak is the largest of these moments; the weights and optimizer states (and DDP's
buckets) are alive in all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbook.planner.plans import Term

START = "start of backward"
RECOMPUTE = "a checkpointed layer recomputed in backward"
END = "end of backward"
OPTIMIZER = "optimizer step"

# The terms alive in every moment (the weights, the optimizer states, DDP's buckets, QLoRA's quantization
# state) are the state terms not named here.
PER_MOMENT = ("gradients", "autocast_weight_copies", "fsdp_gathered_parameters", "activations", "logits_and_loss",
              "backward_temporaries", "optimizer_step_temporaries")


@dataclass(frozen=True)
class StepTensors:
    """What one micro-batch's forward and backward make, in bytes per GPU, beside the state terms."""

    activations: Term  # saved for backward, alive at the start of backward (checkpointed: the layer inputs)
    loss: Term  # the loss's backward: its saved fp32 tensors and the gradients it makes
    checkpointing: bool
    accumulating: bool  # gradient_accumulation_steps > 1: gradients alive under the next micro-batch
    recomputed_layer: int = 0  # checkpointing: one layer's saved tensors, made again in its backward
    layer_input: int = 0  # one layer's input (tokens x hidden x residual bytes): a checkpoint, or a gradient
    head_weight_copy: int = 0  # autocast's copy of the lm_head weight (the head is never checkpointed)
    layer_weight_copies: int = 0  # autocast's copies one decoder layer makes
    head_gradients: int = 0  # the lm_head's (or tied embedding's) gradient: the first to appear
    layer_gradients: int = 0  # one decoder layer's gradients
    untied_embedding_gradients: int = 0  # the input embedding's, the last to appear (untied from the head)
    end_temporaries: int = 0  # at the end of backward: the gradient reaching the embedding, a tied one's new part
    end_explanation: str = ""
    optimizer_temporaries: int = 0  # the optimizer step's own (foreach AdamW: one tensor per parameter)
    optimizer_explanation: str = ""


@dataclass(frozen=True)
class Moment:
    name: str
    alive: dict[str, int]  # term name -> bytes alive then

    @property
    def total(self) -> int:
        return sum(self.alive.values())


def moments(state_terms: list[Term], step: StepTensors) -> list[Moment]:
    """Every moment that can be the peak, each with the bytes of each term alive then."""
    state = {term.name: term.bytes for term in state_terms}
    always = {name: value for name, value in state.items() if name not in PER_MOMENT}
    gradients = state.get("gradients", 0)
    copies = state.get("autocast_weight_copies", 0)
    gathered = state.get("fsdp_gathered_parameters", 0)
    earlier = gradients if step.accumulating else 0  # the earlier micro-batches' gradients

    found = [Moment(START, {**always, "gradients": earlier, "fsdp_gathered_parameters": gathered,
                            "autocast_weight_copies": step.head_weight_copy if step.checkpointing else copies,
                            "activations": step.activations.bytes, "logits_and_loss": step.loss.bytes})]
    if step.checkpointing:
        # The layers' backward from the top one (the head's gradient alone exists, every layer input is kept)
        # to the bottom one (every gradient but its own and the embedding's, one layer input left): what
        # grows and what shrinks are both linear over the layers, so one of the two ends is the largest.
        kept_inputs = step.activations.bytes
        top = (earlier or step.head_gradients, kept_inputs)
        bottom = (gradients if step.accumulating else
                  max(0, gradients - step.layer_gradients - step.untied_embedding_gradients), step.layer_input)
        held, inputs = max(top, bottom, key=sum)
        found.append(Moment(RECOMPUTE, {**always, "gradients": held, "fsdp_gathered_parameters": gathered,
                                        "autocast_weight_copies": step.layer_weight_copies,
                                        "activations": inputs + step.recomputed_layer,
                                        "backward_temporaries": step.layer_input}))
    found.append(Moment(END, {**always, "gradients": gradients, "fsdp_gathered_parameters": gathered,
                              "backward_temporaries": step.end_temporaries}))
    # FSDP has resharded every unit by the optimizer step: its gathered parameters are gone.
    found.append(Moment(OPTIMIZER, {**always, "gradients": gradients,
                                    "optimizer_step_temporaries": step.optimizer_temporaries}))
    return found


def peak(state_terms: list[Term], step: StepTensors) -> tuple[Moment, list[Moment]]:
    """The largest moment (the first of equals, in step order) and all of them."""
    found = moments(state_terms, step)
    return max(found, key=lambda moment: moment.total), found


def peak_terms(state_terms: list[Term], step: StepTensors) -> list[Term]:
    """The plan's terms at the peak: every term, with the bytes alive at that moment; a term not alive then
    is kept at 0 bytes and says when it is alive and how large it is."""
    top, found = peak(state_terms, step)
    whole = {term.name: term for term in [*state_terms, step.activations, step.loss]}
    largest = bytes_when_alive(found)
    explanations = {
        "backward_temporaries": step.end_explanation if top.name != RECOMPUTE else
        "the gradient of the recomputed layer's output",
        "optimizer_step_temporaries": step.optimizer_explanation,
    }
    terms = []
    names = [term.name for term in state_terms] + ["activations", "logits_and_loss"]
    names += [name for name in ("backward_temporaries", "optimizer_step_temporaries") if name in largest]
    for name in names:
        value = top.alive.get(name, 0)
        term = whole.get(name)
        explanation = term.explanation if term is not None else explanations[name]
        if name == "activations" and top.name == RECOMPUTE:
            explanation = (f"{top.name}: the checkpointed layer inputs still kept and one layer's saved tensors "
                           f"made again ({step.recomputed_layer:,} B); {explanation}")
        elif name == "autocast_weight_copies" and top.name == RECOMPUTE:
            explanation = f"{top.name}: the copies of that layer's weights; {explanation}"
        elif name == "autocast_weight_copies" and top.name == START and step.checkpointing:
            explanation = (f"checkpointed: at the start of backward only the lm_head's copy (the layers make theirs "
                           f"again when recomputed); {explanation}")
        elif name == "gradients" and 0 < value < whole[name].bytes:
            explanation = (f"{top.name}: {value:,} of {whole[name].bytes:,} B (the rest appear later in backward); "
                           f"{explanation}")
        elif name == "gradients" and value and step.accumulating and top.name in (START, RECOMPUTE):
            explanation = (f"gradient accumulation: the earlier micro-batches' gradients stay alive under this "
                           f"one's activations; {explanation}")
        if value == 0 and largest.get(name, 0) > 0:
            explanation = f"0 at the peak ({top.name}): {_why_not_alive(name, top.name)}; {explanation}"
        terms.append(Term(name, value, explanation))
    return terms


def bytes_when_alive(found: list[Moment]) -> dict[str, int]:
    """Each term's largest bytes over the moments (a term alive in none left out): what the term holds when it
    is alive, e.g. every saved activation, or every gradient."""
    largest: dict[str, int] = {}
    for moment in found:
        for name, value in moment.alive.items():
            if value > largest.get(name, 0):
                largest[name] = value
    return largest


def _why_not_alive(name: str, moment: str) -> str:
    if name == "gradients":
        return "set to None after each optimizer step, they appear layer by layer in backward (all alive at its end "\
               "and in the optimizer step)"
    if name == "activations":
        return "freed layer by layer in backward, none left at its end"
    if name == "logits_and_loss":
        return "the loss's backward runs first, its tensors are freed before the layers' backward"
    if name == "autocast_weight_copies":
        return "each layer's copies are freed with its saved tensors in backward"
    if name == "fsdp_gathered_parameters":
        return "FSDP reshards every unit after backward"
    if name == "backward_temporaries":
        return "made in backward, after the peak" if moment != OPTIMIZER else "freed by the end of backward"
    return "made in the optimizer step"
