"""The pipeline's plumbing: the stage contract's context (:mod:`.context`), the params schema
(:mod:`.params`) and scales (:mod:`.profile`),
the notebook runner (:mod:`.nbrun`), dvc.yaml (:mod:`.dvcfile`), run names and records
(:mod:`.runs`, :mod:`.records`), atomic files (:mod:`.io`), seeds (:mod:`.rng`), threads and
determinism (:mod:`.runtime`), progress bars (:mod:`.progress`), out-of-memory batching
(:mod:`.batching`) and the machine check (:mod:`.doctor`)."""
