"""One read-out for every SST-2 text model (:mod:`attncert.stages.text`): clean accuracy,
certified radii, certified and PGD accuracy on the embeddings, certification cost, the
soundness audit's rows, the residual gates and what the attention does; a frozen encoder's
outputs computed once.

Certificates per family:

* ``olsa``: :meth:`~attncert.text.models.OLSAClassifier.certified_radius` (global Lipschitz
  constant per sentence length; OLSA, Kim et al. L2 attention, OLSA over a frozen encoder);
* ``lofast``: :func:`attncert.certify.certify_table` on the embeddings of a
  :class:`~attncert.text.models.LipschitzTextTransformer`, one radius per bound variant
  (pairwise test); the model's radius is the largest sound one;
* ``none``: the standard transformer (:mod:`attncert.text.standard`) has no certificate
  (radius 0, PGD only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .attacks import audit_embeddings
from .train_text import certificate_copy, certify_rows, evaluate_text

FAMILIES = ("olsa", "lofast", "none")


def _lofast_table(model: nn.Module, data: Mapping[str, Tensor], device, batch_size: int,
                  variants: Sequence[str]):
    """:func:`attncert.certify.certify_table` on each sentence's real tokens (normalised
    embeddings), one group per sentence length (:meth:`LipschitzTextTransformer.at_length`),
    in float64 (:func:`~attncert.text.train_text.certificate_copy`); rows in the order of
    ``data``."""
    import pandas as pd

    from attncert.certify import certify_table

    lengths = data["mask"].sum(1)
    with torch.no_grad():
        e = model.embed(data["ids"].to(device)).double()
    model64 = certificate_copy(model.eval())
    frames = []
    for n in lengths.unique().tolist():
        rows = (lengths == n).nonzero().squeeze(1)
        part = certify_table(model64.at_length(n), e[rows.to(e.device), :n],
                             data["y"][rows].to(device), variants, ["pairwise"],
                             batch_size=batch_size, progress=False)
        part["index"] = rows.numpy()
        frames.append(part)
    return pd.concat(frames, ignore_index=True).sort_values("index", ignore_index=True)


def _radii(model: nn.Module, family: str, data: Mapping[str, Tensor], device, batch_size: int,
           variants: Sequence[str]) -> tuple[dict[str, Tensor], Tensor, float | None, Any]:
    """({variant: (N,) radius of the prediction, whatever the label}, (N,) bool correct,
    certification seconds per sentence (the mean of the per-sentence seconds, each batch's
    seconds shared by its sentences; the first variant's for LoFAST; None: no certificate),
    the per-sample frame)."""
    import pandas as pd

    n = len(data["y"])
    if family == "olsa":
        rows = certify_rows(model, data, device, batch_size)
        return ({"global": torch.tensor(rows["radius_predicted"].to_numpy()).double()},
                torch.tensor(rows["correct"].to_numpy()),
                float(rows["seconds"].mean()), rows)
    if family == "lofast":  # certify_table's radii are the prediction's
        table = _lofast_table(model, data, device, batch_size, variants)
        correct = torch.tensor(table["correct"].to_numpy())
        radii = {v: torch.tensor(table[f"radius_{v}_pairwise"].to_numpy()).double()
                 for v in variants}
        return radii, correct, float(table[f"seconds_{variants[0]}_pairwise"].mean()), table
    with torch.no_grad():
        pred = torch.cat([model(data["ids"][i:i + batch_size].to(device),
                                data["mask"][i:i + batch_size].to(device)).argmax(1).cpu()
                          for i in range(0, n, batch_size)])
    correct = pred == data["y"]
    rows = pd.DataFrame({"index": range(n), "label": data["y"].numpy(),
                         "prediction": pred.numpy(), "correct": correct.numpy()})
    return {"none": torch.zeros(n, dtype=torch.float64)}, correct, None, rows


def average_radius(radius: Tensor, correct: Tensor) -> dict[str, float]:
    """Three averaging rules of the prediction's radius ``radius``: ``all`` (ours: the mean
    over every sentence, 0 where misclassified: a certificate of the right answer),
    ``correct`` (the mean over the correctly classified sentences) and ``invariant`` (OLSA
    sec. 5.1's: Rad(T, X) is the largest r that keeps the prediction T(X), whatever the label,
    so every sentence counts with its radius)."""
    r = torch.where(correct, radius.double(), torch.zeros_like(radius, dtype=torch.float64))
    n_ok = int(correct.sum())
    return {"all": float(r.mean()) if len(r) else math.nan,
            "correct": float(r[correct].mean()) if n_ok else math.nan,
            "invariant": float(radius.double().mean()) if len(r) else math.nan}


def evaluate_model(name: str, model: nn.Module, family: str, dev: Mapping[str, Tensor],
                   test: Mapping[str, Tensor], n_test: int, cert_eps: Sequence[float],
                   attack_steps: int, attack_restarts: int, device, batch_size: int = 100,
                   variants: Sequence[str] = ("lofast_M",), seed: int = 0,
                   n_attack: int | None = None, attack_batch_size: int | None = None
                   ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every read-out of one trained model: (metrics, one curve row per variant and eps, the
    audit rows of :func:`attncert.text.attacks.audit_embeddings`, one per eps).

    Clean accuracy on all of dev (model selection) and test (the report); certified radii on
    the first ``n_test`` test sentences (0 = all), averaged with the three rules
    (:func:`average_radius`); PGD and the audit on the first ``n_attack`` of them (None = all
    certified), ``attack_batch_size`` at a time (None: ``batch_size``); the residual gates,
    alpha1 and the attention's mean max probability on the certified sentences. A PGD success
    on a certified point is counted in ``broken`` (the stage fails on it:
    :func:`attncert.soundness.require_sound` on the audit rows).
    """
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: choose from {', '.join(FAMILIES)}")
    model.eval()
    accs = {split: evaluate_text(model, data, device, batch_size)["acc"]
            for split, data in (("dev", dev), ("test", test))}
    n_cert = len(test["y"]) if n_test == 0 else min(n_test, len(test["y"]))
    sub = {k: v[:n_cert] for k, v in test.items()}
    predicted, correct, seconds, _ = _radii(model, family, sub, device, batch_size, variants)
    averages = {v: average_radius(r, correct) for v, r in predicted.items()}
    radii = {v: r * correct for v, r in predicted.items()}  # certificates of the right answer
    best = torch.stack(list(radii.values())).max(0).values
    n_att = n_cert if n_attack is None else min(n_attack, n_cert)
    att = {k: v[:n_att] for k, v in sub.items()}
    audit = audit_embeddings(model, att["ids"].to(device), att["mask"].to(device),
                             att["y"].to(device), best[:n_att], cert_eps, attack_steps,
                             attack_restarts, seed, attack_batch_size or batch_size)
    broken = sum(r["broken"] for r in audit)
    curves = [{"model": name, "variant": v, "eps": float(e),
               "certified_acc": float(((r >= e) & (r > 0)).double().mean())}
              for v, r in radii.items() for e in cert_eps]
    metrics = {
        "family": family, "dev_acc": accs["dev"], "test_acc": accs["test"],
        "n_certified": n_cert, "n_attacked": n_att,
        "avg_radius": {v: a["all"] for v, a in averages.items()},
        "avg_radius_correct": {v: a["correct"] for v, a in averages.items()},
        "avg_radius_invariant": {v: a["invariant"] for v, a in averages.items()},
        "certified_acc": {f"{e:g}": float(((best >= e) & (best > 0)).double().mean())
                          for e in cert_eps},
        "attacked_certified_acc": {f"{r['eps']:g}": r["certified_acc"] for r in audit},
        "pgd_acc": {f"{r['eps']:g}": r["robust_acc"] for r in audit},
        "broken": broken, "cert_seconds_per_sentence": seconds,
        **residual_diagnostics(model),
        "attention": attention_statistics(model, sub, device, batch_size),
        "attention_ablation": attention_ablation(model, sub, device, batch_size),
    }
    return metrics, curves, audit


def attention_ablation(model: nn.Module, data: Mapping[str, Tensor], device,
                       batch_size: int = 256) -> dict[str, Any] | None:
    """:func:`attncert.diagnostics.attention_diagnostics` on the sentences of ``data`` (clean
    accuracy with every self-attention matrix replaced by uniform weights over the real
    tokens and by the identity, the points lost each way, the rows' entropy); None for a
    model without self-attention (depth 0)."""
    from attncert import diagnostics

    if not _attention_layers(model):
        return None
    x = (data["ids"].to(device), data["mask"].to(device))
    return diagnostics.attention_diagnostics(model, x, data["y"].to(device), batch_size)


# -- what the attention does -----------------------------------------------------------------


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a text model, in forward order (those with
    ``compute_probs``; a frozen encoder's own attention is not counted)."""
    from attncert.layers import MultiHeadAttention

    from .olsa import L2Attention, OLSAAttention

    kinds = (OLSAAttention, L2Attention, MultiHeadAttention)
    return [m for name, m in model.named_modules()
            if isinstance(m, kinds) and not name.startswith("encoder")]


@torch.no_grad()
def residual_diagnostics(model: nn.Module) -> dict[str, list[float]]:
    """Per OLSA layer: the residual gates b_att, b_ff (0.5 for OLSA's averaged residual) and
    alpha1 of its attention (OLSA only), with their means over layers (``b_att_mean``,
    ``alpha1_mean``: the report's numbers); empty lists and None for the other families."""
    from .olsa import OLSAAttention, OLSALayer

    gates, alpha1 = [], []
    for m in model.modules():
        if isinstance(m, OLSALayer):
            (_, b_att), (_, b_ff) = m.residual_weights()
            gates.append([float(b_att), float(b_ff)])
            if isinstance(m.attn, OLSAAttention):
                alpha1.append(float(m.attn.alpha1))
    return {"gates": gates, "alpha1": alpha1,
            "b_att_mean": sum(g[0] for g in gates) / len(gates) if gates else None,
            "alpha1_mean": sum(alpha1) / len(alpha1) if alpha1 else None}


@torch.no_grad()
def attention_statistics(model: nn.Module, data: Mapping[str, Tensor], device,
                         batch_size: int = 256) -> dict[str, Any]:
    """How far the trained attention is from uniform, on the sentences of ``data``.

    ``max_prob``: per attention layer, the mean over sentences, heads and real query tokens of
    max_j p_ij (padding keys excluded); ``uniform``: the mean of 1/n over the same queries
    (the value of a uniform attention); ``max_prob_mean``: the mean over layers; ``ratio``:
    max_prob_mean / uniform (1 = exactly uniform, a bag of words). Empty for a model without
    self-attention (depth 0).
    """
    layers = _attention_layers(model)
    if not layers:
        return {"max_prob": [], "uniform": None, "max_prob_mean": None, "ratio": None}
    sums = torch.zeros(len(layers), dtype=torch.float64)
    captured: dict[int, Tensor] = {}

    def hook(i):
        def fn(module, args, kwargs, _out):
            x = args[0]
            mask = args[1] if len(args) > 1 else kwargs.get("mask")
            if mask is None:
                mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            p = module.compute_probs(x, mask)  # (B, h, n, n)
            top = p.amax(-1).mean(1).double()  # (B, n): mean over heads
            m = mask.double()
            captured[i] = (top * m).sum(1) / m.sum(1)
        return fn

    handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    model.eval()
    inv_n, count = 0.0, 0
    try:
        for i in range(0, len(data["y"]), batch_size):
            ids, mask = (data[k][i:i + batch_size].to(device) for k in ("ids", "mask"))
            model(ids, mask)
            for k in range(len(layers)):
                sums[k] += float(captured[k].sum())
            inv_n += float((1.0 / mask.sum(1).double()).sum())
            count += len(ids)
    finally:
        for h in handles:
            h.remove()
    per_layer = (sums / count).tolist()
    mean = sum(per_layer) / len(per_layer)
    uniform = inv_n / count
    return {"max_prob": per_layer, "uniform": uniform, "max_prob_mean": mean,
            "ratio": mean / uniform}


# -- a frozen encoder's outputs ------------------------------------------------------------


@torch.no_grad()
def frozen_states(model: nn.Module, data: Mapping[str, Tensor], device,
                  batch_size: int = 256, path: str | Path | None = None) -> dict[str, Tensor]:
    """{"ids": (N, L', hidden) float32 normalised encoder states, "mask", "y"}: a frozen
    encoder's outputs computed once (``model.embed``), truncated to the longest sentence, so
    the head trains for many epochs without running the encoder again. The model reads these
    states in place of ids (its forward accepts embeddings). ``path``: the states live in a
    memory-mapped ``.npy`` file there, not in host memory (QQP's training states at BERT-base
    width are about 36 GB); the head's training then reads them batch by batch
    (:class:`attncert.text.train_text.TextSteps`). The model is moved to ``device``."""
    lengths = data["mask"].sum(1)
    keep = int(lengths.max())
    ids, mask = data["ids"][:, :keep], data["mask"][:, :keep]
    model.to(device).eval()
    shape = (*ids.shape, model.embed_dim)
    if path is None:
        states = torch.zeros(shape)
    else:
        import numpy as np

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        states = torch.from_numpy(np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                                            shape=shape))
    from attncert.pipeline.progress import bar

    order = lengths.argsort()  # batches of similar length: little padding through the encoder
    for i in bar(range(0, len(ids), batch_size), desc="encoder states", unit="batch"):
        rows = order[i:i + batch_size]
        n = int(lengths[rows].max())
        states[rows, :n] = model.embed(ids[rows, :n].to(device),
                                       mask[rows, :n].to(device)).float().cpu()
    return {"ids": states, "mask": mask, "y": data["y"]}


# -- tables ----------------------------------------------------------------------------------


def attention_table(results: Mapping[str, Mapping[str, Any]]):
    """One row per model from :func:`evaluate_model` metrics: accuracy, average radius (the
    three rules of :func:`average_radius`; for LoFAST the best variant), certified and PGD
    accuracy at every eps, cost, the mean residual gates and alpha1 over layers, the attention's
    mean max probability, its uniform value 1/n and their ratio, the points of accuracy lost
    with uniform and identity attention (:func:`attention_ablation`), broken certificates. A
    pandas DataFrame."""
    import pandas as pd

    def mean(v):
        return sum(v) / len(v) if v else math.nan

    rows = []
    for name, r in results.items():
        best = max(r["avg_radius"], key=r["avg_radius"].get)
        att = r["attention"]
        rows.append({
            "model": name, "family": r["family"], "dev_acc": r["dev_acc"],
            "test_acc": r["test_acc"], "avg_radius": r["avg_radius"][best],
            "avg_radius_correct": r["avg_radius_correct"][best],
            "avg_radius_invariant": r["avg_radius_invariant"][best], "variant": best,
            "n_certified": r["n_certified"],
            **{f"cert@{e}": v for e, v in r["certified_acc"].items()},
            **{f"pgd@{e}": v for e, v in r["pgd_acc"].items()},
            "b_att": mean([g[0] for g in r["gates"]]), "b_ff": mean([g[1] for g in r["gates"]]),
            "alpha1": mean(r["alpha1"]),
            "max_prob": math.nan if att["max_prob_mean"] is None else att["max_prob_mean"],
            "1/n": math.nan if att["uniform"] is None else att["uniform"],
            "attn_ratio": math.nan if att["ratio"] is None else att["ratio"],
            **{f"{k}_gap": math.nan if not r.get("attention_ablation")
               else r["attention_ablation"][f"{k}_gap"] for k in ("uniform", "identity")},
            "cert_s/sentence": r.get("cert_seconds_per_sentence"),
            "train_s": r.get("train_seconds"),
            "broken": r["broken"]})
    return pd.DataFrame(rows)
