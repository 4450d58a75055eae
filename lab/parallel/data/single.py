"""One process, no communication: the reference every other strategy must reproduce."""

from lab.measure.placement import Costs
from lab.parallel.base import Strategy


class Single(Strategy):
    name = "single"
    max_world_size = 1
    costs = Costs(traffic=None)
