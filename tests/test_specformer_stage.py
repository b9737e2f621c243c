"""The SpecFormer study at the paper scale's code paths (the CIFAR grid and the pre-trained route
on small stand-ins), its paper numbers beside its runs, and the stage's units and gathering."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from attncert.data import DataUnavailable, load_sample
from attncert.pipeline.context import make_context
from attncert.pipeline.shapes import VitShape
from attncert.report import paper as paper_module
from attncert.soundness import UnsoundCertificateError
from attncert.specformer import methods as sf
from attncert.specformer import study
from attncert.stages import specformer as stage
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]


# -- the paper-scale CIFAR grid, on the mirror's 20 CIFAR-10 images --------------------------


def cifar_shaped(dataset, num_classes, mirror, tmp_path, max_train=0):
    """The mirror's 20 CIFAR-10 test images as a processed dataset shaped as ``dataset``
    (train = test = the 20 images; 10 or 100 classes; the labels 0-9 are valid in both)."""
    try:
        sample = load_sample("cifar10_sample", mirror, tmp_path / "raw")
    except DataUnavailable as exc:
        pytest.skip(str(exc))
    classes = sample["classes"] if num_classes == 10 else [f"c{i}" for i in range(100)]
    return sf.subset_train({"train": sample["test"], "test": sample["test"],
                            "mean": sample["mean"], "std": sample["std"], "classes": classes,
                            "source": f"{dataset}-shaped {sample['source']}"}, max_train, 0)

#: The only knobs shrunk: model size, epochs, batch size, attack steps, attacked images.
TINY = {"vit": VitShape(patch=4, dim=8, depth=1, heads=2, mlp_hidden=8), "attack_steps": 2,
        "n_test": 20}
#: ... and of the from-scratch recipe
TINY_TRAIN = {"epochs": 1, "adv_epochs": 1, "batch_size": 10, "eval_batch_size": 10,
              "adv_steps": 1}


@pytest.mark.parametrize("dataset,num_classes", [("cifar10", 10), ("cifar100", 100)])
def test_paper_scale_cifar_grid_code_path(dataset, num_classes, mirror, tmp_path):
    """The paper-scale ``specformer`` params on the from-scratch route (``sources:
    [scratch]``, every method; CIFAR-10 and CIFAR-100: 3 x 32 x 32, patch 4, crop_flip, 2/255
    and 8/255 attacks, L2 PGD, MSVP, PGD adversarial training) through the stage's own
    calls, with only the size knobs of :data:`TINY` shrunk.

    A code-path check, not a measurement: the mirror's 20 real CIFAR-10 test images stand in
    for both splits (train = test = the 20 images), labelled with CIFAR-10's 10 classes or
    CIFAR-100's 100 (the labels 0-9 are valid in both). On a GPU box the same calls run on the
    torchvision downloads of the full datasets.
    """
    paper = load_params(ROOT / "params.yaml")["specformer"]
    assert paper.datasets == ["cifar10", "cifar100", "imagenette"] and dataset in paper.datasets
    p = dataclasses.replace(paper, **TINY, train=dataclasses.replace(paper.train, **TINY_TRAIN),
                            sources=[sf.SCRATCH], methods=list(sf.METHODS),
                            adv_methods=list(sf.METHODS))
    data = cifar_shaped(dataset, num_classes, mirror, tmp_path, p.max_train)

    # the stage's calls, in its order (attncert.stages.specformer.run, through
    # attncert.specformer.study)
    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.attack_eps)
    plan = sf.run_plan(p.methods, p.adv_methods, *study.recipe(p, 0, sf.SCRATCH))
    base = sf.base_model_config(data, **p.vit.arch(), block=p.block)
    x, y = sf.eval_split(data, p.n_test)
    rows = []
    for training, method, cfg in plan:
        model_cfg = sf.method_model_config(method, base, p.lipsformer_alpha)
        train_cfg = sf.method_train_config(method, cfg, p.msvp_lambda)
        assert (model_cfg.channels, model_cfg.image_size, model_cfg.patch) == (3, 32, 4)
        assert model_cfg.num_classes == num_classes
        assert train_cfg.augment == "crop_flip"
        assert train_cfg.msvp_enabled == (method == "specformer")
        assert train_cfg.adversarial == ("pgd_linf" if training == "adversarial" else "none")
        model, curves, status = sf.train_run(model_cfg, train_cfg, data, dataset,
                                             tmp_path / f"{dataset}-{training}-{method}")
        assert status == "fresh" and len(curves) == 1
        with torch.no_grad():
            assert model(x[:2]).shape == (2, num_classes)
        got = sf.robust_accuracy(model, x, y, specs, p.train.eval_batch_size, 0)
        assert [r["attack"] for r in got] == [s.label for s in specs]
        rows += [{"dataset": dataset, "training": training, "method": method, **r} for r in got]

    assert len(plan) == 2 * 5 and len(x) == 20
    assert [s.label for s in specs] == [
        "clean", "FGSM 2/255", "PGD-2 2/255", "CW-2 8/255", "PGD-2 8/255",
        *[f"L2-PGD-2 {e:g}" for e in paper.attack_eps]]
    df = pd.DataFrame(rows)
    assert len(df) == len(plan) * len(specs)
    assert not df.duplicated(["training", "method", "attack"]).any()
    assert df["accuracy"].between(0, 1).all()
    for _, run in df.groupby(["training", "method"]):
        clean = run.loc[run["kind"] == "clean", "accuracy"].item()
        assert (run["accuracy"] <= clean + 1e-12).all()
    # a model trained from scratch stands for no cell of SpecFormer's tables (pre-trained)
    assert paper_module.specformer_rows([dataset]) == []
    table = sf.comparison_table(rows, paper_module.specformer_rows([dataset]))
    assert len(table) == len(plan) and "paper" not in table.columns.get_level_values(2)


# -- the paper-scale pre-trained route, with a tiny saved ViTForImageClassification ---------

#: The knobs shrunk for the pre-trained route (the model itself is the tiny saved one).
TINY_FINETUNE = {"epochs": 1, "adv_epochs": 1, "batch_size": 10, "warmup_steps": 1,
                 "eval_batch_size": 10, "adv_steps": 1}
TINY_RUN = {"attack_steps": 2, "n_test": 20, "image_size": 64}


@pytest.fixture(scope="module")
def tiny_pretrained(tmp_path_factory):
    """A tiny HF ViTForImageClassification (64 px, patch 16, 2 layers, d 32, 2 heads, 1000
    ImageNet-sized labels) written by save_pretrained: the stand-in for ViT-S/16 and DeiT-Ti."""
    from attncert.certvit import tiny_hf_vit

    return tiny_hf_vit(tmp_path_factory.mktemp("hub") / "tiny-vit-patch16-64", image_size=64,
                       patch_size=16, hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64, num_labels=1000)


@pytest.mark.parametrize("dataset,num_classes", [("cifar10", 10), ("cifar100", 100)])
def test_paper_scale_pretrained_code_path(dataset, num_classes, mirror, tmp_path,
                                          tiny_pretrained):
    """The paper-scale pre-trained route (SpecFormer Tables 1-2: a pre-trained ViT fine-tuned
    with and without MSVP, standard and PGD adversarial, CIFAR upsampled inside the model)
    through the stage's calls, with a tiny local checkpoint in place of the hub's models."""
    paper = load_params(ROOT / "params.yaml")["specformer"]
    assert paper.image_size == 224 and sf.SCRATCH not in paper.sources
    assert set(paper.methods) == set(paper.adv_methods) == set(sf.PRETRAINED_METHODS)
    p = dataclasses.replace(paper, **TINY_RUN, sources=[str(tiny_pretrained)],
                            finetune=dataclasses.replace(paper.finetune, **TINY_FINETUNE))
    data = cifar_shaped(dataset, num_classes, mirror, tmp_path)
    src = p.sources[0]

    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.attack_eps)
    plan = sf.run_plan(p.methods, p.adv_methods, *study.recipe(p, 0, src))
    assert len(plan) == 4
    label = sf.run_label(dataset, src)
    assert label == f"{dataset}@tiny-vit-patch16-64"
    model, notes = sf.pretrained_model(src, data, p.image_size, 0)
    assert any("upsampled x2" in n for n in notes) and any("1000 -> " in n for n in notes)
    x, y = sf.eval_split(data, p.n_test)
    rows = []
    for training, method, cfg in plan:
        train_cfg = sf.method_train_config(method, cfg, p.msvp_lambda)
        assert train_cfg.msvp_enabled == (method == "specformer")
        assert train_cfg.msvp_lambda == ((5e-5, 3e-5, 3e-5) if method == "specformer"
                                         else (0.0,) * 3)  # SpecFormer Table 5 (Table 1 row)
        assert train_cfg.adversarial == ("pgd_linf" if training == "adversarial" else "none")
        assert train_cfg.grad_clip == 1.0
        assert (train_cfg.optimizer, train_cfg.momentum, train_cfg.lr) == ("sgd", 0.9, 0.1)
        assert (train_cfg.mixup_alpha, train_cfg.cutmix_alpha) == (0.8, 1.0)
        assert train_cfg.mix_prob == (0.3 if training == "standard" else 0.0)
        model, curves, status = sf.finetune_run(src, train_cfg, data, dataset, p.image_size,
                                                tmp_path / f"{label}-{training}-{method}")
        assert status == "fresh" and len(curves) == 1
        assert (model.config.image_size, model.config.patch, model.config.dim) == (64, 16, 32)
        assert model.config.num_classes == num_classes
        with torch.no_grad():
            assert model(x[:2]).shape == (2, num_classes)  # 32-pixel input, upsampled inside
        got = sf.robust_accuracy(model, x, y, specs, p.finetune.eval_batch_size, 0)
        rows += [{"dataset": label, "training": training, "method": method, **r} for r in got]
    df = pd.DataFrame(rows)
    assert len(df) == len(plan) * len(specs) and df["accuracy"].between(0, 1).all()
    # the tiny checkpoint's runs labelled as the hub ViT-S's: the labels meet Tables 1-2
    vit_s = paper_module.specformer_rows([sf.run_label(dataset, "WinKawaks/vit-small-patch16-224")])
    table = sf.comparison_table(rows, [{**r, "dataset": label} for r in vit_s])
    assert len(table) == len(plan)
    assert (label, "PGD-2 2/255", "paper") in table.columns
    assert (label, "PGD-20 8/255", "paper") in table.columns
    frame = sf.max_sigma_frame({"vanilla": model})
    assert len(frame) == 2 * 3  # two layers x (q, k, v) of the loaded model
    # resumes the same run; another starting checkpoint or recipe clears it
    again = sf.finetune_run(src, train_cfg, data, dataset, p.image_size,
                            tmp_path / f"{label}-{training}-{method}")
    assert again[2] == "resume"
    with pytest.raises(ValueError, match="64-pixel images, specformer.image_size is 224"):
        sf.pretrained_model(src, data, 224, 0)


def test_msvp_sees_the_pretrained_heads(tiny_pretrained):
    """MSVP on a loaded checkpoint penalises the checkpoint's own per-head W^Q, W^K, W^V:
    the head blocks are the rows of the HF projections (docs/math.md section 1), and the head-h
    attention they give is HF's own head-h attention probabilities."""
    from transformers import ViTForImageClassification

    from attncert.msvp import MSVP, find_attention_modules, head_blocks

    hf = ViTForImageClassification.from_pretrained(str(tiny_pretrained),
                                                   attn_implementation="eager").eval()
    data = {"train": {"x": torch.zeros(2, 3, 64, 64, dtype=torch.uint8)},
            "classes": [str(i) for i in range(1000)]}
    model = sf.pretrained_model(tiny_pretrained, data, 64, 0)[0]
    found = find_attention_modules(model)
    assert list(found) == ["blocks.0.attn", "blocks.1.attn"]
    heads, dh = 2, 16
    for i, name in enumerate(found):
        att = hf.vit.layers[i].attention
        for which, lin in (("q", att.q_proj), ("k", att.k_proj), ("v", att.v_proj)):
            blocks = head_blocks(found[name], which)
            assert blocks.shape == (heads, dh, 32)
            for h in range(heads):
                torch.testing.assert_close(blocks[h], lin.weight[h * dh:(h + 1) * dh, :])
    # head semantics: softmax((x W_q^h + b)(x W_k^h + b)^T / sqrt(d_h)) is HF's head h
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 64, 64, generator=g)
    mean = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)
    with torch.no_grad():
        out = hf(pixel_values=(pixels - mean) / 0.5, output_attentions=True,
                 output_hidden_states=True)
        x = hf.vit.layers[0].layernorm_before(out.hidden_states[0])
        attn = found["blocks.0.attn"]
        bq = attn.q.bias.view(heads, dh)
        bk = attn.k.bias.view(heads, dh)
        for h in range(heads):
            q = x @ head_blocks(attn, "q")[h].T + bq[h]
            k = x @ head_blocks(attn, "k")[h].T + bk[h]
            p = torch.softmax(q @ k.transpose(1, 2) / dh ** 0.5, dim=-1)
            torch.testing.assert_close(p, out.attentions[0][:, h], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(model(pixels), out.logits[:, :1000], atol=1e-4, rtol=1e-4)
    # the penalty is differentiable in exactly those weights
    msvp = MSVP(model.train(), 1e-5, 1e-5, 1e-5, generator=torch.Generator().manual_seed(0))
    penalty = msvp()
    assert penalty > 0
    penalty.backward()
    for name in found:
        for which in "qkv":
            assert model.get_submodule(f"{name}.{which}").weight.grad.abs().sum() > 0
    assert model.head.weight.grad is None


def test_tables_1_2_stand_beside_the_runs_of_their_backbones():
    """SpecFormer Tables 1-2 cells beside the hub checkpoints standing for its ViT-S and
    DeiT-Ti only, per dataset and training, at the attack labels of its columns."""
    ref = paper_module.specformer_reference
    vit_s, deit = "vit-small-patch16-224", "deit-tiny-patch16-224"
    assert ref(f"cifar10@{vit_s}", "standard", "specformer", "PGD-2 2/255")[0] == 29.53
    assert ref(f"cifar100@{deit}", "adversarial", "vanilla", "PGD-20 8/255")[0] == 17.40
    value, label = ref(f"imagenette@{vit_s}", "standard", "vanilla", "FGSM 2/255")
    assert value == 72.60 and "Table 1 (ViT-S, imagenette" in label and "3925" in label
    assert "8 blocks" in label
    assert ref("cifar10", "standard", "vanilla", "clean") is None  # from scratch
    assert ref(f"svhn@{vit_s}", "standard", "vanilla", "clean") is None
    assert ref(f"cifar10@{vit_s}", "adversarial", "vanilla", "CW-2 8/255") is None
    assert ref(f"cifar10@{vit_s}", "standard", "l2former", "clean") is None
    rows = paper_module.specformer_rows([f"cifar10@{vit_s}", f"imagenette@{deit}", "cifar10"])
    assert len(rows) == 2 * 2 * 2 * 3  # two runs x two trainings x two methods x three columns
    head = {r["key"]: r for r in stage.headline_rows(
        {"robustness": {f"cifar100@{deit}/adversarial/specformer/CW-20 8/255": 0.2,
                        "cifar100/standard/vanilla/clean": 0.5}}, {})}
    assert head[f"robustness/cifar100@{deit}/adversarial/specformer/CW-20 8/255"][
        "paper"] == pytest.approx(0.1636)
    assert head["robustness/cifar100/standard/vanilla/clean"]["paper"] is None


def test_table5_and_table3_stand_beside_their_own_runs():
    """Table 5's row beside the CIFAR-10 ViT-S ablation run with the same triple and training,
    Table 3's ratios beside each training's step-time ratio; nothing beside another run."""
    from attncert.report import paper
    from attncert.stages import specformer as stage

    lam = "0.0001,0,0"
    m = {"table5_run": stage.TABLE1_RUN,
         "msvp_ablation": {f"{lam}/standard/PGD-2 2/255": 0.3,
                           f"{lam}/adversarial/CW-20 8/255": 0.31, "9,9,9/standard/clean": 0.8},
         "step_time_ratio": {"vanilla": 1.0, "specformer": 1.2, "l2former": 2.0},
         "step_time_ratio_adversarial": {"vanilla": 1.0, "specformer": 1.1}}
    rows = {r["key"]: r for r in stage.headline_rows(m, {})}
    assert rows[f"msvp_ablation/{lam}/standard/PGD-2 2/255"]["paper"] == pytest.approx(0.3532)
    assert rows[f"msvp_ablation/{lam}/adversarial/CW-20 8/255"]["paper"] == pytest.approx(0.3147)
    assert rows["msvp_ablation/9,9,9/standard/clean"]["paper"] is None
    assert rows["step_time_ratio/specformer"]["paper"] == paper.SPECFORMER_STEP_RATIO
    assert rows["step_time_ratio/l2former"]["paper"] == 2.5
    adv = rows["step_time_ratio_adversarial/specformer"]
    assert adv["paper"] == paper.SPECFORMER_STEP_RATIO_ADV
    assert "step_time_ratio/vanilla" not in rows
    other = {r["key"]: r for r in stage.headline_rows({**m, "table5_run": "fashion_mnist"}, {})}
    assert all(r["paper"] is None for k, r in other.items() if k.startswith("msvp_ablation"))
    # a paper number beside a run below the paper scale says it is not like for like
    assert all("like for like" not in (r["source"] or "") for r in rows.values())
    cpu = {r["key"]: r for r in stage.headline_rows({**m, "scale": "cpu"}, {})}
    assert "cpu scale" in cpu["step_time_ratio/specformer"]["source"]
    assert "not like for like" in cpu[f"msvp_ablation/{lam}/standard/PGD-2 2/255"]["source"]


# -- the stage's units and the gathering stage ----------------------------------------------


def test_units_then_gather(mirror, tmp_path):
    """Every unit of :func:`attncert.stages.specformer.units` on its own (as its DVC stage
    runs it), then :func:`~attncert.stages.specformer.run` gathers them without a device: the
    same tables as one process would give (Table 5 row of ``msvp_lambda`` from the main runs),
    and a record of other params, or a missing one, is refused."""
    from attncert.pipeline.io import torch_save
    from attncert.pipeline.params import BaseParams

    processed = tmp_path / "processed"
    torch_save(cifar_shaped("cifar10", 10, mirror, tmp_path), processed / "cifar10.pt")
    paper = load_params(ROOT / "params.yaml")["specformer"]
    p = dataclasses.replace(paper, **TINY, train=dataclasses.replace(paper.train, **TINY_TRAIN),
                            sources=[sf.SCRATCH], datasets=["cifar10"],
                            attack_eps=[0.5], timing_steps=1, timing_rounds=2, timing_warmup=0,
                            msvp_lambda_ablation=[[1e-3, 0.0, 0.0], list(paper.msvp_lambda)],
                            certified=dataclasses.replace(
                                paper.certified, vit=VitShape(16, 8, 1, 2, 16),
                                train=dataclasses.replace(paper.certified.train, epochs=1,
                                                          batch_size=10, eval_batch_size=10),
                                n_test=4,
                                audit=dataclasses.replace(paper.certified.audit, steps=2,
                                                          restarts=1)),
                            results_dir=str(tmp_path / "results"),
                            metrics=str(tmp_path / "specformer.json"))
    base = BaseParams(scale="smoke", seed=0, device="cpu", precision="fp32", threads=0,
                      deterministic=False, compile="off",
                      batch_memory=0.0)
    assert stage.units(p) == ["cifar10", "lambda0", "lambda1", "certified"]
    with pytest.raises(ValueError, match="has not run"):
        stage.run(p, make_context(base, device=False))
    records = {u: stage.run(p, make_context(base, item=u, processed_dir=str(processed))).record
               for u in stage.units(p)}
    assert records["lambda1"]["ablation"] is None  # msvp_lambda: the main runs answer it
    assert {r["lambda"] for r in records["lambda0"]["ablation"]} == {"0.001,0,0"}
    assert (tmp_path / "results" / "ckpt" / "lambda0").is_dir()
    res = stage.run(p, make_context(base, device=False)).result
    assert len(res.trained) == 4 and res.runs == ["cifar10"]
    assert set(res.ratios.index) == {"vanilla", "specformer"} and "LayerNorm" in res.refusal
    # every attacked model's attention diagnosed on its attacked images
    runs = {tuple(r[k] for k in ("dataset", "training", "method")) for r in
            records["cifar10"]["robustness"]}
    att = res.attention.set_index(["dataset", "training", "method"])
    assert set(att.index) == runs and (att["n"] == p.n_test).all()
    assert ((att["entropy_mean"] > 0) & (att["entropy_mean"] <= 1 + 1e-9)).all()
    assert (att["uniform_gap"] - 100 * (att["acc"] - att["acc_uniform"])).abs().max() < 1e-9
    assert set(res.metrics["attention"]) == {"/".join(r) for r in runs}
    table5 = {k.split("/")[0] for k in res.metrics["msvp_ablation"]}
    assert table5 == {"0.001,0,0", "5e-05,3e-05,3e-05"}
    main = {k: v for k, v in res.metrics["robustness"].items() if "/specformer/" in k}
    for key, acc in main.items():  # the reused row is the main run's
        _, training, _, attack = key.split("/", 3)
        assert res.metrics["msvp_ablation"][f"5e-05,3e-05,3e-05/{training}/{attack}"] == acc
    assert {r["model"] for r in res.metrics["certified"]} == {"lipschitz", "lipschitz + MSVP"}
    # the certified pair is attacked on every certified image at every eps, and sound
    audit = res.metrics["certified_audit"]
    assert set(audit) == {"lipschitz", "lipschitz + MSVP"}
    for rows in audit.values():
        assert [r["eps"] for r in rows] == p.certified.cert_eps
        assert all(r["broken_lofast_M"] == 0 == r["broken_specformer"] for r in rows)
    for r in res.metrics["certified"]:
        for e in p.certified.cert_eps:
            assert r[f"certified@{e}"] <= r[f"pgd@{e}"] <= r["clean_acc"]
    # a broken certificate in the unit's record fails the gathering stage
    record_file = stage.unit_file(p, stage.CERTIFIED)
    record = json.loads(record_file.read_text())
    record["audit"]["lipschitz"][0]["broken_specformer"] = 1
    record_file.write_text(json.dumps(record))
    with pytest.raises(UnsoundCertificateError, match="lipschitz / specformer at eps"):
        stage.run(p, make_context(base, device=False))
    with pytest.raises(ValueError, match="other params"):
        stage.run(dataclasses.replace(p, n_test=10), make_context(base, device=False))


def test_the_hub_revision_is_in_the_notes_and_fingerprint(monkeypatch, tiny_pretrained, mirror,
                                                          tmp_path):
    """A checkpoint loaded from the hub carries its commit: the fine-tune's notes (its
    checkpoint fingerprint) name it, so a run never resumes on other weights; a local folder
    has none."""
    import types

    from attncert.certvit import hub_revision, load_model

    assert hub_revision(load_model(tiny_pretrained)) is None  # a local folder
    assert hub_revision(types.SimpleNamespace(
        config=types.SimpleNamespace(_commit_hash="abc123"))) == "abc123"

    def from_hub(source):
        model = load_model(source)
        model.hub_revision = "0123abcd"
        return model

    monkeypatch.setattr(sf, "load_model", from_hub)
    data = cifar_shaped("cifar10", 10, mirror, tmp_path)
    _, notes = sf.pretrained_model(tiny_pretrained, data, 64, 0)
    assert notes[0] == "hub revision 0123abcd"
