"""Statistics of the parity protocol (docs/design.md §7): paired gaps, the paired-t CI, TOST,
H1-H4, power.

Every function here is pure: numbers in, a frozen result out, each result with
a ``to_dict()`` that is JSON-ready (non-finite floats become ``null``).  Inputs
are per-seed held-out losses, ``Mapping[int, float]`` (seed -> loss); two arms
are always paired seed by seed on the seeds they share, and the seeds either
one lacks are recorded, never silently dropped.

Registered rules (docs/design.md §7), implemented literally:

- Gap per seed: ``(L_cell - L_ref) / L_ref``; the reference is the
  data-parallel control (or, for H1, the flat cell).
- Equivalence: the paired-t 90% CI of the gaps lies strictly inside
  ``(-delta, +delta)``, which is TOST with alpha 0.05 per one-sided test.  The
  verdict is then exactly ``"equivalent at delta = 0.005"``; in every other case
  (CI touching or crossing a margin, CI entirely outside, fewer than two seeds,
  a non-finite loss) it is exactly ``"equivalence not demonstrated at
  delta = 0.005"``.  No other wording exists here ("within noise" never).  A
  ``classification`` (equivalent | inconclusive | different | undefined) says
  which of those cases it was, separately from the verdict.
- Outer-lr selection: lowest mean held-out loss over the seeds among
  non-divergent etas (an eta with any divergent or missing seed is not
  eligible); ties go to the smaller eta.
- H3 promotion: mean paired improvement over flat DiLoCo at the same M larger
  than two standard deviations of the per-seed paired improvement.
- Power: the seed spread (sd) of the paired gaps, the 90% half-width at n
  seeds, and the seeds needed (half-width <= delta; and |mean| + half-width <
  delta if the observed mean and sd held).  Also the probability that TOST
  demonstrates equivalence when the true gap is 0 and the gaps' sd is the
  observed one (``tost_power``, exact by numerical integration over the sample
  sd, Owen's method), at the seeds observed, and the seeds that bring it to
  80% (``POWER_TARGET``), the conventional size of a design.
- Trends (H2 best eta vs M, H4 gap vs M): Kendall's tau-b with a one-sided
  permutation p-value, exact for n <= 8 (all n! orderings), else 100,000
  permutations from a fixed seed (deterministic).

t quantiles come from tdist.py (exact; df = 2 is the registered n = 3 case).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hypertrain.sim.study.tdist import t_cdf, t_ppf, t_sf

DELTA = 0.005
"""Registered equivalence margin on the relative held-out gap (0.5%)."""
ALPHA = 0.05
"""Registered significance level per one-sided test."""
POWER_TARGET = 0.8
"""Power a design is conventionally sized for (``Power.seeds_for_power``)."""
PROMOTION_SD = 2.0
"""H3: a mechanism is promoted if its mean improvement exceeds this many sd."""

Losses = Mapping[int, float]
Classification = Literal["equivalent", "inconclusive", "different", "undefined"]


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, tuples and mappings as plain JSON values; nan and inf become None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


class _Json:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = to_jsonable(self)
        return out


def verdict_text(equivalent: bool, delta: float = DELTA) -> str:
    """The registered verdict wording (docs/design.md §7.4): the only two strings a verdict
    can be."""
    if equivalent:
        return f"equivalent at delta = {delta:g}"
    return f"equivalence not demonstrated at delta = {delta:g}"


# -- pairing ------------------------------------------------------------------------


def shared_seeds(a: Losses, b: Losses) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(seeds both arms have, sorted; seeds only one of them has, sorted)."""
    return tuple(sorted(set(a) & set(b))), tuple(sorted(set(a) ^ set(b)))


def paired_differences(a: Losses, b: Losses) -> dict[int, float]:
    """``a_s - b_s`` for each shared seed s, in seed order."""
    return {s: float(a[s]) - float(b[s]) for s in shared_seeds(a, b)[0]}


def relative_gaps(cell: Losses, ref: Losses) -> dict[int, float]:
    """The registered gap per shared seed: ``(L_cell - L_ref) / L_ref``."""
    out = {}
    for s in shared_seeds(cell, ref)[0]:
        c, r = float(cell[s]), float(ref[s])
        out[s] = (c - r) / r if r != 0 else math.nan  # nan: the comparison becomes undefined
    return out


# -- the paired-t interval and TOST -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfidenceInterval(_Json):
    """Paired-t interval ``mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)``."""

    n: int
    mean: float
    sd: float
    """Sample standard deviation (n - 1 denominator): the seed spread."""
    se: float
    df: int
    level: float
    t_crit: float
    lo: float
    hi: float
    half_width: float


def _all_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def paired_ci(values: Sequence[float], level: float = 1 - 2 * ALPHA) -> ConfidenceInterval:
    """Two-sided paired-t CI of the mean of ``values`` (nan fields when n < 2 or non-finite)."""
    if not 0 < level < 1:
        raise ValueError(f"paired_ci: level must be in (0, 1), got {level}")
    xs = [float(v) for v in values]
    n = len(xs)
    nan = math.nan
    if n < 2 or not _all_finite(xs):
        mean = sum(xs) / n if n else nan
        return ConfidenceInterval(n, mean, nan, nan, max(n - 1, 0), level, nan, nan, nan, nan)
    mean = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    se = sd / math.sqrt(n)
    t_crit = t_ppf((1 + level) / 2, n - 1)
    hw = t_crit * se
    return ConfidenceInterval(n, mean, sd, se, n - 1, level, t_crit, mean - hw, mean + hw, hw)


@dataclass(frozen=True, slots=True)
class Tost(_Json):
    """Two one-sided tests of ``|mean| < delta`` with the matching 1 - 2*alpha CI."""

    delta: float
    alpha: float
    ci: ConfidenceInterval
    t_lower: float
    """(mean + delta) / se: tests H0 mean <= -delta."""
    t_upper: float
    """(mean - delta) / se: tests H0 mean >= +delta."""
    p_lower: float
    p_upper: float
    p: float
    """max(p_lower, p_upper): the TOST p-value."""
    equivalent: bool
    classification: Classification
    verdict: str


def _one_sided(num: float, se: float, df: int, upper_tail: bool) -> tuple[float, float]:
    """(t statistic, p-value) of num / se; se == 0 gives +-inf (or 0 / 0 -> nan)."""
    if se > 0:
        t = num / se
    elif num == 0:
        t = math.nan
    else:
        t = math.copysign(math.inf, num)
    if math.isnan(t):
        return t, math.nan if se > 0 else 1.0
    p = t_sf(t, df) if upper_tail else t_cdf(t, df)
    return t, p


def tost(values: Sequence[float], delta: float = DELTA, alpha: float = ALPHA) -> Tost:
    """TOST at margin ``delta``; equivalent iff the (1 - 2*alpha) CI is inside (-delta, delta)."""
    if not delta > 0 or not 0 < alpha < 0.5:
        raise ValueError(f"tost: need delta > 0 and 0 < alpha < 0.5, got {delta}, {alpha}")
    ci = paired_ci(values, level=1 - 2 * alpha)
    if math.isnan(ci.lo):
        nan = math.nan
        undefined = dict(t_lower=nan, t_upper=nan, p_lower=nan, p_upper=nan, p=nan)
        return Tost(
            delta=delta, alpha=alpha, ci=ci, **undefined, equivalent=False,
            classification="undefined", verdict=verdict_text(False, delta),
        )  # fmt: skip
    t_lo, p_lo = _one_sided(ci.mean + delta, ci.se, ci.df, upper_tail=True)
    t_up, p_up = _one_sided(ci.mean - delta, ci.se, ci.df, upper_tail=False)
    equivalent = -delta < ci.lo and ci.hi < delta
    cls: Classification
    if equivalent:
        cls = "equivalent"
    elif ci.lo >= delta or ci.hi <= -delta:
        cls = "different"
    else:
        cls = "inconclusive"
    return Tost(
        delta=delta, alpha=alpha, ci=ci, t_lower=t_lo, t_upper=t_up, p_lower=p_lo,
        p_upper=p_up, p=max(p_lo, p_up), equivalent=equivalent, classification=cls,
        verdict=verdict_text(equivalent, delta),
    )  # fmt: skip


# -- power ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Power(_Json):
    """How precise the comparison is, and how many seeds would reach the margin."""

    n: int
    mean: float
    sd: float
    """Seed spread: sample sd of the paired gaps."""
    half_width: float
    """Half-width of the (1 - 2*alpha) CI at the n seeds observed."""
    delta: float
    alpha: float
    seeds_for_half_width: int | None
    """Least n >= 2 with t_{1-alpha,n-1} * sd / sqrt(n) <= delta (None: sd unknown)."""
    seeds_for_equivalence: int | None
    """Least n >= 2 with |mean| + half-width(n) < delta if mean and sd held
    (None: |mean| >= delta, sd unknown, or more than max_seeds)."""
    power_at_n: float | None
    """``tost_power(n, sd)``: the chance TOST demonstrates equivalence at the n seeds
    observed if the true gap were 0 and the sd the observed one (None: sd unknown)."""
    seeds_for_power: int | None
    """Least n >= 2 with ``tost_power(n, sd) >= POWER_TARGET`` (None: sd unknown, or
    more than max_seeds)."""
    power_at_half_width_seeds: float | None
    """``tost_power(seeds_for_half_width, sd)``: what a design sized by the half-width
    count alone would give (None: no such count)."""


def _least_n(ok: Any, max_seeds: int) -> int | None:
    """Least n in [2, max_seeds] with ok(n), for ok monotone (False...False True...True)."""
    if ok(2):
        return 2
    lo, hi = 2, 4
    while not ok(hi):
        if hi >= max_seeds:
            return None
        lo, hi = hi, min(hi * 2, max_seeds)
    while hi - lo > 1:  # ok(lo) False, ok(hi) True
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def power(
    values: Sequence[float], delta: float = DELTA, alpha: float = ALPHA, max_seeds: int = 100_000
) -> Power:
    """Seed spread, half-width at n, and seeds needed (planning numbers, see Power)."""
    ci = paired_ci(values, level=1 - 2 * alpha)
    sd, mean = ci.sd, ci.mean
    if math.isnan(sd):
        return Power(ci.n, mean, sd, ci.half_width, delta, alpha, None, None, None, None, None)

    def half_width(n: int) -> float:
        return t_ppf(1 - alpha, n - 1) * sd / math.sqrt(n)

    for_hw = _least_n(lambda n: half_width(n) <= delta, max_seeds)
    for_eq = None
    if abs(mean) < delta:
        for_eq = _least_n(lambda n: abs(mean) + half_width(n) < delta, max_seeds)
    if not sd > 0:  # every gap equal: any n >= 2 demonstrates a mean inside the margin
        sure = 1.0 if abs(mean) < delta else 0.0
        return Power(ci.n, mean, sd, ci.half_width, delta, alpha, for_hw, for_eq, sure,
                     2 if sure else None, sure if for_hw else None)  # fmt: skip

    def pw(n: int) -> float:
        return tost_power(n, sd, delta, alpha)

    for_power = _least_n(lambda n: pw(n) >= POWER_TARGET, max_seeds)
    at_hw = pw(for_hw) if for_hw is not None else None
    return Power(ci.n, mean, sd, ci.half_width, delta, alpha, for_hw, for_eq, pw(ci.n),
                 for_power, at_hw)  # fmt: skip


_NODES = np.polynomial.legendre.leggauss(256)
"""Gauss-Legendre nodes and weights on [-1, 1] for ``tost_power``'s integral."""


def tost_power(
    n: int, sd: float, delta: float = DELTA, alpha: float = ALPHA, true_gap: float = 0.0
) -> float:
    """The probability that ``tost`` finds equivalence at margin ``delta`` with ``n`` paired
    gaps drawn from N(true_gap, sd^2): P(|mean| + t_{1-alpha,n-1} S / sqrt(n) < delta)
    where the mean ~ N(true_gap, sd^2 / n) and (n - 1) S^2 / sd^2 ~ chi^2_{n-1}, apart.

    Exact up to quadrature (Owen's formulation of TOST's power): for u = S / sd the
    condition is a normal probability, integrated against u's density
    2 k^k u^(2k-1) exp(-k u^2) / Gamma(k), k = (n - 1) / 2, over 0 < u < u_max =
    delta sqrt(n) / (t sd), beyond which the CI is wider than the margin; 256-point
    Gauss-Legendre over the part of that range where u's density is not negligible
    (within 12 of its approximate sds of 1)."""
    if n < 2 or not sd > 0 or not delta > 0 or not 0 < alpha < 0.5:
        raise ValueError(f"tost_power: need n >= 2, sd > 0, delta > 0, 0 < alpha < 0.5; got "
                         f"{n}, {sd}, {delta}, {alpha}")  # fmt: skip
    t = t_ppf(1 - alpha, n - 1)
    root_n = math.sqrt(n)
    u_max = delta * root_n / (t * sd)
    width = 1 / math.sqrt(2 * (n - 1))  # u's sd, approximately (exact as n grows)
    lo, hi = max(0.0, 1 - 12 * width), min(u_max, 1 + 12 * width)
    if hi <= lo:
        return 0.0
    x, w = _NODES
    u = lo + (hi - lo) * (x + 1) / 2
    k = (n - 1) / 2
    log_density = (
        math.log(2) + k * math.log(k) - math.lgamma(k) + (2 * k - 1) * np.log(u) - k * u * u
    )
    room = (delta - t * sd * u / root_n) * root_n / sd  # the margin left, in se of the mean
    shift = true_gap * root_n / sd
    inside = _phi(room - shift) - _phi(-room - shift)
    return float(np.clip((hi - lo) / 2 * np.sum(w * np.exp(log_density) * inside), 0.0, 1.0))


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF, elementwise."""
    return 0.5 * np.array([math.erfc(-v / math.sqrt(2)) for v in z.tolist()])


# -- one comparison: a cell against a reference -------------------------------------


@dataclass(frozen=True, slots=True)
class Comparison(_Json):
    """A cell against a reference arm, paired by seed: gaps, TOST and power."""

    cell: str
    reference: str
    seeds: tuple[int, ...]
    missing_seeds: tuple[int, ...]
    """Seeds present in only one of the two arms (not used)."""
    differences: tuple[float, ...]
    """L_cell - L_ref per seed."""
    gaps: tuple[float, ...]
    """(L_cell - L_ref) / L_ref per seed: what the test is on."""
    tost: Tost
    power: Power


def compare(
    cell: str,
    cell_losses: Losses,
    reference: str,
    ref_losses: Losses,
    delta: float = DELTA,
    alpha: float = ALPHA,
) -> Comparison:
    """Pair ``cell`` with ``reference`` seed by seed and test equivalence of the gap."""
    seeds, missing = shared_seeds(cell_losses, ref_losses)
    diffs = paired_differences(cell_losses, ref_losses)
    gaps = relative_gaps(cell_losses, ref_losses)
    g = [gaps[s] for s in seeds]
    return Comparison(
        cell=cell, reference=reference, seeds=seeds, missing_seeds=missing,
        differences=tuple(diffs[s] for s in seeds), gaps=tuple(g),
        tost=tost(g, delta, alpha), power=power(g, delta, alpha),
    )  # fmt: skip


def best_control(losses: Mapping[str, Losses], controls: Sequence[str]) -> str:
    """The control with the lowest mean loss; ties to the first listed.

    The sensitivity analysis compares each cell with this one (docs/design.md §7.3: the
    control with the lower mean loss).  The means are over the seeds every control has a
    finite loss for, so a lost seed cannot make a control look better; a control
    with no finite losses is never best.
    """
    finite = {c: {s: float(v) for s, v in losses.get(c, {}).items() if math.isfinite(v)}
              for c in controls}  # fmt: skip
    usable = [c for c in controls if finite[c]]
    common = set.intersection(*(set(finite[c]) for c in usable)) if usable else set()
    best, best_mean = (usable or list(controls))[0], math.inf
    for cid in usable:
        # on the shared seeds; with none shared, each over its own (better than no choice)
        vals = [finite[cid][s] for s in sorted(common or finite[cid])]
        mean = math.fsum(vals) / len(vals)
        if mean < best_mean:
            best, best_mean = cid, mean
    return best


# -- outer-lr selection ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EtaChoice(_Json):
    """The outer learning rate a cell is reported at (None: every eta diverged)."""

    eta: float | None
    mean_loss: float
    losses: dict[int, float]
    """Per-seed held-out loss at the chosen eta."""
    mean_by_eta: dict[float, float]
    """Mean held-out loss of every eligible eta."""
    excluded: dict[float, str]
    """Ineligible etas and why (divergent or missing seeds; a registered eta with no
    finished run is listed with every seed missing)."""
    sweep: tuple[float, ...]
    """The registered etas (and any other eta that ran), ascending."""
    at_edge: str | None
    """"highest" (or "lowest") when no eta above (below) the chosen one ran in full, so the
    sweep does not bracket the best eta on that side; else None."""


def select_outer_lr(
    runs: Mapping[float, Mapping[int, float | None]],
    seeds: Sequence[int],
    sweep: Sequence[float] = (),
) -> EtaChoice:
    """Lowest mean held-out loss among non-divergent etas, ties to the smaller eta.

    ``seeds`` are the seeds the choice is made on.  Where they are also the seeds the
    verdict is computed on, the choice biases the reported loss downward (the winner's
    curse; docs/design.md §7.6 accepts this and the report must say so); a design with
    verdict seeds chooses on its selection seeds and computes the verdict on fresh ones.

    ``runs[eta][seed]`` is the held-out loss, or None when that run diverged.
    An eta is eligible only if every registered seed ran, finitely and without
    divergence: a mean over fewer seeds would not be comparable.  ``sweep`` is the
    registered etas: one with no run at all is excluded (all seeds missing), not
    silently left out of the comparison.
    """
    means: dict[float, float] = {}
    finite: dict[float, dict[int, float]] = {}
    excluded: dict[float, str] = {}
    diverged: set[float] = set()
    etas = tuple(sorted({*runs, *sweep}))
    for eta in etas:
        by_seed = runs.get(eta, {})
        missing = [s for s in seeds if s not in by_seed]
        good = {s: float(v) for s, v in by_seed.items() if v is not None and math.isfinite(v)}
        bad = [s for s in seeds if s in by_seed and s not in good]
        if bad:
            diverged.add(eta)
        if missing or bad:
            why = [f"divergent seeds {bad}"] if bad else []
            why += [f"missing seeds {missing}"] if missing else []
            excluded[eta] = "; ".join(why)
            continue
        finite[eta] = {s: good[s] for s in seeds}
        means[eta] = math.fsum(finite[eta].values()) / len(seeds)
    chosen: float | None = None
    for eta in sorted(means):  # ascending, strict '<': a tie keeps the smaller eta
        if chosen is None or means[eta] < means[chosen]:
            chosen = eta
    if chosen is None:
        return EtaChoice(None, math.nan, {}, means, excluded, etas, None)
    # A side is bracketed by an eta there that ran in full: eligible, or divergent (worse).
    ran = set(means) | diverged
    edge = None
    if len(etas) > 1:
        if not any(e > chosen for e in ran):
            edge = "highest"
        elif not any(e < chosen for e in ran):
            edge = "lowest"
    return EtaChoice(chosen, means[chosen], finite[chosen], means, excluded, etas, edge)


# -- trends (H2, H4) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Trend(_Json):
    """Does y increase with x?  Kendall tau-b and a one-sided permutation p-value."""

    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    dropped: tuple[float, ...]
    """xs whose y was missing or non-finite (left out of the test)."""
    n: int
    tau: float
    p_one_sided: float
    method: str
    monotone_nondecreasing: bool
    alpha: float
    increasing: bool
    verdict: str


_EXACT_MAX_N = 8
_MC_PERMUTATIONS = 100_000


def _kendall_s(x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Kendall's S for x against each row of ys (concordant minus discordant pairs)."""
    i, j = np.triu_indices(x.size, k=1)
    sx = np.sign(x[j] - x[i])
    return (np.sign(ys[:, j] - ys[:, i]) * sx).sum(axis=1)


def trend_test(
    xs: Sequence[float], ys: Sequence[float | None], alpha: float = ALPHA, label: str = ""
) -> Trend:
    """One-sided test that ys increase with xs (x values distinct)."""
    pairs = [(float(x), y) for x, y in zip(xs, ys, strict=True)]
    kept = sorted((x, float(y)) for x, y in pairs if y is not None and math.isfinite(y))
    dropped = tuple(sorted(x for x, y in pairs if y is None or not math.isfinite(y)))
    x = np.array([p[0] for p in kept], dtype=np.float64)
    y = np.array([p[1] for p in kept], dtype=np.float64)
    n = x.size
    if len(set(x.tolist())) != n:
        raise ValueError(f"trend_test {label}: x values must be distinct, got {sorted(x.tolist())}")
    mono = bool(n >= 2 and np.all(np.diff(y) >= 0))
    ties_y = sum(c * (c - 1) // 2 for c in np.unique(y, return_counts=True)[1].tolist())
    n0 = n * (n - 1) // 2
    if n < 2 or n0 == ties_y:
        tau, p, method = math.nan, 1.0, "undefined (fewer than two distinct values)"
    else:
        s_obs = int(_kendall_s(x, y[None, :])[0])
        tau = s_obs / math.sqrt(n0 * (n0 - ties_y))
        if n <= _EXACT_MAX_N:
            perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
            s_all = _kendall_s(x, y[perms])
            p = float(np.count_nonzero(s_all >= s_obs)) / perms.shape[0]
            method = f"exact permutation ({perms.shape[0]} orderings)"
        else:
            rng = np.random.default_rng(0)
            perms = np.argsort(rng.random((_MC_PERMUTATIONS, n)), axis=1)
            count = int(np.count_nonzero(_kendall_s(x, y[perms]) >= s_obs))
            p = (count + 1) / (_MC_PERMUTATIONS + 1)
            method = f"Monte Carlo permutation ({_MC_PERMUTATIONS}, seed 0)"
    increasing = bool(tau > 0 and p < alpha)
    word = "demonstrated" if increasing else "not demonstrated"
    return Trend(
        label=label, xs=tuple(x.tolist()), ys=tuple(y.tolist()), dropped=dropped, n=n, tau=tau,
        p_one_sided=p, method=method, monotone_nondecreasing=mono, alpha=alpha,
        increasing=increasing, verdict=f"increasing trend {word} at alpha = {alpha:g}",
    )  # fmt: skip


def h2_eta_trend(
    best_eta_by_m: Mapping[int, float | None], alpha: float = ALPHA, label: str = "H2"
) -> Trend:
    """H2: the selected outer learning rate grows with M (None: no eligible eta at that M)."""
    ms = sorted(best_eta_by_m)
    return trend_test(ms, [best_eta_by_m[m] for m in ms], alpha, label)


def h4_gap_trend(
    mean_gap_by_m: Mapping[int, float | None], alpha: float = ALPHA, label: str = "H4"
) -> Trend:
    """H4: the mean gap to data-parallel grows with M."""
    ms = sorted(mean_gap_by_m)
    return trend_test(ms, [mean_gap_by_m[m] for m in ms], alpha, label)


# -- H1 -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class H1Result(_Json):
    """A hierarchy against flat M = R and flat M = R * n_r at the same H_g."""

    hierarchy: str
    vs_flat_r: Comparison
    vs_flat_n: Comparison


def h1_test(
    losses: Mapping[str, Losses],
    hierarchy: str,
    flat_r: str,
    flat_n: str,
    delta: float = DELTA,
    alpha: float = ALPHA,
) -> H1Result:
    """H1: TOST of the paired gap ``(L_hier - L_flat) / L_flat`` against both flat cells."""
    h = losses.get(hierarchy, {})
    return H1Result(
        hierarchy,
        compare(hierarchy, h, flat_r, losses.get(flat_r, {}), delta, alpha),
        compare(hierarchy, h, flat_n, losses.get(flat_n, {}), delta, alpha),
    )


# -- H3 -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MechanismRank(_Json):
    """One mechanism's paired improvement over flat DiLoCo at the same M."""

    rank: int
    cell: str
    baseline: str
    seeds: tuple[int, ...]
    missing_seeds: tuple[int, ...]
    """Seeds only one of the two arms has (not used)."""
    improvements: tuple[float, ...]
    """(L_baseline - L_cell) / L_baseline per seed: positive = the mechanism is better."""
    mean: float
    sd: float
    threshold: float
    """promotion_sd * sd: what the mean must exceed."""
    promoted: bool
    reason: str


def rank_mechanisms(
    losses: Mapping[str, Losses], baselines: Mapping[str, str], promotion_sd: float = PROMOTION_SD
) -> list[MechanismRank]:
    """Rank mechanism cells by mean paired improvement (best first) and apply the promotion rule.

    ``baselines`` maps each mechanism cell to its flat DiLoCo cell at the same
    M.  Undefined improvements (fewer than two seeds, non-finite losses) rank
    last; ties are broken by cell id so the order is reproducible.
    """
    rows = []
    for cell, base in baselines.items():
        seeds, missing = shared_seeds(losses.get(cell, {}), losses.get(base, {}))
        gaps = relative_gaps(losses.get(cell, {}), losses.get(base, {}))
        imp = tuple(-gaps[s] for s in seeds)
        ci = paired_ci(imp)
        threshold = promotion_sd * ci.sd
        if len(imp) < 2 or not _all_finite(imp):
            promoted, reason = False, f"undefined: {len(imp)} paired seeds or a non-finite loss"
        else:
            promoted = ci.mean > threshold
            rel = ">" if promoted else "<="
            reason = (
                f"mean improvement {ci.mean:.6g} {rel} {promotion_sd:g} sd = {threshold:.6g} "
                f"over {len(imp)} seeds"
            )
        rows.append((cell, base, seeds, missing, imp, ci.mean, ci.sd, threshold, promoted, reason))

    def order(r: tuple[Any, ...]) -> tuple[bool, float, str]:
        defined = math.isfinite(r[5]) and len(r[4]) >= 2
        return (not defined, -r[5] if defined else 0.0, r[0])

    rows.sort(key=order)
    return [MechanismRank(i + 1, *r) for i, r in enumerate(rows)]
