"""Resume restores the random state of the current device only, whatever devices were visible
when the checkpoint was written."""

import torch
from torch import nn

from attncert.training import checkpoint
from attncert.training.checkpoint import load_checkpoint, save_checkpoint


def _write(path, cuda_state):
    model = nn.Linear(2, 2)
    save_checkpoint(path, {"lr": 1.0}, {"model": model}, 3, [{"epoch": 3}])
    ckpt = torch.load(path, weights_only=True)
    ckpt["rng"]["cuda"] = cuda_state
    torch.save(ckpt, path)
    return model


def test_resume_with_fewer_visible_gpus_than_when_saved(tmp_path, monkeypatch):
    """A checkpoint of an 8-GPU machine (every device's state) resumes on a 1-GPU one: the
    current device gets one state, nothing indexes the missing devices."""
    path = tmp_path / "ckpt.pt"
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    _write(path, states)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": calls.append(s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda s: (_ for _ in ()).throw(AssertionError("all devices restored")))
    rows, epoch, _ = load_checkpoint(path, {"lr": 1.0}, {"model": nn.Linear(2, 2)})
    assert epoch == 3 and rows == [{"epoch": 3}]
    assert len(calls) == 1 and torch.equal(calls[0], states[0])


def test_a_gpu_checkpoint_resumes_on_a_cpu_machine(tmp_path):
    path = tmp_path / "ckpt.pt"
    _write(path, torch.zeros(16, dtype=torch.uint8))
    torch.manual_seed(123)
    expected = torch.get_rng_state()
    ckpt = torch.load(path, weights_only=True)
    _, epoch, _ = load_checkpoint(path, {"lr": 1.0}, {"model": nn.Linear(2, 2)})
    assert epoch == 3
    if not torch.cuda.is_available():
        assert torch.equal(torch.get_rng_state(), ckpt["rng"]["torch"])
        assert not torch.equal(expected, ckpt["rng"]["torch"])


def test_saved_state_names_one_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.ones(4))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all",
                        lambda: (_ for _ in ()).throw(AssertionError("every device saved")))
    state = checkpoint._rng_state()
    assert torch.equal(state["cuda"], torch.ones(4))


def test_an_evaluation_batch_change_resumes_the_run(tmp_path):
    """Lowering eval_batch_size (say after an out-of-memory error) keeps the checkpoint; a
    training setting still clears it."""
    from attncert.training.checkpoint import prepare_checkpoint_dir

    fp = {"model": {"dim": 8}, "train": {"lr": 1.0, "eval_batch_size": 500}, "sha": "a"}
    ckpt = tmp_path / "run"
    assert prepare_checkpoint_dir(ckpt, fp) == "fresh"
    (ckpt / "ckpt.pt").write_text("state")
    smaller = {**fp, "train": {"lr": 1.0, "eval_batch_size": 125}, "sha": "b"}
    assert prepare_checkpoint_dir(ckpt, smaller) == "resume"
    assert (ckpt / "ckpt.pt").exists()
    other = {**fp, "train": {"lr": 0.5, "eval_batch_size": 125}, "sha": "c"}
    assert prepare_checkpoint_dir(ckpt, other).startswith("cleared: train")
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"lr": 1.0, "eval_batch_size": 500}, {"model": nn.Linear(2, 2)}, 2, [])
    _, epoch, _ = load_checkpoint(path, {"lr": 1.0, "eval_batch_size": 64},
                                  {"model": nn.Linear(2, 2)})
    assert epoch == 2
