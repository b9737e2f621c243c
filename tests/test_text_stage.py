"""The SST-2 text stage (attncert.stages.text), its read-out (attncert.text.evaluate), training
wrapper and figures, on toy sentences."""

import json

import matplotlib
import pandas as pd
import pytest
import torch
from helpers import toy_sentences as _toy
from matplotlib.figure import Figure

from attncert.figures import text as figs
from attncert.pipeline.params import TEXT_DATASETS
from attncert.text import tables as text_tables
from attncert.text.evaluate import (
    attention_statistics,
    attention_table,
    average_radius,
    evaluate_model,
)
from attncert.text.lofast import LipschitzTextTransformer, TextTransformerConfig
from attncert.text.models import OLSAClassifier
from attncert.text.standard import StandardTextTransformer
from attncert.text.train_text import TextTrainConfig, select_splits, train_model

matplotlib.use("Agg")


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
    row, curves, audit = evaluate_model("m", model, family, test, test, n_test=0,
                                        cert_eps=[0.01, 0.1], attack_steps=3,
                                        attack_restarts=1, device="cpu", batch_size=4,
                                        variants=variants, n_attack=5)
    assert 0 <= row["test_acc"] <= 1 and row["broken"] == 0
    assert [a["eps"] for a in audit] == [0.01, 0.1] and sum(a["broken"] for a in audit) == 0
    assert row["pgd_acc"] == {f"{a['eps']:g}": a["robust_acc"] for a in audit}
    assert row["n_certified"] == 12 and row["n_attacked"] == 5  # n_test 0: the whole split
    assert set(row["certified_acc"]) == set(row["pgd_acc"]) == {"0.01", "0.1"}
    expect = {"olsa": {"global"}, "lofast": set(variants), "none": {"none"}}[family]
    assert set(row["avg_radius"]) == set(row["avg_radius_correct"]) == expect
    for v in expect:  # the mean over all sentences is the correct-only mean x accuracy
        assert row["avg_radius"][v] == pytest.approx(row["avg_radius_correct"][v]
                                                     * row["test_acc"], abs=1e-12)
    n_layers = 1 if isinstance(model, OLSAClassifier) else 0
    assert len(row["gates"]) == len(row["alpha1"]) == n_layers
    att = row["attention"]
    assert len(att["max_prob"]) == 1 and 1 / 7 <= att["uniform"] <= 1
    assert att["uniform"] - 1e-9 <= att["max_prob_mean"] <= 1 and att["ratio"] >= 1 - 1e-9
    assert len(attention_table({"m": row | {"train_seconds": 1.0}})) == 1
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
    sweep = pd.DataFrame({"model": ["L0", "L3"], "test_acc": [0.8, 0.78],
                          "avg_radius": [1.0, 0.5], "avg_radius_correct": [1.2, 0.6],
                          "attn_ratio": [float("nan"), 1.3]})
    for fig in (figs.plot_certified_vs_eps(curves), figs.plot_accuracy_vs_radius(table),
                figs.plot_attention_tradeoff(sweep)):
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


def test_depth0_uniform_attention_and_gate_read_outs():
    """Depth 0 has no attention (no statistics); alpha1 huge makes OLSA's attention uniform
    (max probability = 1/n); the averaged residual reads b = 0.5; alpha1 can be frozen."""
    torch.manual_seed(0)
    data = _toy(10)
    flat = attention_statistics(OLSAClassifier(12, max_len=8, dim=8, depth=0, heads=2), data,
                                "cpu")
    assert flat["max_prob"] == [] and flat["ratio"] is None
    model = OLSAClassifier(12, max_len=8, dim=8, depth=2, heads=2, alpha1=1e9,
                           train_alpha1=False).eval()
    stats = attention_statistics(model, data, "cpu", batch_size=3)
    assert len(stats["max_prob"]) == 2 and stats["ratio"] == pytest.approx(1.0, abs=1e-6)
    expect = (1.0 / data["mask"].sum(1).double()).mean()
    assert stats["uniform"] == pytest.approx(float(expect))
    assert not model.layers[0].attn.log_alpha1.requires_grad
    sharp = OLSAClassifier(12, max_len=8, dim=8, depth=1, heads=2, alpha1=1e-3).eval()
    assert attention_statistics(sharp, data, "cpu")["ratio"] > 1.5


def test_average_radius_rules():
    r = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float64)
    ok = torch.tensor([True, True, False, False])
    assert average_radius(r, ok) == {"all": pytest.approx(0.75), "correct": pytest.approx(1.5),
                                     "invariant": pytest.approx(1.75)}


def test_sst2_without_a_labelled_test_split_reports_on_dev(tmp_path):
    """GLUE's download route: the public test split has no labels, so the processed SST-2
    has none; the stage reports on the dev split (and says so)."""
    from attncert import data

    folder = tmp_path / "raw" / "SST2" / "raw"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text("sentence\tlabel\ngood film\t1\nbad film\t0\n"
                                      "fine\t1\n")
    (folder / "dev.tsv").write_text("sentence\tlabel\ngreat\t1\nawful\t0\n")
    (folder / "test.tsv").write_text("index\tsentence\n0\tan unlabelled line\n")
    sst2 = data.process_sst2(tmp_path / "raw", 0, 0, 0, "download (GLUE)")
    assert "test" not in sst2 and sst2["unlabelled_splits"] == ["test"]
    raw, reported = select_splits(sst2, 0, 0, 0)
    assert reported == "dev" and raw["test"] is raw["dev"] and len(raw["train"]["y"]) == 3
    mirror_like = sst2 | {"test": {"text": ["ok"], "y": torch.tensor([1])}}
    raw, reported = select_splits(mirror_like, 2, 0, 0)
    assert reported == "test" and raw["test"]["text"] == ["ok"] and len(raw["train"]["y"]) == 2
    with pytest.raises(ValueError, match="dev"):
        select_splits({"train": sst2["train"]}, 0, 0, 0)


def test_frozen_states_are_the_encoder_outputs_computed_once():
    """The head reads cached encoder states exactly as it reads ids, and its certificate,
    statistics and audit run on them (embed of states is the identity)."""
    import transformers

    from attncert.text.evaluate import frozen_states
    from attncert.text.models import FrozenEncoderOLSA

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16)).eval()
    model = FrozenEncoderOLSA(heads=2, encoder=bert, max_len=8).eval()
    data = _toy(7)
    cached = frozen_states(model, data, "cpu", batch_size=3)
    keep = int(data["mask"].sum(1).max())
    assert cached["ids"].shape == (7, keep, 8) and torch.equal(cached["mask"],
                                                               data["mask"][:, :keep])
    with torch.no_grad():
        assert torch.allclose(model(cached["ids"], cached["mask"]),
                              model(data["ids"], data["mask"]), atol=1e-5)
        assert torch.equal(model.embed(cached["ids"], cached["mask"]), cached["ids"])
    row, _, _ = evaluate_model("frozen", model, "olsa", cached, cached, n_test=0,
                               cert_eps=[0.05], attack_steps=2, attack_restarts=1,
                               device="cpu", batch_size=4, n_attack=4)
    assert row["broken"] == 0 and row["n_certified"] == 7 and len(row["gates"]) == 1


def test_the_stage_plans_every_model_by_the_names_the_report_reads():
    from pathlib import Path

    from attncert.stages import text as stage
    from attncert.stages.registry import load_params

    p = load_params(Path(__file__).resolve().parents[1] / "params.yaml")["text"]
    jobs = stage.dataset_jobs(p, vocab=30)
    deep, g = max(p.olsa.depths), p.gamma
    expect = {f"olsa-L{d}-g{g:g}" for d in (0, *p.olsa.depths, *p.olsa.deep_depths)}
    expect |= {f"olsa-L{min(p.olsa.depths)}-g{a:g}" for a in p.gamma_ablation}  # Table 2
    expect |= {f"olsa-L{deep}-g{g:g}-alpha1-{a:g}" for a in p.attention_alpha1}
    expect |= {f"kim-l2-L{deep}-g{g:g}", f"vanilla-L{deep}", "frozen-olsa"}
    expect |= {f"lofast-L{L}-H{H}-vo{vo:g}" for L in p.lofast.depths for H in p.lofast.heads
               for vo in p.lofast.gamma_vo}
    if p.olsa.residual != "averaged":
        expect.add(f"olsa-L{deep}-g{g:g}-averaged")
    assert set(jobs) == expect
    assert {n for n, j in jobs.items() if j.family == "none"} == {f"vanilla-L{deep}"}
    for name, job in jobs.items():  # the report's OLSA pattern matches OLSA itself only
        olsa = name.startswith("olsa-") and "-alpha1-" not in name
        assert bool(text_tables.OLSA_NAME.match(name)) == olsa
        assert {"epochs", "lr", "gamma"} <= set(job.train)
    assert jobs[f"olsa-L{deep}-g{g:g}"].train["epochs"] == p.epochs["sst2"]
    yelp = stage.dataset_jobs(p, vocab=30, dataset="yelp_polarity")  # OLSA Table 1: depths 1-3
    assert set(yelp) == {f"olsa-L{d}-g{g:g}" for d in p.olsa.depths} | {"frozen-olsa"}
    assert {j.train["epochs"] for n, j in yelp.items() if n != "frozen-olsa"} == {
        p.epochs["yelp_polarity"]}
    qqp = stage.dataset_jobs(p, vocab=30, dataset="qqp")
    assert set(qqp) == {"frozen-olsa"}  # not from scratch
    # the units split every dataset's jobs, each job in exactly one unit
    for dataset in TEXT_DATASETS:
        units = [u for u in stage.UNITS if u == dataset or u.startswith(f"{dataset}-")]
        parts = [stage.unit_jobs(p, 30, u) for u in units]
        assert sum(map(len, parts)) == len(stage.dataset_jobs(p, 30, dataset))
        assert {n for part in parts for n in part} == set(stage.dataset_jobs(p, 30, dataset))
    with pytest.raises(ValueError, match="not one of"):
        stage.unit_jobs(p, 30, "sst2")


def test_dvc_yaml_runs_every_text_unit():
    from pathlib import Path

    from attncert.pipeline.dvcfile import read_stages
    from attncert.stages import text as stage

    spec = read_stages(Path(__file__).resolve().parents[1] / "dvc.yaml")["text_unit"]
    assert tuple(spec["matrix"]["unit"]) == stage.UNITS


def test_an_inflated_certificate_is_counted_broken_and_fails_the_check(monkeypatch):
    """evaluate_model returns the audit rows instead of raising, so the stage can show them;
    a certificate PGD breaks is counted there and fails the one soundness check."""
    from attncert import soundness
    from attncert.text import evaluate

    torch.manual_seed(0)
    model = StandardTextTransformer(12, max_len=8, dim=8, depth=1, heads=2, mlp_hidden=8)
    test = _toy(12, seed=1)
    real = evaluate._radii

    def inflated(*args, **kwargs):
        radii, correct, seconds, rows = real(*args, **kwargs)
        return {k: torch.full_like(v, 100.0) for k, v in radii.items()}, correct, seconds, rows

    monkeypatch.setattr(evaluate, "_radii", inflated)
    row, _, audit = evaluate_model("m", model.eval(), "none", test, test, n_test=0,
                                   cert_eps=[8.0], attack_steps=20, attack_restarts=2,
                                   device="cpu", batch_size=4)
    assert row["broken"] == sum(a["broken"] for a in audit) > 0
    with pytest.raises(soundness.UnsoundCertificateError, match="m at eps 8"):
        soundness.require_sound({"m": audit})


def test_the_lofast_tables_batches_stay_within_what_the_cost_model_prices(monkeypatch):
    """_lofast_table certifies each sentence length in a loop of its own; the cost model prices
    n_steps(n, batch) + min(n, max_len) - 1 batches (attncert.cost.pricing, LayerCertify), so
    never fewer than the run makes."""
    from attncert import certify
    from attncert.cost.work import n_steps
    from attncert.text.evaluate import _lofast_table

    torch.manual_seed(0)
    model = LipschitzTextTransformer(TextTransformerConfig(vocab_size=12, max_len=8, dim=8,
                                                           depth=1, heads=2, mlp_hidden=8))
    real, batches = certify.in_batches, []

    def counted(n, size, run, *args, **kwargs):
        out = real(n, size, lambda a, b: (batches.append(b - a), run(a, b))[1], *args,
                   **kwargs)
        return out
    monkeypatch.setattr(certify, "in_batches", counted)
    g = torch.Generator().manual_seed(3)
    for n, lengths in ((23, range(1, 9)), (9, (8,)), (5, (2, 7))):
        ids = torch.randint(1, 12, (n, 8), generator=g)
        choice = torch.tensor(list(lengths))[torch.randint(0, len(lengths), (n,), generator=g)]
        mask = torch.arange(8)[None, :] < choice[:, None]
        batches.clear()
        _lofast_table(model, {"ids": ids, "mask": mask, "y": torch.zeros(n, dtype=torch.long)},
                      "cpu", 4, ["lofast_M"])
        assert sum(batches) == n
        assert len(batches) <= n_steps(n, 4) + min(n, 8) - 1
