"""Copies of a shard being loaded from a remote tier, written to faster tiers meanwhile."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.errors import TierCkptError
from tierckpt.format import Manifest, encode_manifest, manifest_name

__all__ = ["Repopulation"]

log = logging.getLogger("tierckpt")


class Repopulation:
    """Copies of a shard being read, written to faster tiers so the next restart is local.

    Best effort: a tier that fails (disk full, permissions) is dropped with a warning and the
    load goes on — a full local disk must never stop a restore from S3.
    """

    def __init__(self, backends: Sequence[Backend], name: str) -> None:
        self._writers: list[tuple[Backend, ObjectWriter]] = []
        self._failed: set[int] = set()
        for b in backends:
            try:
                self._writers.append((b, b.open_writer(name)))
            except (OSError, TierCkptError) as exc:
                log.warning("not repopulating %s/%s: %s", b.url, name, exc)

    def _drop(self, i: int, exc: BaseException) -> None:
        if i not in self._failed:
            self._failed.add(i)
            b, w = self._writers[i]
            log.warning("repopulating %s/%s failed; the load goes on: %s", b.url, w.name, exc)

    def write(self, offset: int, data: Any) -> None:
        for i, (_b, w) in enumerate(self._writers):
            if i not in self._failed:
                try:
                    w.write(offset, data)
                except (OSError, TierCkptError) as exc:
                    self._drop(i, exc)

    def finish(
        self, offset: int, tail: bytes | bytearray, manifest: Manifest | None
    ) -> list[Backend]:
        """Write index + footer and commit on every healthy tier, then the manifest (last)
        unless ``manifest`` is None (the caller publishes it: see
        ``tierckpt.commit.CommitStrategy.publish_repopulated``). Returns the tiers whose
        shard file is now committed."""
        done = []
        for i, (b, w) in enumerate(self._writers):
            if i in self._failed:
                w.abort()
                continue
            try:
                w.write(offset, tail)
                w.commit()
                done.append(b)
                if manifest is not None:
                    b.put_atomic(
                        manifest_name(manifest.step, timeline=manifest.timeline),
                        encode_manifest(manifest),
                    )
            except FileExistsError:
                pass
            except (OSError, TierCkptError) as exc:
                w.abort()
                self._drop(i, exc)
        return done

    def abort(self) -> None:
        for _b, w in self._writers:
            w.abort()
