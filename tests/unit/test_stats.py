"""The parity statistics (hypertrain.sim.study.stats, .tdist) on hand-worked and table values.

The registered case is n = 3 seeds, so df = 2, where Student's t has closed
forms a reader can redo on paper:

    P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2         t_{p} = (2p - 1) / sqrt(2 p (1 - p))

so t_{0.95, 2} = 0.9 / sqrt(0.095) = 2.9199856.  The expected numbers below are
worked from these, not from the code under test.
"""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypertrain.sim.study.stats import (
    DELTA,
    best_control,
    compare,
    h1_test,
    h2_eta_trend,
    h4_gap_trend,
    paired_ci,
    power,
    rank_mechanisms,
    relative_gaps,
    select_outer_lr,
    tost,
    tost_power,
    trend_test,
    verdict_text,
)
from hypertrain.sim.study.tdist import betainc, t_cdf, t_ppf, t_sf

EQUIV = "equivalent at delta = 0.005"
NOT_EQUIV = "equivalence not demonstrated at delta = 0.005"

# Student t quantiles from printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), 6 decimals.
T_TABLE = {
    (1, 0.95): 6.313752, (1, 0.975): 12.706205, (1, 0.995): 63.656741,
    (2, 0.95): 2.919986, (2, 0.975): 4.302653, (2, 0.995): 9.924843,
    (5, 0.95): 2.015048, (5, 0.975): 2.570582, (5, 0.995): 4.032143,
    (30, 0.95): 1.697261, (30, 0.975): 2.042272, (30, 0.995): 2.749996,
    (4, 0.95): 2.131847, (3, 0.95): 2.353363, (6, 0.95): 1.943180,
}  # fmt: skip


@pytest.mark.parametrize(("df", "p"), sorted(T_TABLE))
def test_t_quantiles_match_table_values(df: int, p: float) -> None:
    assert t_ppf(p, df) == pytest.approx(T_TABLE[(df, p)], abs=1e-6)
    assert t_ppf(1 - p, df) == -t_ppf(p, df)


def test_t_closed_forms_and_the_incomplete_beta_path_agree() -> None:
    for t in (-7.5, -1.0, 0.0, 0.3, 1.7, 12.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-15)
        assert t_sf(t, 2) == pytest.approx(0.5 * (1 - t / math.sqrt(t * t + 2)), abs=1e-15)
        # df = 3 has no shortcut in the code: it goes through betainc.
        df3 = 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi
        assert t_cdf(t, 3) == pytest.approx(df3, abs=1e-14)
        # The general path at df = 2 (upper tail = I_x(1, 1/2) / 2) matches the closed form.
        tail = 0.5 * betainc(1.0, 0.5, 2 / (2 + t * t))
        assert tail == pytest.approx(0.5 * (1 - abs(t) / math.sqrt(t * t + 2)), abs=1e-14)
    for x in (0.01, 0.3, 0.5, 0.77, 0.999):
        assert betainc(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)))
        assert betainc(2.5, 1.0, x) == pytest.approx(x**2.5)
        assert betainc(1.0, 3.5, x) == pytest.approx(1 - (1 - x) ** 3.5)
    assert t_ppf(0.95, 3.0000001) == pytest.approx(T_TABLE[(3, 0.95)], abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.5, 200), st.floats(-30, 30))
def test_t_ppf_inverts_t_cdf(df: float, t: float) -> None:
    p = t_cdf(t, df)
    # Far in a tail, p = 1 - q itself has lost q's digits; the round trip cannot be exact there.
    # Near the median the incomplete beta's absolute accuracy (~1e-8 in t, seen at df=128,
    # t=4.8e-7) bounds it instead: quantiles used by the tests of the parity protocol
    # (docs/design.md §7; p >= 0.9) are unaffected.
    if 1e-6 < p < 1 - 1e-6:
        assert t_ppf(p, df) == pytest.approx(t, rel=1e-8, abs=1e-7)


def test_equivalent_case_hand_worked() -> None:
    # gaps 0.001, 0.002, 0.003: mean 0.002, sd 0.001, se = 0.001/sqrt(3) = 5.7735e-4,
    # half-width = 2.9199856 * 5.7735e-4 = 1.68585e-3, CI [3.14146e-4, 3.68585e-3] inside +-0.005.
    # t_lower = (0.002 + 0.005)/se = 7 sqrt(3) = 12.124356, p = (1 - 12.124356/sqrt(149))/2 = 0.0033670
    # t_upper = (0.002 - 0.005)/se = -3 sqrt(3) = -5.196152, p = (1 - 5.196152/sqrt(29))/2 = 0.0175494
    r = tost([0.001, 0.002, 0.003])
    assert (r.ci.n, r.ci.df) == (3, 2)
    assert r.ci.mean == pytest.approx(0.002) and r.ci.sd == pytest.approx(0.001)
    assert r.ci.t_crit == pytest.approx(2.9199856, abs=1e-7)
    assert r.ci.half_width == pytest.approx(1.6858545e-3, rel=1e-7)
    assert (r.ci.lo, r.ci.hi) == (pytest.approx(3.1414554e-4), pytest.approx(3.6858545e-3))
    assert r.t_lower == pytest.approx(12.124356) and r.p_lower == pytest.approx(0.0033670417)
    assert r.t_upper == pytest.approx(-5.196152) and r.p_upper == pytest.approx(0.0175493593)
    assert r.p == r.p_upper < 0.05
    assert r.equivalent and r.classification == "equivalent" and r.verdict == EQUIV


def test_clearly_not_equivalent_case_hand_worked() -> None:
    # gaps 0.020, 0.025, 0.030: mean 0.025, sd 0.005, se = 2.88675e-3, half-width 8.42927e-3,
    # CI [0.0165707, 0.0334293] entirely above +0.005.
    # t_upper = (0.025 - 0.005)/se = 4 sqrt(3) = 6.928203, p_upper = (1 + 6.928203/sqrt(50))/2 = 0.989898
    r = tost([0.020, 0.025, 0.030])
    assert (r.ci.lo, r.ci.hi) == (pytest.approx(0.0165707277), pytest.approx(0.0334292723))
    assert r.p_upper == pytest.approx(0.9898979486) and r.p_lower == pytest.approx(0.0045663057)
    assert not r.equivalent and r.classification == "different" and r.verdict == NOT_EQUIV


def test_inconclusive_case_hand_worked() -> None:
    # gaps -0.004, 0.001, 0.006: mean 0.001, deviations -0.005, 0, 0.005 -> sd 0.005,
    # CI 0.001 +- 8.42927e-3 = [-0.0074293, 0.0094293], across both margins.
    # t_lower = 0.006/se = 1.2 sqrt(3) = 2.078461, p = (1 - 2.078461/sqrt(6.32))/2 = 0.0866163
    # t_upper = -0.004/se = -0.8 sqrt(3) = -1.385641, p = (1 - 1.385641/sqrt(3.92))/2 = 0.1500729
    r = tost([-0.004, 0.001, 0.006])
    assert (r.ci.lo, r.ci.hi) == (pytest.approx(-0.0074292723), pytest.approx(0.0094292723))
    assert r.p_lower == pytest.approx(0.0866163090) and r.p_upper == pytest.approx(0.1500728939)
    assert r.p == r.p_upper
    assert not r.equivalent and r.classification == "inconclusive" and r.verdict == NOT_EQUIV


def test_five_seeds_uses_df_4() -> None:
    # gaps 0, 0.001, 0.002, 0.003, 0.004: mean 0.002, sd = sqrt(1e-5 / 4) = 1.5811e-3,
    # se = 7.0711e-4, half-width = 2.131847 * 7.0711e-4 = 1.50744e-3.
    r = tost([0.0, 0.001, 0.002, 0.003, 0.004])
    assert r.ci.df == 4
    assert r.ci.half_width == pytest.approx(2.131847 * math.sqrt(1e-5 / 4) / math.sqrt(5), rel=1e-6)
    assert r.equivalent


def test_verdict_wording_is_exactly_the_registered_text() -> None:
    assert verdict_text(True) == EQUIV
    assert verdict_text(False) == NOT_EQUIV
    assert verdict_text(False, 0.01) == "equivalence not demonstrated at delta = 0.01"


def test_degenerate_inputs_are_never_equivalent() -> None:
    for values in ([0.0], [], [0.001, math.nan, 0.0], [0.0, math.inf, 0.0]):
        r = tost(values)
        assert not r.equivalent and r.classification == "undefined" and r.verdict == NOT_EQUIV
    # Zero spread: the CI collapses to the mean, which decides.
    assert tost([0.001, 0.001, 0.001]).equivalent
    assert tost([0.006, 0.006]).classification == "different"


def test_ci_boundary_is_strict() -> None:
    # mean +- half-width touching the margin exactly is not "inside".
    r = paired_ci([0.001, 0.002, 0.003])
    delta = r.hi
    assert not tost([0.001, 0.002, 0.003], delta=delta).equivalent


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-0.02, 0.02), min_size=2, max_size=8))
def test_tost_p_value_agrees_with_the_ci_rule(gaps: list[float]) -> None:
    r = tost(gaps)
    if math.isfinite(r.p) and abs(r.p - 0.05) > 1e-9 and r.ci.sd > 1e-12:
        assert r.equivalent == (r.p < 0.05)


def test_power_hand_worked() -> None:
    # sd 0.005 at n = 3: half-width 8.42927e-3 (above).  Seeds for half-width <= 0.005:
    # n = 4: 2.353363 * 0.005 / 2 = 5.883e-3 (no); n = 5: 2.131847 * 0.005 / sqrt(5) = 4.767e-3 (yes).
    # Seeds for |mean| + half-width < 0.005 with mean 0.001, i.e. t/sqrt(n) < 0.8:
    # n = 6: 2.015048 / 2.449490 = 0.8226 (no); n = 7: 1.943180 / 2.645751 = 0.7345 (yes).
    p = power([-0.004, 0.001, 0.006])
    assert p.sd == pytest.approx(0.005) and p.half_width == pytest.approx(0.0084292723)
    assert (p.seeds_for_half_width, p.seeds_for_equivalence) == (5, 7)
    # A mean beyond the margin can never reach equivalence.
    assert power([0.020, 0.025, 0.030]).seeds_for_equivalence is None
    assert power([0.001]).seeds_for_half_width is None
    # Tiny spread: two seeds already suffice.
    assert power([0.0, 1e-6, 2e-6]).seeds_for_half_width == 2


@pytest.mark.parametrize(("n", "sd"), [(2, 0.001), (3, 0.002), (5, 0.004), (12, 0.006)])
def test_tost_power_is_the_rate_at_which_tost_finds_equivalence(n: int, sd: float) -> None:
    """Against the decision rule itself: 3000 draws of n gaps from N(0, sd^2) (a fixed seed),
    each through ``tost``; the share found equivalent is within 4 standard errors of the
    exact power (the cases span 0.1 to 0.95)."""
    rng = np.random.default_rng(2026)
    draws = 3000
    found = sum(tost(list(rng.normal(0.0, sd, n))).equivalent for _ in range(draws))
    exact = tost_power(n, sd)
    assert abs(found / draws - exact) < 4 * math.sqrt(exact * (1 - exact) / draws) + 1e-3


def test_tost_power_meets_the_normal_approximation_and_the_textbook_sample_size() -> None:
    """Many seeds: the t quantile tends to z and S to sd, so the power tends to
    2 Phi(delta sqrt(n) / sd - z_{1-alpha}) - 1.  A standardized margin of 0.3 at 80% power
    needs (z_{0.95} + z_{0.90})^2 / 0.3^2 = 95.1, so 96 pairs by that approximation (Chow,
    Shao and Wang, Sample Size Calculations in Clinical Research, formula 3.1.9, the example
    of R's TOSTER ``powerTOSTpaired``); the exact t-based count is one or two more."""
    z = NormalDist()
    for n, sd in ((400, 0.05), (2000, 0.1)):
        approx = 2 * z.cdf(DELTA * math.sqrt(n) / sd - z.inv_cdf(0.95)) - 1
        assert tost_power(n, sd) == pytest.approx(approx, abs=0.005)
    need = next(n for n in range(2, 200) if tost_power(n, 1.0, delta=0.3) >= 0.8)
    assert 96 <= need <= 98
    assert tost_power(4, 0.003, true_gap=0.004) < tost_power(4, 0.003)  # a real gap costs power
    powers = [tost_power(n, 0.005) for n in range(2, 40)]
    assert powers == sorted(powers) and powers[0] < 0.1 and powers[-1] > 0.9
    with pytest.raises(ValueError, match="need n >= 2"):
        tost_power(1, 0.005)


def test_power_reports_the_power_at_n_and_the_seeds_for_80_percent() -> None:
    """The half-width count is not an 80% design: at sd 0.005, 5 seeds bring the half-width
    inside the margin, yet TOST would then demonstrate equivalence of a true gap of 0 far
    less often than 80% of the time."""
    p = power([-0.004, 0.001, 0.006])
    assert p.power_at_n == pytest.approx(tost_power(3, 0.005))
    assert p.seeds_for_power is not None and p.seeds_for_half_width is not None
    assert tost_power(p.seeds_for_power, 0.005) >= 0.8 > tost_power(p.seeds_for_power - 1, 0.005)
    assert p.power_at_half_width_seeds == pytest.approx(tost_power(p.seeds_for_half_width, 0.005))
    assert p.power_at_half_width_seeds < 0.5
    same = power([0.001, 0.001, 0.001])  # no spread: any two seeds are enough
    assert (same.power_at_n, same.seeds_for_power) == (1.0, 2)
    assert power([0.001]).power_at_n is None and power([0.001]).seeds_for_power is None


def test_compare_pairs_by_seed_and_reports_missing_seeds() -> None:
    ref = {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.5}
    cell = {0: 2.002, 1: 2.004, 2: 2.006}
    assert relative_gaps(cell, ref) == pytest.approx({0: 0.001, 1: 0.002, 2: 0.003})
    c = compare("flat-M8-Hg30", cell, "dp-adamw", ref)
    assert c.seeds == (0, 1, 2) and c.missing_seeds == (3,)
    assert c.differences == pytest.approx((0.002, 0.004, 0.006))
    assert c.tost.verdict == EQUIV
    json.dumps(c.to_dict(), allow_nan=False)  # JSON-ready


def test_h1_compares_the_hierarchy_with_both_flat_cells() -> None:
    losses = {
        "hier": {0: 2.002, 1: 2.004, 2: 2.006},
        "flat-r": {0: 2.0, 1: 2.0, 2: 2.0},
        "flat-n": {0: 1.9, 1: 1.9, 2: 1.9},
    }
    h = h1_test(losses, "hier", "flat-r", "flat-n")
    assert h.vs_flat_r.tost.verdict == EQUIV
    assert h.vs_flat_n.tost.classification == "different"
    assert h.vs_flat_n.tost.verdict == NOT_EQUIV


def test_outer_lr_selection_rule() -> None:
    seeds = [0, 1, 2]
    runs: dict[float, dict[int, float | None]] = {
        0.4: {0: 2.10, 1: 2.10, 2: 2.10},
        0.6: {0: 2.00, 1: 2.02, 2: 2.01},  # mean 2.01
        0.8: {0: 2.01, 1: 2.01, 2: 2.01},  # mean 2.01: a tie, goes to 0.6
        1.0: {0: 1.50, 1: None, 2: 1.50},  # lowest, but one seed diverged
    }
    ch = select_outer_lr(runs, seeds)
    assert ch.eta == 0.6 and ch.losses == {0: 2.00, 1: 2.02, 2: 2.01}
    assert "divergent seeds [1]" in ch.excluded[1.0]
    runs[0.6] = {0: 2.0, 1: 2.0}
    assert "missing seeds [2]" in select_outer_lr(runs, seeds).excluded[0.6]
    assert select_outer_lr(runs, seeds).eta == 0.8
    none = select_outer_lr({1.0: {0: math.inf, 1: 2.0, 2: 2.0}}, seeds)
    assert none.eta is None and math.isnan(none.mean_loss)


def test_outer_lr_selection_sees_the_whole_registered_sweep() -> None:
    """A registered eta with no finished run is excluded by name; an end of the sweep is flagged."""
    seeds = [0, 1, 2]
    runs: dict[float, dict[int, float | None]] = {
        0.1: {0: 2.2, 1: 2.2, 2: 2.2},
        0.2: {0: 2.1, 1: 2.1, 2: 2.1},
    }
    ch = select_outer_lr(runs, seeds, sweep=(0.05, 0.1, 0.2, 0.4))
    assert ch.eta == 0.2 and ch.sweep == (0.05, 0.1, 0.2, 0.4) and ch.at_edge == "highest"
    assert ch.excluded == {0.05: "missing seeds [0, 1, 2]", 0.4: "missing seeds [0, 1, 2]"}
    runs[0.4] = {0: 2.0, 1: 2.0, 2: 2.0}
    runs[0.05] = {0: 2.3, 1: 2.3, 2: 2.3}
    assert select_outer_lr(runs, seeds, sweep=(0.05, 0.1, 0.2, 0.4)).at_edge == "highest"
    runs[0.05] = {0: 1.9, 1: 1.9, 2: 1.9}
    assert select_outer_lr(runs, seeds, sweep=(0.05, 0.1, 0.2, 0.4)).at_edge == "lowest"
    # Best at 0.2 with 0.4 never run, or run on two seeds only: not bracketed above.
    partial = {0.1: {0: 2.2, 1: 2.2, 2: 2.2}, 0.2: {0: 2.1, 1: 2.1, 2: 2.1}}
    assert select_outer_lr(partial, seeds, sweep=(0.1, 0.2, 0.4)).at_edge == "highest"
    partial[0.4] = {0: 2.0, 1: 2.0}
    assert select_outer_lr(partial, seeds, sweep=(0.1, 0.2, 0.4)).at_edge == "highest"
    partial[0.4] = {0: 2.0, 1: None, 2: 2.0}  # diverged above: bracketed
    assert select_outer_lr(partial, seeds, sweep=(0.1, 0.2, 0.4)).at_edge is None


def test_best_control_compares_controls_on_the_seeds_they_share() -> None:
    losses = {
        # lr1 is better on every seed, but lost seed 2 (its hardest); lr2 has all three.
        "dp": {0: 2.0, 1: 2.0},
        "dp-lr2": {0: 2.1, 1: 2.1, 2: 1.5},  # mean over all seeds 1.9 < 2.0
        "dp-none": {},
    }
    assert best_control(losses, ["dp", "dp-lr2"]) == "dp"
    assert best_control(losses, ["dp-none", "dp-lr2"]) == "dp-lr2"
    assert best_control({"a": {0: math.nan}, "b": {0: 3.0}}, ["a", "b"]) == "b"
    # No seed shared by the controls that have data: each on its own, never the empty one.
    assert best_control({"a": {}, "b": {0: 1.0}, "c": {1: 0.5}}, ["a", "b", "c"]) == "c"


def test_trend_exact_permutation_p_values() -> None:
    ms = [1, 2, 4, 8, 16, 32]
    up = trend_test(ms, [0.4, 0.5, 0.6, 0.7, 0.8, 1.0])
    # Only the identity ordering of 6 distinct values reaches S = 15: p = 1/720.
    assert up.tau == 1.0 and up.p_one_sided == pytest.approx(1 / 720)
    assert up.increasing and up.verdict == "increasing trend demonstrated at alpha = 0.05"
    # Ties: 2! * 2! orderings reach the maximum S: p = 4/720.
    tied = h2_eta_trend(dict(zip(ms, [0.4, 0.4, 0.6, 0.6, 0.8, 1.0], strict=True)))
    assert tied.p_one_sided == pytest.approx(4 / 720) and tied.monotone_nondecreasing
    # 3! * 3! / 720 = 0.05 is not < 0.05.
    flatish = trend_test(ms, [0.4, 0.4, 0.4, 0.6, 0.6, 0.6])
    assert flatish.p_one_sided == pytest.approx(0.05) and not flatish.increasing
    down = h4_gap_trend(dict(zip(ms, [0.05, 0.04, 0.03, 0.02, 0.01, 0.0], strict=True)))
    assert down.tau == -1.0 and down.p_one_sided == 1.0
    assert down.verdict == "increasing trend not demonstrated at alpha = 0.05"
    same = trend_test(ms, [0.6] * 6)
    assert math.isnan(same.tau) and not same.increasing
    gap = h2_eta_trend({1: 0.4, 2: None, 4: 0.6})
    assert gap.dropped == (2.0,) and gap.n == 2
    json.dumps(up.to_dict(), allow_nan=False)


def test_trend_beyond_exact_range_is_deterministic() -> None:
    xs = list(range(10))
    a = trend_test(xs, [float(x) for x in xs])
    assert a.p_one_sided == trend_test(xs, [float(x) for x in xs]).p_one_sided < 1e-3
    assert a.method.startswith("Monte Carlo")


def test_mechanism_ranking_and_promotion_rule() -> None:
    base = {0: 2.0, 1: 2.0, 2: 2.0}
    losses = {
        "flat": base,
        # improvements 0.010, 0.011, 0.012: mean 0.011, sd 0.001 -> 0.011 > 0.002: promoted
        "good": {0: 1.98, 1: 1.978, 2: 1.976},
        # improvements 0.000, 0.005, 0.010: mean 0.005, sd 0.005 -> 0.005 <= 0.010: not promoted
        "noisy": {0: 2.0, 1: 1.99, 2: 1.98},
        # improvements -0.005 each: worse, sd 0
        "bad": {0: 2.01, 1: 2.01, 2: 2.01},
        "lonely": {0: 1.0},
    }
    ranks = rank_mechanisms(
        losses, {"bad": "flat", "noisy": "flat", "good": "flat", "lonely": "flat"}
    )
    assert [r.cell for r in ranks] == ["good", "noisy", "bad", "lonely"]
    assert [r.rank for r in ranks] == [1, 2, 3, 4]
    good, noisy, bad, lonely = ranks
    assert good.mean == pytest.approx(0.011) and good.threshold == pytest.approx(0.002)
    assert good.promoted and not noisy.promoted and not bad.promoted and not lonely.promoted
    assert noisy.threshold == pytest.approx(0.010)
    assert "<=" in noisy.reason and lonely.reason.startswith("undefined")
    assert lonely.seeds == (0,) and lonely.missing_seeds == (1, 2) and good.missing_seeds == ()
    json.dumps([r.to_dict() for r in ranks], allow_nan=False)
