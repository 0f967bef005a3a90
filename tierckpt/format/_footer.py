"""The shard file's 64-byte footer: where the index is, its checksum, the file's size."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tierckpt import limits
from tierckpt._types import BytesLike
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.format._names import FOOTER_SIZE, FORMAT_VERSION

MAGIC = b"TIERCKPT"
END_MAGIC = b"TCKPTEND"
_FOOTER = struct.Struct("<8sIIQQQQQ8s")
assert _FOOTER.size == FOOTER_SIZE

# -- footer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footer:
    index_offset: int
    index_length: int
    index_checksum: str
    file_size: int
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        head = struct.pack(
            "<8sIIQQQQ",
            MAGIC,
            self.version,
            0,
            self.index_offset,
            self.index_length,
            int(self.index_checksum, 16),
            self.file_size,
        )
        return head + struct.pack("<Q8s", xxhash.xxh3_64_intdigest(head), END_MAGIC)

    @classmethod
    def decode(cls, data: BytesLike, *, file_size: int, where: str) -> Footer:
        raw = bytes(data)
        if len(raw) != FOOTER_SIZE:
            raise CorruptCheckpoint(f"{where}: footer is {len(raw)} bytes, expected 64")
        magic, version, _flags, ioff, ilen, icrc, fsize, fcrc, end = _FOOTER.unpack(raw)
        if magic != MAGIC or end != END_MAGIC:
            raise CorruptCheckpoint(
                f"{where}: no tierckpt footer (bad magic): the file is truncated, "
                "still being written, or not a tierckpt shard file"
            )
        if xxhash.xxh3_64_intdigest(raw[:48]) != fcrc:
            raise CorruptCheckpoint(f"{where}: footer checksum mismatch")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{where}: shard format version {version}; this tierckpt reads version "
                f"{FORMAT_VERSION} (upgrade tierckpt)"
            )
        if fsize != file_size:
            raise CorruptCheckpoint(
                f"{where}: file is {file_size} bytes but its footer says {fsize} (truncated?)"
            )
        if ilen > limits.MAX_INDEX_BYTES or ioff + ilen + FOOTER_SIZE != file_size:
            raise CorruptCheckpoint(f"{where}: index range {ioff}+{ilen} does not end at footer")
        return cls(ioff, ilen, f"{icrc:016x}", fsize, version)
