"""SpecFormer's study: :mod:`~attncert.specformer.methods` (five training methods on one ViT
skeleton, attacked and timed), :mod:`~attncert.specformer.params` (the section's schema) and
:mod:`~attncert.specformer.study` (the stage's runs: recipes, units, Table 5's ablation, the
certified pair)."""
