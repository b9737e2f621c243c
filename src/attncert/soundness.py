"""The soundness check every stage runs after its PGD audit.

A certified point that an attack breaks, or a certified accuracy above the accuracy under
attack, means a bound is wrong: the stage fails with :class:`UnsoundCertificateError`, whose
message names every broken model / variant / eps with its count. The audit rows are those of
:func:`attncert.certify.audit` (a ``broken_<variant>`` column per certified variant) and
:func:`attncert.text.attacks.audit_embeddings` (one ``broken`` column), one row per eps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BROKEN = "broken"


class UnsoundCertificateError(RuntimeError):
    """A certificate an attack broke, or a certified accuracy above an attack's accuracy."""


def broken_counts(audits: Mapping[str, Sequence[Mapping[str, Any]]],
                  by: Sequence[str] = ()) -> dict[str, dict[float, int]]:
    """{label: {eps: broken certificates}} from audit rows grouped by name.

    A label joins the name (when not empty), ``<column> <value>`` for each ``by`` column of
    the row (``depth`` in the CROWN study) and the variant of a ``broken_<variant>`` column.
    A row without ``eps``, a ``by`` column or any broken count is a ValueError: an audit that
    counts nothing cannot pass.
    """
    out: dict[str, dict[float, int]] = {}
    for name, rows in audits.items():
        for row in rows:
            missing = [k for k in ("eps", *by) if k not in row]
            cols = [k for k in row if k == BROKEN or k.startswith(f"{BROKEN}_")]
            if missing or not cols:
                raise ValueError(f"audit row of {name!r} lacks "
                                 f"{', '.join(missing) or 'a broken count'}: {dict(row)}")
            where = [name] if name else []
            where += [f"{k} {row[k]}" for k in by]
            for col in cols:
                label = " / ".join(where + ([col[len(BROKEN) + 1:]] if col != BROKEN else []))
                out.setdefault(label, {})[float(row["eps"])] = int(row[col])
    return out


def require_sound(audits: Mapping[str, Sequence[Mapping[str, Any]]],
                  accuracies: Mapping[str, tuple[Mapping[Any, float], Mapping[Any, float]]]
                  | None = None, by: Sequence[str] = (), see: str = "") -> None:
    """Raise :class:`UnsoundCertificateError` when a certificate is broken or a certified
    accuracy exceeds the attacked one; return None otherwise.

    ``audits``: {name: audit rows} (:func:`broken_counts`, with ``by``). ``accuracies``:
    {label: (certified accuracy by eps, accuracy under attack by eps)}; every eps of the
    first must be in the second (else ValueError). ``see``: where the per-sample results lie,
    appended to the message.
    """
    broken = [(label, eps, n) for label, counts in broken_counts(audits, by).items()
              for eps, n in counts.items() if n]
    over = []
    for label, (certified, attacked) in (accuracies or {}).items():
        missing = [e for e in certified if e not in attacked]
        if missing:
            raise ValueError(f"{label}: no accuracy under attack at eps {missing}")
        over += [(label, e, a, attacked[e]) for e, a in certified.items() if a > attacked[e]]
    if not broken and not over:
        return
    parts = []
    if broken:
        parts.append(f"{sum(n for *_, n in broken)} certified point(s) broken by PGD ("
                     + "; ".join(f"{label} at eps {e:g}: {n}" for label, e, n in broken) + ")")
    if over:
        parts.append("certified accuracy above PGD accuracy ("
                     + "; ".join(f"{label} at eps {e}: {a:.4g} > {b:.4g}"
                                 for label, e, a, b in over) + ")")
    raise UnsoundCertificateError("unsound certificates, a bound is wrong: " + "; ".join(parts)
                                  + (f" (see {see})" if see else ""))
