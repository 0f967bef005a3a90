"""On-disk format v1: shard files, their index and footer, manifests, object names.

See ``docs/format.md`` for the specification; this module is its executable form. The
serialized bytes, not these classes, are the compatibility contract: golden files of every
version live in ``tests/fixtures/``.

The modules behind this one, in the order a reader meets the bytes: ``_names`` (constants,
checkpoint ids, object names), ``_footer`` (the shard file's last 64 bytes), ``_index`` (the
shard index and its bounded parse), ``_manifest`` (the commit record).

Shard file (one per rank per checkpoint per tier)::

    [chunk 0][pad to 4 KiB][chunk 1][pad] ... [index: UTF-8 JSON][footer: 64 bytes]

Footer (little-endian)::

    0  8s  magic  b"TIERCKPT"
    8  I   format version (1)
    12 I   flags (0)
    16 Q   index offset
    24 Q   index length
    32 Q   xxh3-64 of the index bytes
    40 Q   total file size (including this footer)
    48 Q   xxh3-64 of bytes 0..47 of the footer
    56 8s  end magic  b"TCKPTEND"
"""

from __future__ import annotations

from tierckpt.format._footer import (
    Footer,
)
from tierckpt.format._index import (
    HEAD_PROBE_BYTES,
    ChunkRecord,
    EncodedTable,
    check_index_head,
    decode_index,
    encode_index,
    index_counts,
    tree_args,
    with_counts,
)
from tierckpt.format._manifest import (
    Manifest,
    ShardRef,
    decode_manifest,
    encode_manifest,
)
from tierckpt.format._names import (
    ALIGNMENT,
    FOOTER_SIZE,
    FORMAT_VERSION,
    MAX_TIMELINE,
    CheckpointId,
    checksum,
    dcp_metadata_name,
    manifest_name,
    parse_data_folder,
    parse_manifest_id,
    parse_manifest_name,
    shard_name,
    step_prefix,
)

# importable from here before this module became a package; not public API (`as`: exported)
# isort: off
from tierckpt.format._footer import (
    END_MAGIC as END_MAGIC,
    MAGIC as MAGIC,
)
from tierckpt.format._names import (
    CHECKSUM_ALGO as CHECKSUM_ALGO,
    DATA_DIR as DATA_DIR,
    MANIFEST_DIR as MANIFEST_DIR,
    MANIFEST_VERSIONS as MANIFEST_VERSIONS,
    MAX_INDEX_BYTES as MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES,
    MAX_STEP as MAX_STEP,
    MAX_WORLD_SIZE as MAX_WORLD_SIZE,
    align_up as align_up,
    rank_failure_name as rank_failure_name,
    rank_record_name as rank_record_name,
)
# isort: on

__all__ = [
    "ALIGNMENT",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "MAX_TIMELINE",
    "CheckpointId",
    "ChunkRecord",
    "EncodedTable",
    "Footer",
    "Manifest",
    "ShardRef",
    "checksum",
    "decode_index",
    "decode_manifest",
    "encode_index",
    "encode_manifest",
    "HEAD_PROBE_BYTES",
    "check_index_head",
    "index_counts",
    "tree_args",
    "with_counts",
    "manifest_name",
    "parse_data_folder",
    "parse_manifest_id",
    "parse_manifest_name",
    "shard_name",
    "step_prefix",
    "dcp_metadata_name",
]
