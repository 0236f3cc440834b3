"""Which ranks run the target and which train the drafter: the layout, parsed once from its text.

- `colocated`: every rank holds the frozen target and a drafter replica; gradients all-reduced.
- `split:T:D`: ranks 0..T-1 run the target and send features, ranks T..T+D-1 train the drafter.

`Layout.parse` checks the text alone (the run config does, before anything loads); `Layout.on(world)`
checks it against the processes there are and fills in a colocated layout's rank counts.

How each target rank holds the target is `TargetParallel`: whole (`none`), or `fsdp:N`, sharded over
groups of N consecutive target ranks (flashdraft.distributed.sharded_target).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class LayoutKind(StrEnum):
    COLOCATED = "colocated"
    SPLIT = "split"


@dataclass(frozen=True)
class Layout:
    kind: LayoutKind = LayoutKind.COLOCATED
    targets: int = 0  # ranks that run the target (colocated: every rank, once `on` a world)
    drafters: int = 0  # ranks that train the drafter

    @classmethod
    def parse(cls, text: str | Layout) -> Layout:
        if isinstance(text, Layout):
            return text
        if text == "colocated":
            return cls()
        m = re.fullmatch(r"split:(\d+):(\d+)", text)
        if not m:
            raise ValueError(f"layout {text!r}: expected 'colocated' or 'split:T:D' (e.g. split:5:3)")
        t, d = int(m.group(1)), int(m.group(2))
        if t < 1 or d < 1:
            raise ValueError(f"layout {text}: needs at least one target and one drafter rank")
        return cls(LayoutKind.SPLIT, t, d)

    @property
    def is_split(self) -> bool:
        return self.kind is LayoutKind.SPLIT

    def on(self, world_size: int) -> Layout:
        """This layout on `world_size` processes: refused if a split layout needs another count."""
        if not self.is_split:
            return Layout(LayoutKind.COLOCATED, world_size, world_size)
        if self.targets + self.drafters != world_size:
            raise ValueError(
                f"layout {self} needs {self.targets + self.drafters} processes, but the world has "
                f"{world_size}"
            )
        return self

    def __str__(self) -> str:
        return f"split:{self.targets}:{self.drafters}" if self.is_split else "colocated"


@dataclass(frozen=True)
class TargetParallel:
    """The frozen target whole on every target rank (size 1) or FSDP2-sharded over groups of `size`
    consecutive target ranks, each group holding one copy."""

    size: int = 1

    @classmethod
    def parse(cls, text: str | TargetParallel) -> TargetParallel:
        if isinstance(text, TargetParallel):
            return text
        if text == "none":
            return cls()
        m = re.fullmatch(r"fsdp:(\d+)", text)
        if not m or int(m.group(1)) < 1:
            raise ValueError(
                f"target parallelism {text!r}: expected 'none' or 'fsdp:N' (N >= 1, e.g. fsdp:8)"
            )
        return cls(int(m.group(1)))

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def groups(self, layout: Layout) -> list[list[int]]:
        """The target groups of `layout` (on a world): consecutive target ranks, `size` to a group."""
        if layout.targets % self.size:
            raise ValueError(
                f"target parallelism {self}: the {layout.targets} target rank(s) of layout {layout} do not "
                f"split into groups of {self.size}"
            )
        return [list(range(g, g + self.size)) for g in range(0, layout.targets, self.size)]

    def __str__(self) -> str:
        return f"fsdp:{self.size}" if self.sharded else "none"
