"""Training, evaluation and per-sample certification of the SST-2 text models.

The data: seeded subsets of SST-2's splits (:func:`select_splits`), tokenised
(:func:`encode_split`). Training is :func:`attncert.training.train.train` (or
:func:`attncert.training.train.train_resumable`, resumed when the model, config and data match:
:func:`train_model`) with a :class:`TextTrainConfig`: the shared epoch loop of
:mod:`attncert.training.loop` (AdamW, per-step cosine schedule with warmup, an atomic checkpoint
every epoch and resume from it, the metrics file) with the text run's :class:`TextSteps` on
tokenised data {"ids", "mask", "y"}:

* the data order comes from :func:`attncert.training.train.epoch_generator` (on the CPU, which plans
  the batches): batches are drawn from length-sorted buckets (``bucket`` batches each, order
  shuffled), since the OLSA models drop the columns past the longest sentence of a batch and
  attention costs n^2;
* loss = CE(s f, y) - gamma_t mean(relu(M / (sqrt(2) ||W_head||))): OLSA's certificate
  regulariser (docs/math.md section 7) on the certified radius of a model whose layers are
  1-Lipschitz, gamma_t ramped linearly from 0 to ``gamma`` (:func:`.olsa.gamma_ramp`);
* after every step the orthogonal maps are re-projected (:func:`reproject_orthogonal_`), so
  the few Newton-Schulz steps of the forward pass stay converged;
* AdamW sees only the parameters that require a gradient (a frozen encoder stays out).

The tokenised training set moves to the device once and the forward pass and loss run at
``precision`` (:mod:`attncert.training.precision`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.pipeline import rng
from attncert.pipeline.batching import in_batches
from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.pipeline.params import dataclass_from_mapping
from attncert.training.loop import Steps
from attncert.training.precision import require_full_precision
from attncert.training.train import epoch_generator, train_resumable

from .olsa import certificate_regulariser, certified_radius, gamma_ramp, reproject_orthogonal_
from .tokenize import encode

#: the resume record in a model's checkpoint folder (:func:`train_model`)
TRAIN_SPEC = "spec.json"
_MAY_BE_ZERO = ("warmup_steps", "seed", "weight_decay", "gamma", "gamma_ramp", "grad_clip")


@dataclass(frozen=True)
class TextTrainConfig:
    """Optimisation settings; every field is validated (a ValueError names the field).

    ``logit_scale``: CE temperature s (as in :class:`attncert.training.train.TrainConfig`: logits of
    a 1-Lipschitz model are small, so CE(f) learns slowly; s changes the loss only);
    ``gamma``: weight of the certificate regulariser after its ramp (OLSA: 2.0; 0 over a frozen
    encoder); ``gamma_ramp``: fraction of all steps over which it grows linearly from 0;
    ``bucket``: batches per length-sorted bucket (1 = plain shuffling); ``lr_decay_epochs``:
    the LR is multiplied by ``lr_decay`` after each of these epochs (a step schedule, as
    OLSA's QQP run) instead of the cosine decay (:func:`attncert.training.loop.lr_schedule`). The
    optimiser is AdamW (Adam when ``weight_decay`` is 0).
    """

    epochs: int = 3
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    logit_scale: float = 1.0
    gamma: float = 0.0
    gamma_ramp: float = 1.0
    grad_clip: float = 0.0
    bucket: int = 50
    eval_batch_size: int = 256
    seed: int = 0
    lr_decay_epochs: tuple[int, ...] = ()
    lr_decay: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr_decay_epochs", tuple(self.lr_decay_epochs))
        if any(isinstance(e, bool) or not isinstance(e, int) or not 0 < e < self.epochs
               for e in self.lr_decay_epochs):
            raise ValueError(f"TextTrainConfig.lr_decay_epochs must be epochs in [1, "
                             f"{self.epochs - 1}], got {list(self.lr_decay_epochs)!r}")
        for f in dataclasses.fields(self):
            if f.name == "lr_decay_epochs":
                continue
            v = getattr(self, f.name)
            is_int = f.type == "int"
            low = 0 if f.name in _MAY_BE_ZERO else (1 if is_int else None)  # None: > 0
            kinds = int if is_int else int | float
            if (isinstance(v, bool) or not isinstance(v, kinds)
                    or (v < low if low is not None else not v > 0)):
                what = ("an int" if is_int else "a number") + (
                    f" >= {low}" if low is not None else " > 0")
                raise ValueError(f"TextTrainConfig.{f.name} must be {what}, got {v!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TextTrainConfig:
        return dataclass_from_mapping(cls, d)

    def steps(self, model: nn.Module, train_data: Mapping[str, Tensor],
              device: torch.device) -> TextSteps:
        """The batches and loss of a run with this config (:class:`TextSteps`)."""
        return TextSteps(model, train_data, self, device)


# -- data ------------------------------------------------------------------------------------


def encode_split(split: Mapping[str, Any], tokenizer, max_len: int = 32) -> dict[str, Tensor]:
    """A processed text split {"text": [str], "y": (N,)} (sentence pairs: and "text_pair")
    -> {"ids", "mask", "y"} (:func:`attncert.text.tokenize.encode`)."""
    ids, mask = encode(split["text"], tokenizer, max_len, split.get("text_pair"))
    return {"ids": ids, "mask": mask, "y": torch.as_tensor(split["y"], dtype=torch.long)}


def select_splits(dataset: Mapping[str, Any], max_train: int, max_test: int, seed: int
                  ) -> tuple[dict[str, dict[str, Any]], str]:
    """({"train", "dev", "test": {"text", ["text_pair",] "y"}}, the name of the reported
    split) of a processed text dataset (SST-2, Yelp polarity, QQP).

    Seeded subsets (:func:`attncert.data.subset_indices`; 0 = all). "test" is the split the
    stage reports on: the labelled test split when the dataset has one, otherwise (GLUE's
    SST-2 download and QQP, whose public test splits have no labels) the dev split, which then
    serves both model selection and the report; the second value says which. A dataset
    without a dev split (Yelp polarity) gets one held out of its training split: a seeded
    draw as large as the reported split (at most ``max_test``, at most a tenth of training),
    disjoint from the training sentences.
    """
    from attncert.data import subset_indices

    have = sorted(k for k in ("train", "dev", "test") if k in dataset)
    name = dataset.get("name", "text dataset")
    if "train" not in dataset or not {"dev", "test"} & set(have):
        raise ValueError(f"the processed {name} needs a labelled train split and a labelled "
                         f"dev or test split (splits: {have})")
    reported = "test" if "test" in dataset else "dev"

    def take(split: str, idx: torch.Tensor) -> dict[str, Any]:
        rows = dataset[split]
        out = {key: [rows[key][i] for i in idx.tolist()] for key in ("text", "text_pair")
               if key in rows}
        return out | {"y": rows["y"][idx]}

    n_train = len(dataset["train"]["y"])
    pool = torch.arange(n_train)
    if "dev" in dataset:
        dev = take("dev", subset_indices(len(dataset["dev"]["y"]), max_test, seed))
    else:
        n_dev = len(dataset["test"]["y"]) if max_test == 0 else min(
            max_test, len(dataset["test"]["y"]))
        n_dev = max(1, min(n_dev, n_train // 10))
        # host indices into host data: a CPU generator by design
        perm = torch.randperm(n_train, generator=rng.generator(seed, "cpu"))
        dev = take("train", perm[:n_dev].sort().values)
        pool = perm[n_dev:].sort().values
    train = take("train", pool[subset_indices(len(pool), max_train, seed)])
    test = (take("test", subset_indices(len(dataset["test"]["y"]), max_test, seed))
            if reported == "test" else dev)
    return {"train": train, "dev": dev, "test": test}, reported


def train_model(model: nn.Module, spec: Mapping[str, Any], train: Mapping[str, Tensor],
                dev: Mapping[str, Tensor], config: TextTrainConfig, folder: str | Path,
                device: torch.device | str, precision: str = "auto") -> list[dict[str, Any]]:
    """:func:`attncert.training.train.train_resumable` at ``precision`` in ``folder``, resumed when
    ``folder/spec.json`` records the same model ``spec``, training config, training data (its
    size and a hash of its token ids and labels) and resolved precision, otherwise started over
    (the folder is cleared). Returns the per-epoch rows."""
    precision = resolve_precision(precision, resolve_device(device))
    digest = hashlib.sha256()
    for key in ("ids", "mask", "y"):  # the arrays' buffers: no copy of a large dataset
        digest.update(train[key].cpu().contiguous().numpy())
    record = {"model": dict(spec), "train": dataclasses.asdict(config),
              "data": {"n": len(train["y"]), "sha256": digest.hexdigest()[:16]},
              "precision": precision}
    return train_resumable(model, train, dev, config, folder, device, fingerprint=record,
                           marker=TRAIN_SPEC, precision=precision).curves


def bucketed_batches(lengths: Tensor, batch_size: int, bucket: int, g: torch.Generator
                     ) -> list[Tensor]:
    """Index batches covering a random permutation once: each run of ``bucket`` batches is
    sorted by length before it is cut, and the batch order is shuffled."""
    order = torch.randperm(len(lengths), generator=g)
    chunk = batch_size * bucket
    batches = []
    for start in range(0, len(order), chunk):
        part = order[start:start + chunk]
        part = part[lengths[part].argsort(stable=True)]
        batches += list(part.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


# -- loss and evaluation ---------------------------------------------------------------------


def text_loss(model: nn.Module, logits: Tensor, y: Tensor, gamma: float,
              logit_scale: float = 1.0) -> Tensor:
    """CE(s f, y) - gamma mean(relu(M / (sqrt(2) ||W_head||))) (module docstring)."""
    loss = F.cross_entropy(logit_scale * logits, y)
    if gamma > 0:
        loss = loss + certificate_regulariser(logits, y, model.head_lipschitz(), gamma)
    return loss


def step_terms(model: nn.Module, gamma: float
               ) -> tuple[Callable[[Tensor, Tensor], Tensor], Callable[[], None]]:
    """(loss(logits, y), after()) of a training step of ``model`` as :class:`TextSteps` runs it
    at a fixed ``gamma``: :func:`text_loss`, then the orthogonal maps' re-projection (none for
    a model without them). The cost model counts and the bench times a text step by them."""
    return ((lambda logits, y: text_loss(model, logits, y, gamma)),
            (lambda: reproject_orthogonal_(model)))


@torch.no_grad()
def length_lipschitz(model: nn.Module, mask: Tensor, device: torch.device | str | None = None
                     ) -> Tensor:
    """(L + 1,) float64 on ``device`` (default: the mask's): ``model.lipschitz`` at each
    sentence length of ``mask`` (B, L), NaN at the lengths it lacks. A global constant depends
    on a sentence only through its length (its mask's sum), so a loop over batches reads
    ``table[mask.sum(1)]`` instead of solving the same spectral norms for every batch: one call
    of ``model.lipschitz`` on one mask per length, the same values."""
    device = mask.device if device is None else torch.device(device)
    lengths = mask.sum(1).unique()
    probe = (torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]).to(mask.dtype)
    table = torch.full((mask.shape[1] + 1,), math.nan, dtype=torch.float64, device=device)
    if len(lengths):  # no sentence: nothing to solve
        table[lengths.to(device)] = model.lipschitz(probe.to(device)).to(device, torch.float64)
    return table


@torch.no_grad()
def evaluate_text(model: nn.Module, data: Mapping[str, Tensor], device: torch.device | str = "cpu",
                  batch_size: int = 256) -> dict[str, float]:
    """Mean CE and accuracy; for models with a global Lipschitz constant also the average
    certified radius (0 for misclassified points) and the mean Lipschitz constant (one per
    sentence length, :func:`length_lipschitz`)."""
    was_training = model.training
    model.eval()
    loss_sum, correct, radius_sum, lip_sum = 0.0, 0, 0.0, 0.0
    n = len(data["y"])
    table = length_lipschitz(model, data["mask"], device) if hasattr(model, "lipschitz") else None
    for i in range(0, n, batch_size):
        ids, mask, y = (data[k][i:i + batch_size].to(device) for k in ("ids", "mask", "y"))
        logits = model(ids, mask)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        if table is not None:
            lip = table[mask.sum(1)].to(logits.device)
            radius_sum += float(certified_radius(logits, y, lip).sum())
            lip_sum += float(lip.sum())
    model.train(was_training)
    out = {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1)}
    if hasattr(model, "lipschitz"):
        out |= {"avg_radius": radius_sum / max(n, 1), "lipschitz": lip_sum / max(n, 1)}
    return out


@torch.no_grad()
def certificate_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` for its certificates, which start at its embeddings (the
    certified input, :meth:`embed`: feed them as float input). A frozen encoder (the module's
    ``encoder``) is not copied: the copy shares the original, in its own dtype (the encoder
    only makes the embeddings, outside the certified map)."""
    encoder = model._modules.get("encoder")
    if encoder is None:
        return copy.deepcopy(model).double()
    model._modules["encoder"] = None
    try:
        out = copy.deepcopy(model).double()
    finally:
        model._modules["encoder"] = encoder
    out._modules["encoder"] = encoder
    return out


@torch.no_grad()
def certify_rows(model: nn.Module, data: Mapping[str, Tensor], device: torch.device | str = "cpu",
                 batch_size: int = 256):
    """One row per example (index, label, prediction, correct, margin, radius (0 where
    misclassified), radius_predicted (the prediction's, whatever the label: OLSA sec. 5.1's
    prediction invariance), seconds per sample) from ``model.certified_radius`` in float64
    (:func:`certificate_copy`, on the model's own embeddings of each sentence): one forward
    pass a batch, the Lipschitz constants once per sentence length (:func:`length_lipschitz`,
    their seconds shared by every row); a pandas DataFrame."""
    import pandas as pd

    require_full_precision("a certificate (attncert.text)")
    model.eval()
    model64 = certificate_copy(model)
    t0 = time.perf_counter()
    table = length_lipschitz(model64, data["mask"], device)  # its seconds shared by every row
    shared = (time.perf_counter() - t0) / max(len(data["y"]), 1)

    def batch(start: int, stop: int):
        ids, mask, y = (data[k][start:stop].to(device) for k in ("ids", "mask", "y"))
        t0 = time.perf_counter()
        e = model.embed(ids, mask).double()
        logits = model64(e, mask)
        lip = table[mask.sum(1)]  # model64.lipschitz(mask), read from the table
        radius = certified_radius(logits, y, lip)  # model64.certified_radius(e, mask, y)
        seconds = (time.perf_counter() - t0) / len(y) + shared
        pred = logits.argmax(1)
        invariant = certified_radius(logits, pred, lip)  # of the prediction, any label
        top2 = logits.topk(2, dim=1).values
        return pd.DataFrame({
            "index": range(start, stop), "label": y.cpu().numpy(),
            "prediction": pred.cpu().numpy(), "correct": (pred == y).cpu().numpy(),
            "margin": (top2[:, 0] - top2[:, 1]).cpu().numpy(),
            "radius": radius.cpu().numpy(), "radius_predicted": invariant.cpu().numpy(),
            "seconds": seconds})

    # on a CUDA device the batch grows to base.batch_memory of its memory (pipeline.batching)
    frames = in_batches(len(data["y"]), batch_size, batch, "text certificates", device=device)
    return pd.concat(frames, ignore_index=True)


# -- the run ---------------------------------------------------------------------------------


#: training tensors larger than this stay in host memory (moved to the device per batch)
DEVICE_DATA_BYTES = 2 * 2**30


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class TextSteps(Steps):
    """Tokenised text (module docstring): bucketed batches planned on the CPU, the gamma-ramped
    loss of :func:`text_loss`, orthogonal maps re-projected after each step; the epoch's row
    gets the last step's ``gamma``."""

    def __init__(self, model: nn.Module, train_data: Mapping[str, Tensor],
                 config: TextTrainConfig, device: torch.device):
        if config.gamma > 0 and not hasattr(model, "head_lipschitz"):
            raise ValueError(f"gamma > 0 needs a model with a global Lipschitz constant "
                             f"(head_lipschitz); {type(model).__name__} has none")
        self.model, self.config, self.device = model, config, device
        self.lengths = train_data["mask"].sum(1).cpu()  # the CPU plans the batches
        # once on the device, unless too large (a frozen encoder's memory-mapped states):
        # those stay in host memory and go to the device batch by batch
        self.data = {k: train_data[k] if _nbytes(train_data[k]) > DEVICE_DATA_BYTES
                     else train_data[k].to(device) for k in ("ids", "mask", "y")}
        self.n = len(self.lengths)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.total_steps = config.epochs * math.ceil(self.n / config.batch_size)
        self.gamma = 0.0

    def plan(self, epoch: int) -> Sequence[Tensor]:
        return bucketed_batches(self.lengths, self.config.batch_size, self.config.bucket,
                                epoch_generator(self.config.seed, epoch))

    def batch(self, idx: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        on_device = idx.to(self.device, non_blocking=True)
        ids, mask, y = (t[on_device] if t.device == on_device.device
                        else t[idx].to(self.device, non_blocking=True)
                        for t in (self.data[k] for k in ("ids", "mask", "y")))
        return (ids, mask), y

    def loss(self, inputs: tuple[Tensor, ...], y: Tensor, step: int) -> tuple[Tensor, Tensor]:
        cfg = self.config
        self.gamma = gamma_ramp(step, self.total_steps, cfg.gamma, cfg.gamma_ramp)
        logits = self.model(*inputs)
        return logits, text_loss(self.model, logits, y, self.gamma, cfg.logit_scale)

    def after_step(self) -> None:
        reproject_orthogonal_(self.model)

    def evaluate(self, data: Mapping[str, Tensor]) -> dict[str, float]:
        return evaluate_text(self.model, data, self.device, self.config.eval_batch_size)

    def row(self) -> dict[str, Any]:
        return {"gamma": self.gamma}
