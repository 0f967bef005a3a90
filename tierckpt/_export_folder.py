"""The folder an export goes into (:mod:`tierckpt.export`): made and checked writable before
anything is written, and emptied of the previous export (only the files its ``state.json``
lists: see :mod:`tierckpt.export`)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import tempfile
from typing import Any

from tierckpt.errors import BackendError

__all__ = ["ensure_writable", "remove_previous_export"]

log = logging.getLogger("tierckpt")
#: the folders of the ranks' exports (``export_safetensors(rank=None)``)
_RANK_DIR = re.compile(r"rank-\d{6}")

_READ_ONLY = " (the folder is read-only or not writable by this user: pick a writable one)"
_A_FILE = " (a file is in the way where a folder is needed: give the export a folder's path)"
_HINTS = {errno.EROFS: _READ_ONLY, errno.EACCES: _READ_ONLY, errno.EPERM: _READ_ONLY}
_HINTS |= {errno.EEXIST: _A_FILE, errno.ENOTDIR: _A_FILE}


def ensure_writable(where: str) -> None:
    """Create ``where`` and check that files can be written there: a read-only location gets
    a clear error before anything is written, instead of a raw OSError (or safetensors' own
    error) halfway through."""
    try:
        os.makedirs(where, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tierckpt-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        hint = _HINTS.get(exc.errno or 0, "")
        raise BackendError(
            exc.errno or 0, f"{where}: cannot write the export there: {exc.strerror}{hint}"
        ) from exc


def remove_previous_export(out_dir: str) -> list[str]:
    """Remove the export already in ``out_dir`` (its ``state.json`` or the ones in its
    ``rank-NNNNNN/`` folders): only the files its ``state.json`` lists, then that
    ``state.json`` (and the rank folders left empty). Files tierckpt did not write stay."""
    docs = [os.path.join(out_dir, "state.json")]
    if os.path.isdir(out_dir):
        docs += [
            os.path.join(out_dir, d, "state.json")
            for d in sorted(os.listdir(out_dir))
            if _RANK_DIR.fullmatch(d) and os.path.isdir(os.path.join(out_dir, d))
        ]
    removed: list[str] = []
    for doc_path in docs:
        try:
            with open(doc_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):  # none there, or not ours
            continue
        if not isinstance(doc, dict) or "tierckpt_export" not in doc:
            continue
        folder = os.path.dirname(doc_path)
        names: list[Any] = doc["files"] if isinstance(doc.get("files"), list) else []
        paths = [
            os.path.join(folder, n)
            for n in names
            if isinstance(n, str)
            and n == os.path.basename(n)
            and n.endswith((".safetensors", ".safetensors.index.json"))
        ]
        for path in [*paths, doc_path]:
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):  # never a link or folder
                    os.unlink(path)
                    removed.append(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise BackendError(
                    exc.errno or 0,
                    f"{path}: cannot remove this file of the previous export in "
                    f"{out_dir} (an export replaces it): {exc.strerror}",
                ) from exc
        if folder != out_dir:
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                pass
    if removed:
        log.info("export: removed the previous export in %s (%d files)", out_dir, len(removed))
    return removed
