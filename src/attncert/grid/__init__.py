"""The ViT grid (``vit_grid``: dataset x depth x heads x gamma_vo): its schema
(:mod:`attncert.grid.params`); the stages ``train_vit`` and ``certify_vit`` run its points."""
