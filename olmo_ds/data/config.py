"""Data configuration for training: which shard directories, in what mixture, in what order."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceConfig:
    """One source of a mixture: a shard directory written by scripts/prepare_data.py."""

    path: str
    weight: float = 1.0  # relative target share of tokens
    # At most this many passes over the source per mixture epoch: None = 1 (no repetition),
    # > 1 allows upsampling a small source (see olmo_ds/data/mixture.py).
    max_epochs: float | None = None
    name: str | None = None  # defaults to the directory name


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    seed: int = 0
    # Attend only within each document (needs doc boundaries). Unset: off for pretraining data, on for
    # masked (fine-tuning) data, where `false` is refused (packed conversations must not see each other).
    document_masking: bool | None = None
    # Masked (fine-tuning) data: a conversation longer than batch.seq_len keeps its first seq_len tokens
    # (`truncate`, as OLMo-core) or is left out (`drop`); either is counted and logged.
    long_conversations: str = "truncate"
    # Preference (DPO) data: a pair longer than batch.seq_len is an error naming it (`refuse`) or is left out
    # (`drop`, counted and logged). A pair is never cut: its final reply is what is compared.
    long_pairs: str = "refuse"
    prefetch: int = 2  # global batches prepared ahead in a background thread
    val_sources: list[SourceConfig] = field(default_factory=list)  # fixed, unshuffled validation streams
    allow_data_change: bool = False  # resume even if the data fingerprint differs (explicit opt-in)
    # Node-local directory for the global order of very large epochs (see olmo_ds/data/order.py);
    # None = ~/.cache/olmo_ds/order.
    order_cache_dir: str | None = None

    def __post_init__(self) -> None:
        self.sources = [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.sources]
        self.val_sources = [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.val_sources]
        for s in self.sources + self.val_sources:
            if s.weight <= 0:
                raise ValueError(f"data source {s.path}: weight must be > 0, got {s.weight}")
            if s.max_epochs is not None and s.max_epochs <= 0:
                raise ValueError(f"data source {s.path}: max_epochs must be > 0 (or null for 1), got {s.max_epochs}")
        if self.long_conversations not in ("truncate", "drop"):
            raise ValueError(f"data.long_conversations {self.long_conversations!r}: expected truncate or drop")
        if self.long_pairs not in ("refuse", "drop"):
            raise ValueError(f"data.long_pairs {self.long_pairs!r}: expected refuse (a pair longer than batch.seq_len is an error) "
                             "or drop (such pairs are left out and counted)")
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch must be >= 0 (0 = no background thread), got {self.prefetch}")
