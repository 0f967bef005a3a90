"""Restore onto the GPU (issue 14): chunks fetched and decoded into pinned staging, copied to
the device with non-blocking copies on a side stream of the target device, a staging slot
refilled only once its copies completed, read threads on the target device, tensors that
shared storage sharing it again, nvCOMP chunks decoded on the device with no host round trip,
and ``codec="auto"`` choosing nvCOMP for a remote tier only with CUDA and nvCOMP.

The CPU tests run the GPU path with the fake CUDA surface (tests/fake_cuda.py): the device
buffers are host tensors, and the fakes record which buffers were pinned, which copies ran on
which stream, and when events were recorded and waited for. The ``gpu`` tests run the same on
a real GPU and skip without one."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fake_cuda
import pytest
import torch
from fake_cuda import FakeCuda, FakeStream
from test_codecs import _FakeBatch, _FakeNvCodec

from tierckpt import Checkpointer, LocalTier, MemoryTier, S3Tier, capture, devices, restore_gpu
from tierckpt.codecs import nvcomp as nvcomp_mod
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.codecs.nvcomp import NvcompCodec
from tierckpt.errors import CorruptCheckpoint, CorruptChunk, UnknownCodec

CUDA = torch.cuda.is_available()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    # torch itself sees no GPU (on a GPU machine too): host arenas are not pinned or built
    # ahead, so what a load pins and copies is what the fakes record
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return fake_cuda.install(monkeypatch)


@pytest.fixture
def no_nvcomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvCOMP does not import (as on this machine; forced, so GPU machines test it too)."""

    def missing() -> None:
        raise UnknownCodec("the nvcomp codec needs the package nvidia-nvcomp-cu12 (test)")

    monkeypatch.setattr(nvcomp_mod, "_nvcomp", missing)


@pytest.fixture
def fake_nvcomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvCOMP's Python API imitated on the CPU (tests/test_codecs.py), as on a GPU machine
    with the package; encoding on the host keeps using the CPU reference encoder."""
    fake = SimpleNamespace(
        Codec=_FakeNvCodec,
        BitstreamKind=SimpleNamespace(RAW="RAW"),
        as_array=lambda t, cuda_stream=0: t,
        as_arrays=lambda buf, offsets, sizes, cuda_stream=0: _FakeBatch(buf, offsets, sizes),
    )
    monkeypatch.setattr(nvcomp_mod, "_nvcomp", lambda: fake)
    monkeypatch.setattr(nvcomp_mod, "_on_gpu", lambda t: True)
    monkeypatch.setattr(nvcomp_mod, "_stream_of", lambda device: 0)
    monkeypatch.setattr(nvcomp_mod, "_cuda_available", lambda: False)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 80, generator=g)
    emb = torch.randn(200, 16, generator=g).bfloat16()
    return {
        "w": w,
        "w_t": w.t(),
        "row": w[3],
        "enc": {"emb": emb},
        "dec": {"emb": emb},  # tied
        "other": torch.arange(3000),
        "empty": torch.empty(0, 4),
        "step": 4,
    }


#: the storages _state() holds (w, emb, other): the device allocations a load makes for it
_STORAGES = 3


def _check(got: dict[str, Any], state: dict[str, Any]) -> None:
    for k in ("w", "w_t", "row", "other", "empty"):
        assert torch.equal(got[k], state[k]), k
        assert got[k].dtype == state[k].dtype and got[k].stride() == state[k].stride()
    assert torch.equal(got["enc"]["emb"], state["enc"]["emb"])
    assert got["step"] == 4
    assert _same_storage(got["w"], got["w_t"]) and _same_storage(got["w"], got["row"])
    assert got["row"].storage_offset() == 3 * 80
    assert _same_storage(got["enc"]["emb"], got["dec"]["emb"])
    assert not _same_storage(got["w"], got["other"])


def _copies(cuda: FakeCuda) -> list[tuple[Any, ...]]:
    return [e for e in cuda.log if e[0] == "copy"]


def _in_pinned(cuda: FakeCuda, address: int) -> int | None:
    """The index of the pinned buffer holding ``address``, else None."""
    for i, t in enumerate(cuda.pinned):
        if t.data_ptr() <= address < t.data_ptr() + t.numel():
            return i
    return None


# -- the path and its discipline ---------------------------------------------------------------


@pytest.mark.parametrize("index", [1, 3])
def test_map_location_cuda_copies_from_pinned_staging_on_a_side_stream(
    cuda: FakeCuda, index: int
) -> None:
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        got = ck.load(map_location=f"cuda:{index}")
    _check(got, state)
    dev = torch.device("cuda", index)
    # one device allocation per storage, on the target device, made on the caller's thread
    spans = [a for a in cuda.device_allocs if a[0] == "MainThread"]
    assert len(spans) == _STORAGES and {a[1] for a in spans} == {dev}
    assert {a[1] for a in cuda.device_allocs} == {dev}
    copies = _copies(cuda)
    assert copies and cuda.pinned
    for _, thread, stream, _dst, src, _n, current in copies:
        assert _in_pinned(cuda, src) is not None, "a host-to-device copy from unpinned memory"
        # a stream of the target device made for this read thread: not the default stream
        assert isinstance(stream, FakeStream) and stream in cuda.streams
        assert stream.device == dev and stream.made_by == thread
        assert thread.startswith("tierckpt-read") and current == index
    # each read thread works on the target device; the caller's device is left as it was
    assert cuda.devices_of("tierckpt-read") == {index}
    assert {i for _, i in cuda.set_device} == {index}
    assert not [t for t, _ in cuda.set_device if t == "MainThread"]
    # the load returns once every copy completed: each event recorded was waited for
    recorded = [e[1] for e in cuda.log if e[0] == "record"]
    assert recorded and all(ev.synchronized_by for ev in recorded)


def test_read_threads_select_the_load_s_device_whatever_they_did_before(
    cuda: FakeCuda,
) -> None:
    """The read pool's threads outlive a load, and may have worked on another device since
    their stream for this one was made: each chunk's thread makes the target current."""
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        pool = ck._read_pool.get()
        n = pool._max_workers
        barrier = threading.Barrier(n)

        def elsewhere() -> None:  # one task per pool thread (the barrier holds each)
            devices.thread_stream(torch.device("cuda", 1))  # its stream for cuda:1 exists
            devices.use_device("cuda:5")  # ...and it last worked on cuda:5
            barrier.wait(30)

        for f in [pool.submit(elsewhere) for _ in range(n)]:
            f.result()
        start = len(cuda.log)
        _check(ck.load(map_location="cuda:1"), state)
    copies = [e for e in cuda.log[start:] if e[0] == "copy"]
    assert copies and {e[6] for e in copies} == {1}


def test_a_staging_slot_is_refilled_only_after_its_copies_completed(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Double buffering: a read thread fills a slot, queues its copies and records an event;
    the slot is filled again only after that event was synchronized."""
    real = restore_gpu.read_verified

    def read(backend: Any, file: str, rec: Any, ci: int, into: memoryview, **kw: Any) -> None:
        with cuda.lock:
            cuda.log.append(("fill", torch.frombuffer(into, dtype=torch.uint8).data_ptr()))
        real(backend, file, rec, ci, into, **kw)

    monkeypatch.setattr(restore_gpu, "read_verified", read)
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(40_000, generator=g), "b": torch.randn(30_000, generator=g)}
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        got = ck.load(map_location="cuda:0")
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
    assert 0 < len(cuda.pinned) < 8, "the staging ring is small, whatever the state's size"
    synced = {id(e[1]): i for i, e in enumerate(cuda.log) if e[0] == "sync"}
    fills_per_slot: dict[int, int] = {}
    #: slot -> the events recorded after copies out of it, owed before its next fill
    owed: dict[int, list[Any]] = {}
    #: stream -> slots copied from on it since its last recorded event
    queued: dict[Any, set[int]] = {}
    for i, entry in enumerate(cuda.log):
        if entry[0] == "fill":
            slot = _in_pinned(cuda, entry[1])
            assert slot is not None, "a chunk was not fetched into the pinned staging"
            for ev in owed.pop(slot, []):
                assert synced.get(id(ev), len(cuda.log)) < i, (
                    f"slot {slot} refilled (log entry {i}) before the event of the copies "
                    "out of it was synchronized"
                )
            fills_per_slot[slot] = fills_per_slot.get(slot, 0) + 1
        elif entry[0] == "copy":
            slot = _in_pinned(cuda, entry[4])
            assert slot is not None
            queued.setdefault(entry[2], set()).add(slot)
        elif entry[0] == "record":
            for slot in queued.pop(entry[2], set()):
                owed.setdefault(slot, []).append(entry[1])
    assert not queued, "copies with no event recorded after them"
    assert max(fills_per_slot.values()) >= 2, "no slot was reused: the test proves nothing"


def test_a_chunk_of_many_small_tensors_crosses_in_one_copy(cuda: FakeCuda) -> None:
    state = {f"t{i}": torch.full((7 + i,), float(i)) for i in range(60)}
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=1 << 20) as ck:
        ck.save(state, step=1).wait()
        got = ck.load(map_location="cuda:0")
    for k, v in state.items():
        assert torch.equal(got[k], v)
    assert len(_copies(cuda)) == 1  # one chunk: one host-to-device copy...
    (scatter,) = [e for e in cuda.log if e[0] == "copy_many"]  # ...scattered on the device
    assert scatter[3] == 60 and isinstance(scatter[2], FakeStream)


def test_load_stages_through_the_host_arena_when_it_is_built(cuda: FakeCuda) -> None:
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        pipeline = ck._pipeline
        assert pipeline is not None and pipeline.arena is not None
        arena = pipeline.arena
        arena.pinned = True  # as registered on a CUDA machine
        got = ck.load(map_location="cuda:0")
        assert arena.free_slots == arena.n_slots  # the borrowed slots are back
    _check(got, state)
    assert cuda.pinned == [], "pinned a ring of its own beside the arena"
    lo, hi = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes
    assert _copies(cuda) and all(lo <= c[4] < hi for c in _copies(cuda))


# -- into= ---------------------------------------------------------------------------------------


def _on_gpu_targets(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """Make the load see the (host) targets as living on ``cuda:<index>``."""
    monkeypatch.setattr(restore_gpu, "tensor_devices", lambda tree: {torch.device("cuda", index)})


def test_into_cuda_targets_restores_through_a_device_copy(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    target = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }
    target["enc"] = {"emb": torch.zeros_like(state["enc"]["emb"])}
    target["dec"] = {"emb": torch.zeros_like(state["dec"]["emb"])}
    w_ptr = target["w"].data_ptr()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        _on_gpu_targets(monkeypatch, 2)
        out = ck.load(into=target)
    assert out is target and target["w"].data_ptr() == w_ptr  # in place
    for k in ("w", "w_t", "row", "other"):
        assert torch.equal(target[k], state[k])
    assert torch.equal(target["dec"]["emb"], state["dec"]["emb"])
    assert {a[1] for a in cuda.device_allocs} == {torch.device("cuda", 2)}
    assert _copies(cuda) and cuda.devices_of("tierckpt-read") == {2}


def test_into_takes_the_host_path_when_the_device_has_no_room(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    target = {"w": torch.zeros(96, 80), "other": torch.zeros(3000, dtype=torch.long)}
    cuda.free = 1 << 20  # less than the state plus the headroom
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save({"w": state["w"], "other": state["other"]}, step=1).wait()
        _on_gpu_targets(monkeypatch, 0)
        ck.load(into=target)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["other"], state["other"])
    assert cuda.device_allocs == [] and _copies(cuda) == []


def test_a_corrupt_chunk_leaves_into_untouched_and_no_copy_in_flight(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(2)
    state = {"a": torch.randn(20_000, generator=g), "b": torch.randn(20_000, generator=g)}
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
    (shard,) = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 100_000]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a chunk in the middle rots
    shard.write_bytes(bytes(data))
    target = {"a": torch.zeros(20_000), "b": torch.zeros(20_000)}
    _on_gpu_targets(monkeypatch, 0)
    ck = Checkpointer([LocalTier(tmp_path)], chunk_bytes=8192)
    with ck, pytest.raises(CorruptCheckpoint, match="does not match its checksum"):
        ck.load(into=target)
    assert not target["a"].any() and not target["b"].any()
    assert _copies(cuda), "the load failed before reaching the device path"
    recorded = [e[1] for e in cuda.log if e[0] == "record"]
    assert all(ev.synchronized_by for ev in recorded), "returned with copies in flight"


def test_stateful_targets_on_a_gpu_are_restored_there(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save({"model": model, "optim": opt, "step": 3}, step=3).wait()
        fresh = torch.nn.Linear(64, 32)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        _on_gpu_targets(monkeypatch, 1)
        ck.load(into={"model": fresh, "optim": fresh_opt, "step": 0})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    buf = fresh_opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, opt.state_dict()["state"][0]["momentum_buffer"])
    assert {a[1] for a in cuda.device_allocs} == {torch.device("cuda", 1)}


def test_host_targets_and_plain_loads_keep_the_host_path(cuda: FakeCuda) -> None:
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        _check(ck.load(), state)
        _check(ck.load(map_location="cpu"), state)
        target = {k: v for k, v in ck.load().items()}
        ck.load(into=target)
    assert cuda.device_allocs == [] and cuda.pinned == [] and _copies(cuda) == []


def test_target_for_chooses_the_device() -> None:
    cpu = torch.zeros(1)
    assert restore_gpu.target_for(None, None) is None
    assert restore_gpu.target_for({"a": cpu}, None) is None
    assert restore_gpu.target_for({"a": cpu}, "cpu") is None
    assert restore_gpu.target_for(None, "cuda:2") == restore_gpu.DeviceTarget(
        torch.device("cuda", 2)
    )


# -- nvCOMP ---------------------------------------------------------------------------------------


def _nv_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, -1, 8)
    w = (torch.randn(8, 20_000, generator=g) * scales[:, None]).bfloat16()
    small = {f"s{i}": torch.zeros(100 + i) for i in range(12)}  # one chunk, many storages
    return {"w": w, "small": small, "ids": torch.arange(5000) % 7, "step": 2}


def _check_nv(got: dict[str, Any], state: dict[str, Any]) -> None:
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["ids"], state["ids"])
    for k, v in state["small"].items():
        assert torch.equal(got["small"][k], v)


@pytest.mark.usefixtures("fake_nvcomp")
def test_nvcomp_chunks_cross_compressed_and_decode_on_the_device(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = _nv_state()
    tier = LocalTier(tmp_path, codec=NvcompCodec("zstd", piece_bytes=1 << 12))
    with Checkpointer([tier], chunk_bytes=64 << 10) as ck:
        res = ck.save(state, step=1).result()
    assert res["local"].codec == "nvcomp"

    def no_host(*a: Any, **k: Any) -> None:
        raise AssertionError("an nvCOMP chunk was decoded through the host")

    monkeypatch.setattr(NvcompCodec, "decode", no_host)
    monkeypatch.setattr(NvcompCodec, "decode_cpu", no_host)
    calls: list[tuple[int, int, bool]] = []
    real = NvcompCodec.decode_device

    def decode_device(self: NvcompCodec, data: Any, out: torch.Tensor, **kw: Any) -> None:
        calls.append((int(data.numel()), int(out.numel()), kw.get("host_copy") is not None))
        real(self, data, out, **kw)

    monkeypatch.setattr(NvcompCodec, "decode_device", decode_device)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load(map_location="cuda:0")
    _check_nv(got, state)
    assert calls, "no chunk was decoded on the device"
    # the stored (compressed) bytes crossed, parsed from the staging copy (no read-back)
    assert all(stored < raw and parsed for stored, raw, parsed in calls)
    crossed = sum(c[5] for c in _copies(cuda))
    assert crossed == sum(stored for stored, _, _ in calls)
    raw_bytes = state["w"].nbytes + state["ids"].nbytes
    assert crossed < raw_bytes * 0.85


@pytest.mark.usefixtures("fake_nvcomp")
def test_a_chunk_failing_after_its_copy_was_queued_still_fences_its_slot(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A device decode that fails after the chunk's bytes were queued for the device: the
    slot is handed back with an event after that copy, and the load waits for it."""
    state = _nv_state()
    tier = LocalTier(tmp_path, codec=NvcompCodec("zstd", piece_bytes=1 << 12))
    with Checkpointer([tier], chunk_bytes=64 << 10) as ck:
        ck.save(state, step=1).wait()
    real = restore_gpu._decode_device
    calls: list[int] = []

    def failing(*a: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise CorruptChunk("pieces decoded to wrong sizes (test)")
        real(*a)

    monkeypatch.setattr(restore_gpu, "_decode_device", failing)
    ck = Checkpointer([LocalTier(tmp_path)])
    with ck, pytest.raises(CorruptCheckpoint, match="wrong sizes"):
        ck.load(map_location="cuda:0")
    queued: dict[Any, int] = {}
    for entry in cuda.log:
        if entry[0] == "copy":
            queued[entry[2]] = queued.get(entry[2], 0) + 1
        elif entry[0] == "record":
            queued.pop(entry[2], None)
    assert _copies(cuda) and not queued, "a copy with no event after it"
    recorded = [e[1] for e in cuda.log if e[0] == "record"]
    assert all(ev.synchronized_by for ev in recorded), "returned with copies in flight"


@pytest.mark.usefixtures("no_nvcomp")
def test_nvcomp_chunks_decode_on_the_cpu_without_the_package(
    cuda: FakeCuda, tmp_path: Path
) -> None:
    """On a machine whose nvCOMP does not import, the chunks are decoded by the CPU libraries
    into the staging slot and cross raw."""
    state = _nv_state()
    tier = LocalTier(tmp_path, codec=NvcompCodec("zstd", piece_bytes=1 << 12))
    with Checkpointer([tier], chunk_bytes=64 << 10) as ck:
        ck.save(state, step=1).wait()
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load(map_location="cuda:0")
    _check_nv(got, state)
    assert _copies(cuda) and cuda.pinned
    assert sum(c[5] for c in _copies(cuda)) >= state["w"].nbytes + state["ids"].nbytes


# -- codec="auto" ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("cuda", "fake_nvcomp")
def test_auto_picks_nvcomp_for_a_remote_tier_on_a_cuda_device_with_nvcomp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    remote = AdaptiveCodec(remote=True)
    chosen = remote.on_device(gpu)
    assert isinstance(chosen, NvcompCodec) and chosen.cpu_decodable
    assert remote.on_device(gpu) is chosen  # one codec object per tier
    assert AdaptiveCodec(remote=False).on_device(gpu) is None  # RAM and local disks: raw
    assert remote.on_device(cpu) is None and remote.on_device(None) is None
    monkeypatch.setattr("tierckpt.devices.cuda_available", lambda: False)
    assert AdaptiveCodec(remote=True).on_device(gpu) is None  # no GPU


@pytest.mark.usefixtures("cuda", "no_nvcomp")
def test_auto_keeps_todays_choice_without_nvcomp() -> None:
    assert AdaptiveCodec(remote=True).on_device(torch.device("cuda", 0)) is None


@pytest.fixture
def device_save(monkeypatch: pytest.MonkeyPatch, cuda: FakeCuda) -> None:
    """A save whose state the pipeline believes is on cuda:0 and whose chunks the capture
    compresses "on the device" (host tensors here), as in tests/test_device_compress.py."""
    fake_cuda.state_on_device(monkeypatch, 0)
    monkeypatch.setattr(capture, "_device_compressible", lambda device: True)


@pytest.mark.s3
@pytest.mark.parametrize("have_nvcomp", [True, False])
def test_auto_s3_tier_of_a_cuda_state_stores_nvcomp_chunks_only_with_nvcomp(
    device_save: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    moto_server: Any,
    s3_bucket: Any,
    have_nvcomp: bool,
) -> None:
    request.getfixturevalue("fake_nvcomp" if have_nvcomp else "no_nvcomp")
    bucket = s3_bucket(moto_server)
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    state = _nv_state()
    with Checkpointer([tier], chunk_bytes=64 << 10) as ck:
        res = ck.save(state, step=1).result()
    assert ("nvcomp" in res["s3"].codec.split(",")) is have_nvcomp, res["s3"].codec
    if not have_nvcomp:
        assert res["s3"].codec != "raw"  # today's choice: compressed on the host
    monkeypatch.undo()  # a machine without a GPU restores it with the CPU libraries
    with Checkpointer([S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)]) as ck:
        got = ck.load()
    _check_nv(got, state)


# -- on a real GPU --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _cuda_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 1536, device="cuda", generator=g).bfloat16()
    emb = torch.randn(5000, 64, device="cuda", generator=g)
    return {
        "w": w,
        "w_t": w.t(),
        "enc": emb,
        "dec": emb,
        "small": [torch.arange(i, device="cuda", dtype=torch.float16) for i in range(1, 80)],
        "ids": torch.randint(0, 1000, (4099,), device="cuda", generator=g),
        "step": 7,
    }


def _check_cuda(got: dict[str, Any], state: dict[str, Any], device: torch.device) -> None:
    for k in ("w", "w_t", "enc", "ids"):
        assert got[k].device == device and torch.equal(got[k], state[k]), k
    for a, b in zip(got["small"], state["small"], strict=True):
        assert torch.equal(a, b)
    assert _same_storage(got["w"], got["w_t"]) and _same_storage(got["enc"], got["dec"])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("codec", ["raw", "planes"])
def test_gpu_map_location_restores_onto_the_device(tmp_path: Path, codec: str) -> None:
    state = _cuda_state()
    with Checkpointer([LocalTier(tmp_path, codec=codec)], chunk_bytes=1 << 20) as ck:
        ck.save(state, step=1).wait()
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load(map_location="cuda")
    _check_cuda(got, state, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
@gpu
def test_gpu_into_cuda_tensors_in_place(tmp_path: Path) -> None:
    state = _cuda_state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=1 << 20) as ck:
        ck.save(state, step=1).wait()
        target = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()
            if k != "small"
        }
        target["small"] = [torch.zeros_like(t) for t in state["small"]]
        ptr = target["w"].data_ptr()
        ck.load(into=target)
    assert target["w"].data_ptr() == ptr
    for k in ("w", "w_t", "enc", "dec", "ids"):
        assert torch.equal(target[k], state[k]), k


@pytest.mark.gpu
@gpu
def test_gpu_nvcomp_chunks_decode_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("nvidia.nvcomp")
    state = _cuda_state()
    tier = LocalTier(tmp_path, codec=NvcompCodec("zstd"))
    with Checkpointer([tier], chunk_bytes=1 << 20) as ck:
        assert "nvcomp" in ck.save(state, step=1).result()["local"].codec

    def no_host(*a: Any, **k: Any) -> None:
        raise AssertionError("an nvCOMP chunk was decoded through the host")

    monkeypatch.setattr(NvcompCodec, "decode_cpu", no_host)
    monkeypatch.setattr(NvcompCodec, "decode", no_host)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load(map_location="cuda:0")
    _check_cuda(got, state, torch.device("cuda", 0))
