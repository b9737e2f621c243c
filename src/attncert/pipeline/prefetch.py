"""Fetch every Hugging Face hub model the params file names, before an offline run.

    python -m attncert.pipeline.prefetch            # the hub ids of params.yaml, into the HF cache
    python -m attncert.pipeline.prefetch --list     # print them and stop

Compute nodes of a cluster often have no network: run this (and ``dvc repro data``, which
downloads the datasets) once on a node that has, then run the units with ``HF_HUB_OFFLINE=1``.
It reads SpecFormer's pre-trained sources, CertViT's source and ImageNet-route sources, the
text stage's tokenizer and frozen encoder; a value that is a keyword of its stage
(``scratch``, ``pipeline``, ``tiny``, ``none``, ``minilm-package``) or a local folder or file is
not a hub id and is left out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: values of the source keys that name no hub model
KEYWORDS = frozenset({"scratch", "pipeline", "tiny", "none", "minilm-package", ""})


def _get(raw: Mapping[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


#: the params keys that may hold hub ids (a string or a list of them)
SOURCE_KEYS = ("specformer.sources", "certvit.source", "certvit.imagenet.sources",
               "text.tokenizer", "text.frozen.source")


def hub_ids(raw: Mapping[str, Any]) -> list[str]:
    """The distinct hub ids (``owner/name`` or ``name``) the params file names, in key order."""
    out: list[str] = []
    for key in SOURCE_KEYS:
        value = _get(raw, key)
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, str) or v in KEYWORDS or v in out:
                continue
            if Path(v).expanduser().exists() or v.startswith((".", "/", "~")) or v.count("/") > 1:
                continue  # a local folder or file
            if v.endswith((".pt", ".pth", ".bin", ".safetensors")):
                continue
            out.append(v)
    return out


def prefetch(ids: list[str], download: Callable[[str], str] | None = None) -> dict[str, str]:
    """Download each hub id into the Hugging Face cache; {id: local folder}. The first failure
    stops the run with its id named."""
    if download is None:
        from huggingface_hub import snapshot_download as download
    done = {}
    for i, repo in enumerate(ids, 1):
        print(f"prefetch {i}/{len(ids)}: {repo}", flush=True)
        try:
            done[repo] = download(repo)
        except Exception as exc:  # network, auth, unknown id: one line naming the id
            raise RuntimeError(f"prefetch: {repo}: {type(exc).__name__}: {exc}") from exc
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.prefetch",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--list", action="store_true", help="print the hub ids and stop")
    args = ap.parse_args(argv)
    from attncert.pipeline.params import read_yaml

    ids = hub_ids(read_yaml(args.params) or {})
    if args.list:
        print("\n".join(ids))
        return 0
    if not ids:
        print(f"prefetch: {args.params} names no hub model")
        return 0
    try:
        for repo, folder in prefetch(ids).items():
            print(f"{repo} -> {folder}")
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
