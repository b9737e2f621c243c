"""A training run's checkpoint folder: its fingerprint, the per-epoch checkpoint and resume.

A folder holds ``last.pt`` (the full training state after the last finished epoch,
:func:`save_checkpoint`), by default ``metrics.json`` (the per-epoch rows) and a fingerprint
file (``run.json`` unless the caller names another): a JSON record of everything that decides
the run (model, training config, data, precision, ...). :func:`prepare_checkpoint_dir` keeps a
folder whose fingerprint is the same (the run resumes) and clears one written for another run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attncert.pipeline.io import torch_save, write_json

if TYPE_CHECKING:  # annotations only
    from attncert.models import ViTConfig

CHECKPOINT = "last.pt"
METRICS = "metrics.json"
FINGERPRINT = "run.json"


#: training-config fields that change no weight (evaluation between epochs): a checkpoint
#: resumes whatever their value, so lowering one to get past an out-of-memory error keeps the run
EVALUATION_ONLY = ("eval_batch_size",)


def _decisive(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` without what decides no weight: ``sha`` and the evaluation-only fields (at the
    top level and in a ``train`` sub-record)."""
    out = {k: v for k, v in record.items() if k != "sha" and k not in EVALUATION_ONLY}
    if isinstance(out.get("train"), Mapping):
        out["train"] = _decisive(out["train"])
    return out


def prepare_checkpoint_dir(ckpt_dir: str | Path, fingerprint: Mapping[str, Any],
                           marker: str = FINGERPRINT) -> str:
    """Keep a checkpoint written for the same run (resume); clear one written for another.

    ``fingerprint``: a JSON-able record of what decides the run, compared as stored (tuples
    become lists) with ``ckpt_dir/marker``; a key ``sha`` (a hash of the rest) is not named as
    a change, and neither are the :data:`EVALUATION_ONLY` fields (the stored record is
    updated). Returns what happened ("fresh", "resume" or "cleared: <keys> changed").
    """
    ckpt_dir = Path(ckpt_dir)
    fp = json.loads(json.dumps(dict(fingerprint)))
    path = ckpt_dir / marker
    status = "fresh"
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        old = _read_json(path)
        if old == fp:
            return "resume"
        if old and _decisive(old) == _decisive(fp):
            write_json(path, fp)
            return "resume"
        changed = sorted(k for k in set(old) | set(fp) if k != "sha" and old.get(k) != fp.get(k))
        status = f"cleared: {', '.join(changed) or 'no fingerprint'} changed"
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, fp)
    return status


def _read_json(path: Path) -> dict[str, Any]:
    """The stored fingerprint, or {} when there is none (or it is unreadable)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def load_checkpoint(path: Path, config: Mapping[str, Any],
                    states: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int, dict]:
    """Resume from ``path`` if it exists: load every ``states`` entry (model, optimizer,
    scheduler, ...) from the checkpoint key of the same name and the global random state when
    the checkpoint holds one. A checkpoint written with another training config is an error.
    Returns (metrics rows, last finished epoch, checkpoint)."""
    if not path.is_file():
        return [], 0, {}
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if _decisive(ckpt["config"]) != _decisive(dict(config)):
        raise ValueError(f"{path} was written with another training config "
                         f"({ckpt['config']}); delete it to start over")
    for key, obj in states.items():
        obj.load_state_dict(ckpt[key])
    if "rng" in ckpt:
        _set_rng_state(ckpt["rng"])
    return list(ckpt["metrics"]), int(ckpt["epoch"]), ckpt


def save_checkpoint(path: Path, config: Mapping[str, Any], states: Mapping[str, Any],
                    epoch: int, metrics: list[dict[str, Any]]) -> None:
    """Write the state after ``epoch`` atomically: every ``states`` entry's state_dict, the
    metrics rows, the config and the global random state."""
    torch_save({**{k: obj.state_dict() for k, obj in states.items()}, "epoch": epoch,
                "metrics": metrics, "config": dict(config), "rng": _rng_state()}, path)


def _rng_state() -> dict[str, Any]:
    """The host's random state and the current CUDA device's (only that device: a run uses
    one device, and a resume may see another set of devices)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`_rng_state`'s state. The CUDA state goes to the current device; a state
    saved on a CPU-only machine (or a GPU state resumed on one) leaves the other side alone.
    Checkpoints of earlier versions hold a list with every device's state: the first one
    (the current device of a one-device run) is taken."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        if not cuda:
            return
        cuda = cuda[0]
    torch.cuda.set_rng_state(cuda)


def fingerprint(model_cfg: ViTConfig, train_cfg: Any, dataset: str,
                data_source: str, precision: str | None = None) -> dict[str, Any]:
    """What decides a run's checkpoint: the model's config, every field of the training config
    ``train_cfg`` (a :class:`attncert.training.train.TrainConfig`), the dataset and the source
    of its data; ``precision`` (the resolved training precision,
    :func:`attncert.training.precision.resolve_precision`) is part of it when given."""
    d = {"dataset": dataset, "data": data_source, "model": model_cfg.to_dict(),
         "train": {f.name: getattr(train_cfg, f.name) for f in dataclasses.fields(train_cfg)}}
    if precision is not None:
        d["precision"] = precision
    d = json.loads(json.dumps(d))  # as stored: tuples become lists
    d["sha"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return d


def state_sha(model: torch.nn.Module) -> str:
    """Hash of a model's state (names, shapes, dtypes, values): 16 hex digits."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]
