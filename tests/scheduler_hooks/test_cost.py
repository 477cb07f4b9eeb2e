"""Cost lines fitted from measured samples."""

from __future__ import annotations

import pytest

from kvtier.scheduler_hooks import Geometry, PlanInput, PlanKind, Policy, Skip, plan_load
from kvtier.scheduler_hooks.cost import MIN_SAMPLES, CostMeter, LineMeter, StepTimer, fit_line


def test_fit_recovers_a_line():
    meter = LineMeter()
    for tokens in [16, 64, 256, 512, 1024, 32, 128, 2048]:
        meter.add(tokens, 2e-3 + 5e-5 * tokens)
    line = meter.line()
    assert line.fixed_s == pytest.approx(2e-3, rel=1e-6) and line.per_token_s == pytest.approx(5e-5, rel=1e-6)


def test_a_line_is_unknown_until_enough_samples():
    meter = LineMeter()
    for _ in range(MIN_SAMPLES - 1):
        meter.add(100, 1e-3)
    assert meter.line() is None
    meter.add(100, 1e-3)
    assert meter.line() is not None


def test_one_size_only_puts_everything_in_the_slope():
    assert fit_line(*_sums([(100, 1e-2)] * 5)) == (0.0, pytest.approx(1e-4))


def test_noise_never_gives_negative_costs():
    a, b = fit_line(*_sums([(10, 5e-3), (1000, 1e-3), (500, 3e-3)]))
    assert a >= 0 and b >= 0


def test_configured_prefill_rate_replaces_the_measured_slope():
    meter = CostMeter(prefill_tokens_per_s=10_000)
    model = meter.model()
    assert model.step.per_token_s == pytest.approx(1e-4) and model.step.fixed_s == 0
    assert not model.known(["cpu"])
    for tokens in (1, 512) * 4:
        meter.record_step(tokens, 1e-3 + 1e-6 * tokens)
    assert meter.model().step.per_token_s == pytest.approx(1e-4)  # configured beats measured
    for _ in range(MIN_SAMPLES):
        meter.record_load("cpu", 256, 1e-3)
    assert meter.model().known(["cpu"])


def test_load_cost_pays_the_fixed_part_once():
    meter = CostMeter()
    for tokens in (64, 128, 256, 64, 128, 256, 64, 128):
        meter.record_load("cpu", tokens, 2e-3 + 1e-6 * tokens)
        meter.record_load("disk", tokens, 4e-3 + 1e-5 * tokens)
    assert meter.model().loads == {"cpu": meter.loads["cpu"].line(), "disk": meter.loads["disk"].line()}
    assert meter.model().load_s(["cpu", "disk"], 64) == pytest.approx(4e-3 + 64e-6 + 64e-5, rel=1e-6)


def test_step_fixed_cost_comes_from_small_steps_and_the_slope_from_large_ones():
    meter = CostMeter()
    for tokens in (1, 4, 2048, 1, 1024, 2, 512, 1, 300):
        # attention makes long prefills superlinear: a least-squares intercept would be ~0
        meter.record_step(tokens, 2e-3 + 1e-4 * tokens + 1e-8 * tokens * tokens)
    step = meter.model().step
    assert step.fixed_s == pytest.approx(2e-3, rel=0.1)  # small steps still compute a token or few
    assert 1e-4 < step.per_token_s < 1.3e-4


def test_no_step_line_without_a_large_step():
    meter = CostMeter()
    for _ in range(20):
        meter.record_step(1, 1e-3)
    assert meter.model().step is None


def test_workers_chunk_costs_are_a_prior_until_loads_are_measured():
    meter = CostMeter()
    meter.record_chunk_load_ms({"cpu": 2.56, "disk": 25.6}, 256)
    assert meter.model().loads == {}  # no step line yet: nothing is known
    for tokens in (1, 512, 1, 512, 1, 512, 1, 512):
        meter.record_step(tokens, 1e-3 + 1e-5 * tokens)
    model = meter.model()
    assert model.loads["cpu"].per_token_s == pytest.approx(1e-5)
    assert model.loads["disk"].per_token_s == pytest.approx(1e-4)
    assert model.loads["cpu"].fixed_s == pytest.approx(1e-3 + 1e-5, rel=1e-6)
    for tokens in (256, 512) * 4:
        meter.record_load("cpu", tokens, 5e-3 + 1e-6 * tokens)  # what waiting requests saw wins
    assert meter.model().loads["cpu"].per_token_s == pytest.approx(1e-6, rel=1e-6)


G = Geometry(block_size=16, chunk_tokens=256)
HIT = 128  # stored chunks: a 32k-token hit


def first_admission(tiers, disk_ms, probed=("disk",), steps=((2048, 2048 / 28e3),)):
    """What the first request after a restart gets, given the workers' disk figure (ms a chunk)
    and the engine steps run so far (tokens, seconds): by default one prefill step at 28k tokens/s."""
    meter = CostMeter()
    for tokens, seconds in steps:
        meter.record_step(tokens, seconds)
    meter.record_chunk_load_ms({"disk": disk_ms, "cpu": 0.5}, G.chunk_tokens, probed)
    return plan_load(PlanInput(HIT * 256 + 100, 0, tiers), G, Policy(256), meter.model())


def test_a_slow_probed_disk_is_vetoed_on_the_first_request_and_a_fast_one_loads():
    # 32 MiB chunks: 1.5 GB/s reads one in 22 ms (2.9 s for the hit), against a 1.15 s recompute
    slow, fast = first_admission(("disk",) * HIT, 22.4), first_admission(("disk",) * HIT, 3.0)
    assert slow.kind is PlanKind.NONE and slow.skip is Skip.SLOWER
    assert fast.kind is PlanKind.LOAD and fast.predicted_s < 1.15


def test_negative_control_an_unprobed_disk_figure_never_vetoes():
    # The same slow figure without the probe's word: the load goes ahead (today's 3.5x TTFT).
    assert first_admission(("disk",) * HIT, 22.4, probed=()).kind is PlanKind.LOAD


def test_no_veto_before_the_engine_ran_a_prefill_step():
    assert first_admission(("disk",) * HIT, 22.4, steps=()).kind is PlanKind.LOAD
    assert first_admission(("disk",) * HIT, 22.4, steps=((1, 1e-3),) * 20).kind is PlanKind.LOAD  # decode only


def test_a_configured_prefill_rate_vetoes_before_any_step():
    meter = CostMeter(prefill_tokens_per_s=28_000)
    meter.record_chunk_load_ms({"disk": 22.4}, G.chunk_tokens, ["disk"])
    assert plan_load(PlanInput(HIT * 256, 0, ("disk",) * HIT), G, Policy(256), meter.model()).skip is Skip.SLOWER


def test_a_probed_disk_figure_never_vetoes_a_cpu_load():
    assert first_admission(("cpu",) * HIT, 1e6).kind is PlanKind.LOAD


def test_a_probed_disk_figure_never_vetoes_a_load_partly_from_the_cpu_tier():
    meter = CostMeter()
    meter.record_step(2048, 2048 / 28e3)
    for _ in range(MIN_SAMPLES):
        meter.record_load("cpu", 256, 1.0)  # even a CPU tier measured slow
    meter.record_chunk_load_ms({"disk": 1e6, "cpu": 0.5}, G.chunk_tokens, ["disk"])
    mixed = ("cpu",) * (HIT // 2) + ("disk",) * (HIT // 2)
    p = plan_load(PlanInput(HIT * 256, 0, mixed), G, Policy(256), meter.model())
    assert p.kind is PlanKind.LOAD and p.load_end == 256  # cut (both tiers judged), never vetoed whole
    assert plan_load(PlanInput(HIT * 256, 0, ("cpu",) * HIT), G, Policy(256), meter.model()).skip is Skip.SLOWER
    meter.loads.clear()  # a CPU tier with no measured loads: only the probed disk half may be cut
    p = plan_load(PlanInput(HIT * 256, 0, mixed), G, Policy(256), meter.model())
    assert p.kind is PlanKind.LOAD and p.load_end == HIT // 2 * 256


def test_probed_only_names_tiers_with_a_figure():
    meter = CostMeter()
    meter.record_chunk_load_ms({"cpu": 1.0}, 256, ["disk"])
    assert meter.probed == frozenset()


def _sums(samples):
    w = len(samples)
    return (w, sum(x for x, _ in samples), sum(y for _, y in samples), sum(x * x for x, _ in samples),
            sum(x * y for x, y in samples))



def test_the_step_timer_times_each_step_from_its_plan_to_its_output():
    now = [0.0]
    meter = CostMeter()
    timer = StepTimer(meter, lambda: now[0])
    assert meter.model().step is None  # no step seen: nothing may be vetoed
    timer.planned(2048)
    now[0] = 0.1
    timer.ended()
    timer.planned(0)  # a step that computes nothing measures nothing
    timer.ended()
    line = meter.model().step
    assert line is not None and line.per_token_s == pytest.approx(0.1 / 2048)
    # async scheduling: the next step is planned before this one's output; outputs come in order
    timer.planned(1)
    now[0] = 0.2
    timer.planned(1)
    now[0] = 0.25
    timer.ended()
    timer.ended()
    assert meter.steps.small_samples == 2 and meter.model().step.fixed_s == pytest.approx((0.15 + 0.05) / 2)
    timer.ended()  # an output with nothing planned is ignored
    assert meter.steps.small_samples == 2
