"""The tier classes share their common keyword arguments (TierOptions): every tier class takes
each of them and stores it in the field of that name, a field added to TierSpec must be added
there too, an unknown keyword is refused (or, for a store tier, goes to its backend), and a
shared option not given keeps TierSpec's default."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

import pytest

from tierckpt import AzureTier, GCSTier, LocalTier, S3Tier
from tierckpt.policy import TIER_OPTIONS, TierSpec

#: a value other than the default for each shared option
GIVEN: dict[str, Any] = {
    "every": 3,
    "codec": "zstd",
    "source": "fast",
    "max_behind": 4,
    "keep_every_n_steps": 100,
    "keep_best": 2,
    "best_metric": "loss",
    "best_mode": "max",
    "prefixes": 16,
}


def _make(cls: type[TierSpec], **kw: Any) -> TierSpec:
    where = {LocalTier: "/tmp/tierckpt-options", S3Tier: "s3://b/run", GCSTier: "gs://b/run"}
    url = where.get(cls, "az://c/run")
    if cls is S3Tier:
        kw.setdefault("driver", "boto3")
    return cls(url, **kw)  # type: ignore[call-arg]


def test_the_shared_options_are_the_fields_every_tier_has_besides_name_and_keep_last() -> None:
    shared = {f.name for f in fields(TierSpec)} - {"name", "keep_last"}
    assert shared == TIER_OPTIONS == GIVEN.keys()


@pytest.mark.parametrize("cls", [LocalTier, S3Tier, GCSTier, AzureTier])
def test_every_tier_class_stores_each_shared_option(cls: type[TierSpec]) -> None:
    spec = _make(cls, keep_last=7, name="t", **GIVEN)
    assert {k: getattr(spec, k) for k in GIVEN} == GIVEN
    assert (spec.name, spec.keep_last) == ("t", 7)
    if isinstance(spec, S3Tier | GCSTier | AzureTier):
        assert spec.options == {}  # none of them went to the backend


@pytest.mark.parametrize("cls", [LocalTier, S3Tier, GCSTier, AzureTier])
def test_a_shared_option_not_given_keeps_the_default(cls: type[TierSpec]) -> None:
    spec = _make(cls)
    for f in fields(TierSpec):
        if f.name in TIER_OPTIONS:
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            assert getattr(spec, f.name) == default, f.name


def test_an_unknown_keyword_is_refused_by_a_local_tier() -> None:
    with pytest.raises(TypeError, match="bogus"):
        LocalTier("/tmp/x", bogus=1)  # type: ignore[call-arg]


def test_a_store_tier_hands_its_other_keywords_to_the_backend() -> None:
    spec = S3Tier("s3://b/run", endpoint_url="http://127.0.0.1:9", every=2, driver="boto3")
    assert spec.options == {"endpoint_url": "http://127.0.0.1:9"}
    assert spec.every == 2
    gcs = GCSTier("gs://b/run", endpoint_url="http://127.0.0.1:9", keep_best=1, best_metric="m")
    assert gcs.options == {"endpoint_url": "http://127.0.0.1:9"}
    assert (gcs.keep_best, gcs.best_metric) == (1, "m")


def test_shared_options_are_still_validated() -> None:
    with pytest.raises(ValueError, match="every"):
        LocalTier("/tmp/x", every=0)
    with pytest.raises(ValueError, match="max_behind"):
        S3Tier("s3://b/run", max_behind=0, driver="boto3")
