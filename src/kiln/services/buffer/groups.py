"""Groups of samples of one task, and how freshness applies to them.

Pure functions and small records, no I/O: `buffer.py` holds the state and decides when to apply
them. The buffer forms groups and serves them whole (`pick_groups`), never in part; their
advantages are the trainer's (`kiln.services.trainer.advantages`), taken over each served group.

Freshness (`kiln.freshness`): with the trainer at policy version V, a trajectory whose oldest
token version is more than tau behind (`V - oldest > tau`) is stale. A group is judged by its oldest member: if any
member is stale the whole group is dropped, including members that are still fresh and members
that have not arrived yet. Keeping the fresh part would change the group the advantage baseline
`mean_j r_j` is taken over (a smaller, selectively surviving set), biasing every advantage in it;
dropping the whole group costs some fresh samples but keeps the estimator what it claims to be.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Entry:
    """One stored trajectory, as the buffer keeps it in memory (the payload stays serialized)."""

    id: str
    group_key: str
    """`Trajectory.group_key`."""
    oldest_version: int
    payload: bytes
    """The `kiln.v1.Trajectory` bytes, as stored."""


@dataclass
class Group:
    key: str
    size: int
    seq: int
    """Arrival order of the group's first member; breaks ties between equally old groups."""
    members: list[Entry] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.size

    @property
    def oldest_version(self) -> int:
        return min(e.oldest_version for e in self.members)

    def order_key(self) -> tuple[int, int]:
        """Serving order: oldest policy version first, then first arrival."""
        return (self.oldest_version, self.seq)


class GroupPool(dict[str, Group]):
    """Complete groups by key, with their total member count kept as they come and go: the
    buffer needs that count on every Put (backpressure), and summing it over thousands of SFT
    groups of one each time made the buffer its own bottleneck. A complete group's members do
    not change, so adding and removing groups is all there is to track."""

    def __init__(self) -> None:
        super().__init__()
        self.members = 0

    def __setitem__(self, key: str, group: Group) -> None:
        old = self.get(key)
        if old is not None:
            self.members -= len(old.members)
        super().__setitem__(key, group)
        self.members += len(group.members)

    def __delitem__(self, key: str) -> None:
        self.members -= len(self[key].members)
        super().__delitem__(key)

    _MISSING = object()

    def pop(self, key: str, default=_MISSING):  # type: ignore[override]
        if key in self:
            group = super().pop(key)
            self.members -= len(group.members)
            return group
        if default is GroupPool._MISSING:
            raise KeyError(key)
        return default

    def _unsupported(self, *args, **kwargs):
        raise TypeError("GroupPool supports only item assignment, del and pop")

    clear = popitem = setdefault = update = __ior__ = _unsupported  # type: ignore[assignment]


def pick_groups(ready: list[Group], size: int) -> list[Group]:
    """Whole groups, oldest first, adding up to at most `size` trajectories. A group that does not
    fit in what is left is skipped, so smaller groups behind it may still fill the batch."""
    picked: list[Group] = []
    room = size
    for group in sorted(ready, key=Group.order_key):
        if len(group.members) <= room:
            picked.append(group)
            room -= len(group.members)
            if room == 0:
                break
    return picked
