"""What a benchmark run measures: the contenders, the training variants, and every knob
(:class:`BenchConfig`, which the command line maps onto one to one)."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20

#: every contender of the save benchmark, in table order
SAVE_CONTENDERS = (
    "torch_save",
    "dcp_save",
    "dcp_async",
    "dcp_async_stager",
    "tc_async",
    "tierckpt_256m",
    "tierckpt_default",
)
#: the peers that stage the state in host memory before writing it (the others write directly)
STAGING_PEERS = frozenset({"dcp_async", "dcp_async_stager", "tc_async"})
#: the variants of the training benchmark run by default
DEFAULT_TRAIN_VARIANTS = ("none", "tierckpt", "torch_save", "dcp_async", "dcp_async_stager")
#: every variant of the training benchmark; ``tierckpt_memory`` (on request): the same saves
#: into host RAM only (``MemoryTier``), which splits what every-step checkpointing costs
#: between the library and the disk
TRAIN_VARIANTS = (*DEFAULT_TRAIN_VARIANTS, "tierckpt_memory")

LABELS = {
    "torch_save": "torch.save + fsync",
    "dcp_save": "dcp.save",
    "dcp_async": "dcp.async_save (defaults)",
    "dcp_async_stager": "dcp.async_save + reused DefaultStager",
    "tc_async": "torch-checkpointing async",
    "tierckpt_256m": "tierckpt (arena 256 MiB)",
    "tierckpt_default": "tierckpt (default arena)",
    "none": "no checkpointing",
    "tierckpt": "tierckpt (guard)",
    "tierckpt_memory": "tierckpt (guard, MemoryTier only)",
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Every knob of one benchmark run (the command line maps onto it one to one)."""

    sizes_gib: tuple[float, ...] = (1.0, 4.0)
    runs: int = 5
    warmup: int = 1
    compute_s: float = 1.0
    compute: str = "sleep"  # "sleep" (an accelerator computes) or "busy" (CPU matmuls)
    arena_bytes: int = 256 * MiB
    contenders: tuple[str, ...] = SAVE_CONTENDERS
    train_variants: tuple[str, ...] = DEFAULT_TRAIN_VARIANTS
    train_steps: int = 120  # measured steps per variant
    train_every: int = 10
    #: the variants take turns in blocks of at least this many steps; each block ends with a
    #: drain (its last save made durable) charged to its last step, so short blocks charge
    #: one commit's whole latency every few steps, which a run that never stops does not see
    train_block: int = 4
    train_layers: int = 4
    train_dmodel: int = 256
    train_threads: int = 0  # torch intra-op threads of the training loop; 0: torch's default
    directory: str | None = None
    breakdown: bool = True
    worker_timeout_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes_gib or any(s <= 0 for s in self.sizes_gib):
            raise ValueError(f"sizes must be positive GiB values, got {self.sizes_gib}")
        if self.runs < 1 or self.warmup < 0:
            raise ValueError("runs must be >= 1 and warmup >= 0")
        if self.compute not in ("sleep", "busy"):
            raise ValueError(f"compute must be 'sleep' or 'busy', got {self.compute!r}")
        if self.arena_bytes < 4096 or self.arena_bytes % 4096:
            raise ValueError("the arena size must be a positive multiple of 4096 bytes")
        for c in self.contenders:
            if c not in SAVE_CONTENDERS:
                raise ValueError(f"unknown contender {c!r}; known: {', '.join(SAVE_CONTENDERS)}")
        for v in self.train_variants:
            if v not in TRAIN_VARIANTS:
                raise ValueError(f"unknown training variant {v!r}; known: {TRAIN_VARIANTS}")
        if self.train_variants and min(self.train_steps, self.train_every, self.train_block) < 1:
            raise ValueError("train steps, train every and train block must be >= 1")
