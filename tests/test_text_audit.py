"""The text models' read-outs that share work across batches and radii: the OLSA
certificates' Lipschitz constants solved once per sentence length, and the PGD audit attacking
only the sentences still standing."""

import pytest
import torch
from helpers import toy_sentences as _toy
from test_text_models import _olsa

from attncert.text.attacks import audit_embeddings
from attncert.text.train_text import certify_rows, evaluate_text

F64 = torch.float64


def test_the_text_audit_attacks_only_the_sentences_still_standing(monkeypatch):
    """The radii run in ascending order and each attacks the sentences neither misclassified
    nor broken at a smaller radius; an adversarial example found at a smaller radius counts at
    every larger one (robust accuracy never grows with eps), a certificate it contradicts
    there included; the rows keep the order of the grid."""
    from test_device import _olsa_text

    from attncert.text import attacks

    model, ids, mask, y = _olsa_text()
    correct = model(ids, mask).argmax(1) == y
    calls = []
    real = attacks.pgd_embeddings

    def pgd(f, e, yb, eps, *args, **kwargs):
        calls.append((eps, len(e)))
        return real(f, e, yb, eps, *args, **kwargs)

    monkeypatch.setattr(attacks, "pgd_embeddings", pgd)
    unsound = torch.full((6,), 10.0, dtype=F64)  # planted: every correct sentence "certified"
    rows = audit_embeddings(model, ids, mask, y, unsound, [5.0, 0.05, 2.0, 3.0], steps=10,
                            restarts=1)
    assert [r["eps"] for r in rows] == [5.0, 0.05, 2.0, 3.0]
    by = {r["eps"]: r for r in rows}
    grid = sorted(by)
    standing = [round(6 * by[e]["robust_acc"]) for e in grid]
    assert [by[e]["attacked"] for e in grid] == [int(correct.sum()), *standing[:-1]]
    # one batch a radius, ascending; none where no sentence is left
    assert calls == [(e, by[e]["attacked"]) for e in grid if by[e]["attacked"]]
    assert standing == sorted(standing, reverse=True) and standing[0] > standing[-1]
    # every success on a "certified" sentence is a broken certificate, carried ones included
    assert [by[e]["broken"] for e in grid] == [int(correct.sum()) - k for k in standing]
    assert by[5.0]["broken"] > by[2.0]["broken"] or by[2.0]["broken"] > 0


@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_olsa_certificates_solve_each_lengths_constant_once(attention, monkeypatch):
    """certify_rows and evaluate_text read each sentence length's Lipschitz constant from one
    call of ``lipschitz`` (length_lipschitz): the radii, the label's and the prediction's, are
    the per-batch ``certified_radius``'s to the bit, and the constants are solved once a call,
    not once a batch."""
    from attncert.text.train_text import certificate_copy, length_lipschitz

    model, data = _olsa(attention), _toy(13)
    assert len(data["mask"].sum(1).unique()) > 2  # several lengths, some batches mixed
    model64 = certificate_copy(model)
    e = model.embed(data["ids"], data["mask"]).double()
    pred = model64(e, data["mask"]).argmax(1)
    parts = [(e[a:a + 4], data["mask"][a:a + 4], data["y"][a:a + 4], pred[a:a + 4])
             for a in range(0, 13, 4)]
    ref = torch.cat([model64.certified_radius(*p[:3]) for p in parts])
    ref_pred = torch.cat([model64.certified_radius(p[0], p[1], p[3]) for p in parts])
    table = length_lipschitz(model64, data["mask"])
    assert torch.equal(table[data["mask"].sum(1)], model64.lipschitz(data["mask"]))
    assert table[0].isnan() and table.dtype == F64
    assert length_lipschitz(model64, data["mask"][:0]).isnan().all()  # nothing to solve

    calls = []
    lipschitz = type(model).lipschitz
    monkeypatch.setattr(type(model), "lipschitz",
                        lambda self, mask: calls.append(len(mask)) or lipschitz(self, mask))
    rows = certify_rows(model, data, batch_size=4)
    assert calls == [len(data["mask"].sum(1).unique())]  # one probe row per length
    assert torch.equal(torch.tensor(rows.radius.to_numpy()), ref)
    assert torch.equal(torch.tensor(rows.radius_predicted.to_numpy()), ref_pred)
    assert ref.gt(0).any() and (rows.seconds > 0).all()
    calls.clear()
    ev = evaluate_text(model, data, batch_size=4)
    assert len(calls) == 1 and ev["avg_radius"] == pytest.approx(float(ref.mean()), rel=1e-12)
