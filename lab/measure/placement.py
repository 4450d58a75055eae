"""What a placed model costs in theory: the record a data-parallel strategy fills as it places the model (``Costs``),
and the formulas over it, built on the ZeRO rows and the ring convention of ``lab.measure.accounting``.

Plain numbers only, as accounting: ``lab.parallel.accounts`` sets these beside what a rank measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.measure.accounting import COLLECTIVES, StateBytes, comm_bytes_per_step, model_state_bytes, ring_elements_sent
@dataclass(frozen=True)
class Costs:
    """How a data-parallel strategy placed the model on one rank, in the terms the formulas below read: the record each
    strategy fills as it places the model (``lab.parallel.accounts`` sets it beside what the rank measures).
    Element counts are by data-parallel group size: an expert's group is smaller than the data axis."""

    states: str = "ddp"  # the model_state_bytes row its states follow (DeepSpeed's: "zero{zero_stage}" until built)
    traffic: str | None = "ddp"  # the comm_bytes_per_step row of its gradient sync (None: nothing sent)
    synced: tuple[tuple[int, int], ...] | None = None  # (group size, elements) each sync moves; None: every trainable
    fp32_states: bool = False  # weights and gradients at rest in fp32 whatever the precision (FSDP2's shards)
    offloaded: bool = False  # the optimizer states and the update on the host
    grads_at_rest: bool = False  # gradient buffers live between steps
    accumulates_whole: bool = False  # sharded gradients held whole until an accumulated step's last micro-step
    units: tuple[int, ...] = ()  # the flat units' padded elements (two in flight in the backward)
    chunks: tuple[int, ...] = ()  # this rank's chunk of each unit, in elements (the step's temporaries)
    masters: int = 0  # elements of the fp32 masters kept of whole weights under mixed precision
    gathers: tuple[tuple[float, int, int], ...] = ()  # (times a step, elements, group size) of each gathered piece
    pool: int = 0  # elements of the gather pool when full (held from the first forward through the step)


def placed_state_bytes(costs: Costs, counts: dict[int, int], precision: str,
                       one_moment: dict[int, int] | None = None) -> StateBytes:
    """``model_state_bytes`` of a placement holding ``counts`` parameters by group size, each sharded over its group,
    ``one_moment`` of them (by group size) with one optimizer moment (Muon's); ``precision`` is the policy's widths
    (fp32 where the placement keeps fp32 shards)."""
    widths, single = "fp32" if costs.fp32_states else precision, one_moment or {}
    parts = [model_state_bytes(count, costs.states, n, widths, costs.offloaded, single.get(n, 0))
             for n, count in counts.items()]
    return StateBytes(sum(p.params for p in parts), sum(p.grads for p in parts), sum(p.optimizer for p in parts),
                      costs.offloaded)


def placed_comm_bytes(costs: Costs, synced: dict[int, int], reduce_width: float, gather_width: float
                      ) -> dict[str, float]:
    """Bytes one rank sends per step: ``comm_bytes_per_step`` over each group's ``synced`` elements, its all-gathers
    replaced by the pieces the placement gathers (``gathers``, ``gather_width`` bytes an element), where it says how
    often."""
    out = dict.fromkeys(COLLECTIVES, 0.0)
    if costs.traffic is None:
        return out
    for n, count in synced.items():
        for kind, sent in comm_bytes_per_step(count, costs.traffic, n, reduce_width, gather_width).items():
            out[kind] += sent
    if costs.gathers:
        elements: dict[int, float] = {}
        for times, count, n in costs.gathers:
            elements[n] = elements.get(n, 0.0) + times * count
        out["all_gather"] = gather_width * sum(ring_elements_sent("all_gather", e, n) for n, e in elements.items())
    return out


def placed_peak_bytes(costs: Costs, states: StateBytes, accum_steps: int, mixed: bool, width: int,
                      activations: float, cast_weights: float = 0.0) -> dict[str, float]:
    """Per phase, the most bytes a rank holds in theory: its weights and optimizer states (``states``), the gradients
    held in that phase, the gather pool (units and pool in elements of ``width`` bytes, the weights' dtype), and
    ``activations`` (one micro-batch's); the forward also holds autocast's copies of the weights (``cast_weights``),
    the step the optimizer's temporaries.

    Gradients: held between micro-steps where buffers live between steps or a step accumulates (the whole sharded
    gradient where the placement keeps it whole until the last micro-step); the backward adds two flat units in flight
    (one filling, one reduce-scattering). Temporaries: one chunk of a unit (foreach and fused updates allocate none
    else), and under mixed precision the fp32 gradients of the masters or of this rank's chunks."""
    two_units = width * sum(sorted(costs.units)[-2:])
    if costs.accumulates_whole and accum_steps > 1:
        whole = width * sum(costs.units)
        grads_forward, grads_backward = whole, whole + two_units
    else:
        between = costs.grads_at_rest or accum_steps > 1
        grads_forward, grads_backward = (states.grads if between else 0.0), states.grads + two_units
    temporaries = 4.0 * (costs.masters + max(costs.chunks, default=0) + (sum(costs.chunks) if mixed else 0))
    held, pool = states.params + states.optimizer, width * costs.pool
    return {"forward": held + grads_forward + pool + activations + cast_weights,
            "backward": held + grads_backward + pool + activations,
            "step": held + states.grads + temporaries + pool}
