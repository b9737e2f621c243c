"""Keys of an older params.yaml layout and where they are now: parsing one is a one-line error
that names its new place (:func:`attncert.pipeline.params.parse_section`)."""

#: the audit's flat keys (each section had those it used) -> its key in ``<section>.audit``
AUDIT_KEYS = (("n_attack", "n"), ("attack_steps", "steps"), ("attack_restarts", "restarts"),
              ("attack_batch_size", "batch_size"))

#: old key -> where it is now
RENAMED: dict[str, str] = {
    **{f"certvit.dr_{k}": f"certvit.dr.{k}" for k in (
        "threshold", "eta", "relaxation", "iterations", "projection_steps", "batch_size",
        "max_pairs", "images")},
    **{f"certvit.budget_{k}": f"certvit.budget.{k}" for k in (
        "embed", "q", "v", "o", "fc1", "fc2", "gain")},
    **{f"specformer.finetune_{k}": f"specformer.finetune.{k}" for k in (
        "epochs", "adv_epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "grad_clip",
        "optimizer", "momentum", "mixup_alpha", "cutmix_alpha", "mix_prob", "mix_switch_prob")},
    **{f"specformer.cert_{k}": f"specformer.certified.{k}" for k in (
        "patch", "dim", "depth", "heads", "gamma_qk", "gamma_vo", "radius_attn", "epochs", "lr",
        "lmt_offset", "logit_scale", "msvp_lambda", "n_test")},
    "specformer.cert_eps": "specformer.certified.cert_eps",
    "specformer.n_eval": "specformer.n_test",
    **{f"text.lofast_{k}": f"text.lofast.{k}" for k in (
        "heads", "gamma_vo", "dim", "mlp_hidden", "gamma_qk", "radius_attn", "variants",
        "epochs", "lr", "logit_scale")},
    "text.lofast_layers": "text.lofast.depths",
    **{f"text.frozen_{k}": f"text.frozen.{k}" for k in (
        "datasets", "source", "epochs", "lr", "lr_decay_epochs", "max_train")},
    "text.frozen_hidden": "text.frozen.dim",
    **{f"text.olsa_{k}": f"text.olsa.{k}" for k in (
        "depths", "deep_depths", "alpha1", "residual", "residual_init")},
    "text.hidden": "text.dim",
    "text.max_eval": "text.max_test",
    "text.vanilla_lr": "text.vanilla.lr (a group: lr is spelt alike everywhere)",
    "frontier.standard_lr": "frontier.standard.lr (a group: lr is spelt alike everywhere)",
    "train_vit.adv_eps": "train_vit.train.adv_eps_255 (units of 1/255)",
    **{f"train_vit.{k}": f"train_vit.train.{k} (the training recipe, one group)" for k in (
        "epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "margin", "lmt_offset",
        "olsa_gamma", "lofast_eps", "lofast_ramp", "lofast_mix", "logit_scale", "augment",
        "grad_clip", "eval_batch_size", "msvp_lambda", "adversarial", "adv_eps_255",
        "adv_steps")},
    **{f"crown.{k}": f"crown.train.{k} (the training recipe, one group)" for k in (
        "epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "augment", "lmt_offset",
        "logit_scale", "eval_batch_size")},
    **{f"frontier.linear_{k}": f"frontier.linear.{k} (the linear baseline's recipe, one group)"
       for k in ("epochs", "lr", "logit_scale")},
    **{f"certvit.{old}": f"certvit.{new} (a training recipe, one group)" for old, new in (
        ("pretrain_epochs", "train.epochs"), ("batch_size", "train.batch_size"),
        ("lr", "train.lr"), ("weight_decay", "train.weight_decay"),
        ("warmup_steps", "train.warmup_steps"), ("finetune_epochs", "finetune.epochs"),
        ("finetune_lr", "finetune.lr"), ("finetune_margin", "finetune.margin"),
        ("lmt_offset", "finetune.lmt_offset"), ("spectral_epochs", "spectral.epochs"),
        ("spectral_lr", "spectral.lr"), ("margin_eps", "spectral.lmt_offset"),
        ("logit_scale", "spectral.logit_scale"))},
    **{f"specformer.{k}": f"specformer.train.{k} (the from-scratch recipe, one group; "
                          f"finetune holds the fine-tune's)"
       for k in ("epochs", "adv_epochs", "batch_size", "lr", "weight_decay", "warmup_steps",
                 "augment", "adv_eps_255", "adv_steps", "eval_batch_size")},
    **{f"specformer.certified.{k}": f"specformer.certified.train.{k} (the pair's recipe, "
                                    f"one group)"
       for k in ("epochs", "lr", "lmt_offset", "logit_scale")},
    **{f"text.{k}": f"text.train.{k} (the text models' recipe, one group)"
       for k in ("batch_size", "warmup_steps", "logit_scale", "gamma_ramp")},
    "certify_vit.cert_softmax_lipschitz": "certify_vit.softmax_lipschitz",
    "vit_grid.runs_dir": "vit_grid.results_dir",
    **{f"{s}.work_dir": f"{s}.results_dir" for s in ("frontier", "certvit", "crown")},
    **{f"certvit.table1_{k}": f"certvit.table1.{k}" for k in (
        "datasets", "grid", "dim", "depth", "heads", "mlp_hidden", "pretrain_epochs",
        "batch_size", "lr")},
    **{f"certvit.imagenet_{k}": f"certvit.imagenet.{k}" for k in ("sources", "calibration")},
    **{f"{s}.{old}": f"{s}.audit.{new} (the soundness audit, one group)"
       for s, olds in (("certify_vit", AUDIT_KEYS[:3]), ("frontier", AUDIT_KEYS[:3]),
                       ("text", AUDIT_KEYS[:3]), ("certvit", AUDIT_KEYS),
                       ("crown", AUDIT_KEYS[1:3]), ("specformer.certified", AUDIT_KEYS[1:3]))
       for old, new in olds},
    "certvit.processed_dir": "data.processed_dir (one for every stage)",
    **{f"certvit.table1.{k}": "certvit.table1.vit (per dataset the name of a shape of the vit "
                              "section)" for k in ("grid", "dim", "depth", "heads", "mlp_hidden")},
    **{f"{s}.{k}": f"{s}.vit (the name of a shape of the vit section, which holds its {k})"
       for s, keys in (("train_vit", ("patch", "dim", "mlp_hidden")),
                       ("crown", ("patch", "dim", "heads", "mlp_hidden")),
                       ("specformer", ("patch", "dim", "depth", "heads", "mlp_hidden")),
                       ("specformer.certified", ("patch", "dim", "depth", "heads",
                                                 "mlp_hidden")),
                       ("certvit", ("patch", "dim", "depth", "heads", "mlp_hidden")))
       for k in keys},
}


def _final(new: str) -> str:
    """Where a key renamed twice is now (``new`` may name a key renamed again)."""
    seen = set()
    while (key := new.split(" ", 1)[0]) in RENAMED and key not in seen:
        seen.add(key)
        new = RENAMED[key]
    return new


RENAMED = {old: _final(new) for old, new in RENAMED.items()}
