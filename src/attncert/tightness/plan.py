"""The tightness study's plan: one attention layer in float64, its local Lipschitz constant
bounded below by a PGD ascent and above by LoFAST for every figure and table the stage draws
(the stage runs whole, on one device)."""

from __future__ import annotations

from attncert.pipeline.jobs import Job, LayerStudy, Model
from attncert.pipeline.params import StudyParams


def jobs(p: StudyParams) -> list[Job]:
    """One job: per (calls, inputs per call) Table 3, Figure 1 (two pieces), Figure 3 (W^Q,
    W^K, W^V, W^O per size and draw, then X per size) and Figure 4 (one call per scale)."""
    t = p["tightness"]
    s = t.samples
    calls = ((1, s * len(t.cert_eps)), (2, s * len(t.cert_eps)),
             (4 * len(t.fig3_sizes) * t.fig3_samples, s),
             (len(t.fig3_sizes), s * t.fig3_samples), (len(t.fig4_scales), s))
    what = (f"one layer ({t.n_tokens} tokens, {t.dim}-d, {t.heads} heads): "
            f"PGD-{t.attack_steps} x {t.attack_restarts} and LoFAST")
    return [Job("tightness", "", what, Model("none"), (
        LayerStudy(what, t.n_tokens, t.dim, t.heads, calls, t.attack_steps,
                   t.attack_restarts),))]
