"""The HDF5 feature cache (docs/internals.md, "cache"): find it, write it, validate it, read it back.

One file per dataset x backbone x resolution. Every write goes to `<name>.h5.partial` and is renamed to
`<name>.h5` only once complete, so a file under the final name is never half-written. Extraction fills the
partial file batch by batch (`PartialCache`) and can resume from it; `write` is the one-shot writer.

Inside a partial file the arrays are allocated when the file is created, so writing rows later touches no
HDF5 metadata: a process killed between batches leaves a file that opens and resumes. A partial file also
holds `/{split}/bad` (rows whose image could not be decoded), which finalisation turns into dropped rows, and
`/{split}/recomputed` (rows recomputed in fp32 after non-finite features in fp16/bf16), counted in `recomputed_fp32`.
Label matrices of many classes are stored sparse (CSR, `csr.py`) and read back as `labels.SparseLabels`; features may
be stored float16 and `load(in_memory=False)` leaves them in the file (stage two out of core).
`load` refuses non-finite features and labels outside their value sets, naming the rows. A CLIP cache also holds a
text side (class text embeddings, every split's image embeddings, optionally a crop grid's), which `load` reads
into the FeatureSet when present (docs/internals.md, "The text side").
"""

from spml_cache.cache.reading import (
    StoredFeatures, describe_rows, feature_shapes, invalid_rows, load, load_cache, read_header, stored_rules, verify,
)
from spml_cache.cache.schema import (
    OBSERVED_SPLITS, SCHEMA_VERSION, SPLITS, CachedSplit, FeatureSet, SplitRows, cache_id, default_cache_dir,
    default_path, find_cache, partial_path, plain,
)
from spml_cache.cache.rule_masks import RuleMasks, add_rules
from spml_cache.cache.writing import PartialCache, write

__all__ = [
    "OBSERVED_SPLITS", "SCHEMA_VERSION", "SPLITS", "CachedSplit", "FeatureSet", "PartialCache", "RuleMasks",
    "SplitRows", "StoredFeatures", "add_rules", "cache_id", "feature_shapes",
    "default_cache_dir", "default_path", "describe_rows", "find_cache", "invalid_rows", "load", "load_cache", "partial_path", "plain",
    "read_header", "stored_rules", "verify", "write",
]
