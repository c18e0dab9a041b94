"""Compression bombs (issue 28, point 5): a stored chunk that decodes far past its declared
size is refused, by a message naming the file, the variable, the chunk and both sizes,
before anything is decompressed; legitimate stores, those attnpanel writes included,
still load.

Each bomb decodes, with the reader's own decoder, to :data:`BOMB` bytes of zeros
(``test_the_crafted_bombs_are_real`` shows it at a smaller size); it is built without ever
holding them: zstd from RLE blocks, deflate and gzip from one flushed piece repeated, blosc
from one compressed block that every block of the buffer points at.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numcodecs
import numpy as np
import pytest
import torch
import xarray as xr
import zarr
import zarr.codecs
import zarr.codecs.numcodecs as zarr_numcodecs
from hostile import Hostile
from test_io_hostile import small_trace

import attnpanel
from attnpanel.surveys.store import FORMAT, VERSION, SurveyStore
from attnpanel.surveys.survey import survey
from attnpanel.traces import screening

BOMB = 2**31  # bytes each bomb decodes to
PIECE = 2**20
RSS_GROWTH = 200 * 2**20  # the most a refused load may add to the peak memory of a process
pytestmark = [
    pytest.mark.filterwarnings("ignore::zarr.errors.ZarrUserWarning"),
    pytest.mark.filterwarnings("ignore:The data type .* does not have a Zarr V3 specification"),
    pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata"),
]


def zstd_bomb(n_bytes: int, content_size: bool = True) -> bytes:
    """A zstd frame of RLE blocks of zeros, with or without its ``Frame_Content_Size``."""
    blocks, left = [], n_bytes
    while left:
        size = min(left, 128 * 2**10)
        left -= size
        blocks.append((int(not left) | 1 << 1 | size << 3).to_bytes(3, "little") + b"\0")
    # single segment with an 8-byte content size, or a 128 KiB window and no size
    header = b"\xe0" + struct.pack("<Q", n_bytes) if content_size else b"\x00\x38"
    return b"\x28\xb5\x2f\xfd" + header + b"".join(blocks)


def deflate_bomb(n_bytes: int, wbits: int) -> bytes:
    """A zlib (``wbits`` 15) or gzip (31) stream of zeros: after a full flush, every further
    MiB of zeros compresses to the same bytes."""
    zeros, stream = bytes(PIECE), zlib.compressobj(9, zlib.DEFLATED, wbits)
    first = stream.compress(zeros) + stream.flush(zlib.Z_FULL_FLUSH)
    again = stream.compress(zeros) + stream.flush(zlib.Z_FULL_FLUSH)
    end = stream.flush(zlib.Z_FINISH)[: -8 if wbits == 31 else -4]  # its trailer is for 2 MiB
    if wbits == 31:
        crc = 0
        for _ in range(n_bytes // PIECE):
            crc = zlib.crc32(zeros, crc)
        trailer = struct.pack("<II", crc, n_bytes % 2**32)
    else:
        trailer = struct.pack(">I", (n_bytes % 65521) << 16 | 1)  # adler32 of zeros
    return first + again * (n_bytes // PIECE - 1) + end + trailer


def blosc_bomb(n_bytes: int, block: int = 2**18) -> bytes:
    """A blosc buffer of zeros whose every block starts at the same compressed block."""
    one = bytes(numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE, block).encode(bytes(block)))
    version, version_lz, flags, typesize = one[:4]
    data, n_blocks = one[20:], n_bytes // block  # past the header and the one block start
    start = 16 + 4 * n_blocks
    sizes = (n_bytes, block, start + len(data))
    header = struct.pack("<4B3I", version, version_lz, flags, typesize, *sizes)
    return header + struct.pack("<I", start) * n_blocks + data


def test_the_crafted_bombs_are_real():
    n_bytes = 4 * PIECE
    decoded = {
        "zstd": numcodecs.Zstd().decode(zstd_bomb(n_bytes)),
        "zstd, no size": numcodecs.Zstd().decode(zstd_bomb(n_bytes, content_size=False)),
        "gzip": numcodecs.GZip().decode(deflate_bomb(n_bytes, 31)),
        "zlib": numcodecs.Zlib().decode(deflate_bomb(n_bytes, 15)),
        "blosc": numcodecs.Blosc().decode(blosc_bomb(n_bytes)),
    }
    for name, out in decoded.items():
        assert len(out) == n_bytes and not np.frombuffer(out, np.uint8).any(), name
    assert len(zstd_bomb(BOMB)) < 70_000 and len(blosc_bomb(BOMB - 2**18)) < 40_000
    assert len(deflate_bomb(BOMB, 31)) < 2_200_000


def loads_in_a_child(paths: list[Path]) -> list[tuple[str, int]]:
    """Each path given to ``attnpanel.load`` (``io.load(lazy=True)`` where it ends in
    ``+lazy``) in a fresh process: the message it raised, and how far the peak memory of
    the process (``ru_maxrss``, which any decode into memory raises, numpy's, numcodecs'
    or HDF5's own malloc) had by then grown past its high-water mark before the first.

    Legitimate traces of each kind are loaded first (eagerly and lazily), so that what the
    first load imports and compiles is not counted. A control ends the run: a real decode
    of a 1 GiB bomb must show in the same measure.
    """
    warm = Path(paths[0]).parent / "warm-up"
    warm.mkdir(exist_ok=True)
    for suffix in (".zarr", ".nc"):
        if not (warm / f"trace{suffix}").exists():
            attnpanel.save(small_trace(), warm / f"trace{suffix}")
    script = """
import json, os, resource, sys
import numcodecs
import attnpanel
from attnpanel.traces import io
from test_bombs import blosc_bomb
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
in_use = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
for path in sys.argv[1:3]:  # the warm-up traces
    attnpanel.load(path)
    io.load(path, lazy=True)
base, found = max(peak(), in_use()), []  # the high-water mark so far: a decode passes it
for path in sys.argv[3:]:
    try:
        if path.endswith("+lazy"):
            io.load(path.removesuffix("+lazy"), lazy=True)
        else:
            attnpanel.load(path)
        found.append(["loaded", peak() - base])
    except ValueError as error:
        found.append([str(error), peak() - base])
before = in_use()
numcodecs.Blosc().decode(blosc_bomb(2**30 - 2**18))
found.append(["control", peak() - before])
print(json.dumps(found))
"""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(warm / "trace.zarr"),
            str(warm / "trace.nc"),
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = [tuple(entry) for entry in json.loads(done.stdout.splitlines()[-1])]
    assert found.pop()[1] > 2**30 * 0.8  # the measure sees a real decode
    return found


def seeded_trace(length: int = 8) -> xr.Dataset:
    torch.manual_seed(0)
    return small_trace(length=length)


def v3_trace(path: Path, compressor, shards: tuple | None = None, length: int = 8) -> Path:
    """A trace written by xarray as zarr v3, its maps in chunks of one (sample, head)."""
    ds = seeded_trace(length)
    encoding = {}
    for name in ds.data_vars:
        encoding[name] = {"compressors": [compressor]}
        if name == "weights":
            encoding[name]["chunks"] = (1, 1, length, length)
            if shards is not None:
                encoding[name]["shards"] = shards
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding=encoding)
    return path


DECLARED = r"declared \(1, 1, 8, 8\) x 4 bytes = 256 bytes"
SAYS = r"says it decodes to 2,147,483,648 bytes \(2 GiB\)"
MORE = r"decodes to more than 4,352 bytes \(4\.25 KiB\)"
# a 2 GiB gzip or zlib bomb takes 2 MiB, more than a 256-byte chunk can be stored in:
# in 4 MiB chunks, it is the capped decode that stops it
LARGE = r"declared \(1, 1, 1024, 1024\) x 4 bytes = 4,194,304 bytes \(4 MiB\)"
LARGE_MORE = r"decodes to more than 4,198,400 bytes \(4 MiB\)"


def test_zarr_bombs_are_refused_before_anything_is_decoded(tmp_path):
    cases = {  # store -> (codec, bomb, what it decodes to, map length, declared chunk)
        "zstd": (zarr.codecs.ZstdCodec(), zstd_bomb(BOMB), SAYS, 8, DECLARED),
        "zstd-no-size": (
            zarr.codecs.ZstdCodec(),
            zstd_bomb(BOMB, content_size=False),
            r"states no size, and its blocks may decode to 2,147,483,648 bytes \(2 GiB\)",
            8,
            DECLARED,
        ),
        "blosc": (
            zarr.codecs.BloscCodec(),
            blosc_bomb(BOMB - 2**18),
            r"says it decodes to 2,147,221,504 bytes \(2 GiB\)",
            8,
            DECLARED,
        ),
        "gzip": (zarr.codecs.GzipCodec(), deflate_bomb(BOMB, 31), LARGE_MORE, 1024, LARGE),
        "zlib": (zarr_numcodecs.Zlib(), deflate_bomb(BOMB, 15), LARGE_MORE, 1024, LARGE),
    }
    paths, expected = [], []
    for name, (codec, bomb, decodes, length, declared) in cases.items():
        path = v3_trace(tmp_path / f"{name}.zarr", codec, length=length)
        (path / "weights" / "c" / "1" / "0" / "0" / "0").write_bytes(bomb)
        chunk = r"chunk \(1, 0, 0, 0\) \(weights/c/1/0/0/0\)"
        codec_name = "numcodecs.zlib" if name == "zlib" else name.split("-")[0]
        message = rf"^{path}: variable weights, {chunk}: its {codec_name} stream {decodes}"
        paths += [path, Path(f"{path}+lazy")]
        expected += [message + rf", but the chunk is {declared}; refusing to read it"] * 2
    saved = attnpanel.save(small_trace(), tmp_path / "saved.zarr")  # zarr v2, blosc
    (saved / "weights" / "0.1.0.0").write_bytes(blosc_bomb(BOMB - 2**18))
    paths.append(saved)
    expected.append(rf"^{saved}: variable weights, chunk \(0, 1, 0, 0\) \(weights/0\.1\.0\.0\)")
    for (message, growth), pattern in zip(loads_in_a_child(paths), expected, strict=True):
        assert re.search(pattern, message), (pattern, message)
        assert "compression bomb" in message and growth < RSS_GROWTH


def netcdf_trace(path: Path, length: int = 8, **compression) -> Path:
    ds = seeded_trace(length)
    encoding = {"weights": {"chunksizes": (1, 1, length, length), **compression}}
    ds.to_netcdf(path, engine="h5netcdf", encoding=encoding)
    return path


def plugin_filtered(path: Path, code: int, encode=bytes) -> Path:
    """A trace whose weights go through HDF5 plugin filter ``code`` (which this HDF5 may
    lack), each chunk stored as ``encode`` makes it."""
    path = netcdf_trace(path)
    with h5py.File(path, "r+") as handle:
        values = handle["weights"][...]
        attrs = dict(handle["weights"].attrs)
        dims = [handle["weights"].dims[i][0].name for i in range(4)]
        for i, dim in enumerate(dims):
            handle["weights"].dims[i].detach_scale(handle[dim])
        del handle["weights"]
        new = handle.create_dataset(
            "weights",
            values.shape,
            "f4",
            chunks=(1, 1, 8, 8),
            compression=code,
            allow_unknown_filter=True,
        )
        for index in np.ndindex(values.shape[:2]):  # stored as given: no filter runs
            new.id.write_direct_chunk((*index, 0, 0), bytes(encode(values[index].tobytes())))
        for i, dim in enumerate(dims):
            new.dims[i].attach_scale(handle[dim])
        new.attrs.update({k: v for k, v in attrs.items() if k != "DIMENSION_LIST"})
    return path


def test_hdf5_bombs_are_refused_before_anything_is_decoded(tmp_path):
    deflate = netcdf_trace(tmp_path / "deflate.nc", 1024, zlib=True)
    checked = netcdf_trace(tmp_path / "checked.nc", 1024, zlib=True, shuffle=True, fletcher32=True)
    blosc = plugin_filtered(tmp_path / "blosc.nc", 32001, numcodecs.Blosc().encode)
    zstd = plugin_filtered(tmp_path / "zstd.nc", 32015, numcodecs.Zstd().encode)
    cases = {  # file -> (bomb, its filter, what it decodes to, declared chunk)
        deflate: (deflate_bomb(BOMB, 15), "deflate", LARGE_MORE, LARGE),
        # fletcher32 is decoded first: with its checksum right, HDF5 would inflate the bomb
        checked: (
            bytes(numcodecs.Fletcher32().encode(deflate_bomb(BOMB, 15))),
            "deflate",
            LARGE_MORE,
            LARGE,
        ),
        blosc: (blosc_bomb(BOMB - 2**18), "blosc", r"says it decodes to 2,147,221,504", DECLARED),
        zstd: (zstd_bomb(BOMB), "zstd", SAYS, DECLARED),
    }
    for path, (bomb, *_) in cases.items():
        with h5py.File(path, "r+") as handle:
            handle["weights"].id.write_direct_chunk((1, 1, 0, 0), bomb)
    found = loads_in_a_child([*cases, Path(f"{deflate}+lazy")])
    for (message, growth), path in zip(found, [*cases, deflate], strict=True):
        _, name, decodes, declared = cases[path]
        chunk = r"chunk \(1, 1, 0, 0\) at byte \d+"
        assert re.search(
            rf"^{path}: variable weights, {chunk}: its {name} stream {decodes}.*, but the "
            rf"chunk is {declared}; refusing to read it \(a compression bomb\)$",
            message,
        ), message
        assert growth < RSS_GROWTH


def test_a_bomb_in_an_inner_chunk_of_a_shard_is_refused(tmp_path):
    path = v3_trace(tmp_path / "sharded.zarr", zarr.codecs.ZstdCodec(), shards=(2, 2, 8, 8))
    passes_screening_and_reads_back(path)
    shard = path / "weights" / "c" / "0" / "0" / "0" / "0"
    stored = shard.read_bytes()
    index = np.frombuffer(stored[-4 * 16 - 4 : -4], "<u8").reshape(4, 2)  # then its crc32c
    inner = [stored[o : o + n] for o, n in index.tolist()]
    inner[3] = zstd_bomb(BOMB)  # inner chunk (1, 1) of the shard
    offsets = np.cumsum([0] + [len(b) for b in inner[:-1]])
    entries = np.stack([offsets, [len(b) for b in inner]], axis=1).astype("<u8").tobytes()
    shard.write_bytes(b"".join(inner) + bytes(numcodecs.CRC32C().encode(entries)))
    [(message, growth)] = loads_in_a_child([Path(f"{path}+lazy")])
    assert re.search(
        rf"variable weights, chunk \(1, 1, 0, 0\) of shard \(0, 0, 0, 0\) "
        rf"\(weights/c/0/0/0/0\): its zstd stream {SAYS}, but the chunk is {DECLARED}",
        message,
    )
    assert growth < RSS_GROWTH


def test_streams_concatenated_in_one_chunk_are_counted_together(tmp_path):
    """Two zstd frames, or two gzip members with zero padding between them, each within
    the declared size: their reader decodes both, and so does the check."""
    frames = zstd_bomb(3000) + zstd_bomb(3000)
    members = deflate_bomb(3 * PIECE, 31) + bytes(64) + deflate_bomb(3 * PIECE, 31)
    assert len(numcodecs.Zstd().decode(frames)) == 6000
    assert len(numcodecs.GZip().decode(members)) == 6 * PIECE
    cases = [
        (zarr.codecs.ZstdCodec(), frames, 8, r"zstd stream says it decodes to 6,000 bytes"),
        (zarr.codecs.GzipCodec(), members, 1024, rf"gzip stream {LARGE_MORE}"),
    ]
    for number, (codec, stored, length, decodes) in enumerate(cases):
        path = v3_trace(tmp_path / f"{number}.zarr", codec, length=length)
        (path / "weights" / "c" / "0" / "1" / "0" / "0").write_bytes(stored)
        with pytest.raises(ValueError, match=rf"chunk \(0, 1, 0, 0\) .*: its {decodes}"):
            screening.refuse_unsafe_storage(path, "zarr")


def test_a_survey_store_with_a_bomb_is_refused_by_read_and_by_survey(tmp_path):
    torch.manual_seed(0)
    model, batch = Hostile().eval(), torch.randn(1, 6, 16)
    store = tmp_path / "survey.zarr"
    found = survey(model, [batch], store=store, progress=False)
    assert found.sizes["sample"] == 1 and SurveyStore(store).read().sizes["sample"] == 1
    (store / "entropy" / "c" / "0" / "0" / "0").write_bytes(zstd_bomb(BOMB))
    pattern = rf"variable entropy, chunk \(0, 0, 0\) \(entropy/c/0/0/0\): its zstd stream {SAYS}"
    with pytest.raises(ValueError, match=pattern):
        SurveyStore(store).read()
    with pytest.raises(ValueError, match=pattern):
        survey(model, [batch], store=store, progress=False)  # resumed: nothing left to run


def survey_part() -> xr.Dataset:
    values = np.random.default_rng(0).random((3, 2, 4))
    coords = {"sample": np.arange(3), "layer": np.array(["a", "b"]), "head": np.arange(4)}
    part = xr.Dataset({"entropy": (("sample", "layer", "head"), values)}, coords=coords)
    return part.assign_attrs(format=FORMAT, version=VERSION)


LEGIT_V3 = {  # made in the test, where zarr's warning about numcodecs codecs is ignored
    "zstd": zarr.codecs.ZstdCodec,
    "gzip": zarr.codecs.GzipCodec,
    "blosc": zarr.codecs.BloscCodec,
    "lz4": zarr_numcodecs.LZ4,
    "bz2": zarr_numcodecs.BZ2,
    "lzma": zarr_numcodecs.LZMA,
    "zlib": zarr_numcodecs.Zlib,
}


def passes_screening_and_reads_back(path: Path) -> None:
    """``attnpanel.load`` reads zarr v2, as ``save`` writes (it takes a v3 store's arrays
    for groups): a v3 store is screened as ``load`` screens it, then read by xarray."""
    screening.refuse_unsafe_storage(path, "zarr")
    xr.testing.assert_identical(xr.open_zarr(path, consolidated=False).load(), seeded_trace())


@pytest.mark.parametrize("codec", LEGIT_V3)
def test_legit_zarr_v3_stores_pass(tmp_path, codec):
    passes_screening_and_reads_back(v3_trace(tmp_path / "legit.zarr", LEGIT_V3[codec]()))


@pytest.mark.parametrize(
    "compression",
    [{"zlib": True}, {"zlib": True, "shuffle": True, "fletcher32": True}, {"compression": "szip"}],
)
def test_legit_compressed_netcdf_files_load(tmp_path, compression):
    path = netcdf_trace(tmp_path / "legit.nc", **compression)
    with h5py.File(path) as handle:
        assert handle["weights"].id.get_create_plist().get_nfilters() >= 1
    xr.testing.assert_identical(attnpanel.load(path), seeded_trace())


def test_what_attnpanel_writes_still_loads(tmp_path):
    demo = attnpanel.demo(n_windows=2)
    for suffix in (".zarr", ".nc"):
        back = attnpanel.load(attnpanel.save(demo, tmp_path / f"demo{suffix}"))
        xr.testing.assert_identical(back.load(), demo)
    store = SurveyStore(tmp_path / "survey.zarr")
    part = survey_part()
    store.append(part, first=True, before=(0, 0))
    xr.testing.assert_identical(store.read().load().drop_attrs(), part.drop_attrs())


def test_a_chunk_stored_larger_than_it_can_be_is_refused(tmp_path):
    path = attnpanel.save(small_trace(), tmp_path / "t.zarr")
    metadata = json.loads((path / "weights" / ".zarray").read_text())
    metadata["compressor"] = None  # a chunk is then read whole, as stored
    (path / "weights" / ".zarray").write_text(json.dumps(metadata))
    (path / ".zmetadata").unlink()
    (path / "weights" / "0.0.0.0").write_bytes(bytes(2**20))
    with pytest.raises(
        ValueError,
        match=r"variable weights, chunk \(0, 0, 0, 0\) \(weights/0\.0\.0\.0\): it is stored in "
        r"1,048,576 bytes \(1 MiB\), more than any encoding of its declared \(1, 1, 8, 8\) x "
        r"4 bytes = 256 bytes needs",
    ):
        attnpanel.load(path)


def test_pipelines_that_cannot_be_checked_are_refused_by_name(tmp_path):
    path = attnpanel.save(small_trace(), tmp_path / "t.zarr")
    (path / ".zmetadata").unlink()
    metadata = json.loads((path / "weights" / ".zarray").read_text())
    pipelines = {  # v2 decodes the compressor, then the filters from last to first
        "zfpy": ({"id": "zfpy"}, None, r"asks for the codec \{'id': 'zfpy'\}; attnpanel cannot"),
        "two": ({"id": "zlib"}, [{"id": "zstd"}], r"asks for zlib, then zstd, to decode its"),
        "before": (
            {"id": "shuffle"},
            [{"id": "blosc"}],
            r"asks for shuffle to change the stored bytes before blosc decodes them",
        ),
    }
    for compressor, filters, refusal in pipelines.values():
        settings = {**metadata, "compressor": compressor, "filters": filters}
        (path / "weights" / ".zarray").write_text(json.dumps(settings))
        with pytest.raises(ValueError, match=rf"weights/\.zarray: variable weights {refusal}"):
            attnpanel.load(path)
    nc = plugin_filtered(tmp_path / "bitshuffle.nc", 32008)
    with pytest.raises(ValueError, match=r"variable weights is stored through HDF5 filter 32008"):
        attnpanel.load(nc)
