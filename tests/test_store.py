"""Store format: bf16 bit-exactness, digests, corruption detection by verify and by readers."""

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglenest.extraction.backends.hf import HFBackend
from eaglenest.extraction.loop import extract_part
from eaglenest.runtime.errors import EaglenestError
from eaglenest.store.bf16 import from_bits, to_bits
from eaglenest.store.hidden_store import HiddenStore, verify_store
from eaglenest.target.directory import check_fingerprint, materialize
from eaglenest.target.taps import resolve_taps

from .conftest import REPO, gate, random_samples, run_py, write_tokenized


def test_bf16_bits_round_trip_is_exact():
    x = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 24900.0], dtype=torch.bfloat16)])
    back = from_bits(to_bits(x))
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def extract_tiny(
    tiny_target, tmp_path, codec="zstd", n=12, name="p", batch_tokens=200, states="bf16", backend_states=None
):
    """`backend_states`: the format the backend hands over (default: the store's; bf16 with an fp8
    store = states quantized in the fill, as for the sglang backend)."""
    taps = resolve_taps("auto", tiny_target.num_layers)
    seqs = random_samples(n, tiny_target.vocab_size, 33, 60)
    tok = write_tokenized(tmp_path / f"{name}.parquet", seqs)
    be = HFBackend(tiny_target, taps, dtype="bfloat16", device="cpu", states=backend_states or states)
    out = tmp_path / "hidden" / name
    m = extract_part(
        part=name,
        tokenized=tok,
        target=tiny_target,
        backend=be,
        taps=taps,
        dtype="bfloat16",
        revision=0,
        layout_cfg=dict(chunk_mb=0.01, shard_mb=0.05, codec=codec, level=1, states=states),
        validate_cfg=gate(3),
        out_dir=out,
        work_root=tmp_path / "work",
        batch_tokens=batch_tokens,
        max_seq_len=64,
        progress=False,
    )
    return out, seqs, be, m


def test_store_round_trip_bit_exact(tiny_target, tmp_path):
    # batch_tokens 64 < 2 x 33: every sample runs alone, so one-by-one output must match bit for bit
    out, seqs, be, m = extract_tiny(tiny_target, tmp_path, batch_tokens=64)
    assert m["committed"] and m["pieces"] > 1 and m["validation"]["passed"]
    store = HiddenStore(out)
    assert len(store) == len(seqs) and store.n_tokens == sum(map(len, seqs))
    assert store.attrs["taps"] == [2, 4, 5]
    assert store.attrs["target_fingerprint"] == tiny_target.fingerprint
    for i, s in enumerate(seqs):  # one by one through the backend == what the store holds, bit for bit
        ids, aux, final = store.read(i)
        assert store.index[i]["id"] == f"s{i}" and np.array_equal(ids, s)
        a, f = be.extract([s])[0]
        assert np.array_equal(aux, to_bits(a)) and np.array_equal(final, to_bits(f))
    assert verify_store(out, progress=False) == []
    assert not list((tmp_path / "work").rglob("*"))  # the part's work dir is gone: nothing left under the root
    # every piece's shard file side by side in its array's directory (DVC hashes one directory at a time)
    shards = [f.relative_to(out).parts for f in out.rglob("c.*")]
    assert len(shards) == 3 * m["pieces"] and all(len(p) == 2 for p in shards)


def test_fp8_quantization_error_is_bounded():
    from eaglenest.store import states as state_format

    x = torch.randn(64, 3, 256) * torch.logspace(-3, 3, 64)[:, None, None]  # rows over six decades
    x[5, 1] = 0.0  # an all-zero row: scale 0, decodes to exact zeros
    x[7, 2, :4] = torch.tensor([448.0, -448.0, 0.5, 1.0])  # amax 448: scale 1, exact e4m3 values stay exact
    x = x.to(torch.bfloat16)
    stored = state_format.as_numpy(state_format.encode(x, x[:, 0], "fp8"), "fp8")
    assert stored["aux"].dtype == np.uint8 and stored["aux_scale"].shape == (64, 3)
    assert stored["final_scale"].shape == (64,)
    aux, final = (from_bits(a).float() for a in state_format.decode(stored, "fp8"))
    ref = x.float()
    assert not aux[5, 1].any() and aux[7, 2, :4].tolist() == [448.0, -448.0, 0.5, 1.0]
    err = (aux - ref).abs()
    # e4m3: 3 mantissa bits, so an element within 2^-4 of itself (+ bf16 rounding of the product),
    # and nothing worse than 2^-9 of the row's amax (the smallest subnormal step)
    amax = ref.abs().amax(-1, keepdim=True)
    assert (err <= ref.abs() * (2**-4 + 2**-8) + amax * 2**-9).all()
    rel = (aux - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    assert rel.max() < 0.05 and torch.equal(final, aux[:, 0])


def test_fp8_store_half_the_bytes_same_states_either_path(tiny_target, tmp_path):
    """fp8 stores: quantized by the hf backend (on its device) or in the fill (a backend handing over
    bf16, as sglang does) give the same bytes; readers get bf16 within fp8's error of the exact
    states; the gate passes; a flipped scale byte is named."""
    bf16, seqs, be, m16 = extract_tiny(tiny_target, tmp_path / "bf16", codec="none")
    fp8, _, _, m8 = extract_tiny(tiny_target, tmp_path / "fp8", codec="none", states="fp8")
    fill, _, _, mf = extract_tiny(tiny_target, tmp_path / "fill", codec="none", states="fp8", backend_states="bf16")
    assert m8["committed"] and m8["validation"]["passed"]
    # 1 byte + 4/H for the scale vs 2 bytes per value; at H = 64 the scales, ids and the two stores'
    # different padding (a piece holds twice the rows) add a few percent
    assert 0.5 < m8["stored_bytes"] / m16["stored_bytes"] < 0.62
    s16, s8 = HiddenStore(bf16), HiddenStore(fp8)
    assert s8.attrs["layout"]["states"] == "fp8" and "float8_e4m3fn" in s8.attrs["storage"]
    assert [r["digest"] for r in s8.index] == [r["digest"] for r in HiddenStore(fill).index]
    assert [r["digest"] for r in s8.index] != [r["digest"] for r in s16.index]
    for i in range(len(seqs)):
        _, a16, f16 = s16.read(i)
        ids, a8, f8 = s8.read(i)
        assert np.array_equal(ids, seqs[i]) and a8.dtype == np.uint16 and a8.shape == a16.shape
        x, y = (
            from_bits(np.concatenate([a8.reshape(-1, a8.shape[-1]), f8])).float(),
            from_bits(np.concatenate([a16.reshape(-1, a16.shape[-1]), f16])).float(),
        )
        assert ((x - y).norm(dim=-1) / y.norm(dim=-1)).max() < 0.05
    assert verify_store(fp8, progress=False) == []
    victim = next(r for r in s8.index if r["start"] == 0)  # pieces hold samples longest first
    flip_byte(fp8 / "aux_scale" / "c.0.0", 1)  # uncompressed: row 0's first scale
    bad = verify_store(fp8, progress=False)
    assert any(f"sample '{victim['id']}'" in b for b in bad)


def flip_byte(path: Path, offset: int) -> None:
    path.chmod(0o644)
    b = bytearray(path.read_bytes())
    b[offset] ^= 0xFF
    path.write_bytes(bytes(b))


def test_flipped_byte_is_named_by_verify_and_reader(tiny_target, tmp_path):
    out, seqs, _, _ = extract_tiny(tiny_target, tmp_path, codec="none")
    store = HiddenStore(out)
    H, C = store.attrs["hidden_size"], store.attrs["layout"]["chunk_tokens"]
    # uncompressed: shard 0 of `final` is its chunks (rows + a 4-byte crc32c each), then the index
    victim = next(r for r in store.index if r["start"] == 0)  # shard 0's first sample (pieces: longest first)
    row = victim["start"] + victim["length"] // 2
    flip_byte(out / "final" / "c.0.0", (row // C) * (C * H * 2 + 4) + (row % C) * H * 2 + 7)
    bad = verify_store(out, progress=False)
    chunk = range((row // C) * C, (row // C + 1) * C)
    named = [r for r in store.index if any(f"sample '{r['id']}'" in b for b in bad)]
    assert victim in named and len(named) == len(bad)
    assert all(set(range(r["start"], r["start"] + r["length"])) & set(chunk) for r in named)
    with pytest.raises(EaglenestError, match=f"store p .*sample '{victim['id']}'"):
        HiddenStore(out).read(store.index.index(victim))
    p = run_py(["-m", "eaglenest.cli", "verify", "-q", str(out)], cwd=tmp_path, check=False)
    assert p.returncode == 1 and victim["id"] in p.stdout


def test_digest_mismatch_is_named(tiny_target, tmp_path):
    out, *_ = extract_tiny(tiny_target, tmp_path)
    store = HiddenStore(out)
    store.index[2] = {**store.index[2], "digest": "0" * 32}  # bytes that decode fine but are not the sample's
    with pytest.raises(EaglenestError, match=r"sample 's2' \(index 2\) digest mismatch"):
        store.read(2)


def test_flipped_byte_in_compressed_shard_or_shard_index(tiny_target, tmp_path):
    out, *_ = extract_tiny(tiny_target, tmp_path, codec="zstd")
    clean = tmp_path / "clean"
    shutil.copytree(out, clean)
    shard = out / "aux" / "c.0.0.0"
    flip_byte(shard, shard.stat().st_size // 3)  # inside compressed chunk data
    bad = verify_store(out, progress=False)
    assert bad and all("store p" in b and "sample '" in b for b in bad)
    shard = clean / "aux" / "c.0.0.0"
    flip_byte(shard, shard.stat().st_size - 6)  # inside the checksummed shard index
    bad = verify_store(clean, progress=False)
    assert bad and all("sample '" in b for b in bad)


def test_uncommitted_store_is_never_read_as_valid(tiny_target, tmp_path):
    out, *_ = extract_tiny(tiny_target, tmp_path)
    (out / "checksums.json").unlink()
    with pytest.raises(EaglenestError, match="never committed"):
        HiddenStore(out)
    assert verify_store(out, progress=False)


@pytest.mark.parametrize("name", ["zarr.json", "aux/zarr.json", "index.parquet", "checksums.json"])
def test_flipped_byte_in_metadata_is_detected(tiny_target, tmp_path, name):
    out, *_ = extract_tiny(tiny_target, tmp_path)
    f = out / name
    flip_byte(f, f.stat().st_size // 2)
    bad = verify_store(out, progress=False)
    assert len(bad) == 1 and str(out) in bad[0]


def test_verify_cli_ok_exit_zero(tiny_target, tmp_path):
    out, *_ = extract_tiny(tiny_target, tmp_path)
    p = run_py(["-m", "eaglenest.cli", "verify", "-q", str(out)], cwd=REPO)
    assert p.returncode == 0 and "OK" in p.stdout


@pytest.mark.parametrize(
    "codec, direct, states, sep",
    [("zstd", True, "bf16", "."), ("none", True, "bf16", "."), ("zstd", False, "bf16", "."), ("zstd", True, "fp8", "."),
     ("zstd", True, "bf16", "/")],
)  # fmt: skip
def test_our_shard_writer_is_byte_identical_to_zarr(tmp_path, codec, direct, states, sep):
    """Pieces are encoded without zarr (shard_writer); the files must be exactly what zarr writes for
    the array metadata it created: same chunk bytes, crc32c, index, left-out fill chunks, no file
    for an all-fill shard. Written with O_DIRECT (block padding cut off again) and buffered; bf16
    states and fp8 (uint8 states + float32 scale arrays); shard files side by side (".") or a
    directory per piece ("/", the layout stores had before, which zarr still reads)."""
    import zarr

    from eaglenest.store import shard_writer
    from eaglenest.store.hidden_store import Layout, create_arrays
    from eaglenest.store.shard_reader import ShardReader
    from eaglenest.store.shard_writer import shard_files, write_piece

    layout = Layout(16, 3, chunk_tokens=16, shard_tokens=64, codec=codec, level=1, states=states, key_separator=sep)
    ours, ref = tmp_path / "ours", tmp_path / "zarr"
    for d in (ours, ref):
        create_arrays(zarr.open_group(str(d), mode="w"), layout, 3)
    rng = np.random.default_rng(0)
    for piece, used in ((0, 40), (1, 64), (2, 5)):  # padding chunks, a full shard, an all-fill aux shard
        arrays = {"input_ids": np.full(64, -1, np.int32)}
        arrays["input_ids"][:used] = rng.integers(0, 1000, used)
        for name, (row, dtype) in layout.arrays().items():
            if name != "input_ids":
                arrays[name] = np.zeros((64, *row), dtype)
                if piece != 2 or not name.startswith("aux"):
                    arrays[name][:used] = rng.integers(0, 256 ** min(2, dtype.itemsize), (used, *row)).astype(dtype)
        g = zarr.open_group(str(ref), mode="r+")
        sl = slice(piece * 64, piece * 64 + 64)
        for name, a in arrays.items():
            g[name][sl] = a
        write_piece(ours, piece, layout, arrays, [], direct=direct)
        for name, a in shard_files(ours, piece, layout).items():
            b = shard_files(ref, piece, layout)[name]
            assert a.exists() == b.exists(), a
            assert not a.exists() or a.read_bytes() == b.read_bytes(), a
        g = zarr.open_group(str(ours), mode="r")
        assert all((g[name][sl] == a).all() for name, a in arrays.items())
        for name, a in arrays.items():  # read back without zarr: the same rows, padding and left-out chunks too
            reader = ShardReader.for_array(g[name], lambda piece, name=name: shard_files(ours, piece, layout)[name])
            assert reader is not None and np.array_equal(reader.read(sl.start, sl.stop), a), name
            assert np.array_equal(reader.read(sl.start + 3, sl.start + 21), a[3:21]), name  # across chunks
    assert not shard_files(ours, 2, layout)["aux"].exists()  # all-fill aux shard: no file, as zarr does
    if direct and shard_writer.direct_refused(ours):
        pytest.skip("this filesystem refuses O_DIRECT: only the buffered fallback was checked")


def test_target_digest_cache_reuses_digests_but_catches_a_weight_edited_in_place(tiny_target, tmp_path):
    """The extract stage's fingerprint check takes an unchanged file's sha256 from a stat-keyed cache;
    a byte flipped in place, even with size and mtime put back, changes ctime and is hashed again."""
    shutil.copytree(tiny_target.model_dir, tmp_path / "model")
    target = materialize(str(tmp_path / "model"), tmp_path / "target")
    cache = tmp_path / "digests.json"
    check_fingerprint(target, cache)
    entries = json.loads(cache.read_text())
    weights = next(target.model_dir.glob("*.safetensors"))
    assert any(k.startswith(f"{weights.resolve()}|") for k in entries)
    poisoned = {k: "0" * 64 if k.startswith(f"{weights.resolve()}|") else v for k, v in entries.items()}
    cache.write_text(json.dumps(poisoned))  # a stale entry IS used while the stat key matches:
    with pytest.raises(EaglenestError, match="fingerprint"):
        check_fingerprint(target, cache)
    cache.write_text(json.dumps(entries))
    check_fingerprint(target, cache)

    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    with open(weights, "r+b") as f:  # in place: same inode and size
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_ino == st.st_ino
    with pytest.raises(EaglenestError, match="fingerprint .* != recorded"):
        check_fingerprint(target, cache)


def test_target_stage_records_digests_so_the_first_part_reads_no_weight(tiny_target, tmp_path, monkeypatch):
    """materialize with a digest cache records what it hashed: the first extract part's fingerprint
    check then takes every digest from the cache (here: hashing is made to fail)."""
    from eaglenest.files import hashing

    shutil.copytree(tiny_target.model_dir, tmp_path / "model")
    cache = tmp_path / "digests.json"
    target = materialize(str(tmp_path / "model"), tmp_path / "target", digests=cache)
    weights = next(target.model_dir.glob("*.safetensors"))
    assert any(k.startswith(f"{weights.resolve()}|") for k in json.loads(cache.read_text()))

    def no_read(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(hashing, "sha256_file", no_read)
    check_fingerprint(target, cache)


@pytest.mark.parametrize("codec, states", [("zstd", "bf16"), ("none", "fp8")])
def test_samples_are_read_without_zarr_as_zarr_reads_them(tiny_target, tmp_path, codec, states):
    """HiddenStore reads samples from the shard files itself (zarr's read of a sample's rows costs
    ms of Python per array): every sample, every array, the same bytes as zarr's own read."""
    out, *_ = extract_tiny(tiny_target, tmp_path, codec=codec, states=states)
    store = HiddenStore(out)
    assert all(store.readers.values()), store.readers  # this layout is read without zarr
    for i, r in enumerate(store.index):
        rows = slice(r["start"], r["start"] + r["length"])
        ids, stored = store.read_stored(i)
        assert np.array_equal(ids, store.arrays["input_ids"][rows])
        assert stored.keys() == set(store.arrays) - {"input_ids"}
        assert all(
            np.array_equal(v, store.arrays[k][rows]) and v.dtype == store.arrays[k].dtype for k, v in stored.items()
        )
    again = pickle.loads(pickle.dumps(store))  # a store still travels to another process, readers and all
    assert all(np.array_equal(v, stored[k]) for k, v in again.read_stored(len(store) - 1)[1].items())


def test_an_array_zarr_wrote_in_another_layout_is_read_through_zarr(tiny_target, tmp_path):
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    from eaglenest.store.checksums import write_checksums

    out, *_ = extract_tiny(tiny_target, tmp_path)
    store = HiddenStore(out)
    want = [store.read_stored(i) for i in range(len(store))]
    g = zarr.open_group(str(out), mode="r+")
    final = g["final"]
    data, chunks, shards = final[:], final.chunks, final.shards
    g.create_array(
        "final", shape=data.shape, dtype=data.dtype, chunks=chunks, fill_value=0, overwrite=True,
        shards={"shape": shards, "index_location": "start"}, compressors=[ZstdCodec(level=1), Crc32cCodec()],
    )  # fmt: skip
    g["final"][:] = data
    write_checksums(out)
    store = HiddenStore(out)
    assert store.readers["final"] is None and store.readers["aux"] is not None
    for i, (ids, stored) in enumerate(want):
        got_ids, got = store.read_stored(i)
        assert np.array_equal(got_ids, ids) and all(np.array_equal(got[k], v) for k, v in stored.items())


def test_a_cut_short_or_rewritten_shard_is_named_after_a_read(tiny_target, tmp_path):
    """The reader keeps each shard's index once read: a file changed since (restored, rewritten, cut
    short) is read again, and a damaged one fails the read naming the sample."""
    out, *_ = extract_tiny(tiny_target, tmp_path, codec="none")
    store = HiddenStore(out)
    victim = next(i for i, r in enumerate(store.index) if r["piece"] == 0)
    store.read_stored(victim)
    shard = out / "aux" / "c.0.0.0"
    flip_byte(shard, shard.stat().st_size - 6)  # the index the reader already holds
    name = store.index[victim]["id"]
    with pytest.raises(EaglenestError, match=f"store p .*sample '{name}' .*unreadable, the shard is corrupt: .*index"):
        store.read_stored(victim)
    flip_byte(shard, shard.stat().st_size - 6)  # restored: it reads again
    store.read_stored(victim)
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(EaglenestError, match=f"sample '{name}' .*unreadable, the shard is corrupt"):
        store.read_stored(victim)
    assert verify_store(out, progress=False)
