"""Byte ranges of whole lines (what workers read by themselves) and line offsets (where a resume starts)."""

import random
import sys

import pytest

from olmo_ds.data.prepare import readers


def make_file(tmp_path, lines: list[bytes], trailing_newline: bool):
    data = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("trailing_newline", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 20])
def test_ranges_cover_the_file_in_whole_lines(tmp_path, chunk, trailing_newline):
    rng = random.Random(chunk)
    # Short lines, empty lines, and lines far longer than a chunk (and than the 64 KiB probe).
    lines = [b"x" * rng.choice([0, 1, 5, 50, 300, 70_000]) for _ in range(200)]
    path, data = make_file(tmp_path, lines, trailing_newline)
    ranges = list(readers.iter_ranges(path, chunk))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    assert all(data[b - 1 : b] == b"\n" for _, b in ranges[:-1])  # each range but the last ends a line
    assert all(b - a < chunk + 70_002 for a, b in ranges)
    assert b"".join(readers.read_range(path, a, b) for a, b in ranges) == data


def test_ranges_of_an_empty_file_and_from_an_offset(tmp_path):
    path, _ = make_file(tmp_path, [], False)
    assert list(readers.iter_ranges(path, 10)) == []
    path, data = make_file(tmp_path, [b"a" * 5] * 10, True)
    assert list(readers.iter_ranges(path, 13, start=12)) == [(12, 30), (30, 48), (48, 60)]


def test_line_offset_matches_splitting(tmp_path):
    lines = [b"y" * (i % 13) for i in range(500)]
    path, data = make_file(tmp_path, lines, True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    for n in (1, 2, 3, 250, 500, 501):
        assert readers.line_offset(path, n) == starts[n - 1]
    assert readers.line_offset(path, 10_000) == len(data)


def test_a_file_that_shrank_is_an_error_naming_it(tmp_path):
    path, _ = make_file(tmp_path, [b"z" * 10] * 3, True)
    with pytest.raises(OSError, match="x.jsonl.*shrank"):
        readers.read_range(path, 0, 1000)


def _lines(n: int) -> bytes:
    rng = random.Random(n)
    return b"".join(b'{"text": "%d %s"}\n' % (i, b"x" * rng.randrange(200)) for i in range(n))


def _read_all(path) -> bytes:
    stream, _ = readers.open_binary(path)
    with stream:
        return b"".join(iter(lambda: stream.read(1 << 16), b""))


@pytest.mark.parametrize("isal", [True, False])
def test_every_gzip_member_and_zstd_frame_is_read(tmp_path, monkeypatch, isal):
    import gzip

    import zstandard

    if not isal:  # the standard library's reader, as on a machine without python-isal
        monkeypatch.setitem(sys.modules, "isal", None)
    parts = [_lines(3000), _lines(1), _lines(5000)]
    (tmp_path / "a.jsonl.gz").write_bytes(b"".join(gzip.compress(p) for p in parts))  # as `cat a.gz b.gz` makes
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))
    for name in ("a.jsonl.gz", "a.jsonl.zst"):
        assert _read_all(tmp_path / name) == b"".join(parts)
        blocks = list(readers.iter_chunks(tmp_path / name, 4096))
        assert b"".join(b for _, b, _ in blocks) == b"".join(parts) and blocks[-1][0] < 8001


@pytest.mark.parametrize("name, damage", [("t.jsonl.gz", "truncate"), ("t.jsonl.zst", "truncate"), ("t.jsonl.gz", "flip")])
def test_a_damaged_compressed_file_is_an_error_naming_it(tmp_path, name, damage):
    import gzip

    import zstandard

    data = _lines(20_000)
    blob = gzip.compress(data) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(data)
    if damage == "truncate":  # zstandard's own stream reader would end here without a word
        blob = blob[: len(blob) // 2]
    else:
        blob = blob[:1000] + bytes([blob[1000] ^ 0xFF]) + blob[1001:]
    path = tmp_path / name
    path.write_bytes(blob)
    with pytest.raises(readers.CorruptInputError, match=rf"{name}: cannot decompress past line [\d,]+ .*truncated or damaged"):
        for _ in readers.iter_chunks(path, 4096):
            pass


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_truncated_compressed_file_names_its_last_whole_line(tmp_path, suffix):
    """The damage is reported after the last line that could be decompressed whole, not after the
    last block handed out (with 1 MiB blocks that was line 0 for any file under 1 MiB)."""
    import gzip
    import json
    import zlib

    import zstandard

    data = "".join(json.dumps({"text": f"document {i} " + "word " * 50}) + "\n" for i in range(3000)).encode()
    if suffix.endswith(".gz"):
        blob = gzip.compress(data)
        cut = blob[: len(blob) // 3]
        whole = zlib.decompressobj(31).decompress(cut).count(b"\n")
    else:
        blob = zstandard.ZstdCompressor().compress(data)
        cut = blob[: len(blob) // 3]
        whole = zstandard.ZstdDecompressor().decompressobj().decompress(cut).count(b"\n")
    assert 500 < whole < 1500
    path = tmp_path / f"part{suffix}"
    path.write_bytes(cut)
    for chunk in (readers.CHUNK_BYTES, 4096):
        with pytest.raises(readers.CorruptInputError) as e:
            list(readers.iter_chunks(path, chunk))
        assert f"{path}: cannot decompress past line {whole:,} (lines 1-{whole:,} are whole" in str(e.value)
