"""A panic of obstore's Rust client is an error of the family, not a ``BaseException``.

obstore raises pyo3's ``PanicException`` where its client panics (an endpoint it cannot turn
into a request, for one). That is a ``BaseException``: the ``except Exception`` of a training
loop, of the tier threads and of the lease takers let it through. Before, ``save()`` on a
policy with such a tier raised it to the caller, so the local tier beside it committed nothing,
and ``load()`` raised it instead of saying which tier could not be read. The tier settings
that caused it are refused since the seventeenth session; a ready store handed in with
``store=`` is not checked, and that is how these tests reach the panic (no server needed: the
request is never sent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt import BackendError, Checkpointer, CheckpointFailed, LocalTier, S3Tier

obstore_store = pytest.importorskip("obstore.store")


def _panicking_store() -> Any:
    # no scheme: object_store builds the store, then panics on the first request
    return obstore_store.S3Store(
        "bucket", endpoint="127.0.0.1:9", region="us-east-1", skip_signature=True
    )


def _backend() -> Any:
    from tierckpt.backends.objstore import ObjectStoreBackend

    return ObjectStoreBackend("s3://bucket/run", store=_panicking_store())


@pytest.mark.parametrize(
    "call",
    ["list", "exists", "get", "size", "read_into", "put_atomic", "create", "writer", "delete"],
)
def test_every_call_that_reaches_the_client_raises_a_backend_error(call: str) -> None:
    b = _backend()
    calls = {
        "list": lambda: b.list(""),
        "exists": lambda: b.exists("x"),
        "get": lambda: b.get("x"),
        "size": lambda: b.size("x"),
        "read_into": lambda: b.read_into("x", 0, memoryview(bytearray(16))),
        "put_atomic": lambda: b.put_atomic("x", b"1", overwrite=True),
        "create": lambda: b.put_atomic("x", b"1"),
        "delete": lambda: b.delete("x"),
    }

    def write() -> None:
        w = b.open_writer("x")
        w.write(0, b"a" * 100)
        w.commit()

    calls["writer"] = write
    try:
        with pytest.raises(BackendError, match="obstore's client panicked") as got:
            calls[call]()
    except BaseException as exc:  # before: PanicException, which pytest.raises lets through
        pytest.fail(f"{call}: {type(exc).__name__} escaped: {exc}")
    assert "TIERCKPT_S3_DRIVER=boto3" in str(got.value)
    b.close()


def test_a_save_beside_a_panicking_tier_commits_locally_and_fails_only_that_tier(
    tmp_path: Path,
) -> None:
    state = {"w": torch.arange(1000.0)}
    s3 = S3Tier("s3://bucket/run", store=_panicking_store(), codec="raw")
    ck = Checkpointer([LocalTier(tmp_path / "run", codec="raw"), s3])
    caught: list[BaseException] = []
    try:
        try:
            ck.save(state, 1).wait(timeout=60)
        except Exception as exc:  # what a training loop catches
            caught.append(exc)
    except BaseException as exc:
        pytest.fail(f"{type(exc).__name__} escaped save(): {exc}")
    finally:
        ck.close()
    assert len(caught) == 1 and isinstance(caught[0], CheckpointFailed), caught
    assert "obstore's client panicked" in str(caught[0])
    local = Checkpointer([LocalTier(tmp_path / "run")])
    try:
        assert local.steps() == [1]
        assert torch.equal(local.load()["w"], state["w"])
    finally:
        local.close()


def test_a_load_from_a_panicking_tier_says_it_could_not_be_read() -> None:
    ck = Checkpointer([S3Tier("s3://bucket/run", store=_panicking_store())])
    try:
        with pytest.raises(tierckpt.TiersUnreadable, match="obstore's client panicked"):
            ck.load()
    except BaseException as exc:
        if isinstance(exc, pytest.fail.Exception):
            raise
        pytest.fail(f"{type(exc).__name__} escaped load(): {exc}")
    finally:
        ck.close()
