"""A paper-shaped dry run: the committed paper-scale SHAPES through `dvc repro`, tiny counts.

Every model size, depth, head count, patch, token count, input size (32x32x3) and class count
(CIFAR-100's 100) comes from the committed params.yaml; only counts shrink (examples, epochs,
eval points, attack steps and restarts, grid points: one value per grid axis, taken from the
paper's list). The data stage takes its normal mirror route on stand-in raw files written
here in torchvision's layouts (CIFAR-10/100 pickles, SVHN .mat, Imagenette JPEG folders) and
GLUE's SST-2 TSVs (train and dev labelled, test without labels, as GLUE publishes it); MNIST,
Fashion-MNIST and the two samples come from the offline mirror. CertViT takes its Hugging Face
route on a tiny `ViTForImageClassification` saved with `save_pretrained` (224 pixels, patch 16, as
google/vit-base-patch16-224). A crash at paper shapes fails this test.

Stand-in files cannot carry torchvision's MD5 sums, so the stages run with a
`sitecustomize` that accepts any present file in the CIFAR and SVHN integrity checks (and
nothing else changes).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkout import commit_all, copy_worktree
from ruamel.yaml import YAML
from standins import write_imagenette

from attncert.pipeline.profile import flatten
from attncert.pipeline.runs import run_name
from attncert.stages.registry import validate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

N_TRAIN, N_TEST = 200, 100  # stand-in images per split (every CIFAR-100 class appears)
GRID_POINT = {"dataset": "cifar10", "depth": 3, "heads": 8, "gamma_vo": 0.5}

# Counts only; every other key keeps its committed (paper) value. test_overrides_keep_shapes
# checks that no override touches a shape and that grid values come from the paper's lists.
COUNTS: dict[str, dict] = {
    # make gpu-check: ATTNCERT_DRYRUN_DEVICE=cuda runs the same dry run on the GPU
    "base": {"device": os.environ.get("ATTNCERT_DRYRUN_DEVICE", "cpu")},
    "data": {"max_train": N_TRAIN, "max_test": 10, "grid_per_class": 1},
    "tightness": {"samples": 2, "cert_eps": [0.1], "fig3_sizes": [1.0], "fig3_samples": 1,
                  "fig4_scales": [1.0], "attack_steps": 2, "attack_restarts": 1},
    "vit_grid": {k: [v] for k, v in GRID_POINT.items()},
    "train_vit": {"train": {"epochs": 1, "warmup_steps": 1}},
    "certify_vit": {"n_test": 2, "cert_eps": [0.1],
                    "audit": {"n": 1, "steps": 2, "restarts": 1}},
    "frontier": {"settings": ["lmt-0.2", "lmt-0.2_r4", "standard_p8", "linear-0.5"],
                 "holdout": 50,
                 "n_val": 2, "cert_eps": [0.25], "audit": {"n": 1, "steps": 2, "restarts": 1},
                 "linear": {"epochs": 1, "warmup_steps": 1}},
    "specformer": {"datasets": ["cifar100", "imagenette"], "adv_methods": ["specformer"],
                   "max_train": 16,
                   "train": {"epochs": 1, "adv_epochs": 1, "batch_size": 8, "eval_batch_size": 8,
                             "warmup_steps": 1, "adv_steps": 1},
                   "finetune": {"eval_batch_size": 8, "adv_steps": 1},
                   "n_test": 2, "attack_steps": 1,
                   "attack_eps": [0.5], "timing_steps": 1, "timing_rounds": 1, "timing_warmup": 0,
                   "certified": {"train": {"epochs": 1, "batch_size": 8, "eval_batch_size": 8,
                                           "warmup_steps": 1},
                                 "n_test": 2, "cert_eps": [0.1],
                                 "audit": {"steps": 2, "restarts": 1}},
                   "msvp_lambda_ablation": [[1.0e-4, 0.0, 0.0]]},  # one of Table 5's rows
    "text": {"max_train": 64, "max_test": 16, "gamma_ablation": [2.0],
             "olsa": {"depths": [3], "deep_depths": [4]}, "epochs": {"sst2": 1, "yelp_polarity": 1},
             "train": {"batch_size": 32, "warmup_steps": 1},
             "lofast": {"depths": [6], "heads": [8], "gamma_vo": [0.5], "epochs": 1},
             "frozen": {"epochs": {"sst2": 1, "yelp_polarity": 1, "qqp": 2},
                        "lr_decay_epochs": {"qqp": [1]},  # QQP's step decay, one epoch in
                        "max_train": 32}, "n_test": 2, "cert_eps": [0.5],
             "audit": {"steps": 2, "restarts": 1}},
    "certvit": {"train": {"epochs": 1, "batch_size": 128, "warmup_steps": 1,
                          "eval_batch_size": 8}, "adapt_epochs": 1,
                "dr": {"iterations": 1, "projection_steps": 2, "batch_size": 32,
                       "max_pairs": 64, "images": 4},
                "finetune": {"epochs": 1, "batch_size": 128, "eval_batch_size": 8},
                "spectral": {"batch_size": 128, "warmup_steps": 1, "eval_batch_size": 8},
                "eval_batch_size": 8, "n_test": 2,
                "audit": {"n": 2, "steps": 2, "restarts": 1, "batch_size": 8},
                "table1": {"pretrain_epochs": {"mnist": 1, "cifar10": 1, "cifar100": 1},
                           "batch_size": 128}},
    "crown": {"depths": [3], "max_train": 32,
              "train": {"epochs": 1, "batch_size": 16, "warmup_steps": 1},
              "n_test": 1, "cert_eps": [0.02], "alpha_iterations": 1, "time_limit": 5.0,
              "audit": {"steps": 2, "restarts": 1}},
}
# What an offline machine cannot have: the hub's BERT tokenizer and encoder (the offline
# MiniLM package has the same WordPiece vocabulary), and the hub's ViT (a local folder of the
# same class, set by the fixture).
OFFLINE = {"text": {"tokenizer": "minilm-package", "frozen": {"source": "minilm-package"}}}
# keys whose values are shapes (never overridden; grid axes only narrowed to a paper value)
SHAPE_WORDS = ("dim", "depth", "heads", "patch", "hidden", "tokens", "max_len", "layers",
               "gamma", "radius", "block", "pool", "kind", "norm", "attention")


def _merge(tree: dict, over: dict) -> dict:
    out = dict(tree)
    for k, v in over.items():
        out[k] = _merge(tree[k], v) if isinstance(v, dict) else v
    return out


def test_overrides_keep_shapes():
    paper = flatten(YAML(typ="safe", pure=True).load((ROOT / "params.yaml").read_text()))
    for key, value in flatten(COUNTS).items():
        assert key in paper, f"{key}: not in params.yaml"
        leaf = key.split(".")[-1]
        narrowed = ("olsa.depths", "olsa.deep_depths", "lofast.depths", "lofast.heads",
                    "lofast.gamma_vo", "depths", "gamma_ablation", "settings")
        if key.startswith("vit_grid.") or leaf in narrowed or key.split(".", 1)[1] in narrowed:
            assert set(value) <= set(paper[key]), f"{key}: {value} is not from {paper[key]}"
        else:
            assert not any(w in leaf for w in SHAPE_WORDS), f"{key}: a shape, not a count"


# ---------------------------------------------------------------------------- stand-in files
def _images(n: int, classes: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    labels = [i % classes for i in range(n)]
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), labels


def _pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def write_standins(mirror: Path) -> None:
    """CIFAR-10/100 (python pickles), SVHN (.mat), SST-2 and QQP (GLUE TSVs) and Yelp polarity
    (its CSV release) in their raw layouts."""
    from scipy.io import savemat

    base = mirror / "CIFAR10" / "raw" / "cifar-10-batches-py"
    per = N_TRAIN // 5
    for b in range(5):
        x, y = _images(per, 10, b)
        _pickle(base / f"data_batch_{b + 1}", {"data": x, "labels": y})
    x, y = _images(N_TEST, 10, 9)
    _pickle(base / "test_batch", {"data": x, "labels": y})
    _pickle(base / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})

    base = mirror / "CIFAR100" / "raw" / "cifar-100-python"
    for split, n, seed in (("train", N_TRAIN, 10), ("test", N_TEST, 11)):
        x, y = _images(n, 100, seed)
        _pickle(base / split, {"data": x, "fine_labels": y, "coarse_labels": [c // 5 for c in y]})
    _pickle(base / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                            "coarse_label_names": [f"c{i}" for i in range(20)]})

    svhn = mirror / "SVHN" / "raw"
    svhn.mkdir(parents=True)
    for split, n, seed in (("train", N_TRAIN, 12), ("test", N_TEST, 13)):
        x, y = _images(n, 10, seed)
        pix = x.reshape(n, 3, 32, 32).transpose(2, 3, 1, 0)  # (32, 32, 3, N)
        labels = np.array([[c if c else 10] for c in y], dtype=np.uint8)  # digit 0 is label 10
        savemat(svhn / f"{split}_32x32.mat", {"X": pix, "y": labels})

    write_imagenette(mirror / "Imagenette" / "raw", per_class=2)

    sst = mirror / "SST2"
    sst.mkdir()
    words = ["a", "fine", "dull", "film", "with", "great", "bad", "acting", "plot", "moving"]
    rng = np.random.default_rng(14)

    def sentence() -> str:
        return " ".join(rng.choice(words, size=int(rng.integers(3, 40))))

    for split, n in (("train", 128), ("dev", 32)):
        rows = [f"{sentence()}\t{i % 2}" for i in range(n)]
        (sst / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    rows = [f"{i}\t{sentence()}" for i in range(16)]  # GLUE's public test split: no labels
    (sst / "test.tsv").write_text("index\tsentence\n" + "\n".join(rows) + "\n")

    yelp = mirror / "YelpPolarity"  # the original CSV release: "class","text", class 1 or 2
    yelp.mkdir()
    for split, n in (("train", 128), ("test", 16)):
        rows = [f'"{1 + i % 2}","{sentence()}"' for i in range(n)]
        (yelp / f"{split}.csv").write_text("\n".join(rows) + "\n")
    qqp = mirror / "QQP"  # GLUE's TSVs: the test split has no labels
    qqp.mkdir()
    for split, n in (("train", 128), ("dev", 16)):
        rows = [f"{i}\t{i}\t{i + n}\t{sentence()}?\t{sentence()}?\t{i % 2}" for i in range(n)]
        (qqp / f"{split}.tsv").write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                                          + "\n".join(rows) + "\n")
    rows = [f"{i}\t{sentence()}?\t{sentence()}?" for i in range(8)]
    (qqp / "test.tsv").write_text("id\tquestion1\tquestion2\n" + "\n".join(rows) + "\n")


SITECUSTOMIZE = '''\
"""Dry-run test shim: stand-in CIFAR/SVHN files pass torchvision's integrity check if present."""
import importlib.abc
import os
import sys

_PATCHED = {"torchvision.datasets.cifar", "torchvision.datasets.svhn"}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    module.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)
                spec.loader.exec_module = exec_module
                return spec
        return None


sys.meta_path.insert(0, _Finder())
'''


def _sh(cmd, cwd, env, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def dry(tmp_path_factory, mirror):
    """A git checkout of the project with the dry-run params, the stand-in mirror, the env."""
    from attncert.certvit.load import tiny_hf_vit

    tmp = tmp_path_factory.mktemp("dryrun")
    stand = tmp / "mirror"
    write_standins(stand)
    for name in ("MNIST", "FashionMNIST", "CIFAR10-sample", "ImageNet-sample"):
        (stand / name).symlink_to(mirror / name)
    hf = tiny_hf_vit(tmp / "hf-vit")  # the class and input size of google/vit-base-patch16-224
    shim = tmp / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)

    repo = copy_worktree(tmp / "repo")
    yaml = YAML(typ="safe", pure=True)
    params = _merge(yaml.load((repo / "params.yaml").read_text()), COUNTS)
    params = _merge(params, OFFLINE)
    params["certvit"]["source"] = str(hf)
    params["certvit"]["imagenet"]["sources"] = [str(hf)]  # Table 3: the hub ViTs' class
    # the hub's ViT-S/16 and DeiT-Ti are the same class at the same input size
    params["specformer"]["sources"] = [str(hf)]
    validate(params, "dry-run params")
    with open(repo / "params.yaml", "w") as f:
        yaml.dump(params, f)
    commit_all(repo, "dry run")

    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(DVC_NO_ANALYTICS="1", ATTNCERT_DATA_MIRROR=str(stand), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", ATTNCERT_ALLOW_CPU_PAPER="1",  # paper shapes on the CPU
               PYTHONPATH=os.pathsep.join([str(shim), str(repo / "src"),
                                           *filter(None, [env.get("PYTHONPATH")])]))
    return repo, env


def _repro(dry, stage: str) -> str:
    repo, env = dry
    return _sh(["dvc", "repro", "--single-item", stage], repo, env)


def _metrics(dry, rel: str) -> dict:
    return json.loads((dry[0] / rel).read_text())


def test_data(dry):
    _repro(dry, "data")
    m = _metrics(dry, "reports/metrics/data.json")
    for name in ("cifar10", "cifar100", "svhn", "sst2", "yelp_polarity", "qqp"):
        assert m[name]["source"].startswith("mirror "), m[name]
    assert m["cifar100"]["n_train"] == N_TRAIN and m["svhn"]["n_test"] == 10
    assert m["cifar10"]["shape"] == m["svhn"]["shape"] == "3x32x32"
    assert m["imagenette"]["shape"] == "3x224x224" and m["imagenette"]["n_test"] == 10


def test_train_and_certify_grid_point(dry):
    _repro(dry, "train_vit")
    _repro(dry, "certify_vit")
    run = run_name(**GRID_POINT)
    cert = _metrics(dry, f"results/vit/{run}/metrics.json")
    assert cert["broken"] == 0 and cert["n"] == COUNTS["certify_vit"]["n_test"]
    assert cert["n_attacked"] == COUNTS["certify_vit"]["audit"]["n"]


def test_frontier(dry):
    """The grid's paper shape trained with each margin on the held-out split of CIFAR-10."""
    _repro(dry, "frontier_unit")  # the units (each its own DVC stage), then the gathering stage
    _repro(dry, "frontier")
    m = _metrics(dry, "results/frontier/metrics.json")
    assert m["broken"] == 0 and m["settings"] == COUNTS["frontier"]["settings"]
    assert {r["n_val"] for r in m["rows"]} == {COUNTS["frontier"]["n_val"]}


def test_tightness(dry):
    _repro(dry, "tightness")
    tight = _metrics(dry, "reports/metrics/tightness.json")
    assert all(r >= 1.0 for r in tight["table3_lofast_M_over_pgd"].values()), "bound < PGD"


def test_specformer(dry):
    for stage in ("specformer_runs", "specformer_table5", "specformer_certified", "specformer"):
        _repro(dry, stage)  # the units (each its own DVC stage), then the gathering stage
    m = _metrics(dry, "reports/metrics/specformer.json")
    assert set(m["units"]) == {"cifar100", "imagenette", "lambda0", "certified"}
    assert {k.split("/")[0] for k in m["msvp_ablation"]} == {"0.0001,0,0"}


def test_text(dry):
    """GLUE's SST-2 has no labelled test split: dev is the reported evaluation set. OLSA at
    the paper's depth on SST-2 and Yelp (dev held out of training), Table 9's deeper OLSA on
    SST-2 only, the frozen-encoder head on all three (QQP as pairs, reported on dev; OLSA
    trains nothing from scratch there)."""
    _repro(dry, "text_unit")  # the units (each its own DVC stage), then the gathering stage
    _repro(dry, "text")
    m = _metrics(dry, "reports/metrics/text.json")
    assert m["reported_split"] == "dev" and m["broken"] == 0
    depth = COUNTS["text"]["olsa"]["depths"][0]
    yelp, qqp = m["datasets"]["yelp_polarity"], m["datasets"]["qqp"]
    assert yelp["dev_held_out"] and yelp["reported_split"] == "test"
    assert qqp["pairs"] and qqp["reported_split"] == "dev"
    assert set(yelp["models"]) == {f"olsa-L{depth}-g2", "frozen-olsa"}
    assert set(qqp["models"]) == {"frozen-olsa"}
    deep = COUNTS["text"]["olsa"]["deep_depths"][0]
    assert {f"olsa-L{depth}-g2", f"olsa-L{deep}-g2", "frozen-olsa"} <= set(m["models"])


def test_certvit(dry):
    """The Hugging Face route: a saved ViTForImageClassification of the paper's class."""
    for unit in ("certvit_main", "certvit_table1", "certvit_imagenet"):  # each its own stage
        _repro(dry, unit)
    _repro(dry, "certvit")  # the gathering stage
    m = _metrics(dry, "reports/metrics/certvit.json")
    assert m["source"].endswith("hf-vit") and m["broken"] == 0
    # CertViT Table 1: the paper's small ViTs (6 layers, d 128) on every dataset it lists
    assert set(m["table1"]) == {"mnist", "cifar10", "cifar100"}
    for entry in m["table1"].values():
        assert entry["source"] == "pipeline" and entry["n_test"] == 2
        assert all(mm["broken"] == 0 for mm in entry["modes"].values())
    # CertViT Table 3's route: the loaded ViT on the ImageNet sample (no validation images
    # here), one image per class of those left after calibration
    assert m["imagenet"]["images"] == "imagenet_sample"
    assert list(m["imagenet"]["models"]) == [str(dry[0].parent / "hf-vit")]
    assert "imagenet_val" in m["imagenet"]["skipped_images"]
    modes = next(iter(m["imagenet"]["models"].values()))["modes"]
    assert all(mm["broken"] == 0 and mm["calibration_images"] == 10
               and mm["images"] == mm["classes"] for mm in modes.values())


def test_crown(dry):
    """The paper-scale CROWN graph is built on each of LoFAST Table 2's datasets (CIFAR-10 and
    SVHN), one unit per dataset and depth; a bound past the time limit is a '-'."""
    _repro(dry, "crown_unit")  # the units (each its own DVC stage), then the gathering stage
    _repro(dry, "crown")
    m = _metrics(dry, "reports/metrics/crown.json")
    assert list(m["datasets"]) == ["cifar10", "svhn"] and m["broken"] == 0
    assert m["units"] == ["cifar10-L3", "svhn-L3"]
    for part in m["datasets"].values():   # Table 2 per dataset
        assert part["n"] == COUNTS["crown"]["n_test"]
        assert {r["eps"] for r in part["table2"]} == set(COUNTS["crown"]["cert_eps"])


def test_figures(dry):
    """The figures stage through the runner: a stage that did not run is shown as not run."""
    repo, env = dry
    _sh(["python", "-m", "attncert.pipeline.nbrun", "notebooks/10_figures.py",
         "reports/notebooks/10_figures.ipynb", "--section", "base.scale", "--section", "figures"],
        repo, env)
