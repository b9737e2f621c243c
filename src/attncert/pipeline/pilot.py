"""The pilot: one real unit of each big kind, one epoch each, before the long run.

    python -m attncert.pipeline.pilot                  # make pilot (on the GPU box)
    python -m attncert.pipeline.pilot --list           # the units it would run, and stop

In a scratch clone of this repository (``--scratch``, default ``.pilot/``, outside DVC's view
of the workspace) with the workspace's ``params.yaml``, every training run cut to one epoch
(:func:`pilot_params`: every ``*epochs`` key above 1 set to 1, learning-rate decay epochs
dropped) and CROWN's time budget to :data:`CROWN_BUDGET` seconds a method, the pilot runs the
data stage and then one unit of each kind (:func:`pick_units`: a grid point, a frontier unit,
SpecFormer's first dataset, the text unit of Yelp (else the first), the crown unit of the
largest depth, CertViT's own ViT) with ``dvc repro --single-item``, each with its real data,
shapes, batch sizes and evaluation, certificate and audit counts. Per unit it records the wall
seconds, the host and GPU peak memory from the unit's headlines, and its status (a failing unit
is recorded with the end of its output and the pilot goes on). Then the cost model estimates
the same units at the pilot's params and at the real ones: measured / estimated is the unit
kind's calibration, and the real estimate times it is the unit's projected hours. The record
(``--out``, default ``reports/pilot.json``) is written after every unit; a rerun skips the units
it holds as done (``--fresh``: none).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from attncert.pipeline.io import write_json
from attncert.pipeline.params import PARAMS_FILE, ParamsError, read_yaml

#: CROWN's time budget per method and unit in the pilot (seconds): enough for a few bounds
CROWN_BUDGET = 900.0
#: the unit kinds, in the order they run: (label, stage prefix)
KINDS = (("grid point", "train_vit@"), ("frontier", "frontier_unit@"),
         ("specformer", "specformer_runs@"), ("text", "text_unit@"),
         ("crown", "crown_unit@"), ("certvit", "certvit_main"))
#: the text unit the pilot prefers (the largest dataset's)
TEXT_UNIT = "text_unit@yelp_polarity"
OUT = "reports/pilot.json"
SCRATCH = ".pilot"
TAIL = 2000  # characters of a failed unit's output kept in the record


def pilot_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (the nested YAML mapping) with every training run cut to one epoch and
    CROWN's time budget to at most :data:`CROWN_BUDGET`: every key whose name ends in
    ``epochs`` (or a mapping of them, per dataset) above 1 becomes 1, every
    ``lr_decay_epochs`` list empties (a decay epoch must lie inside the run)."""
    def cut(node: Any, owner: str | None) -> Any:  # owner: the nearest key naming epochs
        if isinstance(node, dict):
            return {k: cut(v, k if str(k).endswith("epochs") else owner)
                    for k, v in node.items()}
        if owner is None:
            return node
        if owner.endswith("lr_decay_epochs") and isinstance(node, list):
            return []
        if isinstance(node, int) and not isinstance(node, bool):
            return min(node, 1)
        return node

    out = cut(params, None)  # new mappings throughout: the input is not modified
    crown = out.get("crown", {})
    if crown.get("time_budget"):
        crown["time_budget"] = min(float(crown["time_budget"]), CROWN_BUDGET)
    return out


def pick_units(stages: list[str]) -> list[tuple[str, list[str]]]:
    """(kind, its DVC stages) for each kind of :data:`KINDS` present in ``stages`` (dvc's
    stage names): the first of its prefix, the text unit :data:`TEXT_UNIT` when present, the
    crown unit of the largest depth; a grid point is its ``train_vit`` and ``certify_vit``."""
    out = []
    for kind, prefix in KINDS:
        found = [s for s in stages if s.startswith(prefix)]
        if not found:
            continue
        first = found[0]
        if kind == "text" and TEXT_UNIT in found:
            first = TEXT_UNIT
        if kind == "crown":
            first = max(found, key=lambda s: int(s.rsplit("-", 1)[1]))
        units = [first]
        if kind == "grid point":
            units.append("certify_vit@" + first.split("@", 1)[1])
        out.append((kind, units))
    return out


def _sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-TAIL:]}")
    return proc


def _repro(stage: str, scratch: Path) -> tuple[int, str]:
    """``dvc repro --single-item stage`` in the scratch clone, importing its own ``src/`` first
    (not an editable install's workspace), its output shown as it comes (a unit runs for
    minutes to hours); (exit status, the end of its output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "src"),
                                         *filter(None, [env.get("PYTHONPATH")])])
    tail: collections.deque[str] = collections.deque(maxlen=200)
    with subprocess.Popen(["dvc", "repro", "--single-item", stage], cwd=scratch, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line)
    return proc.returncode, "".join(tail)[-TAIL:]


def prepare(repo: Path, scratch: Path) -> None:
    """A clone of ``repo`` at ``scratch`` (reused when it exists) checked out at ``repo``'s
    HEAD (its committed code: uncommitted edits under src/ are not in the pilot), with
    ``repo``'s DVC cache and ``repo``'s ``params.yaml`` cut by :func:`pilot_params`."""
    head = _sh(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    if not (scratch / ".git").is_dir():
        _sh(["git", "clone", "-q", "--shared", str(repo), str(scratch)], repo)
        _sh(["dvc", "cache", "dir", "--local", str(repo / ".dvc" / "cache")], scratch)
    _sh(["git", "fetch", "-q", "origin"], scratch)
    _sh(["git", "checkout", "-q", "--force", "--detach", head], scratch)
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    with open(scratch / PARAMS_FILE, "w") as f:
        yaml.dump(pilot_params(read_yaml(repo / PARAMS_FILE)), f)


def _peaks(scratch: Path, since: float) -> dict[str, float]:
    """The largest ``peak_gb`` and ``gpu_peak_gb`` of the headlines written after ``since``."""
    out: dict[str, float] = {}
    for path in (scratch / "reports" / "headline").rglob("*.json"):
        if path.stat().st_mtime < since:
            continue
        head = json.loads(path.read_text())
        for key in ("peak_gb", "gpu_peak_gb"):
            if isinstance(head.get(key), (int, float)):
                out[key] = max(out.get(key, 0.0), float(head[key]))
    return out


def run_units(scratch: Path, units: list[tuple[str, list[str]]], record: dict[str, Any],
              out: Path) -> None:
    """Run ``units`` in ``scratch`` one after another (skipping those ``record`` holds as
    done), recording each in ``record["units"]`` and writing ``out`` after each."""
    done = record.setdefault("units", {})
    for i, (kind, stages) in enumerate(units, 1):
        if done.get(kind, {}).get("status") == "ok":
            print(f"pilot: {kind} ({' '.join(stages)}) done before, skipped", flush=True)
            continue
        print(f"pilot: [{i}/{len(units)}] {kind}: {' '.join(stages)}", flush=True)
        t0 = time.time()
        status, tail = "ok", ""
        for stage in stages:
            code, output = _repro(stage, scratch)
            if code:
                status, tail = f"failed in {stage}", output
                break
        seconds = time.time() - t0
        done[kind] = {"stages": stages, "seconds": round(seconds, 1), "status": status,
                      **_peaks(scratch, t0), **({"output": tail} if tail else {})}
        print(f"pilot: {kind}: {status} in {seconds / 60:.1f} min", flush=True)
        write_json(out, record)


def project(record: dict[str, Any], pilot_params_path: Path, real_params_path: Path,
            gpu: str = "h100") -> None:
    """Per done unit: the cost model's hours at the pilot's and at the real params, the
    calibration (measured / pilot estimate) and the projected hours (real estimate x it)."""
    from attncert.cost.calibrate import calibrated
    from attncert.cost.counting import GPUS
    from attncert.cost.graphs import with_graphs
    from attncert.cost.plan import dvc_unit_hours, unit_hours
    from attncert.stages.registry import load_params

    estimates = {}
    for name, path in (("pilot", pilot_params_path), ("real", real_params_path)):
        params = load_params(path)
        estimates[name] = unit_hours(params, with_graphs(calibrated(GPUS[gpu]), params))
    for entry in record["units"].values():
        if entry["status"] != "ok":
            continue
        unit = " ".join(entry["stages"])
        pilot_h = dvc_unit_hours(unit, estimates["pilot"])
        real_h = dvc_unit_hours(unit, estimates["real"])
        factor = entry["seconds"] / 3600 / pilot_h if pilot_h > 0 else float("nan")
        entry |= {"estimated_pilot_hours": _sig(pilot_h), "calibration": _sig(factor),
                  "estimated_hours": _sig(real_h), "projected_hours": _sig(real_h * factor)}
    record["estimates_for"] = GPUS[gpu].name


def _sig(x: float) -> float:
    """``x`` to four significant figures (a tiny estimate is not rounded to 0)."""
    return float(f"{x:.4g}")


def table(record: dict[str, Any]) -> str:
    lines = ["| unit kind | stages | status | minutes | host GB | GPU GB | measured / estimated "
             "| projected h (estimated) |", "|---|---|---|---|---|---|---|---|"]
    for kind, e in record.get("units", {}).items():
        lines.append(f"| {kind} | {' '.join(e['stages'])} | {e['status']} | "
                     f"{e['seconds'] / 60:.1f} | {e.get('peak_gb', '-')} | "
                     f"{e.get('gpu_peak_gb', '-')} | {e.get('calibration', '-')} | "
                     f"{e.get('projected_hours', '-')} ({e.get('estimated_hours', '-')}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.pilot",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", default=SCRATCH, help=f"the scratch clone (default {SCRATCH})")
    ap.add_argument("--out", default=OUT, help=f"the record (default {OUT})")
    ap.add_argument("--gpu", default="h100", help="the card the estimates are for")
    ap.add_argument("--list", action="store_true", help="print the units and stop")
    ap.add_argument("--fresh", action="store_true", help="rerun the units the record holds")
    args = ap.parse_args(argv)
    repo = Path.cwd()
    if not (repo / PARAMS_FILE).is_file() or not (repo / "dvc.yaml").is_file():
        ap.error(f"run it in the repository root ({PARAMS_FILE} and dvc.yaml not found here)")
    try:
        from attncert.stages.registry import load_params

        load_params(repo / PARAMS_FILE)  # bad params: one line, before any work
    except ParamsError as exc:
        ap.error(f"{PARAMS_FILE}: {exc}")
    from attncert.cost.calibrate import calibrated
    from attncert.cost.counting import GPUS

    if args.gpu not in GPUS:
        ap.error(f"--gpu {args.gpu}: choose from {', '.join(sorted(GPUS))}")
    try:  # the projection after the units reads the calibration: refused now, not then
        calibrated(GPUS[args.gpu])
    except ValueError as exc:
        ap.error(str(exc))
    if shutil.which("dvc") is None:
        ap.error("dvc is not on PATH (activate the environment: make env)")
    stages = _sh(["dvc", "stage", "list", "--name-only"], repo).stdout.split()
    units = pick_units(stages)
    if args.list:
        print("\n".join(" ".join(s) for _, s in units))
        return 0
    scratch, out = (repo / args.scratch).resolve(), (repo / args.out).resolve()
    record = {} if args.fresh or not out.is_file() else json.loads(out.read_text())
    record |= {"date": datetime.date.today().isoformat(), "scratch": str(scratch),
               "commit": _sh(["git", "rev-parse", "HEAD"], repo).stdout.strip()}
    prepare(repo, scratch)
    print("pilot: data", flush=True)
    t0 = time.time()
    code, output = _repro("data", scratch)
    if code:
        print(f"pilot: the data stage failed; no unit ran:\n{output}", file=sys.stderr)
        return 1
    record["data_seconds"] = round(time.time() - t0, 1)
    run_units(scratch, units, record, out)
    project(record, scratch / PARAMS_FILE, repo / PARAMS_FILE, args.gpu)
    write_json(out, record)
    print(table(record))
    failed = [k for k, e in record["units"].items() if e["status"] != "ok"]
    if failed:
        print(f"pilot: failed: {', '.join(failed)} (their output is in {args.out})",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
