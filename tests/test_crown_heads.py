"""The CROWN graph's attention bounds all heads in one batched product: its CROWN and
alpha-CROWN margins equal those of the graph with one branch per head (``split_heads``, the
reference), both compute the ViT, and the batched form launches fewer kernels a bound."""

import json
import math

import pytest
import torch
from torch import nn

from attncert.cost.counting import count
from attncert.crown import CrownCertifier
from attncert.crown.graph import GRAPHS, CrownViT
from attncert.models.vit import ViTConfig, build_vit

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def four_head_vit(depth: int = 2) -> nn.Module:
    torch.manual_seed(4)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=depth, heads=4, mlp_hidden=8,
                    num_classes=3, pool="mean", radius_attn=1.0, gamma_qk=1.0, gamma_vo=0.5,
                    mean=(0.3,), std=(0.5,))
    model = build_vit(cfg).double().eval()
    with torch.no_grad():
        model.head.weight.mul_(4.0)
    return model


def per_head_certifier(model: nn.Module) -> CrownCertifier:
    return CrownCertifier.from_vit(model, (1, 8, 8), split_heads=True)


def test_the_reference_computes_the_vit():
    model = four_head_vit()
    x = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        for split in (False, True):
            net = CrownViT(model, split_heads=split).double()
            assert torch.allclose(net(x), model(x), atol=1e-10, rtol=0), split


@pytest.mark.parametrize("method", ["crown", "alpha_crown"])
def test_batched_heads_bound_as_one_branch_per_head(method):
    model = four_head_vit()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    ours = CrownCertifier.from_vit(model, (1, 8, 8))
    ref = per_head_certifier(model)
    for eps in (0.02, 0.05) if method == "crown" else (0.02,):
        a = ours.margin_lower(x, y, eps, method, 3)
        b = ref.margin_lower(x, y, eps, method, 3)
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, atol=1e-12, rtol=0), (eps, (a - b).abs().max())
    lo, up = ours.output_bounds(x, 0.1)
    rlo, rup = ref.output_bounds(x, 0.1)
    assert torch.allclose(lo, rlo, atol=1e-12, rtol=0) and torch.allclose(up, rup, atol=1e-12,
                                                                          rtol=0)


def test_batched_heads_launch_fewer_kernels():
    """The reason for the batched form: CROWN's backward passes (one per node that needs
    intermediate bounds) launch, on a GPU, one kernel after another."""
    model = four_head_vit(depth=1)
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64)
    y = model(x).argmax(1)
    kernels = [count(CrownCertifier.from_vit(model, (1, 8, 8), split_heads=split)
                     .margin_call(x, y, 0.1))[1] for split in (False, True)]
    assert kernels[0] * 2 < kernels[1], kernels


def bounds_both_inputs(monkeypatch) -> None:
    """Undo patch 7: every matrix product asks for the bounds of both its inputs again."""
    from auto_LiRPA.operators.linear import BoundMatMul

    monkeypatch.setattr(BoundMatMul, "requires_input_bounds",
                        property(lambda self: [0, 1], lambda self, value: None))


@pytest.mark.parametrize("method", ["crown", "alpha_crown"])
def test_products_with_a_weight_skip_the_bounds_nothing_reads(method, monkeypatch):
    """Patch 7: a product with a constant weight asks no bounds of its input; the margins are
    those of the unpatched library to the bit, with fewer kernels and fewer backward passes
    (a backward pass starts at each node whose bounds are asked)."""
    import auto_LiRPA.bound_general as bound_general

    model = four_head_vit()
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    passes = []
    backward = bound_general.BoundedModule.backward_general

    def counted(self, *args, **kwargs):
        passes.append(kwargs.get("node"))
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(bound_general.BoundedModule, "backward_general", counted)
    runs = []
    for patched in (True, False):
        if not patched:
            bounds_both_inputs(monkeypatch)
        cert = CrownCertifier.from_vit(model, (1, 8, 8))
        passes.clear()
        margins = cert.margin_lower(x, y, 0.05, method, 3, False)
        n_passes = len(passes)
        kernels = count(cert.margin_call(x, y, 0.05, method, 1, False))[1]
        runs.append((margins, n_passes, kernels))
    (ours, our_passes, our_kernels), (ref, ref_passes, ref_kernels) = runs
    assert torch.isfinite(ours).all() and torch.equal(ours, ref)
    # each block's attention input, its heads' output and its MLP's input: 3 passes a block,
    # in each CROWN pass (alpha-CROWN: the one that initialises its slopes and 3 iterations)
    assert ref_passes - our_passes == 3 * 2 * (1 if method == "crown" else 4)
    assert our_kernels < 0.9 * ref_kernels


def small_crown_params(**crown):
    """The committed params with a crown section of one small depth-1 ViT (8-d, 2 heads, patch
    16), both methods; ``crown``: other fields of the section."""
    import dataclasses

    from attncert.pipeline.shapes import VitShape
    from attncert.stages.registry import load_params

    params = dict(load_params().sections)
    params["crown"] = dataclasses.replace(
        params["crown"], **{"depths": [1], "methods": ["crown", "alpha_crown"],
                            "vit": VitShape(patch=16, dim=8, depth=None, heads=2,
                                            mlp_hidden=8)} | crown)
    return params


def test_kernel_counts_follow_the_graph_not_its_width():
    """``python -m attncert.cost crown --count-kernels`` counts a narrow copy of the crown ViT
    (4 wide a head): the same count as twice as wide; alpha-CROWN's, extended from 1 and 2
    iterations to crown.alpha_iterations, matches a count at that many within 1%."""
    from attncert.cost.crown_bench import count_crown_kernels
    from attncert.crown.study import vit_config
    from attncert.pipeline.datasets import stand_in

    params = small_crown_params(alpha_iterations=3)
    narrow, wide = ([r["kernels"] for r in count_crown_kernels(params, ["crown"], d_head=w)]
                    for w in (4, 8))
    assert narrow == wide
    with pytest.raises(ValueError, match="batch"):
        next(count_crown_kernels(params, batch=0))
    (alpha,) = count_crown_kernels(params, ["alpha_crown"], batch=2)
    c = params["crown"]
    cfg = vit_config(stand_in(c.datasets[0]), c, 1)  # 4 wide a head, as counted
    torch.manual_seed(0)
    model = build_vit(cfg).double().eval()
    x = torch.rand(2, cfg.channels, cfg.image_size, cfg.image_size, dtype=torch.float64)
    cert = CrownCertifier.from_vit(model, x.shape[1:])
    direct = count(cert.margin_call(x, model(x).argmax(1), 0.02, "alpha_crown", 3, False))[1]
    assert alpha["kernels"] == pytest.approx(direct, rel=0.01)
    assert alpha["kernels"] > 3 * narrow[0]


def test_unmeasured_graphs_are_priced_by_their_counted_kernels(tmp_path):
    """A CUDA row of the split-heads graph is no measurement of the batched one: its seconds
    per counted kernel price the batched graph's counted kernels (the most of such rows);
    a CUDA row of the batched graph, once there, counts as measured."""
    from attncert.cost import crown_bench, pricing

    path = tmp_path / "crown.json"
    old = [{"device": "cuda:0", "depth": d, "method": "crown", "seconds_per_bound": s,
            "machine": "X", "date": "x"} for d, s in ((3, 9.0), (4, 20.0))]  # no graph: split
    crown_bench.merge_crown_bench(path, old)
    assert math.isnan(pricing.crown_bound_seconds(3, "crown", path)[0])
    counts = [{"graph": g, "depth": d, "method": "crown", "batch": b, "kernels": k}
              for g, d, b, k in (("split-heads", 3, 1, 300_000), ("split-heads", 4, 1, 500_000),
                                 ("batched-heads", 3, 1, 100_000),
                                 ("batched-heads", 3, 4, 104_000))]
    crown_bench.merge_crown_kernels(path, counts)
    crown_bench.merge_crown_kernels(path, counts[:1])  # replaced, not doubled
    assert len(json.loads(path.read_text())["kernels"]) == 4
    per = 20.0 / 500_000  # the most seconds per kernel of the two rows
    sec, how = pricing.crown_bound_seconds(3, "crown", path)
    assert sec == pytest.approx(100_000 * per) and how.startswith("estimated")
    assert pricing.crown_bound_seconds(3, "crown", path, batch=8)[0] == pytest.approx(
        26_000 * per)
    assert math.isnan(pricing.crown_bound_seconds(4, "crown", path, batch=4)[0])
    crown_bench.merge_crown_bench(path, [old[0] | {"graph": crown_bench.GRAPH,
                                                   "seconds_per_bound": 3.0}])
    assert pricing.crown_bound_seconds(3, "crown", path) == (3.0, "measured on CUDA")
    assert GRAPHS[False] == crown_bench.GRAPH


def test_the_count_command_writes_the_kernels_beside_the_timed_rows(smoke, tmp_path, capsys):
    """``python -m attncert.cost crown --count-kernels --write PATH`` merges its counts into
    the record's ``kernels``, each graph apart, and leaves the timed rows alone."""
    from attncert.cost import cli, crown_bench

    path = tmp_path / "crown.json"
    timed = {"device": "cuda:0", "depth": 1, "method": "crown", "seconds_per_bound": 2.0,
             "machine": "X", "date": "x"}
    crown_bench.merge_crown_bench(path, [timed])
    for extra in ([], ["--split-heads"]):
        cli.main(["crown", "--params", str(smoke), "--count-kernels", "--methods", "crown",
                  "--depths", "1", "--write", str(path), *extra])
    record = json.loads(path.read_text())
    assert [(r["seconds_per_bound"], crown_bench.row_key(r)[-1]) for r in record["rows"]] == [
        (2.0, "split-heads")]  # a row recorded without a graph: the per-head one
    counted = {r["graph"]: r["kernels"] for r in record["kernels"]}
    assert set(counted) == {"batched-heads", "split-heads"} and all(counted.values())
    assert "batched-heads" in capsys.readouterr().out
