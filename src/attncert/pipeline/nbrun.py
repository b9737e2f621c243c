"""Run one pipeline notebook with papermill, parameters taken from params.yaml.

    python -m attncert.pipeline.nbrun notebooks/01_data.py reports/notebooks/01_data.ipynb \
        --section data
    python -m attncert.pipeline.nbrun notebooks/03_train_vit.py OUT.ipynb --section vit_grid \
        --section train_vit --item dataset=mnist --item depth=3 --item heads=4 --item gamma_vo=0.5

The notebook gets the params file's path, its ``unit`` (``--unit``: one independent unit of a
split stage) and its grid ``point`` (``--item``: one value of each list of the grid's section)
and reads its own typed section with :func:`attncert.pipeline.context.setup`; ``--section``
names what the stage reads (as dvc.yaml's ``params``). Everything is checked before the
kernel starts: the params file (YAML 1.2, validated by :mod:`attncert.stages.registry`), the
sections and the grid point, and that the notebook's ``parameters`` cell declares exactly
what is passed.
Errors are one line on stderr, exit status 2; so is a paper-scale stage that would run on the
CPU (:func:`attncert.pipeline.doctor.require_device`).

The console shows one line when the notebook starts and one when it ends (its time), and the
progress of its long loops (:mod:`attncert.pipeline.progress`), relayed from the kernel; the
kernel's printed output goes into the executed notebook only. After a run, the stage's DVC metrics
(its headline: a few numbers, the seconds and the peak memory) are written (:func:`write_headline`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from attncert.pipeline.doctor import DeviceError, require_device
from attncert.pipeline.params import PARAMS_FILE, ParamsError
from attncert.pipeline.progress import CONSOLE_ENV, TTY_ENV, Relay, elapsed
from attncert.pipeline.runtime import GPU_PEAK_ENV
from attncert.stages.registry import load_params

KERNEL = "python3"


class NotebookError(ValueError):
    """The notebook does not match its stage (parameters cell, format)."""


#: the kernel's libraries draw no progress bars into a report (the hub's downloads and
#: "Loading weights", datasets' maps): a bar's stderr block would land in the executed notebook
QUIET_LIBRARIES = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
#: warnings filtered in the kernel (added to PYTHONWARNINGS): tqdm.auto's "IProgress not found",
#: raised when ``transformers`` or ``datasets`` import it in a kernel without ipywidgets (their
#: bars are off above, so the widget it asks for would never be drawn)
QUIET_WARNINGS = ("ignore:IProgress not found",)


def read_notebook(path: str | Path):
    """A jupytext percent ``.py`` notebook (or an ``.ipynb``) as a NotebookNode."""
    import jupytext

    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"{path}: notebook not found")
    return jupytext.read(path)


def declared_parameters(nb) -> list[str]:
    """Names assigned in the cell tagged ``parameters`` (in order)."""
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise NotebookError(f"expected exactly one cell tagged 'parameters', found {len(cells)}")
    names: list[str] = []
    for node in ast.parse(cells[0].source).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if not isinstance(t, ast.Name):
                raise NotebookError("the parameters cell may only assign plain names")
            names.append(t.id)
    return names


def check_parameters(nb, passed: dict, notebook: str) -> None:
    declared = declared_parameters(nb)
    extra = sorted(set(passed) - set(declared))
    if extra:
        raise NotebookError(f"{notebook}: parameter {extra[0]!r} is passed but not declared")
    unset = sorted(set(declared) - set(passed))
    if unset:
        raise NotebookError(f"{notebook}: declared parameter {unset[0]!r} is not passed (nbrun "
                            "passes params_file, and unit or point where given)")


def parse_items(pairs: list[str]) -> dict[str, str]:
    """``["depth=3", ...]`` -> ``{"depth": "3"}`` (values are parsed by the params schema)."""
    items: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ParamsError(f"--item {pair!r}: expected KEY=VALUE")
        if key in items:
            raise ParamsError(f"--item {key}: given twice")
        items[key] = value
    return items


def run(notebook: str, output: str, sections: list[str], params_file: str = PARAMS_FILE,
        cwd: str | None = None, items: list[str] | None = None, unit: str | None = None,
        device: bool = True) -> None:
    """Execute ``notebook`` into ``output`` with the ``sections`` of ``params_file`` (and a
    matrix item's ``items``; ``unit``: the notebook's ``unit`` parameter, one independent unit
    of a stage). ``device=False``: the stage only gathers other stages' results, so no device
    is checked."""
    params = load_params(params_file)
    base = params["base"]
    if device:
        require_device(base.scale, base.device, sections)
    nb = read_notebook(notebook)
    point = parse_items(items or [])
    params.grid_point(sections, point)  # the sections exist, the grid point is on the grid
    values: dict = {"params_file": str(Path(params_file).resolve())}
    if unit is not None:
        values["unit"] = unit
    if point:
        values["point"] = point
    check_parameters(nb, values, notebook)

    import papermill as pm

    # the kernel is always python3, whatever a notebook's header says
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    label = f"nbrun: {Path(notebook).stem}" + "".join(
        f" {v}" for v in [unit, *(i.partition("=")[2] for i in items or [])] if v)
    # Execute into a temporary file and rename: a failed run never leaves a half report.
    fd, tmp = tempfile.mkstemp(suffix=".ipynb", dir=out.parent, prefix=f".{out.stem}.")
    os.close(fd)
    # the kernel's progress goes to a console file relayed here (attncert.pipeline.progress), never
    # into the report; the kernel's own output stays in the notebook
    fd, console = tempfile.mkstemp(suffix=".log", prefix="attncert-console-")
    os.close(fd)
    gpu_peak = Path(tempfile.gettempdir()) / f"attncert-gpu-peak-{os.getpid()}-{Path(tmp).stem}"
    tty = sys.stderr.isatty()
    warn = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), *QUIET_WARNINGS) if w)
    env = {CONSOLE_ENV: console, TTY_ENV: "1" if tty else "0", GPU_PEAK_ENV: str(gpu_peak),
           "PYTHONWARNINGS": warn, **QUIET_LIBRARIES}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    t0 = time.monotonic()
    print(f"{label}: started", file=sys.stderr, flush=True)
    try:
        with quiet_kernel_start(), Relay(console, sys.stderr, label):
            pm.execute_notebook(
                nb, tmp, parameters=values, kernel_name=KERNEL, language="python",
                cwd=cwd or os.getcwd(), progress_bar=False, log_output=False,
                report_mode=False, extra_arguments=[KERNEL_LOG_LEVEL],
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
        out.with_name(out.stem + ".failed.ipynb").unlink(missing_ok=True)
        seconds = time.monotonic() - t0
        write_headline(params, output, seconds, peak_memory_gb(), cwd,
                       gpu_peak_gb=read_gpu_peak(gpu_peak))
        print(f"{label}: done in {elapsed(seconds)}", file=sys.stderr, flush=True)
    except BaseException:
        # keep the failed notebook next to the output for debugging
        failed = out.with_name(out.stem + ".failed.ipynb")
        if Path(tmp).exists():
            os.replace(tmp, failed)
            print(f"{label}: failed after {elapsed(time.monotonic() - t0)}; the notebook is "
                  f"in {failed}", file=sys.stderr)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        Path(console).unlink(missing_ok=True)
        gpu_peak.unlink(missing_ok=True)


def peak_memory_gb() -> float:
    """The largest peak resident memory of this process and of its finished children (the
    notebook's kernel), in GB (10^9 bytes)."""
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return round(peak * scale / 1e9, 3)


def read_gpu_peak(path: Path) -> float | None:
    """The kernel's peak GPU memory in GB (:func:`attncert.pipeline.runtime.record_gpu_peak`);
    None when it wrote none (a CPU run)."""
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_headline(params, output: str, seconds: float, peak_gb: float,
                   cwd: str | None = None, gpu_peak_gb: float | None = None) -> list[str]:
    """Write the DVC metrics (the headline) of the dvc.yaml stage whose report is ``output``:
    the stage's few numbers (:func:`attncert.report.rows.headline_numbers`, from its metrics file)
    and the run's seconds, peak host memory and, on a GPU, peak GPU memory (``gpu_peak_gb``).
    Returns the files written (none when no stage of dvc.yaml writes ``output``: nbrun run by
    hand)."""
    from attncert.pipeline.dvcfile import DVC_FILE, read_stages, stage_runs
    from attncert.pipeline.io import write_json
    from attncert.report.rows import headline_numbers

    root = Path(cwd or os.getcwd())
    if not (root / DVC_FILE).is_file():
        return []
    target = (root / output).resolve()
    written = []
    for r in stage_runs(read_stages(root / DVC_FILE), params):
        if r.notebook is None or (root / r.notebook).resolve() != target:
            continue
        values: dict = {}
        for path in r.metrics[:1]:
            f = root / path
            if f.is_file():
                values = headline_numbers(r.stage, json.loads(f.read_text()), r.item)
        for path in r.headline:
            gpu = {} if gpu_peak_gb is None else {"gpu_peak_gb": gpu_peak_gb}
            write_json(root / path, {**values, "seconds": round(seconds, 1),
                                     "peak_gb": peak_gb, **gpu})
            written.append(path)
    return written


#: the kernel's own log (its "running over TCP without encryption" notice at every start): errors
#: only; the notebook's output is unaffected
KERNEL_LOG_LEVEL = "--IPKernelApp.log_level=ERROR"


@contextlib.contextmanager
def quiet_kernel_start():
    """Silence the known, harmless notices of starting a kernel in this process: papermill's
    and jupyter_client's INFO logs and nbclient's unencrypted-transport warning."""
    import logging

    loggers = [logging.getLogger(n) for n in ("papermill", "traitlets", "jupyter_client")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without encryption.*")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.nbrun",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("notebook", help="jupytext .py (percent) notebook")
    ap.add_argument("output", help="executed .ipynb to write")
    ap.add_argument("--section", action="append", required=True,
                    help="params.yaml section (or one parameter, section.key) the stage "
                         "reads, as dvc.yaml's params (repeatable)")
    ap.add_argument("--item", action="append", default=[], metavar="KEY=VALUE",
                    help="one value of a list parameter: the grid point of a DVC matrix stage")
    ap.add_argument("--unit", help="the notebook's `unit` parameter: one independent unit of a "
                                   "stage (the stage's module lists them)")
    ap.add_argument("--no-device", action="store_true",
                    help="the stage gathers other stages' results only: no device check")
    ap.add_argument("--params", default=PARAMS_FILE, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    try:
        run(args.notebook, args.output, args.section, args.params, items=args.item,
            unit=args.unit, device=not args.no_device)
    except (ParamsError, NotebookError, DeviceError) as exc:
        print(f"nbrun: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from papermill.exceptions import PapermillExecutionError

        if not isinstance(exc, PapermillExecutionError):
            raise
        print(f"nbrun: {args.notebook} failed in cell {exc.exec_count}: {exc.ename}: {exc.evalue}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
