"""The study report: every stage's headline rows (:mod:`.rows`, :mod:`.headline`), the
paper numbers beside them (:mod:`.paper`, :mod:`.fidelity`), README's results block
(:mod:`.readme`) and the HTML export (:mod:`.htmlexport`). Commands: ``python -m
attncert.report summary|readme|html``."""
