"""hypertrain.common.data: token datasets, training batches and holdout windows.

- ``prepare`` (build.py): text files or folders -> byte-level token shards
  plus ``manifest.json`` with a fingerprint, written atomically.
- ``TokenDataset`` (dataset.py): a prepared folder, memory-mapped and checked.
- ``SampleStream`` / ``holdout_windows`` (sampling.py): seeded windows; step t
  depends only on (seed, t); replica batches slice the global batch; holdout
  windows never overlap training windows.
- manifest.py: the ``manifest.json`` format and its fingerprint.

Invariant: every bad-data failure is a ``DataError`` with one line naming the
file and the problem; same dataset + seed gives the same tokens in any process.
"""

from hypertrain.common.data.build import (
    DEFAULT_CORPUS_BYTES,
    DEFAULT_SEPARATOR,
    DEFAULT_SHARD_TOKENS,
    DEFAULT_SUFFIXES,
    SourceFile,
    collect,
    prepare,
    stdlib_corpus,
)
from hypertrain.common.data.dataset import (
    DATA_DIR_ENV,
    TokenDataset,
    default_data_dir,
    ensure_default_dataset,
)
from hypertrain.common.data.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    SourceInfo,
    read_manifest,
)
from hypertrain.common.data.sampling import (
    HOLDOUT_WINDOWS,
    Holdout,
    SampleStream,
    holdout_region_tokens,
    holdout_windows,
    train_end,
    windows_digest,
)

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_CORPUS_BYTES",
    "DEFAULT_SEPARATOR",
    "DEFAULT_SHARD_TOKENS",
    "DEFAULT_SUFFIXES",
    "FORMAT",
    "FORMAT_VERSION",
    "HOLDOUT_WINDOWS",
    "MANIFEST_NAME",
    "Holdout",
    "Manifest",
    "SampleStream",
    "ShardInfo",
    "SourceFile",
    "SourceInfo",
    "TokenDataset",
    "collect",
    "default_data_dir",
    "ensure_default_dataset",
    "holdout_region_tokens",
    "holdout_windows",
    "prepare",
    "read_manifest",
    "stdlib_corpus",
    "train_end",
    "windows_digest",
]
