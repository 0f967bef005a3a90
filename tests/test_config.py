"""One resolved configuration: every knob resolves argument > environment > default in
tierckpt/config.py, a bad value is refused naming its variable, Checkpointer and the DCP writer
size their arena and chunks the same way, the runtime package reads the environment only
through config.py, and docs/configuration.md shows the table config.py holds."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierckpt import Checkpointer, MemoryTier, config
from tierckpt.cli import main as cli_main
from tierckpt.dcp import TierWriter
from tierckpt.distributed import get_knobs, knobs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tierckpt"
#: not the runtime: they may read the environment themselves
OUTSIDE_RUNTIME = ("testing", "bench", "demo")


# -- the table and where the environment is read ----------------------------------------------
def test_docs_page_shows_the_table_config_holds() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert config.knobs_markdown() in page, (
        "docs/configuration.md is out of date: paste tierckpt.config.knobs_markdown() into it"
    )
    assert "configuration.md" in (ROOT / "mkdocs.yml").read_text()
    assert "docs/configuration.md" in (ROOT / "README.md").read_text()


def test_every_variable_config_reads_is_in_the_table() -> None:
    source = (PACKAGE / "config.py").read_text()
    read = set(re.findall(r'_raw\("([A-Z0-9_]+)"\)', source))
    read |= set(re.findall(r'_env_\w+\(\s*"([A-Z0-9_]+)"', source))
    assert read, "the pattern found no reads: update this test"
    tabled = {e.strip() for k in KNOBS_ENV for e in k.split(",")}
    assert read <= tabled, f"read but not in config.KNOBS: {sorted(read - tabled)}"
    assert tabled <= read, f"in config.KNOBS but never read: {sorted(tabled - read)}"


KNOBS_ENV = [k.env for k in config.KNOBS]


def _environment_reads(path: Path) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``from os import environ`` uses in one module."""
    return _scan_text(path.read_text(), str(path.relative_to(ROOT)))


def _scan_text(text: str, where: str = "<text>") -> list[str]:
    tree = ast.parse(text, where)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "environb", "getenv", "getenvb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            found.append(f"{where}:{node.lineno} os.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb", "getenv", "getenvb"):
                    found.append(f"{where}:{node.lineno} from os import")
    return found


def test_runtime_reads_the_environment_only_through_config() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in OUTSIDE_RUNTIME or rel.stem == "bench" or rel == Path("config.py"):
            continue
        offenders += _environment_reads(path)
    assert not offenders, "read the environment through tierckpt/config.py:\n" + "\n".join(
        offenders
    )


def test_the_scan_sees_an_environment_read() -> None:
    """The scan above can fail: it finds each spelling of a read."""
    example = "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
    assert len(_scan_text(example)) == 3


# -- precedence --------------------------------------------------------------------------------
def test_writer_sizes_argument_then_environment_then_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("TIERCKPT_HOST_BUFFER_BYTES", "TIERCKPT_CHUNK_BYTES", "TIERCKPT_IO_THREADS"):
        monkeypatch.delenv(name, raising=False)
    d = config.resolve_writer_config()
    assert d.host_buffer_bytes == max(256 << 20, min(config.total_ram() // 8, 32 << 30))
    assert d.chunk_bytes == config.DEFAULT_CHUNK_BYTES
    assert d.io_threads == config.DEFAULT_IO_THREADS

    monkeypatch.setenv("TIERCKPT_HOST_BUFFER_BYTES", str(64 << 20))
    monkeypatch.setenv("TIERCKPT_CHUNK_BYTES", str(1 << 20))
    monkeypatch.setenv("TIERCKPT_IO_THREADS", " 3 ")
    e = config.resolve_writer_config()
    assert (e.host_buffer_bytes, e.chunk_bytes, e.io_threads) == (64 << 20, 1 << 20, 3)

    a = config.resolve_writer_config(32 << 20, 2 << 20, 5)
    assert (a.host_buffer_bytes, a.chunk_bytes, a.io_threads) == (32 << 20, 2 << 20, 5)
    # 0 / None: not given (as the constructors always treated them)
    z = config.resolve_writer_config(0, 0, 0)
    assert z == e
    with pytest.raises(AttributeError):
        a.chunk_bytes = 1  # type: ignore[misc]


def test_chunk_is_lowered_to_a_quarter_of_the_arena() -> None:
    c = config.resolve_writer_config(host_buffer_bytes=10 << 20, chunk_bytes=64 << 20)
    assert c.chunk_bytes == (10 << 20) // 4 // 4096 * 4096
    tiny = config.resolve_writer_config(host_buffer_bytes=8192, chunk_bytes=64 << 20)
    assert tiny.chunk_bytes == 4096


@pytest.mark.parametrize(
    ("env", "value", "resolve", "expected"),
    [
        ("TIERCKPT_DIRECT_IO", "off", lambda: config.direct_io(), False),
        ("TIERCKPT_DIRECT_IO", "YES", lambda: config.direct_io(), True),
        ("TIERCKPT_DIRECT_IO", "0", lambda: config.direct_io(True), True),
        ("TIERCKPT_EXIT_TIMEOUT_S", "7.5", lambda: config.exit_timeout_s(), 7.5),
        ("TIERCKPT_EXIT_TIMEOUT_S", "-3", lambda: config.exit_timeout_s(), 0.0),
        ("TIERCKPT_EXIT_TIMEOUT_S", "7.5", lambda: config.exit_timeout_s(2.0), 2.0),
        ("TIERCKPT_SAVE_DEADLINE", "2.5", lambda: config.save_deadline_s(), 2.5),
        ("TIERCKPT_SAVE_DEADLINE", "inf", lambda: config.save_deadline_s(), float("inf")),
        ("TIERCKPT_SAVE_DEADLINE", "2.5", lambda: config.save_deadline_s(4), 4.0),
        ("TIERCKPT_LEASE_TTL", "3", lambda: config.lease_ttl_s(), 3.0),
        ("TIERCKPT_LEASE_WAIT_S", "4", lambda: config.lease_wait_s(), 4.0),
        ("TIERCKPT_COMMIT_TIMEOUT_S", "12.5", lambda: get_knobs().commit_timeout, 12.5),
        ("TIERCKPT_COMMIT_POLL_MAX_S", "0.25", lambda: get_knobs().poll_max, 0.25),
        ("TIERCKPT_PRIVATE_TIERS", " nvme, ,x ", lambda: config.private_tiers(), {"nvme", "x"}),
        ("TIERCKPT_ATTEMPT_ID", "job-7.a", lambda: config.attempt_id(), "job-7.a"),
        ("TIERCKPT_DEBUG_BOTOCORE", "on", lambda: config.debug_botocore(), True),
        ("TIERCKPT_DEBUG_BOTOCORE", "0", lambda: config.debug_botocore(True), True),
        ("AWS_ENDPOINT_URL", "http://b:1", lambda: config.s3_endpoint_url(), "http://b:1"),
        ("AWS_ENDPOINT_URL", "http://b:1", lambda: config.s3_endpoint_url("http://a"), "http://a"),
    ],
)
def test_environment_over_default_argument_over_environment(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, resolve: Callable[[], Any], expected: Any
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv(env, value)
    assert resolve() == expected


def test_defaults_when_unset_or_blank(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in config.KNOBS:
        for name in k.env.split(","):
            monkeypatch.setenv(name.strip(), "  ")  # blank means the default
    assert config.direct_io() is True
    assert config.exit_timeout_s() == config.DEFAULT_EXIT_TIMEOUT_S
    assert config.lease_ttl_s() == config.DEFAULT_LEASE_TTL_S
    assert config.save_deadline_s() == config.DEFAULT_SAVE_DEADLINE_S
    assert config.lease_wait_s() == config.DEFAULT_LEASE_WAIT_S
    assert get_knobs().commit_timeout == config.DEFAULT_COMMIT_TIMEOUT_S
    assert get_knobs().poll_max == config.DEFAULT_COMMIT_POLL_MAX_S
    assert config.private_tiers() == frozenset()
    assert config.attempt_id() == ""
    assert config.debug_botocore() is False
    assert config.s3_endpoint_url() is None
    assert config.resolve_writer_config(64 << 20).chunk_bytes == 16 << 20
    with knobs(commit_timeout=1.0):  # the test override still wins
        assert get_knobs().commit_timeout == 1.0


# -- bad values --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "value", "resolve"),
    [
        ("TIERCKPT_HOST_BUFFER_BYTES", "1GiB", config.resolve_writer_config),
        ("TIERCKPT_HOST_BUFFER_BYTES", "-5", config.resolve_writer_config),
        ("TIERCKPT_CHUNK_BYTES", "64M", config.resolve_writer_config),
        ("TIERCKPT_CHUNK_BYTES", "0", config.resolve_writer_config),
        ("TIERCKPT_CHUNK_BYTES", "5000", config.resolve_writer_config),
        ("TIERCKPT_IO_THREADS", "two", config.resolve_writer_config),
        ("TIERCKPT_IO_THREADS", "-1", config.resolve_writer_config),
        ("TIERCKPT_DIRECT_IO", "maybe", config.direct_io),
        ("TIERCKPT_EXIT_TIMEOUT_S", "soon", config.exit_timeout_s),
        ("TIERCKPT_SAVE_DEADLINE", "0", config.save_deadline_s),
        ("TIERCKPT_SAVE_DEADLINE", "soon", config.save_deadline_s),
        ("TIERCKPT_COMMIT_TIMEOUT_S", "0", get_knobs),
        ("TIERCKPT_COMMIT_TIMEOUT_S", "ten", get_knobs),
        ("TIERCKPT_COMMIT_POLL_MAX_S", "nan", get_knobs),
        ("TIERCKPT_ATTEMPT_ID", "has/slash", config.attempt_id),
        ("TIERCKPT_ATTEMPT_ID", "a" * 101, config.attempt_id),
        ("TIERCKPT_LEASE_TTL", "0", config.lease_ttl_s),
        ("TIERCKPT_LEASE_TTL", str(8 * 86400), config.lease_ttl_s),
        ("TIERCKPT_LEASE_WAIT_S", "inf", config.lease_wait_s),
        ("TIERCKPT_DEBUG_BOTOCORE", "verbose", config.debug_botocore),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, resolve: Callable[[], Any]
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=re.escape(env)):
        resolve()


def test_exit_timeout_never_raises_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at interpreter exit too: a bad value is logged and the default used."""
    from tierckpt.pipeline import exit_timeout_s

    monkeypatch.setenv("TIERCKPT_EXIT_TIMEOUT_S", "soon")
    assert exit_timeout_s() == config.DEFAULT_EXIT_TIMEOUT_S


def test_cli_refuses_a_bad_debug_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERCKPT_DEBUG_BOTOCORE", "verbose")
    assert cli_main(["ls", str(tmp_path)]) == 2
    assert "TIERCKPT_DEBUG_BOTOCORE='verbose'" in capsys.readouterr().err


# -- Checkpointer and the DCP writer size the same way ----------------------------------------
def _checkpointer(**kw: Any) -> tuple[int, int, int]:
    ck = Checkpointer([MemoryTier(namespace="config-ck")], **kw)
    try:
        return ck.host_buffer_bytes, ck.chunk_bytes, ck.io_threads
    finally:
        ck.close()


def _tier_writer(**kw: Any) -> tuple[int, int, int]:
    w = TierWriter([MemoryTier(namespace="config-dcp")], **kw)
    try:
        return w.host_buffer_bytes, w.chunk_bytes, w.io_threads
    finally:
        w.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"host_buffer_bytes": 64 << 20},
        {"host_buffer_bytes": 64 << 20, "chunk_bytes": 1 << 20, "io_threads": 3},
        {"host_buffer_bytes": 10 << 20, "chunk_bytes": 64 << 20},
        {"host_buffer_bytes": 8192, "chunk_bytes": 4096},
    ],
)
def test_checkpointer_and_tier_writer_resolve_the_same_sizes(kw: dict[str, int]) -> None:
    want = config.resolve_writer_config(**kw)
    expected = (want.host_buffer_bytes, want.chunk_bytes, want.io_threads)
    assert _checkpointer(**kw) == expected
    assert _tier_writer(**kw) == expected


@pytest.mark.parametrize("chunk", [5000, 4096 + 512, 100])
@pytest.mark.parametrize("make", [_checkpointer, _tier_writer], ids=["Checkpointer", "TierWriter"])
def test_both_writers_refuse_an_unaligned_chunk(
    make: Callable[..., tuple[int, int, int]], chunk: int
) -> None:
    """The DCP writer used to accept a chunk size O_DIRECT cannot write from the arena."""
    with pytest.raises(ValueError, match="multiple of 4096"):
        make(host_buffer_bytes=64 << 20, chunk_bytes=chunk)


def test_both_writers_refuse_an_unaligned_chunk_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERCKPT_CHUNK_BYTES", "5000")
    for make in (_checkpointer, _tier_writer):
        with pytest.raises(ValueError, match="TIERCKPT_CHUNK_BYTES"):
            make(host_buffer_bytes=64 << 20)
