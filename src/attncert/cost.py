"""Cost of the study at the scale of a params file: GPU-hours per stage, and training step times.

    python -m attncert.cost table [--params params.yaml] [--gpu h100] [--utilisation 0.3]
    python -m attncert.cost readme     # rewrite README's table between the cost markers
    python -m attncert.cost bench [--batch 32] [--steps 5]   # measured training step times

How a figure is estimated (``table``): every stage is a list of work items (a training run, an
evaluation, a certificate pass, a PGD audit) whose FLOPs and GPU kernels are COUNTED, not
guessed: the project's own models are built at the shapes the params file gives (datasets'
image shapes and sizes are the public ones, :data:`DATASETS`) and one call of the real code
(a training step with AdamW, a forward pass, one PGD step, the certificate's per-layer terms)
runs on the CPU under ``torch.utils.flop_counter.FlopCounterMode`` and a kernel counter, at
batch 1 and 2: FLOPs = a + b * batch (the weight parametrisations of the Lipschitz layers cost
a per call, not per sample). A work item's time on the GPU is the larger of its FLOPs at a
sustained fraction (``--utilisation``) of the GPU's peak for its precision (training: bf16
autocast; audits: float32 attacks with TF32; evaluation: float32; certificates: float64) and
its kernels times a per-kernel latency (:data:`KERNEL_SECONDS`: small models are bound by
kernel launches, not FLOPs). Only matrix products are counted as FLOPs (elementwise work is
not), and audits assume every restart of every attack runs (no early stop): read the figures
as estimates within a factor of about two. CROWN's bounds are not a model's FLOPs: its row
is the number of bounds times the stage's ``time_limit`` (an upper bound) and is shown apart.

``bench`` measures wall-clock seconds per training step (forward, backward, AdamW; bf16
autocast on CUDA, as ``base.precision: auto`` trains) of every model kind at its params-file
shape with a stated batch, on this machine's device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from attncert import rng

#: public dataset facts: (channels, image size, classes, training images, test images)
DATASETS = {
    "mnist": (1, 28, 10, 60000, 10000),
    "fashion_mnist": (1, 28, 10, 60000, 10000),
    "cifar10": (3, 32, 10, 50000, 10000),
    "cifar100": (3, 32, 100, 50000, 10000),
    "svhn": (3, 32, 10, 73257, 26032),
}
SST2 = {"train": 67349, "dev": 872, "test": 1821}
#: Hugging Face ViTs the certvit stage may load: the project's standard-ViT shape of each
HF_VITS = {
    "google/vit-base-patch16-224": dict(image_size=224, patch=16, dim=768, depth=12, heads=12,
                                        mlp_hidden=3072),
    "WinKawaks/vit-small-patch16-224": dict(image_size=224, patch=16, dim=384, depth=12,
                                            heads=6, mlp_hidden=1536),
    "facebook/deit-tiny-patch16-224": dict(image_size=224, patch=16, dim=192, depth=12,
                                           heads=3, mlp_hidden=768),
}
#: BERT-family encoders the text stage may freeze: (hidden, layers, heads, intermediate)
ENCODERS = {"bert-base-uncased": (768, 12, 12, 3072), "minilm-package": (384, 6, 12, 1536)}
VOCAB = 30522  # the uncased WordPiece vocabulary of both tokenizers


@dataclass(frozen=True)
class GPU:
    """Dense peak FLOP/s per precision (vendor data sheet, without sparsity)."""

    name: str
    bf16: float
    tf32: float
    fp32: float
    fp64: float


GPUS = {
    "h100": GPU("NVIDIA H100 SXM", bf16=989e12, tf32=495e12, fp32=67e12, fp64=67e12),
    "a100": GPU("NVIDIA A100 SXM", bf16=312e12, tf32=156e12, fp32=19.5e12, fp64=19.5e12),
}
#: seconds per GPU kernel (launch and dispatch of eager PyTorch): the floor of a small step
KERNEL_SECONDS = 8e-6
UTILISATION = 0.3


# -- counting ----------------------------------------------------------------------------------


class _KernelCounter(TorchDispatchMode):
    """Counts the aten calls that launch work (views and metadata-only calls excluded)."""

    SKIP = {"detach", "view", "_unsafe_view", "t", "expand", "permute", "transpose",
            "unsqueeze", "squeeze", "slice", "select", "alias", "lift_fresh", "reshape",
            "as_strided", "unbind", "split", "split_with_sizes", "chunk", "narrow", "empty",
            "empty_like", "empty_strided", "_to_copy_noop", "size", "stride"}

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.SKIP and not getattr(func, "is_view", False):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Counts:
    """FLOPs of one call = per_call + per_sample * batch; kernels of one call."""

    per_call: float
    per_sample: float
    kernels: float

    def flops(self, batch: int) -> float:
        return self.per_call + self.per_sample * batch


def count(fn: Callable[[], Any]) -> tuple[float, int]:
    """(matmul FLOPs, kernels) of one call of ``fn`` (on the CPU)."""
    with FlopCounterMode(display=False) as flops, _KernelCounter() as kernels:
        fn()
    return float(flops.get_total_flops()), kernels.kernels


def fit(make: Callable[[int], Callable[[], Any]], per_call_cost: bool = True) -> Counts:
    """:class:`Counts` from calls at batch 1 and 2 (``make(b)`` returns the call); with
    ``per_call_cost=False`` one call at batch 1, every FLOP taken as per sample."""
    f1, k1 = count(make(1))
    if not per_call_cost:
        return Counts(0.0, f1, k1)
    f2, _ = count(make(2))
    return Counts(max(2 * f1 - f2, 0.0), max(f2 - f1, 0.0), k1)


# -- the models at the params' shapes ------------------------------------------------------


def stand_in(dataset: str) -> dict[str, Any]:
    """The processed-data fields a model config reads (shape, classes, statistics)."""
    c, s, k, _, _ = DATASETS[dataset]
    return {"train": {"x": torch.zeros(1, c, s, s, dtype=torch.uint8)}, "classes": list(range(k)),
            "mean": [0.5] * c, "std": [0.25] * c}


def _images(cfg, b: int, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    x = torch.rand(b, cfg.channels, cfg.image_size, cfg.image_size, dtype=dtype)
    return x, torch.zeros(b, dtype=torch.long)


def train_step(model: nn.Module, batch: Callable[[int], tuple], loss_fn=None, msvp=None
               ) -> Callable[[int], Callable[[], None]]:
    """make(b): one training step (forward, loss, backward, AdamW) at batch b."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_fn = loss_fn or (lambda out, y: nn.functional.cross_entropy(out, y))

    def make(b):
        args = batch(b)

        def step():
            model.train()
            loss = loss_fn(model(*args[:-1]), args[-1])
            if msvp is not None:
                loss = loss + msvp()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step
    return make


def forward(model: nn.Module, batch: Callable[[int], tuple]) -> Callable[[int], Callable]:
    def make(b):
        args = batch(b)
        return lambda: model.eval()(*args[:-1])
    return make


def attack_step(model: nn.Module, batch: Callable[[int], tuple]) -> Callable[[int], Callable]:
    """make(b): one PGD step (forward and the gradient with respect to the input)."""
    def make(b):
        args = batch(b)

        def step():
            params = [q for q in model.parameters() if q.requires_grad]
            for q in params:  # the input's gradient only, as an attack takes it
                q.requires_grad_(False)
            try:
                x = args[0].clone().requires_grad_(True)
                model.eval()(x, *args[1:-1]).sum().backward()
            finally:
                for q in params:
                    q.requires_grad_(True)
        return step
    return make


def _vit_counts(cfg, train: bool = True, dtype=torch.float32, msvp_lambda=None):
    from attncert.models import build_vit
    from attncert.msvp import MSVP

    torch.manual_seed(0)
    model = build_vit(cfg).to(dtype)
    batch = functools.partial(_images, cfg, dtype=dtype)
    out = {"forward": fit(forward(model, batch)), "attack": fit(attack_step(model, batch))}
    if train:
        msvp = MSVP(model, *msvp_lambda) if msvp_lambda and any(msvp_lambda) else None
        out["train"] = fit(train_step(model, batch, msvp=msvp))
    return out


def vit_counts(cfg, msvp: tuple[float, ...] | None = None) -> dict[str, Counts]:
    """Train step, forward and attack step of a ViT config (cached per shape: a norm bound
    such as gamma_vo changes no FLOP)."""
    return _vit_counts_cached(dataclasses.replace(cfg, gamma_vo=1.0), msvp)


@functools.cache
def _vit_counts_cached(cfg, msvp):
    return _vit_counts(cfg, msvp_lambda=msvp)


def vit_forward64(cfg) -> Counts:
    """A float64 forward pass (the certificates' precision) of a ViT config (cached)."""
    return _forward64_cached(dataclasses.replace(cfg, gamma_vo=1.0))


@functools.cache
def _forward64_cached(cfg) -> Counts:
    return _vit_counts(cfg, train=False, dtype=torch.float64)["forward"]


@functools.cache
def layer_certificate_counts(n: int, d: int, h: int, variant: str) -> Counts:
    """The eps-independent certificate terms of one residual attention layer (float64)."""
    from attncert import bounds
    from attncert.bounds.bench import bench_layer

    def make(b):
        w, x = bench_layer(n, d, h, b, torch.float64)
        if variant in ("lofast_M", "lofast_xi"):
            return lambda: bounds.lofast_terms(x, w, True, variant.split("_")[1])
        return lambda: bounds.naive_terms(x, w, True)
    return fit(make, per_call_cost=False)  # per sample: batched Lanczos runs per sample


@functools.cache
def layer_pgd_counts(n: int, d: int, h: int) -> tuple[Counts, Counts]:
    """The tightness study's PGD ascent on one layer (float64), per input: (its set-up, the
    Jacobian start direction by Lanczos; one step), from runs of 2 and 4 steps (restarts run
    batched: they multiply FLOPs, not kernels)."""
    from attncert.bounds import pgd_sensitivity
    from attncert.bounds.bench import bench_layer

    w, x = bench_layer(n, d, h, 1, torch.float64)
    runs = {k: count(lambda k=k: pgd_sensitivity(
        x, w, 0.05, True, steps=k, restarts=1, generator=rng.generator(0)))
        for k in (2, 4)}
    step_f, step_k = ((runs[4][i] - runs[2][i]) / 2 for i in (0, 1))
    setup = Counts(0.0, max(runs[2][0] - 2 * step_f, 0.0), max(runs[2][1] - 2 * step_k, 0))
    return setup, Counts(0.0, max(step_f, 0.0), max(step_k, 0))


# -- work items ---------------------------------------------------------------------------------


@dataclass
class Work:
    stage: str
    what: str
    kind: str  # bf16 | tf32 | fp32 | fp64 (the precision it runs at)
    flops: float
    kernels: float

    def seconds(self, gpu: GPU, utilisation: float) -> float:
        return max(self.flops / (getattr(gpu, self.kind) * utilisation),
                   self.kernels * KERNEL_SECONDS)


def _steps(n: int, batch: int) -> int:
    return math.ceil(n / batch)


def training_work(stage: str, what: str, c: Mapping[str, Counts], n_train: int, n_eval: int,
                  epochs: int, batch: int, eval_batch: int, attack_steps: int = 0) -> list[Work]:
    """``epochs`` of training (+ PGD adversarial examples of ``attack_steps`` per step) and a
    forward pass over ``n_eval`` evaluation images after every epoch."""
    steps = epochs * _steps(n_train, batch)
    flops = steps * (c["train"].flops(batch) + attack_steps * c["attack"].flops(batch))
    kernels = steps * (c["train"].kernels + attack_steps * c["attack"].kernels)
    ev = epochs * _steps(n_eval, eval_batch)
    return [Work(stage, what, "bf16", flops, kernels),
            Work(stage, f"{what}: evaluation", "fp32",
                 ev * c["forward"].flops(eval_batch), ev * c["forward"].kernels)]


def audit_work(stage: str, what: str, c: Counts, n: int, eps: int, steps: int, restarts: int,
               batch: int) -> Work:
    """L2 PGD on every point at every eps (no early stop: an upper bound), float32 + TF32."""
    calls = eps * steps * restarts * _steps(n, batch)
    return Work(stage, what, "tf32", calls * c.flops(batch), calls * c.kernels)


def _n(max_n: int, full: int) -> int:
    return min(max_n, full) if max_n else full


def _grid_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    from attncert import runs

    g, s, cv = p["vit_grid"], p["train_vit"].__dict__, p["certify_vit"]
    out = []
    for ds in g.dataset:
        _, _, _, n_tr, n_te = DATASETS[ds]
        n_tr, n_te = _n(n_train_max, n_tr), _n(n_test_max, n_te)
        for depth in g.depth:
            for heads in g.heads:
                for vo in g.gamma_vo:
                    name = runs.run_name(ds, depth, heads, vo)
                    cfg = runs.vit_config(stand_in(ds), s, depth, heads, vo)
                    c = vit_counts(cfg, tuple(s["msvp_lambda"]))
                    adv = s["adv_steps"] if s["adversarial"] != "none" else 0
                    out += training_work("train_vit", name, c, n_tr, n_te, s["epochs"],
                                         s["batch_size"], s["eval_batch_size"], adv)
                    out += _certify_work("certify_vit", name, cfg, min(cv.n_test, n_te),
                                         cv.variants, len(cv.tests), cv.cert_batch_size)
                    out.append(audit_work("certify_vit", f"{name}: PGD audit", c["attack"],
                                          min(cv.n_test, n_te), len(cv.cert_eps),
                                          cv.attack_steps, cv.attack_restarts,
                                          cv.cert_batch_size))
    return out


def _certify_work(stage: str, name: str, cfg, n: int, variants, tests: int, batch: int
                  ) -> list[Work]:
    """Certificates in float64: per batch one forward and each variant's per-layer terms."""
    f64 = vit_forward64(cfg)
    tokens = (cfg.image_size // cfg.patch) ** 2 + (cfg.pool == "cls")
    batches = _steps(n, batch)
    flops = kernels = 0.0
    for v in variants:
        flops += batches * f64.flops(batch)
        kernels += batches * f64.kernels
        if v in ("lofast_M", "lofast_xi", "naive"):
            lc = layer_certificate_counts(tokens, cfg.dim, cfg.heads, v)
            flops += cfg.depth * batches * lc.flops(batch)
            kernels += cfg.depth * batches * lc.kernels
    return [Work(stage, f"{name}: certificates ({len(variants)} variants, {tests} tests)",
                 "fp64", flops, kernels)]


def _tightness_work(p) -> list[Work]:
    t = p["tightness"]
    setup, step = layer_pgd_counts(t.n_tokens, t.dim, t.heads)
    lc = layer_certificate_counts(t.n_tokens, t.dim, t.heads, "lofast_M")
    # (calls, inputs per call): Table 3, Figure 1 (two pieces), Figure 3 (W^Q, W^K, W^V, W^O
    # per size and draw, then X per size), Figure 4 (one call per scale)
    s = t.samples
    calls = [(1, s * len(t.cert_eps)), (2, s * len(t.cert_eps)),
             (4 * len(t.fig3_sizes) * t.fig3_samples, s),
             (len(t.fig3_sizes), s * t.fig3_samples), (len(t.fig4_scales), s)]
    flops = sum(m * (setup.flops(b) + t.attack_steps * step.flops(t.attack_restarts * b)
                     + lc.flops(b)) for m, b in calls)
    kernels = sum(m * (setup.kernels + t.attack_steps * step.kernels + lc.kernels)
                  for m, _ in calls)
    return [Work("tightness", f"one layer ({t.n_tokens} tokens, {t.dim}-d, {t.heads} heads): "
                 f"PGD-{t.attack_steps} x {t.attack_restarts} and LoFAST", "fp64", flops, kernels)]


def _specformer_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    from attncert import specformer as sf

    s = p["specformer"]
    out = []
    for ds, src in ((ds, src) for ds in s.datasets for src in s.sources):
        channels, _, k, n_tr, n_te = DATASETS[ds]
        n_tr, n_te = _n(s.max_train, _n(n_train_max, n_tr)), _n(n_test_max, n_te)
        if src == sf.SCRATCH:
            base = sf.base_model_config(stand_in(ds), s.patch, s.dim, s.depth, s.heads,
                                        s.mlp_hidden, s.block)
            recipe = (s.epochs, s.adv_epochs, s.batch_size)
        elif src in HF_VITS:  # fine-tuned at its own input size (the upsampling is free)
            from attncert.models import ViTConfig

            base = ViTConfig(channels=channels, num_classes=k, kind="standard",
                             block="prenorm", pool="cls", attn_bias=True, **HF_VITS[src])
            recipe = (s.finetune_epochs, s.finetune_adv_epochs, s.finetune_batch_size)
        else:
            raise ValueError(f"specformer.sources: the shape of {src!r} is unknown here; add it "
                             "to attncert.cost.HF_VITS")
        run = sf.run_label(ds, src)
        n_eval = min(s.n_eval, n_te)
        for training, methods, epochs in (("standard", s.methods, recipe[0]),
                                          ("adversarial", s.adv_methods, recipe[1])):
            for m in methods:
                cfg = sf.method_model_config(m, base, s.lipsformer_alpha)
                c = vit_counts(cfg, tuple(s.msvp_lambda) if m == "specformer" else None)
                adv = s.adv_steps if training == "adversarial" else 0
                out += training_work("specformer", f"{run} {training} {m}", c, n_tr, n_te,
                                     epochs, recipe[2], s.eval_batch_size, adv)
                # FGSM (1), PGD-2, CW-n, PGD-n and L2 PGD-n per radius
                steps = 1 + 2 + 2 * s.attack_steps + s.attack_steps * len(s.attack_eps)
                out.append(audit_work("specformer", f"{run} {training} {m}: attacks",
                                      c["attack"], n_eval, 1, steps, 1, s.eval_batch_size))
    # the certified pair: two Lipschitz ViTs (with and without MSVP), certified by two bounds
    ds = s.datasets[0]
    _, _, _, n_tr, n_te = DATASETS[ds]
    n_tr, n_te = _n(s.max_train, _n(n_train_max, n_tr)), _n(n_test_max, n_te)
    cfg = sf.data_config(stand_in(ds), normalize="mean", patch=s.cert_patch, dim=s.cert_dim,
                         depth=s.cert_depth, heads=s.cert_heads, mlp_hidden=2 * s.cert_dim,
                         kind="lipschitz", block="stream", pool="mean",
                         radius_attn=s.cert_radius_attn, gamma_qk=s.cert_gamma_qk,
                         gamma_vo=s.cert_gamma_vo)
    for label, lam in (("without MSVP", None), ("with MSVP", tuple(s.cert_msvp_lambda))):
        c = vit_counts(cfg, lam)
        out += training_work("specformer", f"certified pair, {label}", c, n_tr, n_te,
                             s.cert_epochs, s.batch_size, s.eval_batch_size)
        out += _certify_work("specformer", f"certified pair, {label}", cfg,
                             min(s.cert_n_test, n_te), ["lofast_M", "specformer"], 1, 100)
    return out


def _crown_work(p, n_train_max: int, n_test_max: int) -> tuple[list[Work], float]:
    from attncert.crown import study

    c_p = p["crown"]
    pd_ = c_p.__dict__
    _, _, _, n_tr, n_te = DATASETS[c_p.dataset]
    n_tr, n_te = _n(c_p.max_train, _n(n_train_max, n_tr)), _n(n_test_max, n_te)
    n = min(c_p.n_test, n_te)
    out = []
    for depth in c_p.depths:
        cfg = study.vit_config(stand_in(c_p.dataset), pd_, depth)
        c = vit_counts(cfg)
        out += training_work("crown", f"L{depth}", c, n_tr, n_te, c_p.epochs, c_p.batch_size,
                             500)
        out += _certify_work("crown", f"L{depth} LoFAST", cfg, n, [c_p.lofast_variant], 1, 100)
        out.append(audit_work("crown", f"L{depth}: PGD audit", c["attack"], n,
                              len(c_p.cert_eps), c_p.attack_steps, c_p.attack_restarts, 100))
    bounds = len(c_p.depths) * n * len(c_p.cert_eps) * len(c_p.methods)
    return out, bounds * c_p.time_limit


_TEXT_COUNTS: dict[tuple, dict[str, Counts]] = {}


def _text_work(p) -> list[Work]:
    from attncert.text.models import (
        LipschitzTextTransformer,
        OLSAClassifier,
        TextTransformerConfig,
    )
    from attncert.text.stage import StandardTextTransformer

    t = p["text"]
    n_tr = _n(t.max_train, SST2["train"])
    n_ev = _n(t.max_eval, SST2["dev"]) + _n(t.max_eval, SST2["test"])
    n_cert = min(t.n_test, _n(t.max_eval, SST2["test"]))

    def batch(b):
        return (torch.randint(1, VOCAB, (b, t.max_len)),
                torch.ones(b, t.max_len, dtype=torch.bool), torch.zeros(b, dtype=torch.long))

    def emb_batch(model):
        def make(b):
            ids, mask, y = batch(b)
            with torch.no_grad():
                return model.embed(ids, mask), mask, y
        return make

    def counts(model):
        key = (repr(model), t.max_len)
        if key not in _TEXT_COUNTS:
            _TEXT_COUNTS[key] = {"train": fit(train_step(model, batch)),
                                 "forward": fit(forward(model, batch)),
                                 "attack": fit(attack_step(model, emb_batch(model)))}
        return _TEXT_COUNTS[key]

    deep = max(t.olsa_depths)
    olsa = dict(vocab_size=VOCAB, max_len=t.max_len, dim=t.hidden, heads=t.heads)
    jobs = {f"olsa-L{d}-g{t.gamma:g}": (OLSAClassifier, dict(olsa, depth=d), t.epochs)
            for d in t.olsa_depths}
    jobs |= {f"olsa-L{deep}-g{g:g}": (OLSAClassifier, dict(olsa, depth=deep), t.epochs)
             for g in t.gamma_ablation}
    jobs[f"kim-l2-L{deep}"] = (OLSAClassifier, dict(olsa, depth=deep, attention="l2"), t.epochs)
    jobs[f"vanilla-L{deep}"] = (StandardTextTransformer,
                                dict(vocab_size=VOCAB, max_len=t.max_len, dim=t.hidden,
                                     depth=deep, heads=t.heads, mlp_hidden=2 * t.hidden),
                                t.epochs)
    out = []
    for name, (cls, kw, epochs) in jobs.items():
        torch.manual_seed(0)
        c = counts(cls(**kw))
        out += training_work("text", name, c, n_tr, n_ev, epochs, t.batch_size,
                             t.cert_batch_size)
        out.append(audit_work("text", f"{name}: PGD audit", c["attack"], n_cert, len(t.cert_eps),
                              t.attack_steps, t.attack_restarts, t.cert_batch_size))
    for L in t.lofast_layers:
        for H in t.lofast_heads:
            for vo in t.lofast_gamma_vo:
                name = f"lofast-L{L}-H{H}-vo{vo:g}"
                cfg = TextTransformerConfig(vocab_size=VOCAB, max_len=t.max_len, dim=t.lofast_dim,
                                            depth=L, heads=H, mlp_hidden=t.lofast_mlp_hidden,
                                            radius_attn=t.lofast_radius_attn,
                                            gamma_qk=t.lofast_gamma_qk, gamma_vo=vo)
                torch.manual_seed(0)
                c = counts(LipschitzTextTransformer(cfg))
                out += training_work("text", name, c, n_tr, n_ev, t.lofast_epochs,
                                     t.batch_size, t.cert_batch_size)
                lc = layer_certificate_counts(t.max_len, t.lofast_dim, H, "lofast_M")
                b = _steps(n_cert, t.cert_batch_size)
                out.append(Work("text", f"{name}: certificates", "fp64",
                                len(t.lofast_variants) * L * b * lc.flops(t.cert_batch_size),
                                len(t.lofast_variants) * L * b * lc.kernels))
                out.append(audit_work("text", f"{name}: PGD audit", c["attack"], n_cert,
                                      len(t.cert_eps), t.attack_steps, t.attack_restarts,
                                      t.cert_batch_size))
    # OLSA over a frozen encoder: the encoder's forward on every step and evaluation sentence
    hidden, layers, heads, inter = ENCODERS[t.frozen_source]
    enc = _encoder_forward(hidden, layers, heads, inter, t.max_len)
    n_fr = _n(t.frozen_max_train, SST2["train"])  # drawn from the whole split
    steps = t.frozen_epochs * _steps(n_fr, t.batch_size)
    ev = t.frozen_epochs * _steps(n_ev, t.cert_batch_size)
    out.append(Work("text", f"frozen-olsa ({t.frozen_source} encoder forward)", "bf16",
                    steps * enc.flops(t.batch_size), steps * enc.kernels))
    out.append(Work("text", "frozen-olsa: evaluation and audit forwards", "fp32",
                    (ev + len(t.cert_eps) * t.attack_steps * t.attack_restarts
                     * _steps(n_cert, t.cert_batch_size)) * 3 * enc.flops(t.cert_batch_size),
                    ev * enc.kernels))
    return out


@functools.cache
def _encoder_forward(hidden: int, layers: int, heads: int, inter: int, max_len: int) -> Counts:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=heads, intermediate_size=inter)).eval()

    def make(b):
        ids = torch.randint(1, VOCAB, (b, max_len))
        return lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        return fit(make)


def _certvit_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    from attncert.certvit import stage

    cv = p["certvit"]
    _, size, _, n_tr, n_te = DATASETS[cv.dataset]
    n_tr, n_te = _n(n_train_max, n_tr), _n(n_test_max, n_te)
    if cv.source == stage.PIPELINE:
        arch = dict(patch=cv.patch, dim=cv.dim, depth=cv.depth, heads=cv.heads,
                    mlp_hidden=cv.mlp_hidden)
        cfg = stage.pretrain_config(stand_in(cv.dataset), **arch)
    elif cv.source in HF_VITS:
        from attncert.models import ViTConfig

        _, _, k, _, _ = DATASETS[cv.dataset]
        c = DATASETS[cv.dataset][0]
        cfg = ViTConfig(channels=c, num_classes=k, kind="standard", block="prenorm",
                        pool="cls", attn_bias=True, **HF_VITS[cv.source])
    else:
        raise ValueError(f"certvit.source {cv.source!r}: its shape is unknown here; add it to "
                         "attncert.cost.HF_VITS")
    c = vit_counts(cfg)
    out = []
    for phase, epochs in (("pre-train / fine-tune", cv.pretrain_epochs),
                          ("adaptation fine-tune", cv.adapt_epochs),
                          ("final fine-tune", cv.finetune_epochs)):
        out += training_work("certvit", phase, c, n_tr, n_te, epochs, cv.batch_size,
                             cv.eval_batch_size)
    # Douglas-Rachford: per linear map, dr_iterations x dr_projection_steps passes over its
    # recorded pairs (a matrix product each), plus recording the pairs (forwards)
    maps = cfg.depth * 6 + 2
    per_pass = 2 * 2 * cv.dr_max_pairs * cfg.dim * max(cfg.mlp_hidden, cfg.dim)
    passes = cv.dr_iterations * cv.dr_projection_steps * math.ceil(cv.dr_max_pairs
                                                                   / cv.dr_batch_size)
    out.append(Work("certvit", "Douglas-Rachford (from its matrix sizes)", "fp32",
                    maps * passes * per_pass,
                    maps * passes * 20))
    n = min(cv.n_test, n_te)
    f64 = vit_forward64(cfg)
    out.append(Work("certvit", "global certificate (float64 forwards)", "fp64",
                    _steps(n, cv.eval_batch_size) * f64.flops(cv.eval_batch_size),
                    _steps(n, cv.eval_batch_size) * f64.kernels))
    out.append(audit_work("certvit", "PGD audit", c["attack"], n, len(cv.cert_eps),
                          cv.attack_steps, cv.attack_restarts, cv.eval_batch_size))
    return out


STAGES = ("data", "tightness", "train_vit", "certify_vit", "specformer", "text", "certvit",
          "crown", "figures")


def stage_work(params, stages=STAGES) -> tuple[list[Work], float]:
    """The work items of ``stages`` at ``params`` (a :class:`attncert.params.Params`), and
    CROWN's upper bound in seconds (bounds x time limit; 0 without the crown stage)."""
    d = params["data"]
    work, crown_seconds = [], 0.0
    if "data" in stages:
        work.append(Work("data", "downloads and conversion on the CPU", "fp32", 0.0, 0.0))
    if "tightness" in stages:
        work += _tightness_work(params)
    if {"train_vit", "certify_vit"} & set(stages):
        work += _grid_work(params, d.max_train, d.max_test)
    if "specformer" in stages:
        work += _specformer_work(params, d.max_train, d.max_test)
    if "text" in stages:
        work += _text_work(params)
    if "certvit" in stages:
        work += _certvit_work(params, d.max_train, d.max_test)
    if "crown" in stages:
        crown, crown_seconds = _crown_work(params, d.max_train, d.max_test)
        work += crown
    if "figures" in stages:
        work.append(Work("figures", "tables and figures from saved metrics (CPU)", "fp32",
                         0.0, 0.0))
    return [w for w in work if w.stage in stages], crown_seconds


def cost_table(params, gpu: GPU, utilisation: float = UTILISATION) -> str:
    """The README table: GPU-hours per stage and the total, with the method in one line."""
    work, crown_seconds = stage_work(params)
    hours = {s: 0.0 for s in STAGES}
    pflop = {s: 0.0 for s in STAGES}
    bound_by = {s: set() for s in STAGES}
    for w in work:
        sec = w.seconds(gpu, utilisation)
        hours[w.stage] += sec / 3600
        pflop[w.stage] += w.flops / 1e15
        if w.flops:
            flop_s = w.flops / (getattr(gpu, w.kind) * utilisation)
            bound_by[w.stage].add("kernels" if w.kernels * KERNEL_SECONDS > flop_s else "FLOPs")
    g = params["vit_grid"]
    points = len(g.dataset) * len(g.depth) * len(g.heads) * len(g.gamma_vo)
    notes = {s: f"{points} grid points, {hours[s] / points:.2g} h each"
             for s in ("train_vit", "certify_vit")}
    notes |= {"data": "CPU (downloads)", "figures": "CPU"}
    lines = ["| stage | PFLOP (counted) | GPU-hours | bound by | note |", "|---|---|---|---|---|"]
    for s in STAGES:
        lines.append(f"| {s} | {pflop[s]:.3g} | {hours[s]:.3g} | "
                     f"{', '.join(sorted(bound_by[s])) or '-'} | {notes.get(s, '')} |")
    total = sum(hours.values())
    lines.append(f"| **total** | {sum(pflop.values()):.3g} | **{total:.3g}** | | |")
    c = params["crown"]
    lines.append(f"| crown: CROWN / alpha-CROWN bounds | - | at most {crown_seconds / 3600:.3g} "
                 f"| time limit | {len(c.depths)} depths x {c.n_test} points x "
                 f"{len(c.cert_eps)} eps x {len(c.methods)} methods x {c.time_limit:g} s; "
                 "points LoFAST certifies skip CROWN |")
    head = (f"Scale `{params['base'].scale}`; one {gpu.name} at {utilisation:.0%} of its dense "
            f"peak per precision (bf16 {gpu.bf16 / 1e12:.0f}, TF32 {gpu.tf32 / 1e12:.0f}, "
            f"FP32 {gpu.fp32 / 1e12:.0f}, FP64 {gpu.fp64 / 1e12:.0f} TFLOP/s) and "
            f"{KERNEL_SECONDS * 1e6:.0f} us per kernel; generated by `python -m attncert.cost "
            f"readme`.")
    return head + "\n\n" + "\n".join(lines)


# -- training step times (make bench) ----------------------------------------------------------


def bench_models(params) -> dict[str, tuple[nn.Module, Callable[[int], tuple], str]]:
    """Every trained model kind at its params-file shape: name -> (model, batch(b), shape)."""
    from attncert import runs
    from attncert import specformer as sf
    from attncert.models import build_vit
    from attncert.text.models import (
        LipschitzTextTransformer,
        OLSAClassifier,
        TextTransformerConfig,
    )
    from attncert.text.stage import StandardTextTransformer

    g, s, sfp, t = params["vit_grid"], params["train_vit"], params["specformer"], params["text"]
    ds, depth, heads = g.dataset[0], max(g.depth), max(g.heads)
    lip = runs.vit_config(stand_in(ds), s.__dict__, depth, heads, g.gamma_vo[0])
    base = sf.base_model_config(stand_in(sfp.datasets[0]), sfp.patch, sfp.dim, sfp.depth,
                                sfp.heads, sfp.mlp_hidden, sfp.block)

    def images(cfg):
        return functools.partial(_images, cfg)

    def tokens(b):
        return (torch.randint(1, VOCAB, (b, t.max_len)),
                torch.ones(b, t.max_len, dtype=torch.bool), torch.zeros(b, dtype=torch.long))

    torch.manual_seed(0)
    deep = max(t.olsa_depths)
    lcfg = TextTransformerConfig(vocab_size=VOCAB, max_len=t.max_len, dim=t.lofast_dim,
                                 depth=max(t.lofast_layers), heads=max(t.lofast_heads),
                                 mlp_hidden=t.lofast_mlp_hidden, radius_attn=t.lofast_radius_attn,
                                 gamma_qk=t.lofast_gamma_qk, gamma_vo=t.lofast_gamma_vo[0])
    return {
        "lipschitz ViT (train_vit)": (build_vit(lip), images(lip),
                                      f"{ds} {lip.image_size}px patch {lip.patch}, "
                                      f"{lip.dim}-d, depth {depth}, {heads} heads"),
        "standard ViT (specformer vanilla)": (build_vit(base), images(base),
                                              f"{base.dim}-d, depth {base.depth}, patch "
                                              f"{base.patch}"),
        "SpecFormer (MSVP)": (build_vit(base), images(base), "as vanilla + MSVP"),
        "OLSA text": (OLSAClassifier(vocab_size=VOCAB, max_len=t.max_len, dim=t.hidden,
                                     depth=deep, heads=t.heads), tokens,
                      f"{t.max_len} tokens, {t.hidden}-d, depth {deep}"),
        "LoFAST text": (LipschitzTextTransformer(lcfg), tokens,
                        f"{t.max_len} tokens, {lcfg.dim}-d, depth {lcfg.depth}"),
        "standard text": (StandardTextTransformer(VOCAB, t.max_len, t.hidden, deep, t.heads,
                                                  2 * t.hidden), tokens,
                          f"{t.max_len} tokens, {t.hidden}-d, depth {deep}"),
    }


def bench_training(params, batch: int, steps: int = 5, device: str = "auto",
                   precision: str = "auto") -> list[dict[str, Any]]:
    """Seconds per training step (median of ``steps`` after one warm-up) per model kind."""
    from attncert.msvp import MSVP
    from attncert.precision import autocast, resolve_precision, training_matmuls
    from attncert.train import resolve_device

    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    rows = []
    for name, (model, make_batch, shape) in bench_models(params).items():
        model.to(dev).train()
        args = [a.to(dev) for a in make_batch(batch)]
        msvp = (MSVP(model, *params["specformer"].msvp_lambda) if "MSVP" in name else None)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(model=model, args=args, msvp=msvp, opt=opt):
            with autocast(prec, dev):
                loss = nn.functional.cross_entropy(model(*args[:-1]), args[-1])
                if msvp is not None:
                    loss = loss + msvp()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        times = []
        with training_matmuls(prec, dev):
            for i in range(steps + 1):
                _sync(dev)
                t0 = time.perf_counter()
                step()
                _sync(dev)
                if i:
                    times.append(time.perf_counter() - t0)
        times.sort()
        rows.append({"model": name, "shape": shape, "batch": batch, "device": str(dev),
                     "precision": prec, "ms_per_step": 1e3 * times[len(times) // 2],
                     "parameters": sum(p.numel() for p in model.parameters())})
        model.cpu()
    return rows


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- command line -----------------------------------------------------------------------------

MARKERS = ("<!-- cost:start -->", "<!-- cost:end -->")


def write_readme(table: str, readme: str | Path = "README.md") -> None:
    path = Path(readme)
    text = path.read_text()
    start, end = MARKERS
    if start not in text or end not in text:
        raise ValueError(f"{path}: the markers {start} / {end} are missing")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    path.write_text(pattern.sub(lambda _: f"{start}\n{table}\n{end}", text, count=1))


def main(argv: list[str] | None = None) -> int:
    from attncert.params import load_params

    ap = argparse.ArgumentParser(prog="python -m attncert.cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["table", "readme", "bench"])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--utilisation", type=float, default=UTILISATION)
    ap.add_argument("--batch", type=int, default=32, help="bench: batch size")
    ap.add_argument("--steps", type=int, default=5, help="bench: timed steps per model")
    ap.add_argument("--device", default="auto", help="bench: auto | cpu | cuda ...")
    args = ap.parse_args(argv)
    if not 0 < args.utilisation <= 1:
        ap.error("--utilisation must be in (0, 1]")
    params = load_params(args.params)
    if args.command == "bench":
        rows = bench_training(params, args.batch, args.steps, args.device)
        print(f"training step (forward, backward, AdamW), batch {args.batch}, "
              f"device {rows[0]['device']}, precision {rows[0]['precision']}, "
              f"threads {torch.get_num_threads()}")
        print(f"{'model':>34} {'ms/step':>9} {'params':>11}  shape")
        for r in rows:
            print(f"{r['model']:>34} {r['ms_per_step']:9.1f} {r['parameters']:11,}  {r['shape']}")
        return 0
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    table = cost_table(params, GPUS[args.gpu], args.utilisation)
    if args.command == "readme":
        write_readme(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
