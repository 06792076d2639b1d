"""Placement affinity of a group: the choices of one n > 1 request go where the first of them went.

The gateway sends such a request as n requests sharing a group id and one prompt. On one worker the engine
computes that prompt once (its other choices wait for its blocks and reuse them from the prefix cache); spread
over workers, each would compute it. The KV-aware router cannot keep them together by itself: it learns of a
worker's cached blocks only once they are computed, after the choices are placed (they arrive together).

Best effort: a choice whose group's worker has no free slot, or is gone, is placed by the router as any request
(it then computes the prompt itself). An entry is forgotten once all n choices are placed, and the table is
bounded (oldest groups first), so a group whose choices were cancelled before placement cannot hold an entry.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_GROUPS = 4096  # groups remembered at once: far more than can be mid-placement (n choices arrive together)


class GroupAffinity:
    def __init__(self, max_groups: int = MAX_GROUPS):
        self.max_groups = max_groups
        self._groups: OrderedDict[str, tuple[str, int]] = OrderedDict()  # group -> (worker, choices left to place)

    def worker_for(self, group_id: str) -> str | None:
        """The worker the group's first choice went to (None: no group, or none placed yet)."""
        entry = self._groups.get(group_id) if group_id else None
        return entry[0] if entry is not None else None

    def placed(self, group_id: str, group_size: int, worker_id: str) -> None:
        """A choice of the group was placed on worker_id: remembered for its siblings until all are placed."""
        if not group_id:
            return
        entry = self._groups.get(group_id)
        if entry is None:
            if group_size <= 1:  # a choice placed again (recovery) whose siblings are all placed
                return
            entry = (worker_id, group_size)
            self._groups[group_id] = entry
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        left = entry[1] - 1
        if left <= 0:
            del self._groups[group_id]
        else:
            self._groups[group_id] = (entry[0], left)

    def drop_worker(self, worker_id: str) -> None:
        for group in [g for g, (w, _) in self._groups.items() if w == worker_id]:
            del self._groups[group]

    def __len__(self) -> int:
        return len(self._groups)
