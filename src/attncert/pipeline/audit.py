"""The soundness audit's settings: one params group of one shape in every section that
certifies (``certify_vit.audit``, ``frontier.audit``, ``specformer.certified.audit``,
``crown.audit``, ``text.audit``, ``certvit.audit``)."""

from __future__ import annotations

from dataclasses import dataclass

from attncert.pipeline.params import nonneg, param, positive


@dataclass(frozen=True)
class Audit:
    """A section's PGD soundness audit (params.yaml ``<section>.audit``, one shape in every
    section that certifies): L2 PGD of ``steps`` x ``restarts`` at every certified eps on the
    first ``n`` certified points, ``batch_size`` at a time (halved on a CUDA out-of-memory
    error). A point PGD breaks inside its certified radius fails the stage."""

    n: int = param(nonneg, doc="the first n certified points attacked (0 = all of them)")
    steps: int = param(positive, doc="PGD steps per restart")
    restarts: int = param(positive, doc="random starts per point")
    batch_size: int = param(nonneg, doc="points attacked at once (0 = the section's "
                                        "certificate batch)")

    def count(self, n_points: int) -> int:
        """How many of ``n_points`` certified points the audit attacks."""
        return n_points if self.n == 0 else min(self.n, n_points)

    def batch(self, certificate_batch: int) -> int:
        """The audit's batch: its own, or (0) the section's certificate batch."""
        return self.batch_size or certificate_batch
