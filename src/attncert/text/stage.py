"""The SST-2 text stage (notebooks/06_text.py): a standard (non-Lipschitz) text transformer
for the clean-accuracy reference, resumable training per model, and one evaluation routine
that gives every model the same read-out (clean accuracy, certified radii, certified and PGD
accuracy on the embeddings, certification cost, the soundness audit).

Certificates per family:

* ``olsa``: :meth:`~attncert.text.models.OLSAClassifier.certified_radius` (global Lipschitz
  constant per sentence length; OLSA, Kim et al. L2 attention, OLSA over a frozen encoder);
* ``lofast``: :func:`attncert.certify.certify_table` on the embeddings of a
  :class:`~attncert.text.models.LipschitzTextTransformer`, one radius per bound variant
  (pairwise test); the model's radius is the largest sound one;
* ``none``: the standard transformer has no certificate (radius 0, PGD only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attncert.models.vit import Block, ViTConfig
from attncert.precision import resolve_precision
from attncert.train import resolve_device

from .attacks import audit_embeddings
from .train_text import TextTrainConfig, certify_rows, evaluate_text, train_text

FAMILIES = ("olsa", "lofast", "none")
SPEC = "spec.json"


class StandardTextTransformer(nn.Module):
    """A standard pre-norm transformer classifier of the given size: word + position
    embeddings, :class:`attncert.models.vit.Block` s of the standard ViT (LayerNorm,
    dot-product attention, GELU MLP), LayerNorm, mean pooling over the real tokens, a linear
    head. No Lipschitz constraint: the clean-accuracy reference of the certified models."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, depth: int, heads: int,
                 mlp_hidden: int, num_classes: int = 2):
        super().__init__()
        cfg = ViTConfig(dim=dim, depth=depth, heads=heads, mlp_hidden=mlp_hidden,
                        num_classes=num_classes, kind="standard", block="prenorm", pool="mean")
        self.word = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def embed(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, dim): word embeddings (the input PGD perturbs)."""
        return self.word(ids)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        t = (x if x.is_floating_point() else self.embed(x)) + self.pos[:, :x.shape[1]]
        for block in self.blocks:
            t = block(t)
        t = self.norm(t)
        if mask is None:
            return self.head(t.mean(dim=1))
        m = mask.to(t.dtype)[..., None]
        return self.head((t * m).sum(1) / m.sum(1).clamp_min(1.0))


def train_model(model: nn.Module, spec: Mapping[str, Any], train: Mapping[str, Tensor],
                dev: Mapping[str, Tensor], config: TextTrainConfig, folder: str | Path,
                device: torch.device | str, precision: str = "auto") -> list[dict[str, Any]]:
    """:func:`train_text` at ``precision`` in ``folder``, resumed when ``folder/spec.json``
    records the same model ``spec``, training config, training data (its size and a hash of
    its token ids and labels) and resolved precision, otherwise started over (the folder is
    cleared)."""
    folder = Path(folder)
    precision = resolve_precision(precision, resolve_device(device))
    digest = hashlib.sha256()
    for key in ("ids", "mask", "y"):
        digest.update(train[key].cpu().contiguous().numpy().tobytes())
    record = {"model": dict(spec), "train": dataclasses.asdict(config),
              "data": {"n": len(train["y"]), "sha256": digest.hexdigest()[:16]},
              "precision": precision}
    spec_path = folder / SPEC
    if folder.exists() and (not spec_path.is_file()
                            or json.loads(spec_path.read_text()) != record):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(record, sort_keys=True))
    return train_text(model, train, dev, config, folder, device, progress=False,
                      precision=precision)


def _radii(model: nn.Module, family: str, data: Mapping[str, Tensor], device, batch_size: int,
           variants: Sequence[str]) -> tuple[dict[str, Tensor], float, Any]:
    """({variant: (N,) radius}, certification seconds per batch, the per-sample frame)."""
    import pandas as pd

    n = len(data["y"])
    if family == "olsa":
        rows = certify_rows(model, data, device, batch_size)
        return ({"global": torch.tensor(rows["radius"].to_numpy())},
                float(rows["seconds"].mean()) * min(batch_size, n), rows)
    if family == "lofast":
        from attncert.certify import certify_table

        with torch.no_grad():
            e = model.embed(data["ids"].to(device))
        table = certify_table(model, e, data["y"].to(device), variants, ["pairwise"],
                              batch_size=batch_size, progress=False)
        correct = torch.tensor(table["correct"].to_numpy())
        radii = {v: torch.tensor(table[f"radius_{v}_pairwise"].to_numpy()).double()
                 * correct for v in variants}  # 0 on misclassified points, as OLSA's
        seconds = {v: float(table[f"seconds_{v}_pairwise"].mean()) * min(batch_size, n)
                   for v in variants}
        return radii, seconds[variants[0]], table
    with torch.no_grad():
        pred = torch.cat([model(data["ids"][i:i + batch_size].to(device),
                                data["mask"][i:i + batch_size].to(device)).argmax(1).cpu()
                          for i in range(0, n, batch_size)])
    rows = pd.DataFrame({"index": range(n), "label": data["y"].numpy(),
                         "prediction": pred.numpy(), "correct": (pred == data["y"]).numpy()})
    return {"none": torch.zeros(n, dtype=torch.float64)}, 0.0, rows


def evaluate_model(name: str, model: nn.Module, family: str, dev: Mapping[str, Tensor],
                   test: Mapping[str, Tensor], n_test: int, eps: Sequence[float],
                   pgd_steps: int, pgd_restarts: int, device, batch_size: int = 100,
                   variants: Sequence[str] = ("lofast_M",), seed: int = 0
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every read-out of one trained model: (metrics, one curve row per variant and eps).

    Clean accuracy on all of dev (model selection) and test (the report); certificates, PGD
    and the audit on the first ``n_test`` test sentences. A PGD success on a certified point
    raises (a broken certificate is a soundness bug, the stage must fail).
    """
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: choose from {', '.join(FAMILIES)}")
    model.eval()
    accs = {split: evaluate_text(model, data, device, batch_size)["acc"]
            for split, data in (("dev", dev), ("test", test))}
    sub = {k: v[:n_test] for k, v in test.items()}
    radii, seconds, _ = _radii(model, family, sub, device, batch_size, variants)
    best = torch.stack(list(radii.values())).max(0).values
    audit = audit_embeddings(model, sub["ids"].to(device), sub["mask"].to(device),
                             sub["y"].to(device), best, eps, pgd_steps, pgd_restarts, seed,
                             batch_size)
    broken = sum(r["broken"] for r in audit)
    if broken:
        raise AssertionError(f"{name}: {broken} certificates broken by PGD (eps "
                             f"{[r['eps'] for r in audit if r['broken']]}): unsound bound")
    curves = [{"model": name, "variant": v, "eps": float(e),
               "certified_acc": float(((r >= e) & (r > 0)).double().mean())}
              for v, r in radii.items() for e in eps]
    metrics = {
        "family": family, "dev_acc": accs["dev"], "test_acc": accs["test"],
        "n_certified": len(sub["y"]),
        "avg_radius": {v: float(r.mean()) for v, r in radii.items()},
        "certified_acc": {f"{r['eps']:g}": r["certified_acc"] for r in audit},
        "pgd_acc": {f"{r['eps']:g}": r["robust_acc"] for r in audit},
        "broken": broken, "cert_seconds_per_batch": seconds, "cert_batch_size": batch_size,
    }
    return metrics, curves
