"""nvCOMP on the GPU, framed so that a machine without a GPU can still restore the checkpoint.

The GPU compresses a chunk *before* the device-to-host copy, so fewer bytes cross PCIe
(:meth:`NvcompCodec.encode_device`). nvCOMP works on many small independent pieces; each piece
is compressed in nvCOMP's ``RAW`` bitstream mode, which for ``zstd``, ``deflate`` and ``lz4``
is the algorithm's standard format (a zstd frame, a raw RFC 1951 deflate stream, an LZ4 block;
NVIDIA documents GPU-compress/CPU-decompress for each). So the CPU decodes those with
``zstandard``, ``zlib`` and ``lz4`` when CUDA (or the nvCOMP package) is absent. The other
algorithms (``ans``, ``bitcomp``, ``gdeflate``, ``cascaded``, ``snappy``) decode only on a GPU:
decoding them without one raises :class:`~tierckpt.errors.UnknownCodec` that says so, and
:attr:`NvcompCodec.cpu_decodable` is False so the codec chooser leaves them out by default.

With ``itemsize`` > 1 the chunk is first cut into byte planes on the GPU (as
:mod:`tierckpt.codecs.planes` does on the CPU), so the sign/exponent plane lands in pieces of
its own and compresses well while mantissa pieces cost nothing to decode.

Framing (version 1, little-endian)::

    magic b"TCNV" | version u8 | algorithm u8 | itemsize u8 | reserved u8 = 0
    raw_len u64 | piece_bytes u32 | n_pieces u32            (24 bytes)
    stored sizes u32[n_pieces] | zero padding to a multiple of 16
    pieces, each starting 16-byte aligned (nvCOMP's alignment), zero padding between
    tail: the last raw_len % itemsize bytes, raw

Pieces cut the body in order: with itemsize 1 the raw bytes; otherwise plane 0, plane 1, …
(each plane of raw_len // itemsize bytes cut separately), so every piece but the last of a
plane holds exactly ``piece_bytes`` raw bytes. Without a GPU, :meth:`NvcompCodec.encode` uses
the CPU library of a CPU-decodable algorithm and writes the same framing.

The framing lives in ``_nvcomp_framing``, the CPU path in ``_nvcomp_cpu``, the GPU work that
makes no nvCOMP call (streams, body layout, packing) in ``_nvcomp_device``; this module holds
the codec and its calls to nvCOMP.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tierckpt._types import JSON, BytesLike
from tierckpt.codecs._byteplanes import _as_u8
from tierckpt.codecs._nvcomp_cpu import decode_frame, encode_frame
from tierckpt.codecs._nvcomp_device import device_body, from_body, pack_pieces, piece_offsets
from tierckpt.codecs._nvcomp_device import work_stream as _work_stream
from tierckpt.codecs._nvcomp_framing import (
    _ALIGN,
    _HEADER,
    _MAX_PIECE,
    _U8,
    ALGORITHMS,
    _align,
    _Layout,
    encode_header,
    parse_frame,
)
from tierckpt.codecs.base import Codec, register_codec
from tierckpt.codecs.planes import FLOAT_ITEMSIZE
from tierckpt.errors import CorruptChunk, UnknownCodec

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHMS", "CPU_DECODABLE", "NvcompCodec"]

#: algorithms whose RAW bitstream a standard CPU library decodes
CPU_DECODABLE = frozenset({"zstd", "deflate", "lz4"})
_NV_NAMES = {
    "zstd": "Zstd",
    "deflate": "Deflate",
    "lz4": "LZ4",
    "gdeflate": "GDeflate",
    "ans": "ANS",
    "bitcomp": "Bitcomp",
    "cascaded": "Cascaded",
    "snappy": "Snappy",
}


def _package_name() -> str:
    """The nvCOMP wheel that matches this torch's CUDA (cu12 for CUDA 12, cu13 for 13)."""
    import torch

    major = (torch.version.cuda or "12").split(".")[0]
    return f"nvidia-nvcomp-cu{major}"


_PACKAGE = _package_name()


def _nvcomp() -> Any:
    """The ``nvidia.nvcomp`` module, or UnknownCodec naming the package to install."""
    try:
        import nvidia.nvcomp as nv
    except ImportError as exc:
        raise UnknownCodec(
            f"the nvcomp codec needs a CUDA GPU and the package {_PACKAGE!r} for this: "
            f"pip install {_PACKAGE} ({exc})"
        ) from exc
    return nv


def _on_gpu(t: torch.Tensor) -> bool:
    return bool(t.is_cuda)


def _stream_of(device: torch.device) -> int:
    """The CUDA stream nvCOMP orders its work on, as an integer: the current stream of
    ``device`` (inside :func:`_work_stream`, never the default stream)."""
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


class NvcompCodec(Codec):
    """nvCOMP compression on the GPU; CPU decode for zstd / deflate / lz4 streams.

    ``algorithm`` is one of :data:`ALGORITHMS`; ``piece_bytes`` is nvCOMP's chunk size (64 KiB
    suits every algorithm; deflate and gdeflate allow no more); ``itemsize`` > 1 splits values
    into byte planes first (``for_dtype`` sets it for float dtypes); ``options`` are passed to
    ``nvidia.nvcomp.Codec`` (e.g. ``{"algorithm_type": 0}`` for entropy-only deflate,
    ``{"data_type": "<f2"}`` for ANS or Bitcomp).
    """

    codec_id = "nvcomp"

    def __init__(
        self,
        algorithm: str = "zstd",
        piece_bytes: int = 1 << 16,
        itemsize: int = 1,
        options: dict[str, JSON] | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"nvcomp algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if (
            not isinstance(piece_bytes, int)
            or isinstance(piece_bytes, bool)
            or not _ALIGN <= piece_bytes <= _MAX_PIECE
            or piece_bytes % _ALIGN
        ):
            raise ValueError(
                f"nvcomp piece_bytes must be a multiple of {_ALIGN} in [{_ALIGN}, {_MAX_PIECE}],"
                f" got {piece_bytes!r}"
            )
        if algorithm in ("deflate", "gdeflate") and piece_bytes > 1 << 16:
            raise ValueError(f"nvcomp {algorithm} pieces are at most 65536 bytes")
        if (
            not isinstance(itemsize, int)
            or isinstance(itemsize, bool)
            or itemsize not in (1, 2, 4, 8)
        ):
            raise ValueError(f"nvcomp itemsize must be 1, 2, 4 or 8, got {itemsize!r}")
        opts = dict(options or {})
        if not all(
            isinstance(k, str) and isinstance(v, (int, str, float)) for k, v in opts.items()
        ):
            raise ValueError(f"nvcomp options must map names to numbers or strings: {opts!r}")
        self.algorithm = algorithm
        self.piece_bytes = piece_bytes
        self.itemsize = itemsize
        self.options = opts
        self._local = threading.local()
        #: one codec per itemsize, so each keeps its per-thread nvCOMP codec objects
        self._by_itemsize: dict[int, NvcompCodec] = {itemsize: self}
        self._by_itemsize_lock = threading.Lock()

    def get_config(self) -> dict[str, JSON]:
        return {
            "id": self.codec_id,
            "algorithm": self.algorithm,
            "piece_bytes": self.piece_bytes,
            "itemsize": self.itemsize,
            "options": dict(sorted(self.options.items())),
        }

    @property
    def cpu_decodable(self) -> bool:
        """True when a machine without a GPU can decode this codec's chunks."""
        return self.algorithm in CPU_DECODABLE

    def for_dtype(self, dtype_name: str) -> Codec:
        itemsize = FLOAT_ITEMSIZE.get(dtype_name.removeprefix("torch."), 1)
        with self._by_itemsize_lock:
            codec = self._by_itemsize.get(itemsize)
            if codec is None:
                codec = NvcompCodec(self.algorithm, self.piece_bytes, itemsize, self.options)
                self._by_itemsize[itemsize] = codec
            return codec

    # -- framing --------------------------------------------------------------------------

    def _header(self, layout: _Layout, stored: list[int]) -> bytes:
        return encode_header(layout, self.algorithm, self.itemsize, self.piece_bytes, stored)

    def _parse(
        self, src: _U8, raw_len: int, total: int | None = None
    ) -> tuple[_Layout, list[int], list[int]]:
        """Validate the framing against ``raw_len``; (layout, piece starts, stored sizes).

        ``src`` holds at least the header; ``total`` is the stored chunk's length (default
        ``src.size``), so a chunk that lives on the GPU is checked from its header alone.
        """
        return parse_frame(src, raw_len, total, algorithm=self.algorithm, itemsize=self.itemsize)

    # -- host entry points ----------------------------------------------------------------

    def encode(self, data: BytesLike) -> BytesLike:
        src = _as_u8(data)
        if _cuda_available() and self._have_nvcomp():
            import torch

            dev = self.encode_device(torch.from_numpy(src.copy()).cuda())
            return np.ascontiguousarray(dev.cpu().numpy(), dtype=np.uint8).data
        if not self.cpu_decodable:
            raise UnknownCodec(
                f"nvcomp {self.algorithm!r} compresses only on a CUDA GPU with the package "
                f"{_PACKAGE!r} (none is available here)"
            )
        return self.encode_cpu(src.data)

    def encode_cpu(self, data: BytesLike) -> memoryview:
        """The same framing, compressed with the CPU library (zstd / deflate / lz4 only)."""
        return encode_frame(_as_u8(data), self.algorithm, self.itemsize, self.piece_bytes)

    def decode(self, data: BytesLike, out: memoryview) -> None:
        if _cuda_available() and self._have_nvcomp():
            import torch

            dest = _as_u8(out)
            dev = torch.empty(dest.size, dtype=torch.uint8, device="cuda")
            self.decode_device(data, dev)
            torch.from_numpy(dest).copy_(dev.cpu())
            return
        self.decode_cpu(data, out)

    def decode_cpu(self, data: BytesLike, out: memoryview) -> None:
        """Decode on the CPU; UnknownCodec for algorithms only a GPU decodes."""
        if not self.cpu_decodable:
            raise UnknownCodec(
                f"this checkpoint chunk was compressed with nvCOMP {self.algorithm!r}, which "
                "only a CUDA GPU can decode; restore it on a machine with a GPU and the "
                f"package {_PACKAGE!r}"
            )
        decode_frame(_as_u8(data), _as_u8(out), self.algorithm, self.itemsize)

    # -- GPU entry points -----------------------------------------------------------------

    def _have_nvcomp(self) -> bool:
        try:
            _nvcomp()
        except UnknownCodec:
            return False
        return True

    def _nv_codec(self, device: int, stream: int) -> Any:
        nv = _nvcomp()
        cache: dict[tuple[int, int], Any] = self._local.__dict__.setdefault("codecs", {})
        codec = cache.get((device, stream))
        if codec is None:
            codec = nv.Codec(
                algorithm=_NV_NAMES[self.algorithm],
                device_id=device,
                cuda_stream=stream,
                uncomp_chunk_size=self.piece_bytes,
                bitstream_kind=nv.BitstreamKind.RAW,
                **self.options,
            )
            cache[(device, stream)] = codec
        return codec

    def encode_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Compress a 1-D uint8 CUDA tensor on its GPU; returns the stored chunk on that GPU.

        Copy the result to the host (``.cpu()`` or into a pinned buffer) and store it as the
        chunk's bytes: :meth:`decode`, :meth:`decode_cpu` and :meth:`decode_device` read it.
        nvCOMP writes every piece into one preallocated buffer at a fixed stride; the pieces
        are then packed behind the header with one ``torch.cat``, so no per-piece Python
        object is made.
        """
        import torch

        _nvcomp()
        if not _on_gpu(tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError("encode_device takes a 1-D torch.uint8 CUDA tensor")
        device = tensor.device
        with _work_stream(device, tensor) as handed:
            out = self._encode_on_stream(tensor, device)
            handed.append(out)
        return out

    def _encode_on_stream(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        import torch

        nv = _nvcomp()
        stream = _stream_of(device)
        t = tensor.contiguous()
        layout = _Layout(t.numel(), self.itemsize, self.piece_bytes)
        stored: list[int] = []
        packed: torch.Tensor | None = None
        out_offsets: list[int] = []
        if layout.n_pieces:
            body = device_body(t, layout)
            offsets, sizes = piece_offsets(layout)
            codec = self._nv_codec(device.index or 0, stream)
            bound = int(codec.get_max_comp_buffer_size(nv.as_array(body[: sizes[0]])))
            stride = _align(bound)
            packed = torch.empty(stride * layout.n_pieces, dtype=torch.uint8, device=device)
            out_offsets = [i * stride for i in range(layout.n_pieces)]
            result = codec.encode(
                nv.as_arrays(body, offsets, sizes, stream),
                out=nv.as_arrays(packed, out_offsets, [bound] * layout.n_pieces, stream),
            )
            stored = [int(n) for n in result.buffer_sizes]
            if len(stored) != layout.n_pieces or not all(0 < n <= bound for n in stored):
                raise RuntimeError(f"nvcomp {self.algorithm} returned bad piece sizes")
        header = self._header(layout, stored)
        tail = t[t.numel() - layout.tail :]
        return pack_pieces(device, header, packed, out_offsets, stored, layout, tail)

    def decode_device(
        self,
        data: BytesLike | torch.Tensor,
        out: torch.Tensor,
        *,
        host_copy: BytesLike | None = None,
    ) -> None:
        """Decode a stored chunk into ``out``, a contiguous 1-D uint8 CUDA tensor.

        ``data`` is host bytes or a uint8 tensor already on the GPU (only its header is read
        back to the host, unless ``host_copy``, the host bytes it was uploaded from, is
        given: the restore onto the GPU parses the framing there, with no read-back). The
        framing is validated here, but NVIDIA documents that several
        nvCOMP GPU decoders cannot detect corrupt pieces: decode only chunks whose checksum
        passed (the restore path verifies before it decodes).
        """
        import torch

        _nvcomp()
        if (
            not _on_gpu(out)
            or out.dtype != torch.uint8
            or out.dim() != 1
            or not out.is_contiguous()
        ):
            raise ValueError("decode_device fills a contiguous 1-D torch.uint8 CUDA tensor")
        device = out.device
        inputs = [out, data] if isinstance(data, torch.Tensor) and data.is_cuda else [out]
        with _work_stream(device, *inputs):
            self._decode_on_stream(data, out, device, host_copy)

    def _decode_on_stream(
        self,
        data: BytesLike | torch.Tensor,
        out: torch.Tensor,
        device: torch.device,
        host_copy: BytesLike | None = None,
    ) -> None:
        import torch

        nv = _nvcomp()
        dev_in: torch.Tensor | None
        if isinstance(data, torch.Tensor) and host_copy is not None:
            dev_in = data.to(device=device, dtype=torch.uint8).contiguous().view(-1)
            total = dev_in.numel()
            layout, starts, stored = self._parse(_as_u8(host_copy), out.numel(), total)
        elif isinstance(data, torch.Tensor):
            dev_in = data.to(device=device, dtype=torch.uint8).contiguous().view(-1)
            total = dev_in.numel()
            first = dev_in[: min(total, _HEADER.size)].cpu().numpy()
            n_pieces = _HEADER.unpack_from(first.data, 0)[-1] if first.size == _HEADER.size else 0
            head_len = min(total, _align(_HEADER.size + 4 * n_pieces))
            head = dev_in[:head_len].cpu().numpy()
            layout, starts, stored = self._parse(head, out.numel(), total)
        else:
            src = _as_u8(data)
            layout, starts, stored = self._parse(src, out.numel())
            total = src.size
            dev_in = (
                torch.from_numpy(src.copy()).to(device) if layout.n_pieces or layout.tail else None
            )
        stream = _stream_of(device)
        if layout.n_pieces:
            assert dev_in is not None
            if layout.n_planes == 1 and out.data_ptr() % _ALIGN == 0:
                body = out
            else:
                body = torch.empty(
                    layout.n_planes * layout.plane_stride, dtype=torch.uint8, device=device
                )
            offsets, sizes = piece_offsets(layout)
            codec = self._nv_codec(device.index or 0, stream)
            try:
                result = codec.decode(
                    nv.as_arrays(dev_in, starts, stored, stream),
                    out=nv.as_arrays(body, offsets, sizes, stream),
                )
                got = [int(n) for n in result.buffer_sizes]
            except (RuntimeError, ValueError) as exc:
                raise CorruptChunk(f"nvcomp {self.algorithm} decode failed: {exc}") from exc
            if got != sizes:
                raise CorruptChunk(f"nvcomp {self.algorithm} pieces decoded to wrong sizes")
            from_body(body, out, layout)
        if layout.tail:
            assert dev_in is not None
            out[out.numel() - layout.tail :].copy_(dev_in[total - layout.tail :])


register_codec(NvcompCodec)
