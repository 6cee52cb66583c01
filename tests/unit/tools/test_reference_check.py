"""tools/reference_check/live.py's verdict: a NaN or inf anywhere in a report is the worst difference, not one that
max() drops (a NaN after a finite value) or that compares below the tolerance (NaN > tol is False)."""

import math
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "reference_check"))
from live import worst  # noqa: E402


def test_a_planted_nan_or_inf_fails_the_check():
    report = {"tp2": {"final": {"max_abs_diff": 1e-7, "scale": 1.0}, "layer3": {"max_abs_diff": 2e-6}},
              "drafter": {"draft_logits": {"abs_diff": 3e-7}}}
    assert worst(report) == 2e-6
    for planted in (math.nan, math.inf, -math.inf):
        bad = {**report, "pp2": {"final": {"max_abs_diff": 1e-8}, "layer1": {"max_abs_diff": planted}}}
        assert worst(bad) == math.inf and not worst(bad) <= 1e-4
    all_nan = {"a": {"max_abs_diff": math.nan}, "b": {"abs_diff": math.nan}}
    assert worst(all_nan) == math.inf
