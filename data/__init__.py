"""Pre-training data: corpus -> WordPiece ids -> MLM/NSP instances -> HDF5 shards -> loader.

The `prepare-data` pipeline (`popbert.data.prepare`: dump → `wikipedia` → `sentences` →
`vocab` → instances → `packing`) makes sharded data at scale; see docs/data.md.

The library ships a small real corpus (a slice of Wikipedia leads, CC BY-SA 4.0) and a matching
8192-entry vocabulary, so `load_or_create_instances(None, None, 128, 20, seed)` works from a
fresh clone. See `resources/ATTRIBUTION.md`.
"""

from popbert.data.corpus import expand_input_files, read_documents, read_text_documents
from popbert.data.errors import DataError
from popbert.data.hdf5 import (
    SCHEMA_VERSION,
    ShardInfo,
    check_shard_info,
    read_shard,
    read_shard_info,
    write_shard,
)
from popbert.data.instances import (
    FEATURE_NAMES,
    InstanceCreator,
    InstanceOptions,
    TrainingInstance,
    create_instance_arrays,
    create_pretraining_arrays,
    instances_to_arrays,
    truncate_seq_pair,
)
from popbert.data.loader import PretrainingLoader, default_cache_dir, load_or_create_instances
from popbert.data.packing import (
    NSP_IGNORE,
    PACKED_FEATURE_NAMES,
    PackingStats,
    histogram_packing,
    pack_instance_arrays,
)
from popbert.data.tokenization import (
    JsonTokenizer,
    TextTokenizer,
    WordPieceTokenizer,
    bundled_corpus_path,
    bundled_vocab_path,
    file_sha256,
    load_tokenizer,
)

__all__ = [
    "FEATURE_NAMES",
    "NSP_IGNORE",
    "PACKED_FEATURE_NAMES",
    "SCHEMA_VERSION",
    "DataError",
    "InstanceCreator",
    "InstanceOptions",
    "PackingStats",
    "PretrainingLoader",
    "ShardInfo",
    "TrainingInstance",
    "WordPieceTokenizer",
    "JsonTokenizer",
    "TextTokenizer",
    "load_tokenizer",
    "bundled_corpus_path",
    "bundled_vocab_path",
    "check_shard_info",
    "create_instance_arrays",
    "create_pretraining_arrays",
    "default_cache_dir",
    "expand_input_files",
    "file_sha256",
    "histogram_packing",
    "instances_to_arrays",
    "load_or_create_instances",
    "pack_instance_arrays",
    "read_documents",
    "read_shard",
    "read_shard_info",
    "read_text_documents",
    "truncate_seq_pair",
    "write_shard",
]
