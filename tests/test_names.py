"""Public names live where their docs say: every error in ``tierckpt.errors`` (with its
built-in base), importable from ``tierckpt`` and from the modules that used to define them."""

from __future__ import annotations

import tierckpt
import tierckpt.distributed as tdist
from tierckpt import errors


def test_rank_errors_are_in_the_error_family_with_a_builtin_base() -> None:
    assert tdist.CommitTimeout is errors.CommitTimeout is tierckpt.CommitTimeout
    assert tdist.RankFailed is errors.RankFailed is tierckpt.RankFailed
    assert issubclass(errors.CommitTimeout, errors.TierCkptError)
    assert issubclass(errors.CommitTimeout, TimeoutError)
    assert issubclass(errors.RankFailed, errors.TierCkptError)
    assert issubclass(errors.RankFailed, RuntimeError)
    assert {"CommitTimeout", "RankFailed"} <= set(tierckpt.__all__)


def test_every_error_has_a_builtin_base() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.TierCkptError), name
        if cls is errors.TierCkptError:
            continue
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b is not object]
        assert any(b is not Exception and b is not BaseException for b in builtin), name


def test_codec_hooks_are_typed_protocols() -> None:
    from tierckpt.codecs import RawCodec, SupportsObserve, SupportsProfile, ZstdCodec
    from tierckpt.codecs.adaptive import AdaptiveCodec

    auto = AdaptiveCodec(remote=True)
    assert isinstance(auto, SupportsProfile) and isinstance(auto, SupportsObserve)
    for plain in (RawCodec(), ZstdCodec()):
        assert not isinstance(plain, SupportsProfile)
        assert not isinstance(plain, SupportsObserve)


def test_old_module_names_still_import_the_same_objects() -> None:
    import importlib

    for old, new in (
        ("tierckpt.observe", "tierckpt.stats"),
        ("tierckpt.tools", "tierckpt.offline"),
        ("tierckpt.objects", "tierckpt.tree"),
    ):
        old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
        assert old_mod.__all__ == new_mod.__all__, old
        for name in new_mod.__all__:
            assert getattr(old_mod, name) is getattr(new_mod, name), f"{old}.{name}"


def test_pipeline_owners_hand_typed_frozen_hooks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    import pytest

    from tierckpt.pipeline import PipelineHooks

    with tierckpt.Checkpointer([tierckpt.LocalTier(str(tmp_path))]) as ck:
        hooks = ck._pipeline_hooks()
        assert isinstance(hooks, PipelineHooks)
        assert hooks.commit is not None and hooks.on_result is not None
        with pytest.raises(dataclasses.FrozenInstanceError):
            hooks.commit = None  # type: ignore[misc]
