"""Pearson chi-square goodness of fit for sampler tests (scipy.stats does the statistics)."""
from __future__ import annotations

import torch
from scipy import stats


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 0.0) -> float:
    """p-value that `observed` counts were drawn from `expected_probs`, over the cells with mass > 0.

    A count in a zero-mass cell is an outright rejection (p-value 0). Cells whose expected count is below
    `min_expected` are pooled into one (the usual >= 5 rule for sparse distributions)."""
    observed = observed.double().flatten()
    probs = expected_probs.double().flatten()
    support = probs > 0
    if observed[~support].sum() > 0:
        return 0.0
    expected = probs[support] / probs[support].sum() * observed.sum()
    observed = observed[support]
    small = expected < min_expected
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)
