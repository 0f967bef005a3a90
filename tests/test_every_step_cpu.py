"""Library CPU per checkpoint on the every-step path: what each cut changes, tested by
behaviour (never by timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tierckpt.arena import ALIGN, HUGE_PAGE, HostArena


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _vma_field(addr: int, field: str) -> str | None:
    """``field`` of the mapping of this process that holds ``addr`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages")
def test_arena_is_huge_page_aligned_and_eligible_for_huge_pages() -> None:
    """A direct-I/O write pins each page it reads from: the arena asks for huge pages before
    its first touch, from a huge-page boundary, so each write pins 512x fewer pages."""
    a = HostArena(3, HUGE_PAGE)
    ptr = a.buffer.data_ptr()
    assert ptr % HUGE_PAGE == 0
    assert a.buffer.numel() == 3 * HUGE_PAGE
    mode = _thp_mode()
    if mode is None or mode == "never":
        pytest.skip(f"transparent huge pages are {mode or 'missing'} here")
    assert a.huge_pages
    # the kernel's own word that the arena's mapping may hold huge pages
    assert _vma_field(ptr, "THPeligible") == "1"
    a.slot(2).fill_(5)  # usable end to end
    assert int(a.buffer[-1]) == 5 and int(a.buffer[0]) == 0
    a.close()


def test_small_arena_keeps_page_alignment_and_no_huge_pages() -> None:
    a = HostArena(2, 4 * ALIGN)
    assert a.buffer.data_ptr() % ALIGN == 0
    assert not a.huge_pages  # 32 KiB: not worth a 2 MiB alignment
    a.close()
