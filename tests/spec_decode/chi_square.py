"""Two-sample chi-square test of homogeneity (scipy is not a dependency)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch


def chi_square_p(a: Sequence[Hashable], b: Sequence[Hashable], min_expected: float = 5.0
                 ) -> float:
    """p-value that samples a and b come from one distribution. Categories whose expected
    count is below min_expected in either sample are pooled into one."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    total = na + nb
    cats: list[tuple[int, int]] = []
    pooled = [0, 0]
    for key in set(ca) | set(cb):
        oa, ob = ca[key], cb[key]
        if (oa + ob) * min(na, nb) / total < min_expected:
            pooled[0] += oa
            pooled[1] += ob
        else:
            cats.append((oa, ob))
    if sum(pooled):
        cats.append((pooled[0], pooled[1]))
    if len(cats) < 2:
        return 1.0
    stat = 0.0
    for oa, ob in cats:
        col = oa + ob
        for o, n in ((oa, na), (ob, nb)):
            e = col * n / total
            stat += (o - e) ** 2 / e
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square_gof_p(sample: Sequence[int], probs: Sequence[float],
                     min_expected: float = 5.0) -> float:
    """p-value that `sample` (token ids) was drawn from `probs` (pooling rare tokens)."""
    n = len(sample)
    counts = Counter(sample)
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for tok, p in enumerate(probs):
        e = n * p
        if e < min_expected:
            pool_o += counts[tok]
            pool_e += e
            continue
        stat += (counts[tok] - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    elif pool_o:
        return 0.0  # a token with no probability was drawn
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
