"""A/B of the sparse op's "auto" plan against the dense plan on real training steps.

The training "auto" decides per layer from a cost model fitted on synthetic sparsity patterns.
Trained patterns differ (hot neurons, dense first tokens, a skewed per-neuron load), and on a
trained-sparse 0.5b the plan it chose ran slower than its dense twin (BENCHMARKS.md), below the
0.98x floor the op promises. So the trainer checks the plan on the run itself: after compiling a
plan with a sparse piece it times `steps` training steps with it, then `steps` with the dense
program (compiled once per run), and keeps the sparse plan only when its median step time is at
least `floor` x as fast as dense's (a sparse plan that costs up to 2% still saves memory). Both arms
are ordinary training steps (the same math, the same batches in order), so the check costs only
the slower arm's extra time and one compile; nothing is synchronised inside a step.

The first step of each arm is not timed (a new executable's first run may warm caches)."""
from __future__ import annotations

import dataclasses
import statistics

ARMS = ("auto", "dense")


@dataclasses.dataclass
class PlanTrial:
    """One A/B: feed `add(seconds)` each step's time while `arm()` names the program to run."""

    steps: int  # timed steps per arm (>= 1)
    floor: float = 0.98  # keep "auto" when dense_time / auto_time >= floor
    # Timed step seconds per arm, and steps seen per arm (the first is warm-up, not timed).
    times: dict[str, list[float]] = dataclasses.field(init=False, default_factory=lambda: {a: [] for a in ARMS})
    _seen: dict[str, int] = dataclasses.field(init=False, repr=False, default_factory=lambda: {a: 0 for a in ARMS})

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"PlanTrial.steps must be an int >= 1, got {self.steps!r}")
        if not 0 < self.floor <= 1:
            raise ValueError(f"PlanTrial.floor must be in (0, 1], got {self.floor!r}")

    def arm(self) -> str | None:
        """The program the next step runs: "auto", then "dense", then None (decided)."""
        for arm in ARMS:
            if len(self.times[arm]) < self.steps:
                return arm
        return None

    def add(self, seconds: float) -> None:
        """Record the step just run on `arm()` (its first step is skipped: warm-up)."""
        arm = self.arm()
        if arm is None:
            raise RuntimeError("PlanTrial.add after the trial was decided")
        self._seen[arm] += 1
        if self._seen[arm] > 1:
            self.times[arm].append(float(seconds))

    @property
    def decided(self) -> bool:
        return self.arm() is None

    def medians(self) -> dict[str, float]:
        """Median step seconds per arm (only once decided)."""
        if not self.decided:
            raise RuntimeError("PlanTrial.medians before both arms were timed")
        return {arm: statistics.median(self.times[arm]) for arm in ARMS}

    def verdict(self, medians: dict[str, float] | None = None) -> str:
        """ "auto" when dense_median / auto_median >= floor, else "dense"; `medians` (default: this
        trial's) lets a multi-process run decide on process 0's times everywhere."""
        return "auto" if self.speed_ratio(medians) >= self.floor else "dense"

    def speed_ratio(self, medians: dict[str, float] | None = None) -> float:
        """The auto plan's speed relative to dense (dense_median / auto_median)."""
        medians = self.medians() if medians is None else medians
        return medians["dense"] / medians["auto"]
