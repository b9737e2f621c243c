"""The SST-2 text stage's helpers (attncert.text.stage) and its figures, on toy sentences."""

import json

import matplotlib
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from attncert.figures import text as figs
from attncert.text.models import LipschitzTextTransformer, OLSAClassifier, TextTransformerConfig
from attncert.text.stage import StandardTextTransformer, evaluate_model, train_model
from attncert.text.train_text import TextTrainConfig

matplotlib.use("Agg")


def _toy(n, vocab=12, max_len=8, seed=0):
    """[CLS] = 1, [SEP] = 2, [PAD] = 0, random words 3..; label: token 3 beats token 4."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len - 1, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] < (lengths + 2)[:, None]
    ids[:, 0] = 1
    ids[torch.arange(n), lengths + 1] = 2
    ids[~mask] = 0
    return {"ids": ids, "mask": mask, "y": ((ids == 3).sum(1) > (ids == 4).sum(1)).long()}


def test_standard_transformer_takes_ids_or_embeddings():
    torch.manual_seed(0)
    model = StandardTextTransformer(12, max_len=8, dim=8, depth=1, heads=2, mlp_hidden=16).eval()
    data = _toy(4)
    ids, mask = data["ids"], data["mask"]
    assert torch.allclose(model(ids, mask), model(model.embed(ids), mask))
    assert model(ids, mask).shape == (4, 2) and model(ids).shape == (4, 2)


@pytest.mark.parametrize("family", ["olsa", "olsa-gated", "lofast", "none"])
def test_evaluate_model_reads_out_everything_and_audits(family, tmp_path):
    torch.manual_seed(0)
    if family == "olsa":
        model = OLSAClassifier(12, max_len=8, dim=8, depth=1, heads=2)
    elif family == "olsa-gated":  # the cpu profile's OLSA settings
        model = OLSAClassifier(12, max_len=8, dim=8, depth=1, heads=2, alpha1=256.0,
                               residual="gated", residual_init=0.1)
        family = "olsa"
    elif family == "lofast":
        model = LipschitzTextTransformer(TextTransformerConfig(vocab_size=12, max_len=8, dim=8,
                                                               depth=1, heads=2, mlp_hidden=8))
    else:
        model = StandardTextTransformer(12, max_len=8, dim=8, depth=1, heads=2, mlp_hidden=8)
    train, test = _toy(32), _toy(12, seed=1)
    cfg = TextTrainConfig(epochs=1, batch_size=16, logit_scale=5.0)
    history = train_model(model, {"class": family}, train, test, cfg, tmp_path / "ck", "cpu")
    assert len(history) == 1
    # same spec and config: resumed (nothing to train); another spec: started over
    assert train_model(model, {"class": family}, train, test, cfg, tmp_path / "ck", "cpu")
    variants = ["lofast_M", "global"]
    row, curves = evaluate_model("m", model, family, test, test, n_test=6, eps=[0.01, 0.1],
                                 pgd_steps=3, pgd_restarts=1, device="cpu", batch_size=4,
                                 variants=variants)
    assert 0 <= row["test_acc"] <= 1 and row["broken"] == 0 and row["n_certified"] == 6
    assert set(row["certified_acc"]) == set(row["pgd_acc"]) == {"0.01", "0.1"}
    expect = {"olsa": {"global"}, "lofast": set(variants), "none": {"none"}}[family]
    assert set(row["avg_radius"]) == expect
    assert {c["variant"] for c in curves} == expect and len(curves) == 2 * len(expect)
    if family == "none":
        assert row["certified_acc"] == {"0.01": 0.0, "0.1": 0.0}
    for c in curves:  # the curve of the best variant bounds the audit's certified accuracy
        assert c["certified_acc"] <= row["certified_acc"][f"{c['eps']:g}"] + 1e-12


def test_figures_draw_from_saved_rows():
    curves = pd.DataFrame({"model": ["a", "a", "b", "b"], "variant": ["global"] * 2 + ["M"] * 2,
                           "eps": [0.1, 0.5] * 2, "certified_acc": [0.5, 0.2, 0.4, 0.0]})
    table = pd.DataFrame({"model": ["a", "b"], "family": ["olsa", "lofast"],
                          "test_acc": [0.7, 0.6], "avg_radius": [0.2, 0.1]})
    for fig in (figs.plot_certified_vs_eps(curves), figs.plot_accuracy_vs_radius(table)):
        assert isinstance(fig, Figure) and fig.axes


def test_train_model_starts_over_on_other_training_data(tmp_path):
    """The resume record holds the training data: a larger subset (max_train) retrains."""
    model = StandardTextTransformer(12, max_len=8, dim=8, depth=1, heads=2, mlp_hidden=8)
    cfg = TextTrainConfig(epochs=1, batch_size=16, logit_scale=5.0)
    small, test = _toy(32), _toy(12, seed=1)
    assert len(train_model(model, {"class": "none"}, small, test, cfg, tmp_path, "cpu")) == 1
    first = (tmp_path / "spec.json").read_text()
    train_model(model, {"class": "none"}, small, test, cfg, tmp_path, "cpu")
    assert (tmp_path / "spec.json").read_text() == first  # same data: resumed
    larger = _toy(48)
    train_model(model, {"class": "none"}, larger, test, cfg, tmp_path, "cpu")
    record = json.loads((tmp_path / "spec.json").read_text())
    assert record["data"]["n"] == 48 and (tmp_path / "spec.json").read_text() != first
