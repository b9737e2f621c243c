"""Training: the resumable loop (:mod:`.train`, :mod:`.loop`), its losses and margins
(:mod:`.losses`, :mod:`.certified_training`), mixed batches (:mod:`.mix`), the precision
policy (:mod:`.precision`) and checkpoints (:mod:`.checkpoint`)."""
