"""Comparison figures of the whole study, drawn from saved metrics only (stage ``figures``).

Every ``*_frame`` function turns metrics files (as the stages write them) into a tidy
DataFrame, every ``plot_*`` function draws one. Where a paper gives the number, its rows carry
``source`` = "paper: <table>" and are drawn beside ours, labelled.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure

from attncert.figures import sns
from attncert.figures.grid import plot_certified_grid, plot_tradeoff, tradeoff_frame
from attncert.figures.headline import OURS, headline_frame, plot_headline
from attncert.report import paper

__all__ = ["tightness_frame", "plot_tightness", "ablation_frames", "plot_ablations",
           "certified_frame", "certified_csv_frame",
           "plot_certified_grid", "tradeoff_frame", "plot_tradeoff", "cost_frame", "plot_cost",
           "specformer_frame", "plot_specformer", "text_certified_frame",
           "plot_text_certified", "crown_frame", "plot_crown", "headline_frame", "plot_headline"]

#: the variant the grid's figures draw: LoFAST's eq. 27 form at the last layer with our pairwise
#: test (LoFAST certifies with Proposition 1's sqrt(2) logit test; the pairwise one is ours)
PAPER_VARIANT = "lofast_M"


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


# -- LoFAST Table 3 ---------------------------------------------------------------------------
def tightness_frame(m: Mapping) -> pd.DataFrame:
    """(method, eps, ratio, source): every bound / PGD from the tightness metrics, and LoFAST
    Table 3's LoFAST (the xi form) and SpecFormer ratios."""
    from attncert.tightness import PAPER_TABLE3 as t3

    names = {"lofast_M": "LoFAST(M)", "lofast_xi": "LoFAST(xi)", "naive": "naive",
             "specformer": "SpecFormer"}
    rows = [{"method": label, "eps": float(e), "ratio": r, "source": OURS}
            for key, label in names.items()
            for e, r in m.get(f"table3_{key}_over_pgd", {}).items()]
    from attncert.tightness.studies import PAPER_TABLE3_METHODS as ours

    rows += [{"method": ours[key], "eps": e, "ratio": v / pgd, "source": "paper: LoFAST Table 3"}
             for key in ("LoFAST", "SpecFormer")
             for e, v, pgd in zip(t3["eps"], t3[key], t3["PGD"], strict=True)]
    return pd.DataFrame(rows)


def plot_tightness(df: pd.DataFrame) -> Figure:
    """Bound / PGD lower bound vs eps (log scale; 1 = exact), ours solid, the paper dashed."""
    _style()
    fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
    sns.lineplot(df, x="eps", y="ratio", hue="method", style="source", markers=True, ax=ax)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(yscale="log", ylabel="bound / PGD lower bound",
           title="LoFAST Table 3: tightness on one attention layer")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small",
                    frameon=False)  # beside the axes: the lines span their whole height
    return fig


def ablation_frames(m: Mapping) -> tuple[pd.DataFrame, pd.DataFrame]:
    """LoFAST Figures 3 and 4 from the tightness metrics: (target, size, ratio) LoFAST(M) /
    PGD per perturbed weight or X and perturbation size, and (method, scale, input_norm,
    ratio) every bound / PGD per input scale (empty where the metrics have no such series)."""
    fig3 = pd.DataFrame([{"target": t, "size": float(k), "ratio": r}
                         for t, per in m.get("fig3_ratio", {}).items() for k, r in per.items()],
                        columns=["target", "size", "ratio"])
    norms = m.get("fig4_input_norm", {})
    fig4 = pd.DataFrame([{"method": meth, "scale": float(k), "input_norm": norms.get(k),
                          "ratio": r}
                         for meth, per in m.get("fig4_ratio_to_pgd", {}).items()
                         for k, r in per.items()],
                        columns=["method", "scale", "input_norm", "ratio"])
    return fig3, fig4


def plot_ablations(fig3: pd.DataFrame, fig4: pd.DataFrame, eps: float | None = None) -> Figure:
    """LoFAST Figures 3 (perturbing W^Q, W^K, W^V, W^O or X) and 4 (the input norm): bound /
    PGD lower bound, 1 = exact."""
    _style()
    fig, (a3, a4) = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    if len(fig3):
        sns.lineplot(fig3, x="size", y="ratio", hue="target", style="target", markers=True,
                     ax=a3)
    a3.set(xlabel="perturbation size (Frobenius)", ylabel="LoFAST(M) / PGD",
           title="Figure 3: perturbed weights and inputs")
    if len(fig4):
        sns.lineplot(fig4, x="input_norm", y="ratio", hue="method", style="method",
                     markers=True, ax=a4)
    a4.set(xscale="log", yscale="log", xlabel=r"mean $\|X\|$", ylabel="bound / PGD",
           title="Figure 4: tightness vs input norm")
    for ax in (a3, a4):
        ax.axhline(1.0, color="grey", ls=":", lw=1)
    if eps is not None:
        fig.suptitle(f"LoFAST Figures 3-4 at eps = {eps:g}")
    return fig


# -- certified accuracy over the grid (LoFAST Figure 2 analog) --------------------------------
def certified_frame(points: Mapping[str, Mapping]) -> pd.DataFrame:
    """(run, variant, test, eps, accuracy) of every grid point's certify metrics, with the
    L2 PGD accuracy as variant "PGD (upper bound)" (accuracies as fractions)."""
    from attncert.certify import long_certified_accuracy

    frames = [long_certified_accuracy(m).assign(run=run) for run, m in points.items()]
    cols = ["run", "variant", "test", "eps", "accuracy"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def beside_baselines(points: Mapping[str, Mapping], samples: Mapping[str, pd.DataFrame],
                     baseline: Mapping | None = None, frontier: Mapping | None = None,
                     certificate: str = "lofast_M_pairwise") -> pd.DataFrame:
    """Every grid point beside the trivial baseline and the frontier, in percent.

    ``points``: {run: certify_vit metrics}; ``samples``: {run: its samples.csv}. ``baseline``:
    the certvit stage's linear model on pixels, ``{"dataset", "samples" (its samples.csv rows),
    "metrics" (its metrics entry)}``: certified accuracy on the same first n test images as the
    grid point (n the smaller count), PGD accuracy on each model's own attacked points (the
    first ``n_attacked``). ``frontier``: the frontier stage's metrics, its selected setting and
    linear baseline on its validation split (not the test split: a different set of images).
    """
    from attncert.certify import certified_accuracy

    rows = []

    def add(run, model, split, n, clean, cert, pgd, n_attacked):
        rows.append({"point": run, "model": model, "split": split, "n": n,
                     "clean": 100 * clean,
                     **{f"certified@{e:g}": 100 * a for e, a in cert.items()},
                     **{f"pgd@{e:g}": 100 * a for e, a in pgd.items()},
                     "n_attacked": n_attacked})

    def on_first(df: pd.DataFrame, n: int, radius: str, eps: list[float]):
        df = df.sort_values("index").head(n) if "index" in df else df.head(n)
        correct = torch.tensor(df["correct"].astype(bool).to_numpy())
        return (float(correct.double().mean()),
                certified_accuracy(correct, torch.tensor(df[radius].to_numpy()), eps))

    for run, m in points.items():
        eps = sorted(float(e) for e in m["certified_acc"][certificate])
        pgd = {float(e): a for e, a in m["pgd_acc"].items()}
        grid = samples.get(run)
        n = len(grid) if grid is not None else m["n"]
        base = baseline if baseline and baseline["dataset"] == m["dataset"] else None
        if base is not None:
            n = min(n, len(base["samples"]))
        if grid is not None:
            clean, cert = on_first(grid, n, f"radius_{certificate}", eps)
        else:
            clean, cert = m["clean_acc"], {e: m["certified_acc"][certificate][str(e)]
                                          for e in eps}
        add(run, f"ViT ({certificate})", "test", n, clean, cert, pgd, m.get("n_attacked"))
        if base is not None:
            clean, cert = on_first(base["samples"], n, "radius", eps)
            bm = base["metrics"]
            add(run, "linear baseline (certvit stage)", "test", n, clean, cert,
                {float(e): a for e, a in bm["pgd_acc"].items() if float(e) in eps},
                bm["n_attacked"])
        for r in (frontier or {}).get("rows", []):
            if r["dataset"] != m["dataset"] or not (
                    r["setting"] == frontier.get("selected") or r["kind"] == "linear"):
                continue
            cols = {float(k.split("@")[1]): r[k] / 100 for k in r if k.startswith("certified@")}
            pgd_f = {float(k.split("@")[1]): r[k] / 100 for k in r if k.startswith("pgd@")}
            add(run, f"frontier {r['setting']}", "validation", r["n_val"], r["clean"] / 100,
                {e: a for e, a in cols.items() if e in eps},
                {e: a for e, a in pgd_f.items() if e in eps}, r["n_attacked"])
    return pd.DataFrame(rows)


def certified_csv_frame(long: pd.DataFrame) -> pd.DataFrame:
    """The DVC plot's table: run, variant (``<variant>_<test>`` or ``pgd``), eps, accuracy."""
    variant = [("pgd" if t == "attack" else f"{v}_{t}")
               for v, t in zip(long["variant"], long["test"], strict=True)]
    return long.assign(variant=variant)[["run", "variant", "eps", "accuracy"]]


# -- cost --------------------------------------------------------------------------------------
def cost_frame(points: Mapping[str, Mapping], crown: Mapping | None = None) -> pd.DataFrame:
    """(run, method, seconds, source): seconds per sample of every certificate, every grid
    point, the crown stage's LoFAST and CROWN seconds by dataset and depth (``crown``: its
    metrics), and LoFAST Table 1's LoFAST and alpha,beta-CROWN seconds beside the crown
    stage's CIFAR-10 rows only (its 128-d ViTs; never beside the 384-d grid)."""
    rows = [{"run": run, "method": key, "seconds": s, "source": OURS}
            for run, m in points.items() for key, s in m.get("seconds_per_sample", {}).items()]
    ours = [r for ds, part in (crown or {}).get("datasets", {}).items()
            for r in part.get("table1", []) for r in [dict(r, dataset=ds)]]
    rows += [{"run": None, "method": f"{r['method']} L={r['depth']} (crown stage, "
              f"{r['dataset']})", "seconds": r["seconds_per_sample"], "source": OURS}
             for r in ours]
    t1 = paper.LOFAST_TABLE1
    for name, key in (("LoFAST", "lofast_seconds"), ("CROWN", "crown_seconds")):
        rows += [{"run": None, "method": f"{name} L={d} (crown stage, cifar10)", "seconds": s,
                  "source": "paper: LoFAST Table 1 (alpha,beta-CROWN; its local machine)"}
                 for d, s in t1[key].items()
                 if any(r["dataset"] == "cifar10" and r["method"] == name and r["depth"] == d
                        for r in ours)]
    return pd.DataFrame(rows, columns=["run", "method", "seconds", "source"])


def plot_cost(df: pd.DataFrame) -> Figure:
    """Seconds per sample per method (log scale; bars: mean over grid points, whiskers: the
    range), the paper's seconds beside ours."""
    _style()
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.3 * df["method"].nunique())),
                           constrained_layout=True)
    sns.barplot(df, y="method", x="seconds", hue="source", errorbar=("pi", 100), ax=ax)
    ax.set(xscale="log", xlabel="seconds per sample", ylabel="",
           title="Certification cost per sample")
    return fig


# -- SpecFormer --------------------------------------------------------------------------------
def specformer_frame(m: Mapping) -> pd.DataFrame:
    """(dataset, training, method, attack, accuracy %, source) of the SpecFormer metrics'
    robustness table, with the SpecFormer Table 1-2 cells its runs stand for beside
    (:func:`attncert.report.paper.specformer_rows`)."""
    rows = []
    for key, acc in m.get("robustness", {}).items():
        dataset, training, method, attack = key.split("/", 3)
        rows.append({"dataset": dataset, "training": training, "method": method,
                     "attack": attack, "accuracy": 100 * acc, "source": OURS})
    rows += [{**r, "source": f"paper: SpecFormer Table {1 if r['training'] == 'standard' else 2}"}
             for r in paper.specformer_rows(list(dict.fromkeys(r["dataset"] for r in rows)))]
    return pd.DataFrame(rows)


def plot_specformer(df: pd.DataFrame) -> Figure:
    """Accuracy under every attack per method, one panel per (source, dataset, training)."""
    _style()
    d = df.assign(panel=df["source"] + ": " + df["dataset"] + ", " + df["training"])
    g = sns.catplot(d, x="attack", y="accuracy", hue="method", col="panel", kind="bar",
                    col_wrap=min(3, d["panel"].nunique()), height=3.2, aspect=1.3,
                    sharex=False)
    g.set_axis_labels("", "accuracy (%)")
    g.set_titles("{col_name}")
    for ax in g.axes.flat:
        ax.tick_params(axis="x", rotation=30)
    g.figure.suptitle("SpecFormer Tables 1-2: accuracy under attack", y=1.02)
    return g.figure


# -- text: certified accuracy vs eps per model (LoFAST Figure 5 analog) -----------------------
def text_certified_frame(m: Mapping) -> pd.DataFrame:
    """(model, family, eps, accuracy %) of every certified SST-2 model of the text metrics
    (the audit's certified accuracy: each model's largest sound radius)."""
    rows = [{"model": name, "family": r.get("family"), "eps": float(e), "accuracy": 100 * a}
            for name, r in m.get("models", {}).items() if r.get("family") != "none"
            for e, a in r.get("certified_acc", {}).items()]
    return pd.DataFrame(rows, columns=["model", "family", "eps", "accuracy"])


def plot_text_certified(df: pd.DataFrame) -> Figure:
    """Certified accuracy vs eps (l2 in each model's embedding space), one line per model,
    one panel per family (LoFAST's small-BERT grid is the Figure 5 analog)."""
    _style()
    g = sns.relplot(df, x="eps", y="accuracy", hue="model", col="family", kind="line",
                    markers=True, height=3.2, aspect=1.2)
    g.set_axis_labels("eps (l2, embedding space)", "certified accuracy (%)")
    g.figure.suptitle("SST-2: certified accuracy vs eps per model (LoFAST Figure 5 analog)",
                      y=1.03)
    return g.figure


# -- CROWN: LoFAST Tables 1-2 ------------------------------------------------------------------
def crown_frame(m: Mapping) -> pd.DataFrame:
    """(table, depth, method, eps, accuracy %, seconds, source) of the crown metrics, each
    dataset its own source (Table 1: LoFAST and CROWN; Table 2: LoFAST first with CROWN on the
    rest) and LoFAST Tables 1-2's
    numbers (alpha,beta-CROWN in Table 1; a "-" of either is a missing row)."""
    rows = []
    for ds, part in m.get("datasets", {}).items():
        ours = f"{OURS} ({ds})"
        rows += [{"table": "Table 1", "depth": r["depth"], "method": r["method"],
                  "eps": float(k[4:]), "accuracy": r[k], "seconds": r["seconds_per_sample"],
                  "source": ours}
                 for r in part.get("table1", []) for k in r if k.startswith("acc_")]
        rows += [{"table": "Table 2", "depth": r["depth"], "method": f"LoFAST + {r['method']}",
                  "eps": float(r["eps"]), "accuracy": r["combined_acc"],
                  "seconds": r["combined_seconds"], "source": ours}
                 for r in part.get("table2", [])]
    t1 = paper.LOFAST_TABLE1
    for key, method in (("lofast", "LoFAST"), ("crown", "alpha,beta-CROWN")):
        rows += [{"table": "Table 1", "depth": d, "method": method, "eps": e, "accuracy": a,
                  "seconds": t1[f"{key}_seconds"][d], "source": "paper: LoFAST Table 1 (cifar10)"}
                 for d, accs in t1[key].items()
                 for e, a in zip(t1["eps"], accs, strict=True)]
    names = {"CROWN": "CROWN", "CROWN+LoFAST": "LoFAST + CROWN"}   # ours' names
    for ds, per in paper.LOFAST_TABLE2.items():
        rows += [{"table": "Table 2", "depth": 3, "method": names[method], "eps": e,
                  "accuracy": a,
                  "seconds": sec, "source": f"paper: LoFAST Table 2 ({ds})"}
                 for method, vals in per.items()
                 for e, (a, sec) in zip(paper.LOFAST_TABLE_EPS[:2], vals, strict=True)]
    cols = ["table", "depth", "method", "eps", "accuracy", "seconds", "source"]
    return pd.DataFrame(rows, columns=cols).dropna(subset=["accuracy"]).reset_index(drop=True)


def plot_crown(df: pd.DataFrame) -> Figure:
    """Certified accuracy vs eps per method and depth, ours solid and the paper's dashed, one
    panel per depth (LoFAST Tables 1-2 as curves)."""
    _style()
    d = df.assign(depth="L=" + df["depth"].astype(str))
    g = sns.relplot(d, x="eps", y="accuracy", hue="method", style="source", col="depth",
                    kind="line", markers=True, height=3.2, aspect=1.1)
    g.set_axis_labels("eps (pixel-space l2)", "certified accuracy (%)")
    g.figure.suptitle("LoFAST vs CROWN and LoFAST + CROWN (LoFAST Tables 1-2)", y=1.03)
    return g.figure


# -- any stage's headline rows (CertViT, OLSA, CROWN) ------------------------------------------
