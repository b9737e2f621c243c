"""Attacks: ball and box constraints; exact behaviour on linear models with known distances."""

import pytest
import torch
from torch import nn

from attncert.attacks import attack_loss, cw_linf, fgsm_linf, pgd_l2, pgd_linf, project


def linear_model(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0]).double()
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return nn.Sequential(nn.Flatten(), lin).eval()


def binary_setup(n=6, seed=0):
    """2 classes on 1x4x4 images near the box centre; class 0 is predicted everywhere below.

    The boundary is the hyperplane (w1 - w0) x + b1 - b0 = 0; the l2 / linf distance of x to
    it is margin / ||w1 - w0||_2 / margin / ||w1 - w0||_1. The optimal perturbation moves no
    coordinate by more than that distance, so the box does not bind while x is within
    [0.4, 0.6] and the distance below 0.4.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 16, generator=g, dtype=torch.float64)
    x = 0.5 + 0.01 * torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64)
    u = w[1] - w[0]
    margins = torch.linspace(0.05, 0.3, n, dtype=torch.float64)  # f_0 - f_1 per sample
    # choose b so each sample has its own margin: b1 - b0 = -(u . x) - margin
    model = linear_model(w, torch.zeros(2, dtype=torch.float64))
    return model, x, u, margins


def with_margins(x, u, margins):
    """Shift the samples along u so f_0 - f_1 = margins exactly (bias 0)."""
    current = -(x.flatten(1) @ u)
    return x + ((margins - current) / u.dot(u)).view(-1, 1, 1, 1) * (-u).view(1, 1, 4, 4)


@pytest.mark.parametrize("attack, dual", [("l2", 2), ("linf", 1)])
def test_linear_model_exact_threshold(attack, dual):
    model, x, u, margins = binary_setup()
    x = with_margins(x, u, margins)
    y = torch.zeros(len(x), dtype=torch.long)
    logits = model(x)
    torch.testing.assert_close(logits[:, 0] - logits[:, 1], margins)
    dist = margins / u.norm(p=dual)
    assert float(dist.max()) < 0.4 and 0.4 < float(x.min()) and float(x.max()) < 0.6
    g = torch.Generator().manual_seed(0)
    run = {"l2": lambda e: pgd_l2(model, x, y, e, steps=50, restarts=2, generator=g),
           "linf": lambda e: pgd_linf(model, x, y, e, steps=20, generator=g)}[attack]
    _, above = run(1.05 * dist)
    assert above.all()  # per-sample eps tensors, all just above the minimal distance
    x_adv, below = run(0.95 * dist)
    assert not below.any()  # never below it
    assert (model(x_adv).argmax(1) == 0).all()
    if attack == "linf":
        assert fgsm_linf(model, x, y, 1.05 * dist)[1].all()  # FGSM is exact on a binary linear map
        assert not fgsm_linf(model, x, y, 0.95 * dist)[1].any()
        assert cw_linf(model, x, y, 1.05 * dist, generator=g)[1].all()


def test_multiclass_linear_never_below_min_distance():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 16, generator=g, dtype=torch.float64)
    model = linear_model(w, torch.zeros(4, dtype=torch.float64))
    x = torch.rand(8, 1, 4, 4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = model(x).argmax(1)
        f = model(x)
    dist = torch.stack([min((f[i, y[i]] - f[i, j]) / (w[y[i]] - w[j]).norm()
                            for j in range(4) if j != y[i]) for i in range(8)])
    assert not pgd_l2(model, x, y, 0.999 * dist, steps=40, restarts=3, generator=g)[1].any()
    # far above the unconstrained distance (the box can bind, so allow generous slack)
    _, ok = pgd_l2(model, x, y, 3.0 * dist + 0.5, steps=40, restarts=3, generator=g)
    assert ok.float().mean() >= 0.75


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_perturbation_stays_in_ball_and_box(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 5)).double()
    x = torch.rand(6, 3, 4, 4, dtype=torch.float64)
    x[0] = 0.0  # corners of the box
    x[1] = 1.0
    y = torch.randint(0, 5, (6,))
    eps = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.1, 3.0], dtype=torch.float64)
    if norm == "l2":
        x_adv, _ = pgd_l2(model, x, y, eps, steps=10, restarts=2)
        size = (x_adv - x).flatten(1).norm(dim=1)
        runs = [x_adv]
    else:
        eps = eps / 10
        runs = [pgd_linf(model, x, y, eps, steps=10)[0], fgsm_linf(model, x, y, eps)[0],
                cw_linf(model, x, y, eps, steps=5)[0]]
        size = torch.stack([(r - x).flatten(1).abs().max(dim=1).values for r in runs]).amax(0)
    assert (size <= eps + 1e-12).all()
    for r in runs:
        assert r.min() >= 0 and r.max() <= 1
    assert torch.equal(runs[0][0], x[0]) or eps[0] > 0


def test_success_is_consistent_with_predictions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3)).double().eval()
    x = torch.rand(20, 1, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    x_adv, ok = pgd_l2(model, x, y, 0.3, steps=10, restarts=2)
    with torch.no_grad():
        assert torch.equal(ok, model(x_adv).argmax(1) != y)
    clean_wrong = model(x).argmax(1) != y
    assert ok[clean_wrong].all()  # a clean error is a success


def test_project_and_losses():
    x = torch.full((1, 4), 0.9, dtype=torch.float64)
    d = project(torch.tensor([[3.0, 4.0, 0.0, -0.5]], dtype=torch.float64), x,
                torch.tensor([[1.0]], dtype=torch.float64), "l2")
    want = [[0.1, 0.1, 0.0, -0.5 / 25.25 ** 0.5]]  # into the unit ball, then into the box
    torch.testing.assert_close(d, torch.tensor(want, dtype=torch.float64))
    logits = torch.tensor([[2.0, 0.5, 1.0]])
    torch.testing.assert_close(attack_loss(logits, torch.tensor([0]), "margin"),
                               torch.tensor([-1.0]))
    with pytest.raises(ValueError):
        pgd_l2(nn.Identity(), x, torch.tensor([0]), 0.1, loss="hinge")
