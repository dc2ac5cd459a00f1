"""What one step's speculation decision reads, in one value passed down the call (never set on
an object before the call and reset after)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blockspec.policy.cost_model import StepCostModel
from blockspec.policy.drain import Drain

# (batch size, cost model) -> (seconds, horizon): what speculating this step would pay once
# first (the lazy drafter context's catch-up), and the tokens per sequence left to repay it.
SwitchCost = Callable[[int, StepCostModel], tuple[float, float]]
# A draining batch, or a function that builds it on demand (None where the batch does not drain).
DrainArg = Drain | Callable[[], Drain | None] | None


@dataclass(frozen=True)
class StepContext:
    """The engine's side of a step's decision: the load, and the draining batch if any. The
    runner adds what only it knows (this step's catch-up price) with `dataclasses.replace`."""

    num_unfinished: int = 0  # running + waiting requests (the lazy context's load rule)
    drain: DrainArg = None  # set while a closed batch drains (every request running)
    switch_cost: SwitchCost | None = None
    # The block length the policy already chose for this step (async scheduling decides before
    # it commits the step in flight, and a step that cannot run ahead then runs synchronously
    # with that choice): no second decision.
    chosen_block_len: int | None = None


NO_CONTEXT = StepContext()  # a step with nothing known beyond its batch (tests, benchmarks)
