"""Cost model of a load versus recompute, fed by what kvtier measures while serving.

Two straight lines, both in seconds. An engine step costs ``fixed_s + per_token_s * tokens``,
measured from the engine's own step times (or with a configured prefill rate): the fixed part
is what small steps (decode-sized, at most :data:`SMALL_STEP_TOKENS`) take, the slope what
larger steps take beyond it. A plain least-squares line would do worse: attention makes long
prefills superlinear, which drives the fitted intercept to zero and makes an extra step look
free. A load from a tier costs ``fixed_s + per_token_s * tokens fetched``, fitted from when a
load is handed to the workers to when they report it: what the waiting request really waits.
Until a tier has such samples, the workers' own per-chunk figure (sent with every lookup reply)
gives its slope, with one engine step as the fixed part: enough to compare partial with handoff
(:meth:`CostModel.known`), not enough to veto a load (:meth:`CostModel.measured`, after
:data:`MIN_SAMPLES` measured loads) -- unless the figure is *probed*: it started from the tier's
read speed, measured when the workers started (the disk tier's), and loads refine it since. That
figure leaves out verifying and copying a chunk, so it is a lower bound on what a load costs, and
a veto on it is sound from the first request on, once the step line is known: with a configured
``prefill_tokens_per_s`` at once, else after the engine's first prefill step
(:data:`MIN_STEP_SAMPLES`). No other prior for the recompute side exists: until then every load
goes ahead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

MIN_SAMPLES = 8  # measured loads before a tier's own line replaces the workers' figure
# Steps before the step line is known, one of them prefilling more than SMALL_STEP_TOKENS. One is
# enough: until small steps are seen, all of a step's time counts per token, which overestimates
# recompute and underestimates a load's fixed part, so an early line can only veto too little.
MIN_STEP_SAMPLES = 1
SMALL_STEP_TOKENS = 64  # steps up to this many tokens measure the fixed cost of a step
DECAY = 0.97  # each new sample down-weights the history, so the fit follows load changes


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``seconds(tokens) = fixed_s + per_token_s * tokens``; both non-negative. ``samples``: the
    measured samples the line was fitted from (0: a worker's figure); ``probed``: a worker's figure
    that started from the tier's read speed, measured at start (see the module docstring)."""

    fixed_s: float
    per_token_s: float
    samples: int = 0
    probed: bool = False

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True, slots=True)
class CostModel:
    """What a plan costs. ``step``: one engine step; ``loads``: per tier name."""

    step: LinearCost | None = None
    loads: Mapping[str, LinearCost] = field(default_factory=dict)

    def known(self, tiers: Iterable[str]) -> bool:
        """Every cost is at least estimated (a worker's figure will do): enough to compare loads."""
        return self.step is not None and all(t in self.loads for t in tiers)

    def measured(self, tiers: Iterable[str]) -> bool:
        """Every tier's load line comes from loads that waiting requests really waited, or every
        tier's from its measured read speed (``probed``): enough to veto a load in favour of
        recompute. Never a mix of the two: a probed disk figure must not veto a load that is
        partly from the CPU tier (though it may cut the disk chunks after it: :meth:`vetoable_from`)."""
        tiers = set(tiers)
        return self.known(tiers) and (all(self.loads[t].samples >= MIN_SAMPLES for t in tiers)
                                      or all(self.loads[t].probed for t in tiers))

    def vetoable_from(self, tiers: list[str]) -> int:
        """The first chunk of a hit (``tiers``: each chunk's tier) from which every chunk's tier is
        measured or probed: cutting the load there or later is sound even when the tiers before are
        not (a probed figure is a lower bound, so a suffix it says is slower than recompute is)."""
        if not self.known(tiers):
            return len(tiers)
        first = len(tiers)
        while first and (self.loads[tiers[first - 1]].samples >= MIN_SAMPLES or self.loads[tiers[first - 1]].probed):
            first -= 1
        return first

    def prefill_s(self, tokens: int) -> float:
        """Marginal seconds to prefill ``tokens`` inside a step that runs anyway."""
        return self.step.per_token_s * tokens

    def step_s(self, tokens: int) -> float:
        """Seconds of a step of its own that prefills ``tokens``."""
        return self.step.seconds(tokens)

    def load_s(self, fetched_tiers: list[str], chunk_tokens: int) -> float:
        """Seconds to fetch whole chunks, one per entry of ``fetched_tiers``, as one load."""
        if not fetched_tiers:
            return 0.0
        fixed = max(self.loads[t].fixed_s for t in set(fetched_tiers))
        return fixed + sum(self.loads[t].per_token_s for t in fetched_tiers) * chunk_tokens


def fit_line(w: float, sx: float, sy: float, sxx: float, sxy: float) -> tuple[float, float]:
    """Weighted least squares ``y = a + b x`` from sums; ``a, b >= 0``.

    With no spread in ``x`` the intercept is unknowable: all of ``y`` goes to the slope.
    """
    if w <= 0:
        return 0.0, 0.0
    mx, my = sx / w, sy / w
    var = sxx / w - mx * mx
    if var <= 1e-9 * max(1.0, mx * mx):
        return 0.0, (my / mx if mx > 0 else 0.0)
    b = (sxy / w - mx * my) / var
    a = my - b * mx
    if b < 0:  # noise; a flat line through the mean
        return max(my, 0.0), 0.0
    if a < 0:  # through the origin instead
        return 0.0, (sxy / sxx if sxx > 0 else 0.0)
    return a, b


class LineMeter:
    """Accumulates ``(tokens, seconds)`` samples of one line with exponential forgetting. Not thread-safe."""

    def __init__(self) -> None:
        self.samples = 0
        self._sums = [0.0] * 5  # w, sx, sy, sxx, sxy

    def add(self, tokens: float, seconds: float) -> None:
        w, sx, sy, sxx, sxy = (s * DECAY for s in self._sums)
        self._sums = [w + 1, sx + tokens, sy + seconds, sxx + tokens * tokens, sxy + tokens * seconds]
        self.samples += 1

    def line(self) -> LinearCost | None:
        if self.samples < MIN_SAMPLES:
            return None
        a, b = fit_line(*self._sums)
        return LinearCost(a, b, self.samples)


class StepMeter:
    """Engine steps: the fixed cost from small steps, the per-token cost from the rest (EWMAs)."""

    def __init__(self) -> None:
        self.small_samples = self.large_samples = 0
        self._fixed = 0.0
        self._per_token = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= SMALL_STEP_TOKENS:
            self._fixed = _ewma(self._fixed, seconds, self.small_samples)
            self.small_samples += 1
        else:
            # Before any small step is seen, all of a large step counts per token (pessimistic
            # for recompute, so it never vetoes a load it should not).
            per_token = max(0.0, seconds - self._fixed) / tokens
            self._per_token = _ewma(self._per_token, per_token, self.large_samples)
            self.large_samples += 1

    def line(self) -> LinearCost | None:
        if self.small_samples + self.large_samples < MIN_STEP_SAMPLES or not self.large_samples:
            return None
        return LinearCost(self._fixed, self._per_token, self.small_samples + self.large_samples)


def _ewma(old: float, new: float, samples: int) -> float:
    if samples == 0:
        return new
    weight = max(1.0 - DECAY, 1.0 / (samples + 1))  # a plain mean while history is short
    return old + weight * (new - old)


class CostMeter:
    """Measured costs of one engine. ``prefill_tokens_per_s``: a configured prefill rate that
    replaces the measured per-token step cost (the measured fixed cost still applies)."""

    def __init__(self, prefill_tokens_per_s: float | None = None):
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.steps = StepMeter()
        self.loads: dict[str, LineMeter] = {}
        self.chunk_s: dict[str, float] = {}  # the workers' seconds per token fetched, by tier
        self.probed: frozenset[str] = frozenset()  # tiers of chunk_s that started from a measured read speed

    def record_step(self, tokens: int, seconds: float) -> None:
        """An engine step that computed ``tokens`` took ``seconds`` (wall clock)."""
        if tokens > 0 and seconds >= 0:
            self.steps.add(tokens, seconds)

    def record_load(self, tier: str, tokens: int, seconds: float) -> None:
        """A load that fetched ``tokens`` (whole chunks) from one ``tier`` was reported after ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.loads.setdefault(tier, LineMeter()).add(tokens, seconds)

    def record_chunk_load_ms(self, ms_by_tier: Mapping[str, float], chunk_tokens: int,
                             probed: Iterable[str] = ()) -> None:
        """The workers' latest measured milliseconds to load one whole chunk, by tier; ``probed``:
        the tiers whose figure started from a read speed measured at start."""
        for tier, ms in ms_by_tier.items():
            if ms >= 0:
                self.chunk_s[tier] = ms / 1e3 / chunk_tokens
        self.probed = frozenset(probed) & self.chunk_s.keys()

    def model(self) -> CostModel:
        step = self.steps.line()
        if self.prefill_tokens_per_s:
            fixed, samples = (step.fixed_s, step.samples) if step else (0.0, 0)
            step = LinearCost(fixed, 1.0 / self.prefill_tokens_per_s, samples)
        loads = {}
        if step is not None:  # the workers' figures: a prior until the tier has measured loads
            loads = {tier: LinearCost(step.fixed_s, per_token, 0, tier in self.probed)
                     for tier, per_token in self.chunk_s.items()}
        loads.update({tier: line for tier, meter in self.loads.items() if (line := meter.line()) is not None})
        return CostModel(step, loads)


class StepTimer:
    """Times engine steps for a :class:`CostMeter` from two calls any scheduler makes: ``planned``
    when a step is scheduled (vLLM's ``build_connector_meta``), ``ended`` when its output arrives
    (``update_connector_output``), in order, one each per step. A step's time is from the one to the
    other: what a prefill of its tokens costs the engine (with async scheduling, where the next step
    is planned before this one's output, also a wait behind the step before: recompute looks dearer,
    so a veto comes later, never wrongly). ``clock``: seconds, monotonic."""

    MAX_OUT = 3  # steps planned and not ended; older ones lost their output (none came) and are dropped

    def __init__(self, meter: CostMeter, clock: Callable[[], float]):
        self._meter, self._clock = meter, clock
        self._out: deque[tuple[float, int]] = deque(maxlen=self.MAX_OUT)  # (planned at s, tokens)

    def planned(self, tokens: int) -> None:
        self._out.append((self._clock(), tokens))

    def ended(self) -> None:
        if self._out:
            at, tokens = self._out.popleft()
            self._meter.record_step(tokens, self._clock() - at)
