"""Stored chunks that decode far past their declared size (compression bombs), refused unread.

A reader learns what a compressed chunk decodes to only by decoding it: a few KB of zstd,
gzip or deflate can hold gigabytes of zeros, which zarr and HDF5 decode whole into memory
(HDF5's deflate filter grows its buffer until the stream ends). So, before any data is
read, every stored chunk is held to the size its metadata declares (cells times the bytes
of one, plus :data:`ALLOWANCE` for codec headers and checksums), never decoded whole:

- where the stream's header states what it decodes to, and the decoder allocates that and
  no more, only the header is read: zstd (every frame's ``Frame_Content_Size``; frames
  without one are bounded by their block headers, a block decoding to at most 128 KiB by
  RFC 8878), blosc (``nbytes``), lz4 (numcodecs' and HDF5's size prefix), szip (HDF5's);
- where it does not (gzip, zlib, deflate, bz2, lzma), the stream is decoded in pieces of
  :data:`PIECE` bytes, each dropped at once, and the decode stops past the declared size.

A chunk stored in more bytes than any encoding of its declared size needs is refused by its
size alone. Checksums are stepped over; codecs that act on the decompressed chunk (bytes,
transpose, shuffle, delta, nbit, ...) need no check; a sharded zarr v3 array has every
inner chunk of every shard checked through the shard's index. A codec or HDF5 filter whose
decoded size cannot be told, two compressors in one pipeline, or a codec that changes the
stored bytes before they are decompressed, is refused by name: no trace needs them.
"""

from __future__ import annotations

import bz2
import lzma
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

ALLOWANCE = 4096  # bytes a chunk may decode to past its cells: codec headers, checksums
PIECE = 2**20  # bytes read, or decoded and dropped, at a time by a capped decode
VLEN_CELL_BYTES = 1024  # what one variable-length string or bytes cell may hold on average
ZSTD_BLOCK_BYTES = 128 * 2**10  # the most one zstd block decodes to (RFC 8878, 3.1.1.2.4)
_EMPTY = 2**64 - 1  # a shard index entry of an inner chunk never written
_VLEN_TYPES = {"|O", "O", "string", "bytes", "variable_length_utf8", "variable_length_bytes"}


def zarr_itemsize(dtype) -> int:
    """Bytes per element of a zarr v2 ``dtype`` or v3 ``data_type``; 8 (one pointer) where
    it cannot be told, as for variable-length strings."""
    if isinstance(dtype, dict):  # a v3 data type with a configuration
        configuration = dtype.get("configuration")
        configuration = configuration if isinstance(configuration, dict) else {}
        length = configuration.get("length_bytes")
        if isinstance(length, int) and length > 0:
            return length
        fields = configuration.get("fields")
        if dtype.get("name") == "structured" and isinstance(fields, list):
            return sum(zarr_itemsize(f[1]) for f in fields if isinstance(f, list) and len(f) > 1)
        return zarr_itemsize(dtype.get("name"))
    if isinstance(dtype, str) and re.fullmatch(r"r\d+", dtype):  # v3 raw bits
        return max(1, int(dtype[1:]) // 8)
    if isinstance(dtype, list):  # a v2 structured dtype: [[name, dtype, shape?], ...]
        dtype = [tuple(f) if isinstance(f, list) else f for f in dtype]
    try:
        return np.dtype(dtype).itemsize
    except (TypeError, ValueError):
        return 8


class _Window(NamedTuple):
    """Bytes ``start`` to ``start + length`` of an open file: one stored chunk."""

    file: BinaryIO
    start: int
    length: int

    def read(self, offset: int, n_bytes: int) -> bytes:
        n_bytes = min(n_bytes, self.length - offset)
        if n_bytes <= 0 or offset < 0:
            return b""
        self.file.seek(self.start + offset)
        return self.file.read(n_bytes)

    def part(self, offset: int, length: int) -> _Window:
        offset = min(max(offset, 0), self.length)
        return _Window(self.file, self.start + offset, max(0, min(length, self.length - offset)))


class _Decoded(NamedTuple):
    """What a stored stream decodes to, as far as its check found, in words."""

    n_bytes: int
    text: str


def _count(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes:,} bytes ({n_bytes / scale:.3g} {unit})"
    return f"{n_bytes:,} bytes"


def _prefix(offset: int, size: int, byteorder: str) -> Callable:
    """A check that reads the decoded size where the format stores it, in a prefix."""

    def check(window: _Window, limit: int) -> _Decoded:
        header = window.read(offset, size)
        if len(header) < size:  # too short to be decoded at all: its reader fails on it
            return _Decoded(0, "")
        n_bytes = int.from_bytes(header, byteorder)  # type: ignore[arg-type]
        return _Decoded(n_bytes, f"says it decodes to {_count(n_bytes)}")

    return check


def _zstd_frame(window: _Window, offset: int) -> tuple[int, int | None, int, bool]:
    """A zstd frame from the byte after its magic number: where it ends, its content size
    (None where it states none), the most its blocks decode to, and whether it is whole."""
    header = window.read(offset, 14)
    descriptor = header[0] if header else 0
    single = descriptor >> 5 & 1
    position, window_size = 1, ZSTD_BLOCK_BYTES
    if not single and len(header) > 1:
        base = 1 << (10 + (header[1] >> 3))
        window_size, position = base + base // 8 * (header[1] & 7), 2
    position += (0, 1, 2, 4)[descriptor & 3]  # the dictionary id
    size_bytes = (single, 2, 4, 8)[descriptor >> 6]
    content = None
    if size_bytes:
        content = int.from_bytes(header[position : position + size_bytes], "little")
        content += 256 if size_bytes == 2 else 0
        window_size = content if single else window_size
    block_max = min(ZSTD_BLOCK_BYTES, window_size)
    offset, blocks = offset + position + size_bytes, 0
    while True:
        raw = window.read(offset, 3)
        if len(header) < position + size_bytes or len(raw) < 3:
            return window.length, content, blocks, False
        head = int.from_bytes(raw, "little")
        kind, size = head >> 1 & 3, head >> 3
        if kind == 3:  # reserved: the decoder stops here with an error
            return window.length, content, blocks, False
        blocks += size if kind < 2 else block_max  # raw and RLE blocks state their size
        offset += 3 + (1 if kind == 1 else size)
        if head & 1:
            return offset + (4 if descriptor & 4 else 0), content, blocks, True


def _zstd(window: _Window, limit: int) -> _Decoded:
    """The sum of the frames' content sizes where every frame states one (numcodecs then
    allocates that sum and decodes no more); else what their blocks may decode to."""
    offset, stated, blocks, unknown = 0, 0, 0, False
    while offset + 4 <= window.length and (blocks if unknown else stated) <= limit:
        magic = int.from_bytes(window.read(offset, 4), "little")
        if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame, decoded to nothing
            offset += 8 + int.from_bytes(window.read(offset + 4, 4), "little")
            continue
        if magic != 0xFD2FB528:
            break  # not a frame: its decoder stops with an error here
        offset, content, frame_blocks, whole = _zstd_frame(window, offset + 4)
        stated += content or 0
        blocks += frame_blocks
        unknown |= content is None or not whole
    if unknown:
        return _Decoded(blocks, f"states no size, and its blocks may decode to {_count(blocks)}")
    return _Decoded(stated, f"says it decodes to {_count(stated)}")


class _Inflate:
    """zlib's streaming decoder behind the interface of bz2's and lzma's."""

    def __init__(self, wbits: int):
        self._stream, self._tail = zlib.decompressobj(wbits), b""
        self.needs_input = True

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._stream.decompress(self._tail + data, max_length)
        self._tail = self._stream.unconsumed_tail
        self.needs_input = not self._tail and len(out) < max_length
        return out

    eof = property(lambda self: self._stream.eof)
    unused_data = property(lambda self: self._stream.unused_data)


def _past_zeros(window: _Window, offset: int) -> int:
    """The first byte at or after ``offset`` that is not zero (gzip members may be padded)."""
    while data := window.read(offset, PIECE):
        stripped = data.lstrip(b"\0")
        offset += len(data) - len(stripped)
        if stripped:
            break
    return offset


def _streamed(make: Callable, streams: str = "one") -> Callable:
    """A check that decodes the stream in pieces, dropping each, and stops past ``limit``.

    ``streams``: "one" (zlib, HDF5's deflate), "many" (concatenated streams, as bz2 and
    lzma read them) or "padded" (gzip members, with zero bytes between them).
    """

    def check(window: _Window, limit: int) -> _Decoded:
        produced, offset, stream, data = 0, 0, make(), b""
        while True:
            if stream.needs_input:
                data = window.read(offset, PIECE)
                if not data:  # a cut stream: its reader fails here, having decoded this
                    return _Decoded(produced, "")
                offset += len(data)
            try:
                out = stream.decompress(data, min(PIECE, limit + 1 - produced))
            except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError):
                return _Decoded(produced, "")  # corrupt: its reader fails here too
            produced, data = produced + len(out), b""
            if produced > limit:
                return _Decoded(produced, f"decodes to more than {_count(limit)}")
            if stream.eof:
                offset -= len(stream.unused_data)
                if streams == "one":
                    return _Decoded(produced, "")
                offset = _past_zeros(window, offset) if streams == "padded" else offset
                if offset >= window.length:
                    return _Decoded(produced, "")
                stream = make()

    return check


def _lzma(configuration: dict) -> Callable:
    fmt = configuration.get("format", lzma.FORMAT_XZ)
    filters = configuration.get("filters") if fmt == lzma.FORMAT_RAW else None
    return _streamed(lambda: lzma.LZMADecompressor(format=fmt, filters=filters), "many")


def _blosc(window: _Window, limit: int) -> _Decoded:
    """``nbytes`` of a blosc header, where it is one: c-blosc refuses any other version
    (a corrupted chunk) before it decodes a byte."""
    if window.read(0, 1) not in (b"\x01", b"\x02"):
        return _Decoded(0, "")
    return _prefix(4, 4, "little")(window, limit)


_COMPRESSORS = {  # zarr codec (and numcodecs id) -> the check of its stored stream
    "zstd": _zstd,
    "blosc": _blosc,
    "lz4": _prefix(0, 4, "little"),
    "gzip": _streamed(lambda: _Inflate(31), "padded"),
    "zlib": _streamed(lambda: _Inflate(15)),
    "bz2": _streamed(bz2.BZ2Decompressor, "many"),
}
_CHECKSUMS = dict(  # where each keeps its 4 bytes by default
    crc32c="end", crc32="start", adler32="start", fletcher32="end", jenkins_lookup3="end"
)
_ON_DECODED = set(  # codecs that act on the decompressed chunk
    "bytes endian transpose shuffle delta fixedscaleoffset quantize bitround packbits astype "
    "categorize vlen-utf8 vlen-bytes vlen-array".split()
)
_H5_FILTERS = {  # HDF5 filter id -> (name, role, check or checksum place)
    1: ("deflate", "compressor", _streamed(lambda: _Inflate(15))),
    2: ("shuffle", "decoded", None),
    3: ("fletcher32", "checksum", "end"),
    4: ("szip", "compressor", _prefix(0, 4, "little")),
    5: ("nbit", "decoded", None),
    6: ("scaleoffset", "decoded", None),
    307: ("bzip2", "compressor", _streamed(bz2.BZ2Decompressor)),
    32001: ("blosc", "compressor", _blosc),
    32004: ("lz4", "compressor", _prefix(0, 8, "big")),
    32015: ("zstd", "compressor", _zstd),
}


class _Stage(NamedTuple):
    """One codec or filter of a chunk's pipeline, in the order a reader decodes."""

    name: str
    role: str  # "compressor", "checksum", "decoded" or "shard"
    arg: object = None  # a compressor's check, a checksum's place, a shard's configuration


def _zarr_stage(codec) -> _Stage | None:
    """The stage of a zarr v2 or v3 codec; None for one that is not known."""
    if isinstance(codec, str):
        codec = {"name": codec}
    if not isinstance(codec, dict):
        return None
    name = codec.get("id", codec.get("name"))
    configuration = codec.get("configuration", codec)
    if not isinstance(name, str) or not isinstance(configuration, dict):
        return None
    base = name.removeprefix("numcodecs.")
    if base in _COMPRESSORS:
        return _Stage(name, "compressor", _COMPRESSORS[base])
    if base == "lzma":
        return _Stage(name, "compressor", _lzma(configuration))
    if base in _CHECKSUMS:
        return _Stage(name, "checksum", configuration.get("location", _CHECKSUMS[base]))
    if base in _ON_DECODED:
        return _Stage(name, "decoded")
    if base == "sharding_indexed":
        return _Stage(name, "shard", configuration)
    return None


def _lead(stages: list[_Stage], where: str) -> tuple[list[_Stage], _Stage | None]:
    """The checksums a reader strips before it decompresses, and the compressor or shard
    it then reads (None where the chunk is stored as it decodes); refuses a pipeline whose
    chunks cannot be checked that way."""
    lead, first, before = [], None, None
    for stage in stages:
        if stage.role in ("compressor", "shard"):
            if first is not None:
                raise ValueError(
                    f"{where} asks for {first.name}, then {stage.name}, to decode its stored "
                    "chunks: what they decode to cannot be told before decoding; refusing it"
                )
            if before is not None:
                raise ValueError(
                    f"{where} asks for {before.name} to change the stored bytes before "
                    f"{stage.name} decodes them; refusing it"
                )
            first = stage
        elif stage.role == "checksum" and first is None and before is None:
            lead.append(stage)
        elif first is None:
            before = stage
    return lead, first


class _Chunks(NamedTuple):
    """How the stored chunks of one array must decode: the facts a check compares with."""

    where: str  # "<file>: variable <name>"
    shape: tuple[int, ...]  # of one chunk
    itemsize: int  # bytes of one cell as a compressor's output holds it
    stages: list[_Stage]  # decode order

    @property
    def limit(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.itemsize + ALLOWANCE

    def check(self, window: _Window, chunk: str) -> None:
        """Raise if the stored chunk in ``window`` is or decodes to more than it may."""
        limit = self.limit
        declared = f"{self.shape} x {self.itemsize} bytes = {_count(limit - ALLOWANCE)}"
        lead, first = _lead(self.stages, self.where)
        extra = 0 if first is None or first.role != "shard" else _shard_layout(self, first.arg)[3]
        # more than any encoding of the declared bytes needs (blosc, zstd, gzip, bz2, lzma)
        if window.length > limit + limit // 64 + 64 * 2**10 + extra:
            raise ValueError(
                f"{self.where}, chunk {chunk}: it is stored in {_count(window.length)}, more "
                f"than any encoding of its declared {declared} needs; refusing to read it"
            )
        for stage in lead:
            window = window.part(4 if stage.arg == "start" else 0, window.length - 4)
        if first is not None and first.role == "shard":
            _check_shard(self, first.arg, window, chunk)
        elif first is not None:
            decoded = first.arg(window, limit)
            if decoded.n_bytes > limit:
                raise ValueError(
                    f"{self.where}, chunk {chunk}: its {first.name} stream {decoded.text}, "
                    f"but the chunk is declared {declared}; refusing to read it (a "
                    "compression bomb)"
                )


def _shard_layout(chunks: _Chunks, configuration: dict) -> tuple[_Chunks, tuple, bool, int]:
    """A shard's inner chunks, how many of them lie along each axis, whether its index is
    big-endian and how many bytes the index takes."""
    inner = configuration.get("chunk_shape")
    if not (isinstance(inner, list) and len(inner) == len(chunks.shape)) or not all(
        isinstance(n, int) and n > 0 for n in inner
    ):
        raise ValueError(f"{chunks.where} declares inner chunks {inner!r}, which are no shape")
    codecs = configuration.get("codecs", [])
    index = configuration.get("index_codecs", [{"name": "bytes"}, {"name": "crc32c"}])
    codecs, index = [c if isinstance(c, list) else [c] for c in (codecs, index)]
    stages = [_zarr_stage(c) for c in reversed(codecs)]
    index_stages = [_zarr_stage(c) for c in index]
    if any(s is None for s in stages) or any(
        s is None or s.role not in ("checksum", "decoded") for s in index_stages
    ):
        raise ValueError(
            f"{chunks.where} asks for shard codecs {codecs!r}, index codecs {index!r}: "
            "attnpanel cannot check them before decoding; refusing it"
        )
    per_shard = tuple(-(-n // m) for n, m in zip(chunks.shape, inner, strict=True))
    big = any(isinstance(c, dict) and "big" in str(c.get("configuration")) for c in index)
    n_bytes = int(np.prod(per_shard, dtype=object)) * 16
    n_bytes += 4 * sum(s.role == "checksum" for s in index_stages)
    return _Chunks(chunks.where, tuple(inner), chunks.itemsize, stages), per_shard, big, n_bytes


def _check_shard(chunks: _Chunks, configuration: dict, window: _Window, shard: str) -> None:
    """Check every inner chunk of a shard, found through the shard's index."""
    inner, per_shard, big, size = _shard_layout(chunks, configuration)
    n_inner = int(np.prod(per_shard, dtype=object))
    at_start = configuration.get("index_location", "end") == "start"
    raw = window.read(0 if at_start else window.length - size, n_inner * 16)
    if len(raw) < n_inner * 16:
        return  # no index: its reader fails on the shard
    entries = np.frombuffer(raw, dtype=">u8" if big else "<u8").reshape(n_inner, 2)
    for number in np.flatnonzero((entries != _EMPTY).any(axis=1)).tolist():
        offset, length = (int(n) for n in entries[number])
        position = tuple(int(i) for i in np.unravel_index(number, per_shard))
        inner.check(window.part(offset, length), f"{position} of shard {shard}")


def _chunk_pattern(metadata: dict, ndim: int, version: int) -> re.Pattern:
    """The chunk keys of an array, relative to its folder, as zarr names them."""
    encoding = metadata.get("chunk_key_encoding") if version == 3 else None
    encoding = encoding if isinstance(encoding, dict) else {"name": f"v{version}"}
    configuration = encoding.get("configuration")
    configuration = configuration if isinstance(configuration, dict) else {}
    if version == 2:
        separator = metadata.get("dimension_separator") or "."
    else:
        separator = configuration.get("separator", "/" if encoding.get("name") != "v2" else ".")
    digits = re.escape(str(separator)).join([r"\d+"] * ndim)
    if encoding.get("name") == "v2":
        return re.compile(digits or "0")
    return re.compile("c" + (re.escape(str(separator)) + digits if ndim else ""))


def _zarr_chunks(path: Path, source: Path, name: str, metadata: dict, version: int):
    """An array's chunks as its metadata declares them, and the pattern of their keys;
    refuses a codec or a chunk grid whose chunks cannot be checked."""
    where = f"{source}: variable {name}"
    if version == 2:
        chunk_shape, dtype = metadata.get("chunks"), metadata.get("dtype")
        filters = metadata.get("filters") or []
        codecs = [
            metadata.get("compressor"),
            *(filters[::-1] if isinstance(filters, list) else [filters]),
        ]
        codecs = [c for c in codecs if c is not None]
    else:
        grid = metadata.get("chunk_grid")
        grid = grid if isinstance(grid, dict) else {}
        if grid.get("name") != "regular":
            raise ValueError(f"{where} declares a {grid.get('name')!r} chunk grid; refusing it")
        settings = grid.get("configuration")
        chunk_shape = settings.get("chunk_shape") if isinstance(settings, dict) else None
        dtype, codecs = metadata.get("data_type"), metadata.get("codecs") or []
        codecs = codecs[::-1] if isinstance(codecs, list) else [codecs]
    if not isinstance(chunk_shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in chunk_shape
    ):
        raise ValueError(f"{where} declares chunks {chunk_shape!r}, which are no shape")
    stages = [_zarr_stage(codec) for codec in codecs]
    unknown = [c for c, s in zip(codecs, stages, strict=True) if s is None]
    if unknown:
        raise ValueError(
            f"{where} asks for the codec {unknown[0]!r}; attnpanel cannot tell what its "
            "chunks decode to before decoding them, so refuses it"
        )
    _lead(stages, where)
    itemsize = zarr_itemsize(dtype)
    type_name = str(dtype.get("name") if isinstance(dtype, dict) else dtype)
    if type_name in _VLEN_TYPES or any("vlen-" in s.name for s in stages):
        itemsize = max(itemsize, VLEN_CELL_BYTES)
    for codec in codecs:  # filters that store cells as another type (delta, astype, ...)
        settings = codec.get("configuration", codec) if isinstance(codec, dict) else None
        for key in ("dtype", "astype", "encode_dtype", "decode_dtype"):
            if isinstance(settings, dict) and settings.get(key) is not None:
                itemsize = max(itemsize, zarr_itemsize(settings[key]))
    chunks = _Chunks(f"{path}: variable {name}", tuple(chunk_shape), itemsize, stages)
    return chunks, _chunk_pattern(metadata, len(chunk_shape), version)


def _zarr_arrays(source: Path, metadata) -> list[tuple[Path, dict, int]]:
    """The arrays a metadata document declares (a folder, its metadata, the zarr version):
    itself (``.zarray``, an array's ``zarr.json``) or those it consolidates."""
    if not isinstance(metadata, dict):
        return []
    folder = source.parent
    if source.name == ".zarray":
        return [(folder, metadata, 2)]
    if source.name == ".zmetadata" and isinstance(metadata.get("metadata"), dict):
        return [
            (folder / key.removesuffix(".zarray"), array, 2)
            for key, array in metadata["metadata"].items()
            if (key == ".zarray" or key.endswith("/.zarray")) and isinstance(array, dict)
        ]
    if source.name != "zarr.json":
        return []
    if metadata.get("node_type") == "array":
        return [(folder, metadata, 3)]
    consolidated = metadata.get("consolidated_metadata")
    members = consolidated.get("metadata") if isinstance(consolidated, dict) else None
    return [
        (folder / key, array, 3)
        for key, array in (members.items() if isinstance(members, dict) else ())
        if isinstance(array, dict) and array.get("node_type") == "array"
    ]


def refuse_zarr_bombs(path: Path, documents: list[tuple[Path, object]], files: list[Path]):
    """Raise if a stored chunk of the zarr store at ``path`` is, or decodes to, more than
    its array declares; only headers are read, or streams decoded in dropped pieces and
    stopped past the declared size.

    ``documents`` are the store's metadata files and their parsed content (every
    declaration of an array is held to, consolidated or not); ``files`` every file of it.
    """
    arrays: dict[Path, list] = {}
    for source, metadata in documents:
        for folder, array, version in _zarr_arrays(source, metadata):
            name = path.name if folder == path else Path(os.path.relpath(folder, path)).as_posix()
            found = _zarr_chunks(path, source, name, array, version)
            arrays.setdefault(folder, []).append(found)
    for file in files:
        for folder in (file.parent, *file.parent.parents):
            for chunks, pattern in arrays.get(folder, ()):
                key = file.relative_to(folder).as_posix()
                if pattern.fullmatch(key):
                    index = tuple(int(n) for n in re.findall(r"\d+", key))
                    with open(file, "rb") as handle:
                        window = _Window(handle, 0, file.stat().st_size)
                        chunks.check(window, f"{index} ({file.relative_to(path).as_posix()})")
            if folder == path:
                break


def _hdf5_chunks(path: Path, name: str, dataset) -> tuple[_Chunks, list[int]] | None:
    """A filtered dataset's chunks, and the filter number of each stage (decode order);
    None where its chunks are stored as they decode."""
    import h5py

    plist = dataset.id.get_create_plist()
    if dataset.chunks is None or plist.get_nfilters() == 0:
        return None
    kind = dataset.id.get_type()
    variable = isinstance(kind, h5py.h5t.TypeVlenID) or (
        isinstance(kind, h5py.h5t.TypeStringID) and kind.is_variable_str()
    )
    itemsize = 16 if variable else kind.get_size()  # a heap reference, on disk
    chunks = _Chunks(f"{path}: variable {name}", tuple(dataset.chunks), itemsize, [])
    for number in range(plist.get_nfilters()):
        code, _, values, label = plist.get_filter(number)
        if code not in _H5_FILTERS:
            raise ValueError(
                f"{chunks.where} is stored through HDF5 filter {code} "
                f"({label.decode(errors='replace')}); attnpanel cannot tell what its chunks "
                "decode to before decoding them, so refuses it"
            )
        if code in (5, 6) and len(values) > 4 and values[2] * values[4] > chunks.limit:
            raise ValueError(
                f"{chunks.where}: its {_H5_FILTERS[code][0]} filter decodes each chunk to "
                f"{_count(values[2] * values[4])}, but chunks are declared {chunks.shape} x "
                f"{itemsize} bytes; refusing to read it"
            )
        chunks.stages.insert(0, _Stage(*_H5_FILTERS[code]))
    _lead(chunks.stages, chunks.where)
    return chunks, list(range(plist.get_nfilters()))[::-1]


def _check_hdf5_chunk(raw: BinaryIO, chunks: _Chunks, order: list[int], info) -> None:
    """Check one stored chunk (h5py's ``StoreInfo``) through the filters it went through."""
    mask = info.filter_mask  # a bit set for each filter skipped for this chunk
    stages = [s for s, n in zip(chunks.stages, order, strict=True) if not mask >> n & 1]
    index = tuple(o // c for o, c in zip(info.chunk_offset, chunks.shape, strict=True))
    window = _Window(raw, info.byte_offset, info.size)
    _Chunks(chunks.where, chunks.shape, chunks.itemsize, stages).check(
        window, f"{index} at byte {info.byte_offset}"
    )


def refuse_hdf5_bombs(path: Path) -> None:
    """Raise if a stored chunk of the HDF5 (netCDF) file at ``path`` is, or decodes to,
    more than its dataset declares; HDF5 tells only where the raw chunks lie, which are
    then read as the zarr ones are (headers, or streams stopped past the size)."""
    import h5py

    with h5py.File(path, "r") as handle, open(path, "rb") as raw:
        names: list[str] = []
        handle.visititems(
            lambda n, item: names.append(n) if isinstance(item, h5py.Dataset) else None
        )
        for name in names:
            found = _hdf5_chunks(path, name, handle[name])
            if found is None:
                continue
            store = handle[name].id
            if hasattr(store, "chunk_iter"):  # one pass over the chunk index
                store.chunk_iter(lambda info, found=found: _check_hdf5_chunk(raw, *found, info))
            else:
                for number in range(store.get_num_chunks()):
                    _check_hdf5_chunk(raw, *found, store.get_chunk_info(number))
