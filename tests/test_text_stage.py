"""The SST-2 text stage (attncert.stages.text), its read-out (attncert.text.evaluate), training
wrapper and figures, on toy sentences."""

import json

import matplotlib
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from attncert.figures import text as figs
from attncert.pipeline.context import make_context
from attncert.pipeline.params import TEXT_DATASETS
from attncert.report import paper
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
    jobs = stage.jobs(p, vocab=30)
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
    yelp = stage.jobs(p, vocab=30, dataset="yelp_polarity")  # OLSA Table 1: depths 1-3
    assert set(yelp) == {f"olsa-L{d}-g{g:g}" for d in p.olsa.depths} | {"frozen-olsa"}
    assert {j.train["epochs"] for n, j in yelp.items() if n != "frozen-olsa"} == {
        p.epochs["yelp_polarity"]}
    assert set(stage.jobs(p, vocab=30, dataset="qqp")) == {"frozen-olsa"}  # not from scratch
    # the units split every dataset's jobs, each job in exactly one unit
    for dataset in TEXT_DATASETS:
        units = [u for u in stage.UNITS if u == dataset or u.startswith(f"{dataset}-")]
        parts = [stage.unit_jobs(p, 30, u) for u in units]
        assert sum(map(len, parts)) == len(stage.jobs(p, 30, dataset))
        assert {n for part in parts for n in part} == set(stage.jobs(p, 30, dataset))
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


def _review_set(n: int, seed: int, pairs: bool = False) -> dict:
    """A processed text split of ``n`` rows: "good"/"bad" words decide the label."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    words = ["good film" if int(v) else "bad film" for v in y]
    split = {"text": [f"{w} number {i}" for i, w in enumerate(words)], "y": y}
    if pairs:
        split["text_pair"] = [f"is it {w}?" for w in words]
    return split


def test_a_dataset_without_dev_gets_one_held_out_of_training():
    """Yelp polarity: train and test only. The dev split is a seeded draw from training, as
    large as the reported split (capped by max_test and a tenth of training), disjoint from
    the training sentences that remain; QQP-like data (no labelled test) reports on dev."""
    yelp = {"name": "yelp_polarity", "train": _review_set(60, 0), "test": _review_set(5, 1)}
    raw, reported = select_splits(yelp, 0, 0, 3)
    assert reported == "test" and len(raw["dev"]["y"]) == 5 and len(raw["train"]["y"]) == 55
    assert not set(raw["dev"]["text"]) & set(raw["train"]["text"])
    assert sorted(raw["dev"]["text"] + raw["train"]["text"]) == sorted(yelp["train"]["text"])
    again, _ = select_splits(yelp, 0, 0, 3)
    assert again["dev"]["text"] == raw["dev"]["text"], "seeded"
    capped, _ = select_splits(yelp, 20, 2, 3)
    assert len(capped["dev"]["y"]) == 2 and len(capped["train"]["y"]) == 20
    assert set(capped["dev"]["text"]) == set(select_splits(yelp, 0, 2, 3)[0]["dev"]["text"])
    assert len(select_splits(yelp | {"test": _review_set(40, 1)}, 0, 0, 3)[0]["dev"]["y"]) == 6
    qqp = {"name": "qqp", "train": _review_set(8, 0, pairs=True),
           "dev": _review_set(4, 1, pairs=True)}
    raw, reported = select_splits(qqp, 0, 0, 0)
    assert reported == "dev" and raw["test"] is raw["dev"]
    assert raw["train"]["text_pair"][0].startswith("is it")


def test_sentence_pairs_are_one_sequence_with_bert_segments():
    from attncert.text.tokenize import encode, load_tokenizer, segments

    tok = load_tokenizer("minilm-package")
    ids, mask = encode(["how tall is everest", "why"], tok, 12,
                       pairs=["what is the height of mount everest today", "why not"])
    sep = tok.sep_token_id
    assert ((ids == sep) & mask).sum(1).tolist() == [2, 2], "both [SEP]s kept when truncated"
    assert int(mask[0].sum()) == 12 and (ids[0] == sep).nonzero().flatten()[0] >= 5
    types = segments(ids, mask, sep)
    first = int((ids[1] == sep).nonzero()[0])
    assert types[1, :first + 1].eq(0).all() and types[1, first + 1:int(mask[1].sum())].eq(1).all()
    assert types[~mask].eq(0).all()
    single, single_mask = encode(["how tall is everest"], tok, 12)
    assert segments(single, single_mask, sep).eq(0).all()
    with pytest.raises(ValueError, match="pairs"):
        encode(["a", "b"], tok, 8, pairs=["c"])


def test_the_frozen_head_gives_the_encoder_segment_ids_of_pairs():
    import transformers

    from attncert.text.models import FrozenEncoderOLSA
    from attncert.text.tokenize import segments

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16)).eval()
    ids = torch.tensor([[1, 5, 6, 2, 7, 8, 2, 0]])
    mask = ids != 0
    paired = FrozenEncoderOLSA(heads=2, encoder=bert, max_len=8, sep_token_id=2)
    plain = FrozenEncoderOLSA(heads=2, encoder=bert, max_len=8)
    with torch.no_grad():
        want = bert(input_ids=ids, attention_mask=mask.long(),
                    token_type_ids=segments(ids, mask, 2)).last_hidden_state
        got = paired.embed(ids, mask)
        assert torch.allclose(got.norm(dim=-1), torch.full((1, 8), paired.token_norm))
        assert torch.allclose(got, want * (paired.token_norm / want.norm(dim=-1, keepdim=True)),
                              atol=1e-6)
        assert not torch.allclose(plain.embed(ids, mask), got, atol=1e-4)


def test_the_stage_trains_yelp_and_qqp_and_reports_a_skipped_dataset(tmp_path, monkeypatch):
    """The stage end to end on tiny processed stand-ins: the SST-2 study, OLSA at every depth
    on Yelp (dev held out) and on QQP (pairs, reported on dev) with the frozen-encoder head,
    the paper's numbers beside; a dataset the data stage skipped is reported, not fatal."""
    import dataclasses
    from pathlib import Path

    from attncert.data import skipped_dataset
    from attncert.pipeline import params
    from attncert.stages import text as stage

    processed = tmp_path / "processed"
    processed.mkdir()
    torch.save({"name": "sst2", "kind": "text", "source": "stand-in", "train":
                _review_set(40, 0), "dev": _review_set(8, 1), "test": _review_set(8, 2)},
               processed / "sst2.pt")
    yelp = {"name": "yelp_polarity", "kind": "text", "source": "stand-in",
            "train": _review_set(40, 3), "test": _review_set(6, 4)}
    qqp = {"name": "qqp", "kind": "text", "source": "stand-in",
           "train": _review_set(40, 5, pairs=True), "dev": _review_set(6, 6, pairs=True)}
    raw = params.read_yaml(Path(__file__).resolve().parents[1] / "params.yaml")
    base = params.parse_section("base", {**raw["base"], "device": "cpu"}, params.BaseParams)
    committed = params.parse_section("text", raw["text"], stage.Params)
    p = dataclasses.replace(
        committed, tokenizer="minilm-package", max_len=12, gamma_ablation=[],
        olsa=dataclasses.replace(committed.olsa, depths=[1, 2], deep_depths=[3]),
        attention_alpha1=[], dim=16, heads=2, epochs={"sst2": 1, "yelp_polarity": 1},
        batch_size=16, warmup_steps=1,
        lofast=dataclasses.replace(committed.lofast, depths=[1], heads=[2], gamma_vo=[0.5], dim=8,
                                   mlp_hidden=8, epochs=1),
        n_test=0, n_attack=3,
        frozen=dataclasses.replace(committed.frozen, source="minilm-package", dim=16,
                                   epochs={"sst2": 1, "yelp_polarity": 1, "qqp": 2},
                                   lr_decay_epochs={"sst2": [], "yelp_polarity": [],
                                                    "qqp": [1]}),
        cert_batch_size=8, cert_eps=[0.1], attack_steps=1, attack_restarts=1,
        results_dir=str(tmp_path / "results"), metrics=str(tmp_path / "text.json"))
    for what in ("ok", "skipped"):
        torch.save(yelp, processed / "yelp_polarity.pt")
        torch.save(qqp if what == "ok" else skipped_dataset("qqp", "no route offline"),
                   processed / "qqp.pt")
        if what == "ok":
            with pytest.raises(ValueError, match="has not run"):
                stage.run(p, make_context(base, device=False))
        for unit in stage.UNITS:  # each its own DVC stage
            stage.run(p, make_context(base, item=unit, processed_dir=str(processed)))
        r = stage.run(p, make_context(base, device=False))
        m = json.loads((tmp_path / "text.json").read_text())
        assert list(r.jobs["model"]) == list(stage.jobs(p, r.data["vocab"]))  # its order
        assert set(m["models"]) == set(r.jobs["model"])
        assert set(m["datasets"]) == {"yelp_polarity", "qqp"} and m["broken"] == 0
        y = m["datasets"]["yelp_polarity"]
        assert set(y["models"]) == {"olsa-L1-g2", "olsa-L2-g2", "frozen-olsa"}
        assert y["dev_held_out"] and y["reported_split"] == "test" and not y["pairs"]
        assert (y["train_sentences"], y["dev_sentences"], y["n_certified"]) == (36, 4, 6)
        assert (tmp_path / "results" / "ckpt" / "yelp_polarity" / "olsa-L2-g2").is_dir()
        assert set(r.audits) >= {"yelp_polarity/olsa-L1-g2", "olsa-L0-g2", "olsa-L3-g2",
                                 "frozen-olsa"}
        rows = {row["key"]: row for row in stage.headline_rows(m, {})}
        assert rows["datasets/yelp_polarity/models/olsa-L1-g2/test_acc"]["ours"] == (
            y["models"]["olsa-L1-g2"]["test_acc"])
        q = m["datasets"]["qqp"]
        if what == "skipped":
            assert q == {"unavailable": "no route offline"}
            assert "unavailable: no route offline" in set(r.datasets_table["status"])
            continue
        assert q["pairs"] and q["reported_split"] == "dev" and not q["dev_held_out"]
        assert set(q["models"]) == {"frozen-olsa"}  # QQP: the frozen head only (OLSA 5.1)
        assert q["frozen_train_sentences"] == 40 and q["n_attacked"] == 3
        frozen = rows["datasets/qqp/models/frozen-olsa/avg_radius_invariant/global"]
        assert frozen["paper"] == paper.OLSA_FROZEN_BERT_QQP["olsa"]  # beside OLSA's rule
        assert rows["datasets/qqp/models/frozen-olsa/avg_radius/global"]["paper"] is None
        assert rows["datasets/yelp_polarity/models/olsa-L1-g2/avg_radius_invariant/global"][
            "paper"] is None
        table = r.datasets_table.set_index(["dataset", "model"])
        assert table.loc[("qqp", "frozen-olsa"), "paper_avg_radius"] == frozen["paper"]
        assert (tmp_path / "results" / "datasets.csv").is_file()
    with pytest.raises(ValueError, match="other params"):
        stage.run(dataclasses.replace(p, n_attack=2), make_context(base, device=False))


def test_the_text_section_refuses_unknown_or_inconsistent_datasets():
    from pathlib import Path

    from attncert.pipeline import params
    from attncert.stages import text as stage

    raw = params.read_yaml(Path(__file__).resolve().parents[1] / "params.yaml")["text"]
    for change, match in (({"datasets": ["yelp_polarity"]}, "must include 'sst2'"),
                          ({"datasets": ["sst2", "imdb"]}, "imdb"),
                          ({"epochs": {"sst2": 5}}, r"needs an entry for \['yelp_polarity'\]"),
                          ({"olsa": {**raw["olsa"], "deep_depths": [3, 4]}},
                           r"text.olsa: deep_depths \[3\] already in"),
                          ({"frozen": {**raw["frozen"], "epochs": {"sst2": 1}}},
                           r"text.frozen: epochs needs an entry")):
        with pytest.raises(params.ParamsError, match=match):
            params.parse_section("text", {**raw, **change}, stage.Params)


def test_the_paper_numbers_sit_beside_the_models_olsa_reports():

    yelp = text_tables.paper_reference("yelp_polarity", "olsa-L3-g2", 3)
    assert yelp[0] == paper.OLSA_AVG_RADIUS["yelp"] and "Yelp" in yelp[1]
    assert text_tables.paper_reference("yelp_polarity", "olsa-L4-g2", 4) is None
    assert text_tables.paper_reference("qqp", "olsa-L3-g2", 3) is None
    assert text_tables.paper_reference("qqp", "frozen-olsa", None)[0] == 0.368


def test_large_frozen_states_stay_in_host_memory(tmp_path, monkeypatch):
    """The frozen encoder's states memory-mapped to a file equal the in-memory ones; training
    data past the device limit stays on the host (moved per batch) and trains the same."""
    import numpy as np

    from attncert.text import train_text
    from attncert.text.evaluate import frozen_states
    from attncert.text.models import FrozenEncoderOLSA
    from attncert.text.train_text import TextTrainConfig, train_model

    torch.manual_seed(0)
    model = FrozenEncoderOLSA(source="minilm-package", heads=2, max_len=8)
    ids = torch.randint(1000, 2000, (10, 8))
    data = {"ids": ids, "mask": torch.ones(10, 8, dtype=torch.bool), "y": torch.arange(10) % 2}
    mem = frozen_states(model, data, "cpu", batch_size=4)
    mapped = frozen_states(model, data, "cpu", batch_size=4, path=tmp_path / "s" / "train.npy")
    assert isinstance(np.load(tmp_path / "s" / "train.npy", mmap_mode="r"), np.memmap)
    torch.testing.assert_close(mapped["ids"], mem["ids"])
    cfg = TextTrainConfig(epochs=1, batch_size=4, lr=1e-3, gamma=0.0, warmup_steps=0, seed=0)
    want = train_model(model, {}, mem, mem, cfg, tmp_path / "a", "cpu")
    monkeypatch.setattr(train_text, "DEVICE_DATA_BYTES", 0)
    torch.manual_seed(0)
    model = FrozenEncoderOLSA(source="minilm-package", heads=2, max_len=8)
    got = train_model(model, {}, mapped, mapped, cfg, tmp_path / "b", "cpu")
    assert [r["train_loss"] for r in got] == [r["train_loss"] for r in want]


def test_a_paper_number_beside_a_smaller_scale_says_it_is_not_like_for_like():
    from attncert.stages import text as stage

    m = {"models": {"olsa-L3-g2": {"family": "olsa", "test_acc": 0.8,
                                   "avg_radius": {"global": 1.1},
                                   "avg_radius_invariant": {"global": 1.2}}}}
    for scale, unlike in (("paper", False), ("cpu", True)):
        rows = {r["key"]: r for r in stage.headline_rows(m | {"scale": scale}, {})}
        r = rows["models/olsa-L3-g2/avg_radius_invariant/global"]  # OLSA's averaging rule
        assert r["paper"] == 0.979 and ("not like for like" in r["source"]) == unlike
        assert rows["models/olsa-L3-g2/avg_radius/global"]["paper"] is None  # 0 where wrong


@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_attention_ablation_of_text_models(attention):
    """attention_ablation: None at depth 0; OLSA with a huge alpha1 is exactly uniform over
    the real tokens (entropy 1, no gap); a sharp model's attention is replaced (its entropy
    below 1), the ablation reaches every layer (the L2 attention's too) and leaves the model
    as it was."""
    from attncert.text.evaluate import attention_ablation

    torch.manual_seed(0)
    data = _toy(10)
    flat = OLSAClassifier(12, max_len=8, dim=8, depth=0, heads=2, attention=attention)
    assert attention_ablation(flat, data, "cpu") is None
    if attention == "olsa":
        uniform = OLSAClassifier(12, max_len=8, dim=8, depth=2, heads=2, alpha1=1e9,
                                 train_alpha1=False).eval()
        a = attention_ablation(uniform, data, "cpu", batch_size=3)
        assert a["entropy"] == pytest.approx([1.0, 1.0], abs=1e-6)
        assert a["uniform_gap"] == 0.0 and a["n"] == 10
    kw = {"alpha1": 1e-3} if attention == "olsa" else {}
    sharp = OLSAClassifier(12, max_len=8, dim=8, depth=2, heads=2, attention=attention,
                           **kw).eval()
    before = sharp(data["ids"], data["mask"])
    a = attention_ablation(sharp, data, "cpu", batch_size=4)
    assert len(a["entropy"]) == 2 and a["entropy_mean"] < 1.0
    assert {"uniform_gap", "identity_gap", "acc_uniform"} <= set(a)
    torch.testing.assert_close(sharp(data["ids"], data["mask"]), before)
