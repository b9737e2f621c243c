"""CROWN through auto_LiRPA on the Lipschitz ViT: the patches, the bridge equals the model, the
bounds contain every sampled and attacked output, the combination, failures as rows."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from attncert.attacks import pgd_l2
from attncert.crown import PATCHES, CrownCertifier, CrownViT, apply_patches, certify_points, study
from attncert.crown.bridge import margin_spec
from attncert.crown.tables import attention_table, tables
from attncert.models.vit import ViTConfig, build_vit
from attncert.pipeline.audit import Audit
from attncert.pipeline.context import make_context
from attncert.pipeline.device import resolve_device
from attncert.pipeline.nbrun import read_notebook
from attncert.pipeline.shapes import VitShape
from attncert.stages import crown as stage
from attncert.stages.registry import load_params


def tiny_vit(seed: int = 0, pool: str = "mean") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
                    num_classes=3, pool=pool, radius_attn=1.0, gamma_qk=1.0, gamma_vo=0.5,
                    mean=(0.3,), std=(0.5,))
    model = build_vit(cfg).double().eval()
    with torch.no_grad():  # spread the logits so that some points certify
        model.head.weight.mul_(4.0)
    return model


def sample_ball(x: torch.Tensor, eps: float, n: int, g: torch.Generator) -> torch.Tensor:
    d = torch.randn((n, *x.shape[1:]), generator=g, dtype=x.dtype)
    d = d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    r = eps * torch.rand(n, generator=g, dtype=x.dtype) ** (1 / d[0].numel())
    return x + d * r.view(-1, 1, 1, 1)


def test_the_training_config_is_the_section_s_training_group():
    """crown.train is the same group as train_vit.train (every TrainConfig field but the seed):
    the paper scale trains LoFAST section 5.2's LMT recipe, the config takes the group whole."""
    from attncert.training.recipe import Training

    p = load_params()["crown"]
    assert isinstance(p.train, Training) and type(p.train) is type(load_params()["train_vit"].train)
    cfg = p.train.config(seed=5)
    assert (cfg.margin, cfg.lmt_offset, cfg.seed) == ("lmt", 0.2, 5)


def test_patches_are_idempotent():
    assert apply_patches() == PATCHES and len(PATCHES) == 7


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_bridge_equals_the_vit(pool):
    model = tiny_vit(1, pool)
    x = torch.rand(5, 1, 8, 8, dtype=torch.float64)
    assert torch.allclose(CrownViT(model).double()(x), model(x), atol=1e-6, rtol=0)


def test_margin_spec_rows():
    c = margin_spec(torch.tensor([2, 0]), 3)
    assert c.shape == (2, 2, 3)
    assert torch.equal(c[0], torch.tensor([[-1.0, 0, 1], [0, -1, 1]], dtype=torch.float64))


def test_crown_bounds_contain_sampled_and_attacked_outputs():
    model = tiny_vit()
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    g = torch.Generator().manual_seed(0)
    for k in range(2):
        x = torch.rand(1, 1, 8, 8, generator=g, dtype=torch.float64)
        eps = 0.3
        lower, upper = cert.output_bounds(x, eps)
        pts = sample_ball(x, eps, 2000, g)
        with torch.no_grad():
            out = model(pts)
        assert (out >= lower - 1e-9).all() and (out <= upper + 1e-9).all()
        y = model(x).argmax(1)
        xa, _ = pgd_l2(model, x.expand(4, -1, -1, -1), y.expand(4), eps, 30, 2, generator=g)
        with torch.no_grad():
            logits = torch.cat([model(xa), out])
        gaps = logits[:, y] - logits  # (N, C): f_y - f_j
        others = [j for j in range(3) if j != int(y)]
        margin = cert.margin_lower(x, y, eps)
        assert (gaps[:, others] >= margin - 1e-9).all(), k


def test_alpha_crown_is_sound_and_at_least_as_tight_as_crown():
    """alpha-CROWN (full alphas on the (tokens, features) activations) runs on the ViT graph:
    its margins hold against sampled and attacked points and never fall below CROWN's."""
    model = tiny_vit()
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1, 1, 8, 8, generator=g, dtype=torch.float64)
    y, eps = model(x).argmax(1), 0.1
    crown = cert.margin_lower(x, y, eps, "crown")
    alpha = cert.margin_lower(x, y, eps, "alpha_crown", 10)
    assert (alpha >= crown - 1e-9).all() and torch.isfinite(alpha).all()
    assert (alpha > crown + 1e-3).any(), "the optimised relaxations tighten this point"
    xa, _ = pgd_l2(model, x.expand(4, -1, -1, -1), y.expand(4), eps, 30, 2, generator=g)
    with torch.no_grad():
        logits = torch.cat([model(xa), model(sample_ball(x, eps, 2000, g))])
    gaps = logits[:, y] - logits
    others = [j for j in range(3) if j != int(y)]
    assert (gaps[:, others] >= alpha - 1e-9).all()


def test_combination_certifies_at_least_either_method():
    model = tiny_vit()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(6, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    eps = [0.02, 0.1]
    lofast = study.lofast_frame(model, x, y, "lofast_M", eps)
    crown, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, dtype=torch.float64)
    t1, t2 = tables(lofast, crown, eps, 1, "CROWN")
    assert len(t1) == 2 and len(t2) == 2
    for r in t2:
        assert r["combined_acc"] >= max(r["crown_acc"], r["lofast_acc"])
        assert r["combined_seconds"] <= r["crown_seconds"] + lofast["seconds"].mean() + 1e-12
    assert crown["certified"].any()  # the tiny model certifies some points at 0.02


def test_failures_are_rows_not_exceptions():
    model = tiny_vit()
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    y = model(x).argmax(1)
    broken = CrownCertifier(None, 3, torch.float64, 0.0, "NotImplementedError: op")
    rows = certify_points(broken, x, y, [0.1])
    assert [r["status"] for r in rows] == ["unsupported", "unsupported"]
    assert not any(r["certified"] for r in rows)
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    rows = certify_points(cert, x, y, [1e6])  # the bounds leave 1/x's domain or overflow
    assert all(r["status"] in ("domain", "overflow", "ok") and not r["certified"]
               for r in rows)
    skip = torch.tensor([[True], [False]])
    rows = certify_points(cert, x, y, [0.05], skip=skip)
    assert rows[0]["status"] == "skipped" and rows[0]["seconds"] == 0.0
    assert rows[1]["status"] == "ok" and math.isfinite(rows[1]["margin_lower"])
    assert isinstance(pd.DataFrame(rows), pd.DataFrame)


def test_time_limit_is_recorded_when_the_alarm_is_caught_and_rethrown():
    """auto_LiRPA catches some errors and retries; a TimeLimit turned into a TypeError inside
    the block must still be recorded as the time limit, not as an error."""
    import time

    from attncert.crown.bridge import TimeLimit, time_limit

    with pytest.raises(TypeError), time_limit(0.05) as alarm:
        try:
            time.sleep(1.0)
        except TimeLimit:
            raise TypeError("a call retried after the alarm") from None
    assert alarm.fired
    with time_limit(5.0) as quiet:
        pass
    assert not quiet.fired


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("method", ["crown", "alpha_crown"])
def test_crown_runs_on_the_stage_device(monkeypatch, method):
    """The stage's device (base.device of params.yaml, resolved: the GPU on a GPU box) carries
    the whole CROWN path; nothing moves a model or a tensor to the CPU on the way."""
    dev = resolve_device(load_params(ROOT / "params.yaml")["base"].device)
    model = tiny_vit().to(dev)
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(3),
                   dtype=torch.float64).to(dev)
    y = model(x).argmax(1)

    def pinned(*args, **kwargs):
        raise AssertionError("the CROWN path moved something to the CPU")

    monkeypatch.setattr(torch.Tensor, "cpu", pinned)
    monkeypatch.setattr(torch.nn.Module, "cpu", pinned)
    rows, _ = study.crown_frame(model, x, y, [0.02], method, 0.0, 2, dtype=torch.float64)
    assert set(rows["status"]) == {"ok"} and rows["certified"].any()
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    assert {p.device for p in cert.bounded.parameters()} == {x.device}
    assert cert.margin_lower(x[:1], y[:1], 0.02, method, 2).device == x.device
    with pytest.raises(ValueError, match="but y on"):
        study.crown_frame(model, x, y.to("meta"), [0.02], method, 0.0, 3)


def _sources_outside_parameters(path: Path) -> str:
    if path.suffix == ".py" and path.parent.name == "notebooks":
        nb = read_notebook(path)
        return "\n".join(c.source for c in nb.cells
                         if "parameters" not in c.get("metadata", {}).get("tags", []))
    return path.read_text()


@pytest.mark.parametrize("path", sorted((ROOT / "src/attncert/crown").glob("*.py"))
                         + [ROOT / "src/attncert/stages/crown.py",
                            ROOT / "notebooks/09_crown.py"], ids=lambda p: p.name)
def test_crown_code_never_pins_the_cpu(path):
    """The device comes from base.device: no `.cpu()`, no 'cpu' literal (the parameters cell's
    default aside, which papermill replaces)."""
    src = _sources_outside_parameters(path)
    assert not re.search(r"\.cpu\(|['\"]cpu['\"]", src), path


def test_paper_scale_crown_model_is_patch_16_at_32_pixels():
    """LoFAST section 5.2's ViT at the committed scale: 4 tokens of 16 x 16 pixels on CIFAR's
    32 x 32 x 3, and the CROWN graph computes the same function."""
    p = load_params(ROOT / "params.yaml")["crown"]
    assert p.vit.patch == 16 and p.datasets == ["cifar10", "svhn"]   # LoFAST Table 2's rows
    data = {"train": {"x": torch.zeros(2, 3, 32, 32, dtype=torch.uint8)},
            "classes": [str(c) for c in range(10)], "mean": [0.5] * 3, "std": [0.25] * 3}
    torch.manual_seed(0)
    model = build_vit(study.vit_config(data, p, min(p.depths))).double().eval()
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    assert model.pos.shape[1] == 4 + (model.cls_token is not None)
    assert torch.allclose(CrownViT(model).double()(x), model(x), atol=1e-6, rtol=0)


def test_points_lofast_certified_and_a_spent_budget_skip_crown():
    """With ``lofast`` CROWN runs only where LoFAST did not certify, and CROWN alone is then
    not measured (None) while the combination still is; a spent budget stops every bound."""
    model = tiny_vit()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(4, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    eps = [0.02, 0.1]
    lofast = study.lofast_frame(model, x, y, "lofast_M", eps)
    done = torch.tensor(lofast[["certified_0.02", "certified_0.1"]].to_numpy())
    done[0] = True  # as if LoFAST certified point 0 at both radii
    budget = study.Budget(0.0)
    assert not budget.spent()  # 0 = no budget
    rows, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, lofast=done, budget=budget)
    assert (rows[rows["index"] == 0]["status"] == "lofast").all()
    assert (rows.loc[rows["status"] == "lofast", "seconds"] == 0).all()
    assert set(rows.loc[~torch.tensor(done.flatten().tolist()).numpy(), "status"]) <= {
        "ok", "skipped"}
    t1, t2 = tables(lofast.assign(**{"certified_0.02": done[:, 0].numpy(),
                                     "certified_0.1": done[:, 1].numpy()}),
                    rows, eps, 1, "CROWN")
    assert t1[1]["acc_0.02"] is None and t2[0]["crown_acc"] is None
    assert t2[0]["combined_acc"] >= t2[0]["lofast_acc"]
    spent = study.Budget(1e-9)
    rows, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, budget=spent)
    assert rows["status"].iloc[0] == "ok" and set(rows["status"].iloc[1:]) == {"budget"}
    with pytest.raises(ValueError, match="shape"):
        study.crown_frame(model, x, y, eps, "crown", 0.0, 5, lofast=done[:, :1])


def test_crown_alone_is_measured_on_its_own_sample_when_lofast_goes_first():
    """LoFAST first with ``alone`` points: CROWN runs on the first points whatever LoFAST
    certified (as the stage sets it up), and its accuracy and seconds alone are those of that
    sample, equal to a run of CROWN alone on it; with no sample they are not measured."""
    model = tiny_vit()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(5, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    eps = [0.02, 0.1]
    lofast = study.lofast_frame(model, x, y, "lofast_M", eps)
    done = torch.tensor(lofast[["certified_0.02", "certified_0.1"]].to_numpy())
    done[:] = True  # as if LoFAST certified every point: CROWN would run nowhere
    done[:2] = False  # the stage's sample of 2: CROWN runs there
    rows, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, lofast=done)
    assert set(rows[rows["index"] >= 2]["status"]) == {"lofast"}
    assert "lofast" not in set(rows[rows["index"] < 2]["status"])
    full, _ = study.crown_frame(model, x[:2], y[:2], eps, "crown", 0.0, 5)
    lo = lofast.assign(**{"certified_0.02": True, "certified_0.1": True})
    t1, t2 = tables(lo, rows, eps, 1, "CROWN", alone=2)
    for j, e in enumerate(eps):
        expect = 100 * float(study.crown_certified(full, 2, e).double().mean())
        assert t2[j]["crown_acc"] == pytest.approx(expect) and t2[j]["crown_n"] == 2
        assert t1[1][f"acc_{e}"] in (None, pytest.approx(expect))  # None: no bound succeeded
        ran = rows[(rows["index"] < 2) & (rows["eps"] == e) & ~rows["status"].isin(study.NOT_RUN)]
        if len(ran):
            assert t2[j]["crown_seconds"] == pytest.approx(ran["seconds"].mean())
        assert t2[j]["combined_acc"] == 100.0  # LoFAST certified everything
    assert t1[1]["n"] == 2 and t1[0]["n"] == 5
    t1, t2 = tables(lo, rows, eps, 1, "CROWN", alone=0)
    assert t2[0]["crown_acc"] is None and t1[1]["acc_0.02"] is None and t2[0]["crown_n"] == 0


def test_misclassified_points_are_not_bounded_and_rows_survive_a_crash(tmp_path, monkeypatch):
    """A point the model misclassifies runs no bound ("misclassified", 0 s); each point's rows
    are journaled as it finishes: a crash mid-unit keeps the finished points, the rerun bounds
    only the rest and gives the rows of an uninterrupted run; another key starts afresh."""
    from attncert.crown import study as crown_study

    model = tiny_vit()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(4, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    y[1] = (y[1] + 1) % 3  # point 1 misclassified
    correct = model(x).argmax(1) == y
    eps = [0.02, 0.1]
    whole, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, correct=correct)
    assert (whole[whole["index"] == 1]["status"] == "misclassified").all()
    assert (whole[whole["index"] == 1]["seconds"] == 0).all()
    assert "misclassified" in study.NOT_RUN
    with pytest.raises(ValueError, match="correct"):
        study.crown_frame(model, x, y, eps, "crown", 0.0, 5, correct=correct[:2])

    path, key = tmp_path / "crown-crown.jsonl", {"unit": "u", "seed": 0}
    real, bounded = crown_study.certify_batch, []

    def crash_at_point_2(cert, xi, yi, *args, **kwargs):
        if torch.equal(xi, x[2:3]):
            raise KeyboardInterrupt("preempted")
        bounded.append(xi)
        return real(cert, xi, yi, *args, **kwargs)

    monkeypatch.setattr(crown_study, "certify_batch", crash_at_point_2)
    with pytest.raises(KeyboardInterrupt):
        study.crown_frame(model, x, y, eps, "crown", 0.0, 5, correct=correct,
                          journal=study.Journal(path, key))
    assert len(path.read_text().splitlines()) == 3  # the key and points 0 and 1
    monkeypatch.setattr(crown_study, "certify_batch", real)
    journal = study.Journal(path, key)
    assert sorted(journal.done) == [0, 1]
    calls = []
    monkeypatch.setattr(crown_study, "certify_batch",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    budget = study.Budget(1e6)
    resumed, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, correct=correct,
                                   journal=journal, budget=budget)
    assert not any(torch.equal(c, x[0:1]) for c in calls), "point 0 came from the journal"
    cols = ["index", "eps", "method", "certified", "status"]
    pd.testing.assert_frame_equal(resumed[cols], whole[cols])
    assert budget.left == pytest.approx(1e6 - resumed["seconds"].sum())
    assert len(study.Journal(path, key).done) == 4
    assert study.Journal(path, {"unit": "u", "seed": 1}).done == {}  # another key: afresh


def test_a_stage_whose_bounds_mostly_fail_fails():
    rows = pd.DataFrame({"status": ["ok", "time_limit", "out_of_memory", "skipped", "lofast",
                                    "budget"]})
    study.require_few_errors(rows, 0.5, "x")  # 1 error of 3 that ran
    with pytest.raises(RuntimeError, match=r"1 of 3 CROWN bounds failed \(out_of_memory 1\)"):
        study.require_few_errors(rows, 0.25, "x")
    study.require_few_errors(rows[rows["status"] == "skipped"], 0.0, "x")  # none ran


def small_unit(tmp_path, **crown):
    """(crown section, base) for small units of a synthetic MNIST-shaped dataset (24 images
    of 3 classes, also its test split) written under ``tmp_path/processed``, on the CPU;
    ``crown``: other fields of the section."""
    from attncert.pipeline.io import torch_save
    from attncert.pipeline.params import BaseParams

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (24, 1, 16, 16), generator=g, dtype=torch.uint8)
    split = {"x": x, "y": torch.arange(24) % 3}
    torch_save({"name": "mnist", "train": split, "test": split, "classes": ["0", "1", "2"],
                "mean": [0.5], "std": [0.25], "source": "synthetic"},
               tmp_path / "processed" / "mnist.pt")
    paper = load_params(Path(__file__).resolve().parents[1] / "params.yaml")["crown"]
    fields = {"datasets": ["mnist"], "depths": [1], "n_test": 3, "cert_eps": [0.02],
              "vit": VitShape(patch=8, dim=8, depth=None, heads=2, mlp_hidden=8),
              "train": dataclasses.replace(paper.train, epochs=1, batch_size=8, warmup_steps=1),
              "methods": ["crown"], "time_limit": 0.0, "batch_size": 2,
              "audit": Audit(n=0, steps=2, restarts=1, batch_size=100),
              "results_dir": str(tmp_path / "w"), "metrics": str(tmp_path / "crown.json")}
    base = BaseParams(scale="smoke", seed=0, device="cpu", precision="fp32", threads=0,
                      deterministic=False, compile="off", batch_memory=0.0)
    return dataclasses.replace(paper, **fields | crown), base


def test_units_then_gather(tmp_path):
    """Each (dataset, depth) unit on its own, as its DVC stage runs it, then the gathering
    stage: Tables 1-2 per dataset from the records, a stale or missing record refused."""
    p, base = small_unit(tmp_path, depths=[1, 2])
    assert stage.units(p) == ["mnist-L1", "mnist-L2"]
    with pytest.raises(ValueError, match="has not run"):
        stage.run(p, make_context(base, device=False))
    for unit in stage.units(p):
        rec = stage.run(p, make_context(base, item=unit,
                                        processed_dir=str(tmp_path / "processed"))).record
        assert rec["n"] == 3 and (tmp_path / "w" / "ckpt" / "mnist" / unit[-2:]).is_dir()
        assert {r["batch"] for r in rec["crown"]} <= {0, 1, 2}  # crown.batch_size at most
        # the attention diagnostics cover the whole test split, not only the certified points
        assert rec["attention"]["n"] > rec["n"] and 0 <= rec["attention"]["entropy_mean"] <= 1
    res = stage.run(p, make_context(base, device=False)).result
    part = res.datasets["mnist"]
    assert set(part.metrics["attention"]) == {"L1", "L2"}
    assert list(attention_table(res.datasets).index) == [("mnist", "L1"), ("mnist", "L2")]
    gap = stage.headline_numbers(json.loads(Path(p.metrics).read_text()), {})
    assert gap["attn_uniform_gap"] == part.metrics["attention"]["L1"]["uniform_gap"]
    assert list(part.table1["depth"]) == [1, 1, 2, 2] and set(part.ratio) == {"1", "2"}
    assert (tmp_path / "w" / "crown.csv").is_file() and res.device == "cpu"
    with pytest.raises(ValueError, match="other params"):
        stage.run(dataclasses.replace(p, n_test=2), make_context(base, device=False))
