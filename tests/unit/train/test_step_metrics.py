"""The logged training metrics are the window's: losses the mean over its steps, acceptance and τ̂ pooled over its
supervised positions, calibration over its positions; read back in one copy."""

from types import SimpleNamespace

import pytest
import torch

from dstrain.train.step_metrics import MetricWindow, step_values

GAMMA = 2
LOSS = SimpleNamespace(alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0)


def _step(ce, accept_sums, counts, grad_norm, tokens=10.0):
    stats = torch.tensor([ce, 2 * ce, 0.5, 1.0, tokens, *accept_sums, *counts])
    bins = torch.tensor([[1.0, 0.0], [0.2, 0.0], [0.0, 0.0]])
    return {"stats": stats, "grad_norm": torch.tensor(grad_norm), "positions": stats[5 + GAMMA:].sum(),
            "tokens": stats[4], "calibration": bins}


def test_a_window_pools_its_steps_and_keeps_the_last_grad_norm():
    w = MetricWindow()
    w.add(_step(4.0, [1.0, 0.0], [2.0, 2.0], 9.0))  # acceptance 0.5, 0 on 2 positions each
    w.add(_step(2.0, [5.0, 3.0], [6.0, 6.0], 1.0))  # 5/6, 3/6 on 6 each
    last, _ = w.read()
    m = step_values(last, LOSS, GAMMA, 1)
    assert m["loss_ce"] == pytest.approx(3.0) and m["loss_tv"] == pytest.approx(6.0)  # the mean over the 2 steps
    assert m["acceptance@1"] == pytest.approx(6 / 8) and m["acceptance@2"] == pytest.approx(3 / 8)  # pooled
    assert m["tau_hat"] == pytest.approx(1 + 6 / 8 + 6 / 8 * 3 / 8)
    assert m["grad_norm"] == pytest.approx(1.0) and last["positions"] == 16 and last["tokens"] == 20
    assert m["calibration_error"] == pytest.approx(0.2)  # 2 positions at confidence 0.2, label 0
    w.add(_step(1.0, [1.0, 1.0], [1.0, 1.0], 3.0))  # a fresh window after the read
    m = step_values(w.read()[0], LOSS, GAMMA, 1)
    assert m["loss_ce"] == pytest.approx(1.0) and m["tau_hat"] == pytest.approx(3.0)
