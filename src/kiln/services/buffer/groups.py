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
    """Whole groups that fill exactly `size` trajectories if any selection of them can: of
    those selections, the one that prefers older groups (in `order_key` order, each group is
    taken if a full batch can still be made with it). Else the greedy pick, oldest first, of
    groups that fit (a partial batch).

    Exact, so that no group can wedge serving: taking the oldest group whenever it fits (the
    greedy pick alone) lets a group of 2 at the head of groups of 8 hold every batch of 16 at
    10 trajectories forever, though two groups of 8 are ready."""
    ordered = sorted(ready, key=Group.order_key)
    greedy: list[Group] = []
    room = size
    for group in ordered:
        if len(group.members) <= room:
            greedy.append(group)
            room -= len(group.members)
            if room == 0:
                return greedy  # the common case: no search needed
    # can[i]: bit r set if some selection of ordered[i:] holds exactly r trajectories.
    mask = (1 << (size + 1)) - 1
    can = [1] * (len(ordered) + 1)
    for i in range(len(ordered) - 1, -1, -1):
        can[i] = (can[i + 1] | (can[i + 1] << len(ordered[i].members))) & mask
    if not can[0] >> size & 1:
        return greedy
    picked: list[Group] = []
    room = size
    for i, group in enumerate(ordered):
        n = len(group.members)
        if n <= room and can[i + 1] >> (room - n) & 1:
            picked.append(group)
            room -= n
            if room == 0:
                break
    return picked
