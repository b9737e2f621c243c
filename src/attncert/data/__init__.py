"""Datasets: fetch (local mirror first, then the real download), load, subset, save.

Every image dataset is loaded through torchvision's own dataset class with
``download=False`` once its raw files are in place; only the source of those raw files
differs:

1. a local mirror in torchvision's ``<mirror>/<Dataset>/raw`` layout (``../shared/datasets``
   by default, ``data.mirror`` in params.yaml, ``$ATTNCERT_DATA_MIRROR`` overrides both);
   files are copied or decompressed into ``data/raw``, the mirror is never modified;
2. the real download (torchvision ``download=True``; SST-2 from GLUE; Yelp polarity and QQP
   through Hugging Face ``datasets``, written out in their original file layout).

A dataset listed in ``data.optional`` that neither route provides is skipped, never fatal: its
processed file records why (the same record as a skipped sample).

Processed outputs hold uint8 pixels (N, C, H, W) and per-channel mean/std of the training
split in [0, 1] pixel space: models normalise inside, so eps stays in pixel space.
"""

from attncert.data.common import (
    MIRROR_ENV,
    SOURCE_MARKER,
    TEXT_FOLDER,
    DataUnavailable,
    channel_stats,
    resolve_mirror,
    subset_indices,
)
from attncert.data.hub_text import (
    HUB_TEXT_DATASETS,
    QQP_COLUMNS,
    HubTextDataset,
    fetch_hub_text,
    process_hub_text,
    read_qqp_tsv,
    read_yelp_csv,
)
from attncert.data.images import IMAGE_DATASETS, ImageDataset, fetch_image, process_image
from attncert.data.processed import (
    as_float,
    dataset_skipped,
    load_processed,
    sample_skipped,
)
from attncert.data.samples import (
    SAMPLE_FOLDERS,
    load_imagenet_val,
    load_sample,
    sample_classes,
)
from attncert.data.sst2 import SST2_GLUE_URL, fetch_sst2, process_sst2, read_sst2_tsv
from attncert.data.stage import fetch, prepare, skipped_dataset, skipped_sample, summary_row

__all__ = [
    "HUB_TEXT_DATASETS", "IMAGE_DATASETS", "MIRROR_ENV", "QQP_COLUMNS", "SAMPLE_FOLDERS",
    "SOURCE_MARKER", "SST2_GLUE_URL", "TEXT_FOLDER", "DataUnavailable", "HubTextDataset",
    "ImageDataset", "as_float", "channel_stats", "dataset_skipped", "fetch", "fetch_hub_text",
    "fetch_image", "fetch_sst2", "load_imagenet_val", "load_processed", "load_sample", "prepare",
    "process_hub_text", "process_image", "process_sst2", "read_qqp_tsv", "read_sst2_tsv",
    "read_yelp_csv", "resolve_mirror", "sample_classes", "sample_skipped", "skipped_dataset",
    "skipped_sample", "subset_indices", "summary_row",
]
