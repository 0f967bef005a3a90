"""A float-aware codec: split values into byte planes, entropy-code the planes that compress.

Dense float weights look random to a byte-oriented compressor because their mantissa bytes are
close to uniform, but the byte that holds the sign and most of the exponent carries ~2.7 bits of
information in 8. Splitting a chunk into byte planes (byte *k* of every element side by side)
puts that redundancy into one plane where an entropy coder takes it out, while the mantissa
planes are stored as they are unless compressing them pays (zero-heavy optimizer state,
weights stored at lower precision). This is the approach of ZipNN; see ``docs/compression.md``
for the measurements behind each choice below.

Format (version 1, little-endian), written by :meth:`PlanesCodec.encode`::

    magic b"TCPL" | version u8 | itemsize u8 | reserved u16 = 0
    raw_len u64 | seg_elems u32 | n_entries u32      (24 bytes)
    lengths u32[n_entries] | modes u8[n_entries]
    payload: one entry per (segment, plane), segment-major
    tail: the last raw_len % itemsize bytes, stored raw

The elements are cut into segments of ``seg_elems`` elements (the last one may be shorter);
segments are independent, so encode and decode spread them over ``threads`` threads, and the
stored bytes do not depend on the thread count. Mode 0 stores the plane raw, mode 1 as one
zstd frame whose header declares the plane's size. Decode checks every field against
``len(out)`` and the input length before it touches the payload, so a hostile chunk cannot make
it allocate more than one segment's plane per thread.

The byte-plane kernels, scratch buffers and helper pool (shared with the nvcomp codec) live in
``_byteplanes``.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable

import numpy as np
import zstandard

from tierckpt._types import JSON, BytesLike
from tierckpt.codecs._byteplanes import (
    _U8,
    _as_u8,
    _looks_incompressible,
    _merge,
    _run_tasks,
    _scratch,
    _split,
    _split_plane,
)
from tierckpt.codecs.base import Codec, register_codec
from tierckpt.codecs.zstd import ZstdCodec
from tierckpt.errors import CorruptChunk

__all__ = ["PlanesCodec", "FLOAT_ITEMSIZE"]

#: element size of each dtype whose values are floats (complex: the size of one component)
FLOAT_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 8,
    "complex64": 4,
    "complex32": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

_MAGIC = b"TCPL"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHQII")
_MODE_RAW = 0
_MODE_ZSTD = 1
#: target raw bytes per segment: big enough that per-call overhead vanishes, small enough that
#: a 64 MiB chunk gives each of two threads several segments (1-8 MiB measured alike)
_SEGMENT_BYTES = 4 << 20


def _zstd_params(level: int | None) -> zstandard.ZstdCompressionParameters:
    if level is not None:
        return zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True)
    # Entropy first: the `fast` match finder with the smallest hash table and the longest
    # minimum match finds few matches and spends little time looking, so nearly all the work
    # is zstd's Huffman coder on 128 KiB blocks (which also adapts to each block's exponent
    # distribution). 3.7x faster than level 1 on an exponent plane and 9% smaller.
    return zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST,
        window_log=17,
        hash_log=6,
        chain_log=6,
        search_log=1,
        min_match=7,
        target_length=0,
        write_content_size=True,
    )


class PlanesCodec(Codec):
    """Byte planes + zstd entropy coding of the planes that compress; lossless for any bytes.

    ``itemsize`` is the element size the planes are cut by (4 for float32, 2 for bfloat16 and
    float16, 8 for float64, 1 for float8: one plane). ``level`` None uses parameters tuned for
    entropy coding (see the module docstring); an int uses that zstd level. ``threads`` is how
    many threads one call may use, the caller's included.
    """

    codec_id = "planes"

    def __init__(
        self, itemsize: int = 4, coder: str = "zstd", level: int | None = None, threads: int = 2
    ) -> None:
        if (
            not isinstance(itemsize, int)
            or isinstance(itemsize, bool)
            or itemsize
            not in (
                1,
                2,
                4,
                8,
            )
        ):
            raise ValueError(f"planes itemsize must be 1, 2, 4 or 8, got {itemsize!r}")
        if coder != "zstd":
            raise ValueError(f"planes coder must be 'zstd', got {coder!r}")
        if level is not None and (
            not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22
        ):
            raise ValueError(f"planes level must be None or an int in [-7, 22], got {level!r}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"planes threads must be an int >= 1, got {threads!r}")
        self.itemsize = itemsize
        self.coder = coder
        self.level = level
        self.threads = threads
        self._params = _zstd_params(level)
        self._local = threading.local()

    def get_config(self) -> dict[str, JSON]:
        return {
            "id": self.codec_id,
            "itemsize": self.itemsize,
            "coder": self.coder,
            "level": self.level,
            "threads": self.threads,
        }

    def for_dtype(self, dtype_name: str) -> Codec:
        name = dtype_name.removeprefix("torch.")
        itemsize = FLOAT_ITEMSIZE.get(name)
        if itemsize is None:
            # integers, bools and unknown dtypes: plain zstd finds runs and small values
            return ZstdCodec(level=1)
        if itemsize == self.itemsize:
            return self
        return PlanesCodec(itemsize, self.coder, self.level, self.threads)

    # -- encode ---------------------------------------------------------------------------

    def _compressor(self) -> zstandard.ZstdCompressor:
        c: zstandard.ZstdCompressor | None = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(compression_params=self._params)
        return c

    def _segment_elems(self, n_elems: int) -> int:
        return max(1, min(n_elems, _SEGMENT_BYTES // self.itemsize))

    def max_encoded_size(self, raw_len: int) -> int:
        """An upper bound of ``len(encode(x))`` for ``len(x) == raw_len`` (every plane raw)."""
        n_elems = raw_len // self.itemsize
        n_segs = -(-n_elems // self._segment_elems(n_elems)) if n_elems else 0
        return _HEADER.size + 5 * n_segs * self.itemsize + raw_len

    def encode(self, data: BytesLike) -> BytesLike:
        src = _as_u8(data)
        # pages past the end of the encoding are never touched, so they cost no memory
        out = np.empty(self.max_encoded_size(src.size), np.uint8)
        return out[: self._encode(src, out)].data

    def encode_into(self, data: BytesLike, out: memoryview) -> int:
        """Encode into ``out`` (at least :meth:`max_encoded_size` bytes); returns the length.

        Lets a caller reuse one warm buffer: on a machine where first touching fresh memory is
        slow, writing the encoding into new pages is a large part of the cost of ``encode``.
        """
        src = _as_u8(data)
        dest = _as_u8(out)
        if dest.size < self.max_encoded_size(src.size) or not dest.flags.writeable:
            raise ValueError(
                f"encode_into needs a writable buffer of {self.max_encoded_size(src.size)} bytes"
            )
        return self._encode(src, dest)

    def _encode(self, src: _U8, out: _U8) -> int:
        size = self.itemsize
        raw_len = src.size
        n_elems = raw_len // size
        seg_elems = self._segment_elems(n_elems)
        n_segs = -(-n_elems // seg_elems) if n_elems else 0
        n_entries = n_segs * size
        packed_planes: list[bytes | None] = [None] * n_entries  # None: stored raw
        lengths = np.zeros(n_entries, "<u4")

        def segment(s: int) -> _U8:
            lo = s * seg_elems
            return src[lo * size : min(n_elems, lo + seg_elems) * size]

        def encode_segment(s: int) -> None:
            seg = segment(s)
            if size == 1:
                planes = [seg]
            else:
                planes = _scratch.plane_buffers(size, seg.size // size)
                _split(seg, size, planes)
            compressor = self._compressor()
            for k, plane in enumerate(planes):
                e = s * size + k
                lengths[e] = plane.size
                # the plane holding the exponent always compresses; mantissa planes are tried
                # on a sample first
                if k == size - 1 or not _looks_incompressible(compressor, plane):
                    packed = compressor.compress(plane.data)
                    if len(packed) < plane.size:
                        packed_planes[e] = packed
                        lengths[e] = len(packed)

        _run_tasks(n_segs, encode_segment, self.threads)

        head_len = _HEADER.size + 5 * n_entries
        starts = np.empty(n_entries + 1, np.int64)
        starts[0] = head_len
        np.cumsum(lengths, out=starts[1:])
        starts[1:] += head_len
        tail = raw_len - n_elems * size
        total = int(starts[-1]) + tail
        modes = np.fromiter(
            (_MODE_RAW if p is None else _MODE_ZSTD for p in packed_planes), np.uint8, n_entries
        )
        _HEADER.pack_into(out.data, 0, _MAGIC, _VERSION, size, 0, raw_len, seg_elems, n_entries)
        out[_HEADER.size : _HEADER.size + 4 * n_entries] = lengths.view(np.uint8)
        out[_HEADER.size + 4 * n_entries : head_len] = modes
        starts_l: list[int] = starts.tolist()

        def gather_segment(s: int) -> None:
            for k in range(size):
                e = s * size + k
                dest = out[starts_l[e] : starts_l[e + 1]]
                packed = packed_planes[e]
                if packed is None:  # raw planes are cut again, straight into the output
                    _split_plane(segment(s), size, k, dest)
                else:
                    dest[:] = np.frombuffer(packed, np.uint8)

        _run_tasks(n_segs, gather_segment, self.threads)
        if tail:
            out[total - tail : total] = src[raw_len - tail :]
        return total

    # -- decode ---------------------------------------------------------------------------

    def decode(self, data: BytesLike, out: memoryview) -> None:
        self.decode_progressive(data, out, _all_there)

    def decode_progressive(
        self, data: BytesLike, out: memoryview, ready: Callable[[int], None]
    ) -> None:
        """:meth:`decode` while ``data`` arrives: segments are independent and stored in
        order, so segment ``s`` decodes once the bytes up to its last plane are in (``ready``
        blocks until they are; see :class:`~tierckpt.codecs.base.SupportsProgressiveDecode`)."""
        src = _as_u8(data)
        dest = _as_u8(out)
        if dest.size and not dest.flags.writeable:
            raise ValueError("decode needs a writable out buffer")
        size = self.itemsize
        raw_len = dest.size
        if src.size < _HEADER.size:
            raise CorruptChunk(f"planes chunk of {src.size} bytes is shorter than its header")
        ready(_HEADER.size)
        magic, version, itemsize, reserved, declared, seg_elems, n_entries = _HEADER.unpack_from(
            src.data, 0
        )
        if magic != _MAGIC:
            raise CorruptChunk(f"not a planes chunk (magic {bytes(magic)!r})")
        if version != _VERSION or reserved != 0:
            raise CorruptChunk(f"planes chunk version {version}/{reserved} is not supported")
        if itemsize != size:
            raise CorruptChunk(f"planes chunk has itemsize {itemsize}, codec expects {size}")
        if declared != raw_len:
            raise CorruptChunk(f"planes chunk declares {declared} bytes, expected {raw_len}")
        n_elems = raw_len // size
        tail = raw_len - n_elems * size
        if seg_elems < 1:
            raise CorruptChunk("planes chunk declares an empty segment size")
        n_segs = -(-n_elems // seg_elems)
        if n_entries != n_segs * size:
            raise CorruptChunk(f"planes chunk has {n_entries} entries, expected {n_segs * size}")
        head_len = _HEADER.size + 5 * n_entries
        if src.size < head_len + tail:
            raise CorruptChunk(f"planes chunk of {src.size} bytes is truncated")
        ready(head_len)
        lengths = np.frombuffer(src, "<u4", n_entries, _HEADER.size).astype(np.int64)
        modes = np.frombuffer(src, np.uint8, n_entries, _HEADER.size + 4 * n_entries)
        plane_lens = np.full(n_entries, seg_elems, np.int64)
        if n_segs:
            plane_lens[-size:] = n_elems - (n_segs - 1) * seg_elems
        raw_ok = (modes == _MODE_RAW) & (lengths == plane_lens)
        zstd_ok = (modes == _MODE_ZSTD) & (lengths > 0) & (lengths < plane_lens)
        if not bool(np.all(raw_ok | zstd_ok)):
            bad = int(np.argmin(raw_ok | zstd_ok))
            raise CorruptChunk(
                f"planes chunk entry {bad}: mode {int(modes[bad])} with {int(lengths[bad])} "
                f"bytes for a plane of {int(plane_lens[bad])}"
            )
        starts = np.empty(n_entries + 1, np.int64)
        starts[0] = head_len
        np.cumsum(lengths, out=starts[1:])
        starts[1:] += head_len
        if int(starts[-1]) + tail != src.size:
            raise CorruptChunk(
                f"planes chunk holds {src.size} bytes, its header accounts for "
                f"{int(starts[-1]) + tail}"
            )
        starts_l: list[int] = starts.tolist()
        modes_l: list[int] = modes.tolist()

        def decode_segment(s: int) -> None:
            ready(starts_l[(s + 1) * size])
            lo = s * seg_elems
            hi = min(n_elems, lo + seg_elems)
            target = dest[lo * size : hi * size]
            pieces = [src[starts_l[e] : starts_l[e + 1]] for e in range(s * size, (s + 1) * size)]
            raw = [modes_l[e] == _MODE_RAW for e in range(s * size, (s + 1) * size)]
            if size == 1:  # one plane: straight into `out`
                if raw[0]:
                    target[:] = pieces[0]
                else:
                    _unzstd_into(pieces[0], target)
                return
            scratch = _scratch.plane_buffers(size, hi - lo)
            planes = [
                p if r else _unzstd_into(p, b) for p, r, b in zip(pieces, raw, scratch, strict=True)
            ]
            _merge(planes, size, target)

        _run_tasks(n_segs, decode_segment, self.threads)
        if tail:
            ready(src.size)
            dest[raw_len - tail :] = src[src.size - tail :]


def _all_there(n: int) -> None:
    """``ready`` of a whole buffer: every byte is there already."""


def _unzstd_into(frame: _U8, into: _U8) -> _U8:
    """Decode one zstd frame into ``into``, which it must fill exactly; returns ``into``.

    Decoding into a reused buffer rather than a new bytes object saves the page faults of a
    fresh allocation per plane (10-15% of decode time measured here).
    """
    expected = into.size
    try:
        params = zstandard.get_frame_parameters(frame.data)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"planes chunk holds a bad zstd frame: {exc}") from exc
    if params.content_size != expected:
        raise CorruptChunk(f"zstd frame declares {params.content_size} bytes, expected {expected}")
    got = 0
    try:
        # the whole frame as one input block: the default 128 KiB blocks cost 30% of the speed
        with _scratch.decompressor().stream_reader(frame.data, read_size=frame.size) as reader:
            view = into.data
            while got < expected:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)  # reaches the frame's end, where zstd checks its size
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"zstd frame failed to decode: {exc}") from exc
    if got != expected or extra:
        raise CorruptChunk(f"zstd frame does not decode to exactly {expected} bytes")
    return into


register_codec(PlanesCodec)
