"""Student's t distribution: CDF, survival function and quantile, without scipy.

Used by the parity statistics (stats.py): the paired-t 90% confidence interval
and the two one-sided tests.  With the registered n = 3 seeds the degrees of
freedom are 2, so the quantile must be right far out in the tail of a heavy
distribution; this module is therefore exact up to floating point, not an
approximation:

- ``t_cdf`` goes through the regularized incomplete beta function,
  ``P(|T| > t) = I_x(df/2, 1/2)`` with ``x = df / (df + t^2)``, evaluated by its
  continued fraction (modified Lentz), accurate to about 1e-14.
- df = 1 (Cauchy) and df = 2 have closed forms, used directly for both the CDF
  and the quantile (df = 2 is the registered case, so its numbers are exact
  formulas a reader can check by hand).
- ``t_ppf`` for other df inverts ``t_cdf`` by bracketing and bisection to the
  last representable bit; bisection cannot diverge, and 200 halvings are cheap.

Invariants: ``t_ppf(t_cdf(t, df), df) == t`` to ~1e-12 relative for
moderate t; ``t_ppf(1 - p, df) == -t_ppf(p, df)`` exactly (symmetry is applied
by construction).  tests/unit/test_stats.py checks df 1, 2, 5, 30 against table
values and the closed forms for df 1, 2, 3.
"""

from __future__ import annotations

import math

_EPS = 1e-16
_TINY = 1e-300


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta: continued fraction did not converge (a={a}, b={b})")


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a and b must be > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2);
    # beyond it use the symmetry I_x(a, b) = 1 - I_{1-x}(b, a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _check_df(df: float) -> None:
    if not df > 0 or math.isinf(df):
        raise ValueError(f"t distribution: df must be finite and > 0, got {df}")


def t_sf(t: float, df: float) -> float:
    """Survival function P(T > t) of Student's t with ``df`` degrees of freedom."""
    _check_df(df)
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if df == 1.0:
        return 0.5 - math.atan(t) / math.pi
    if df == 2.0:
        return 0.5 * (1.0 - t / math.sqrt(t * t + 2.0))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return tail if t >= 0 else 1.0 - tail


def t_cdf(t: float, df: float) -> float:
    """Cumulative distribution P(T <= t) of Student's t."""
    return t_sf(-t, df)  # symmetry: P(T <= t) = P(T >= -t)


def t_ppf(p: float, df: float) -> float:
    """Quantile: the t with P(T <= t) = p, for 0 < p < 1."""
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_ppf: p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    if df == 1.0:
        return math.tan(math.pi * (p - 0.5))
    if df == 2.0:
        return (2.0 * p - 1.0) / math.sqrt(2.0 * p * (1.0 - p))
    q = 1.0 - p  # upper tail mass; solve t_sf(t) = q on t > 0
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > q:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            raise ArithmeticError(f"t_ppf: quantile out of range (p={p}, df={df})")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if t_sf(mid, df) > q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
