"""base.threads and base.deterministic reach PyTorch in every stage's process."""

import torch

from attncert.pipeline.params import BaseParams
from attncert.pipeline.runtime import configure


def _base(**kw):
    return BaseParams(**({"scale": "smoke", "seed": 0, "device": "cpu", "precision": "fp32",
                          "threads": 0, "deterministic": False, "compile": "off",
                          "batch_memory": 0.0} | kw))


def test_threads_and_deterministic_algorithms(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    threads = torch.get_num_threads()
    try:
        configure(_base(threads=1, deterministic=True))
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        configure(_base())  # 0 threads: left as they are; determinism off
        assert torch.get_num_threads() == 1 and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def test_every_stage_notebook_configures_first():
    from pathlib import Path

    for nb in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.py")):
        text = nb.read_text()
        if 'parse_section("base"' in text:
            assert 'b = parse_section("base", base, BaseParams)\nconfigure(b)' in text, nb.name


class _Shell:
    """IPython's event registry, as a notebook's kernel has it."""

    def __init__(self):
        self.callbacks = []
        self.events = self

    def register(self, event, fn):
        assert event == "post_run_cell"
        self.callbacks.append(fn)


def test_the_kernel_writes_its_gpu_peak_after_every_cell(tmp_path, monkeypatch):
    import IPython

    from attncert.pipeline import nbrun, runtime

    shell, out = _Shell(), tmp_path / "peak"
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(runtime, "_HOOKED", set())
    monkeypatch.delenv(runtime.GPU_PEAK_ENV, raising=False)
    runtime.record_gpu_peak()
    assert shell.callbacks == []  # not run by nbrun: nothing to report to
    monkeypatch.setenv(runtime.GPU_PEAK_ENV, str(out))
    runtime.record_gpu_peak()
    runtime.record_gpu_peak()  # configure runs once per stage; a kernel is hooked once
    assert len(shell.callbacks) == 1
    peaks = iter([None, 1.25, 3.5])
    monkeypatch.setattr(runtime, "gpu_peak_gb", lambda: next(peaks))
    shell.callbacks[0](object())  # a CPU run so far: no file
    assert not out.exists() and nbrun.read_gpu_peak(out) is None
    shell.callbacks[0](object())
    shell.callbacks[0](object())  # every cell rewrites it with the peak so far
    assert nbrun.read_gpu_peak(out) == 3.5 and not list(tmp_path.glob("*.tmp"))


def test_no_gpu_peak_without_cuda():
    from attncert.pipeline import runtime

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        assert runtime.gpu_peak_gb() is None


def test_the_headline_carries_the_gpu_peak_only_from_a_gpu_run(tmp_path):
    import json
    from pathlib import Path

    from attncert.pipeline.nbrun import write_headline
    from attncert.stages.registry import load_params

    root = Path(__file__).resolve().parents[1]
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((root / name).read_text())
    params = load_params(tmp_path / "params.yaml")
    report = "reports/notebooks/02_tightness.ipynb"
    (path,) = write_headline(params, report, 12.0, 1.5, str(tmp_path))
    assert "gpu_peak_gb" not in json.loads((tmp_path / path).read_text())
    write_headline(params, report, 12.0, 1.5, str(tmp_path), gpu_peak_gb=7.25)
    head = json.loads((tmp_path / path).read_text())
    assert head["gpu_peak_gb"] == 7.25 and head["peak_gb"] == 1.5 and head["seconds"] == 12.0
