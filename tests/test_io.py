"""Atomic, reproducible writes."""

import json

import torch

from attncert.pipeline.io import merge_rows, torch_save, write_json


def test_torch_save_is_byte_reproducible_and_loads(tmp_path):
    obj = {"x": torch.arange(12, dtype=torch.uint8).view(3, 4), "name": "mnist", "mean": [0.13]}
    torch_save(obj, tmp_path / "a.pt")
    first = (tmp_path / "a.pt").read_bytes()
    torch_save(obj, tmp_path / "a.pt")
    assert (tmp_path / "a.pt").read_bytes() == first  # DVC sees an unchanged output
    back = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(back["x"], obj["x"]) and back["name"] == "mnist"
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temporary file left


def test_write_json_sorted_and_atomic(tmp_path):
    write_json(tmp_path / "sub" / "m.json", {"b": 1, "a": 2})
    assert (tmp_path / "sub" / "m.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_merge_rows_replaces_rows_by_key_and_keeps_the_rest(tmp_path):
    path = tmp_path / "record.json"
    key = lambda r: r["k"]  # noqa: E731
    merge_rows(path, [{"k": 2, "v": "old"}, {"k": 1, "v": "kept"}], key)
    record = merge_rows(path, [{"k": 2, "v": "new"}], key, ordered=True,
                        update=lambda rec: rec.update(note="updated"))
    assert record == json.loads(path.read_text())
    assert record["rows"] == [{"k": 1, "v": "kept"}, {"k": 2, "v": "new"}]
    assert record["note"] == "updated"
