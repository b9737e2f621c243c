"""The layer the tightness study measures: a seeded random residual attention layer with
prescribed spectral norms, or a trained Lipschitz ViT's layer on its clean inputs, with every
token projected onto the input ball."""

from __future__ import annotations

import torch
from torch import Tensor

from attncert.bounds import AttentionWeights
from attncert.pipeline import rng


def layer_project(x: Tensor, radius: float = 1.0) -> Tensor:
    """LayerProject (LoFAST eq. 29), per token: x_i <- x_i if ||x_i|| <= R else R x_i / ||x_i||."""
    norm = x.norm(dim=-1, keepdim=True)
    return x * (radius / norm.clamp_min(radius))


def random_attention_layer(
    n: int,
    d: int,
    h: int,
    seed: int,
    weight_scale: float | tuple[float, float] = (0.5, 0.5),
    samples: int = 16,
    token_norm: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[AttentionWeights, Tensor]:
    """Seeded random attention layer and projected inputs.

    weight_scale: spectral norm of every per-head W^Q_l, W^K_l and of W^V_l, W^O_l, given as
    (gamma_qk, gamma_vo) or one float for both (the Lipschitz-ViT recipe constrains
    ||W|| <= gamma). Returns (weights, x) with x (samples, n, d): Gaussian tokens of typical
    norm 2 token_norm, then LayerProject with R = token_norm (so ||x_i|| <= token_norm).
    """
    g_qk, g_vo = (
        (weight_scale, weight_scale) if isinstance(weight_scale, float | int) else weight_scale
    )
    gen = rng.generator(seed, "cpu")  # built on the host; callers move w and x
    d_h = d // h

    def mat(gamma: float, *shape: int) -> Tensor:
        m = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (m * (gamma / torch.linalg.matrix_norm(m, 2))[:, None, None]).to(dtype)

    w = AttentionWeights(
        mat(g_qk, h, d, d_h), mat(g_qk, h, d, d_h), mat(g_vo, h, d, d_h), mat(g_vo, h, d_h, d)
    )
    x = torch.randn(samples, n, d, generator=gen, dtype=torch.float64) * (2 * token_norm / d**0.5)
    return w, layer_project(x, token_norm).to(dtype)


def study_layer(checkpoint: str, inputs: str, n: int, d: int, h: int, samples: int,
                gamma_qk: float, gamma_vo: float, seed: int, layer: int = 0,
                input_radius: float = 1.0) -> tuple[AttentionWeights, Tensor, str]:
    """The layer the study measures and its projected inputs, with a label for the report.

    ``checkpoint`` '' gives :func:`random_attention_layer`; otherwise a Lipschitz ViT saved by
    :func:`attncert.models.vit.save_vit`, whose attention layer ``layer`` is taken with its
    clean inputs on the first ``samples`` test images of the processed dataset ``inputs``.
    Either way every token is projected to ||x_i|| <= ``input_radius`` (LoFAST's Table 3
    setting is 1; a trained layer sees its LayerProject radius, reported in the label).
    """
    if not checkpoint:
        w, x = random_attention_layer(n, d, h, seed, (gamma_qk, gamma_vo), samples,
                                      token_norm=input_radius)
        return w, x, (f"seeded random residual layer (seed {seed}): ||W^Q_l||, ||W^K_l|| = "
                      f"{gamma_qk}, ||W^V_l||, ||W^O_l|| = {gamma_vo}, inputs projected to "
                      f"||x_i|| <= {input_radius:g} (no trained checkpoint given)")
    from pathlib import Path

    from attncert.data import as_float, load_processed
    from attncert.models.vit import load_vit

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"tightness.checkpoint: {checkpoint} not found")
    model = load_vit(checkpoint).double()
    obj = load_processed(Path(inputs).stem, Path(inputs).parent)
    images = as_float(obj["test"]["x"][:samples]).double()
    name = f"blocks.{layer}.attn"
    if name not in model.attention_modules():
        raise ValueError(f"{checkpoint}: no attention layer {name!r}")
    _, acts = model.attention_inputs(images)
    w = model.attention_modules()[name].attention_weights()
    x = acts[name]
    trained = float(x.norm(dim=-1).max())
    return w, layer_project(x, input_radius), (
        f"trained layer {name} of {checkpoint} on the clean inputs of {len(images)} test images "
        f"of {inputs} (token norms up to {trained:.3g} in the model), projected to ||x_i|| <= "
        f"{input_radius:g}")
