"""Cost of the study at the scale of a params file: GPU-hours per stage, and training step times.

    python -m attncert.cost table [--params params.yaml] [--gpu h100] [--utilisation 0.3]
    python -m attncert.cost readme     # rewrite docs/cost.md's table and plan (their markers)
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
as estimates within a factor of about two. CROWN's bounds are not a model's FLOPs: they are
counted at their worst, every bound at ``crown.time_limit`` capped by each unit's
``crown.time_budget`` (an upper bound), in the crown row and the total, and shown apart too.

``bench`` measures wall-clock seconds per training step (forward, backward, AdamW; bf16
autocast on CUDA, as ``base.precision: auto`` trains) of every model kind at its params-file
shape with a stated batch, on this machine's device.
"""

from attncert.cost.bench import bench_training
from attncert.cost.cli import COST_DOC, MARKERS, PLAN_MARKERS, main, write_block
from attncert.cost.counting import (
    DATASETS,
    GPU,
    GPUS,
    KERNEL_SECONDS,
    SST2,
    TEXT_SIZES,
    UTILISATION,
    Counts,
    attack_step,
    count,
    fit,
    forward,
    train_step,
    vit_counts,
    vit_forward64,
)
from attncert.cost.kinds import bench_models
from attncert.cost.layer_counts import layer_certificate_counts, layer_pgd_counts
from attncert.cost.table import STAGES, cost_table, stage_work
from attncert.cost.work import Work, audit_work, training_work
from attncert.models.config import HF_VITS
from attncert.pipeline.datasets import stand_in
from attncert.text.tokenize import ENCODERS, VOCAB

__all__ = [
    "COST_DOC", "DATASETS", "ENCODERS", "GPU", "GPUS", "HF_VITS", "KERNEL_SECONDS", "MARKERS",
    "PLAN_MARKERS", "SST2", "TEXT_SIZES", "STAGES", "UTILISATION", "VOCAB", "Counts", "Work",
    "attack_step", "audit_work", "bench_models", "bench_training", "cost_table", "count", "fit",
    "forward", "layer_certificate_counts", "layer_pgd_counts", "main", "stage_work", "stand_in",
    "train_step", "training_work", "vit_counts", "vit_forward64", "write_block",
]
