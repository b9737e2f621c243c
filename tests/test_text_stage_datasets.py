"""The text stage beyond SST-2: datasets without a dev split, QQP's sentence pairs, Yelp and QQP
trained and a skipped dataset reported, the frozen head's memory, the paper numbers beside,
the attention ablation of the text models."""

import json

import matplotlib
import pytest
import torch
from helpers import toy_sentences as _toy

from attncert.pipeline.context import make_context
from attncert.report import paper
from attncert.text import tables as text_tables
from attncert.text.models import OLSAClassifier
from attncert.text.train_text import TextTrainConfig, select_splits, train_model

matplotlib.use("Agg")


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
        train=dataclasses.replace(committed.train, batch_size=16, warmup_steps=1),
        lofast=dataclasses.replace(committed.lofast, depths=[1], heads=[2], gamma_vo=[0.5], dim=8,
                                   mlp_hidden=8, epochs=1),
        n_test=0, audit=dataclasses.replace(committed.audit, n=3, steps=1, restarts=1),
        frozen=dataclasses.replace(committed.frozen, source="minilm-package", dim=16,
                                   epochs={"sst2": 1, "yelp_polarity": 1, "qqp": 2},
                                   lr_decay_epochs={"sst2": [], "yelp_polarity": [],
                                                    "qqp": [1]}),
        cert_batch_size=8, cert_eps=[0.1],
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
        run = stage.run(p, make_context(base, device=False))
        r, m = run.result, json.loads((tmp_path / "text.json").read_text())
        assert run.record == m
        assert list(r.jobs["model"]) == list(stage.dataset_jobs(p, r.data["vocab"]))  # its order
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
        stage.run(dataclasses.replace(p, audit=dataclasses.replace(p.audit, n=2)),
                  make_context(base, device=False))


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
