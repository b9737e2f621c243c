"""base.threads and base.deterministic reach PyTorch in every stage's process."""

import torch

from attncert.pipeline.params import BaseParams
from attncert.pipeline.runtime import configure


def _base(**kw):
    return BaseParams(**({"scale": "smoke", "seed": 0, "device": "cpu", "precision": "fp32",
                          "threads": 0, "deterministic": False, "compile": "off"} | kw))


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
