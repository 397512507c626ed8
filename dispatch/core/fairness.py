"""Fair candidate pages: Projects served round-robin (issue 11, docs/adr/0012).

The candidate read does not page through one global queue any more. Queued
Runs fall into *queue groups*, one per (Project, pinned TaskRevision): every
Run of a group has the same executor type, required labels, Task limit and
Project limit, so whether the group can be served now is decided once per
group, never per Run. A page is built in three steps, the same for the ORM
adapter and the in-memory fakes (both implement `QueueReader`):

1. `QueueReader.walk`: at most `WALK_CAP` groups in (project id, group id)
   order, starting after a position and wrapping around once. Each carries
   whether it is servable now — placeable on a Session in scope that has a
   free slot, its Project and Task under their limits — and the room left
   under those limits. The walk reads one row per group (an index probe), so
   its cost does not depend on how many Runs a group holds.
2. `QueueReader.rows`: for the first `limit` Projects with a servable group,
   up to its Project's share of the page and one more per group (never more
   than its room; a lone Project's group up to `limit`), in the
   Project's own order (priority DESC, queued_at, run id), after what this
   cycle already emitted of it.
3. `fair_page`: the Projects' rows interleaved round-robin — one Run of each
   Project in turn, then the next round — up to `limit`.

The turn carries over between cycles through a `Rotation` kept per process
(the ORM adapter's module, the fake store): a cycle starts after the Project
it last planned a candidate of (`Rotation.served`, told by the plan source),
so with free slots every Project with servable work gets a candidate within
one cycle per Project ahead of it in the rotation (docs/adr/0012, "The
bound").
"""

from __future__ import annotations

import heapq
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Protocol

from dispatch.core.budget import HARD_CAPS
from dispatch.core.ports import Candidate, Page, id_sort_key

__all__ = [
    "WALK_CAP",
    "CandidateKey",
    "QueueGroup",
    "QueueReader",
    "Rotation",
    "RowsWanted",
    "WalkStart",
    "candidate_key",
    "candidate_order",
    "fair_page",
]

# Queue groups one page walks at most: one hard-capped page of rows.
WALK_CAP: Final = HARD_CAPS["page_size"]

# Where a walk starts: strictly after (project id, group id); a group id of
# None means after every group of that Project.
WalkStart = tuple[str, str | None]
# A candidate's place in its Project's order: (priority, queued_at, run id).
CandidateKey = tuple[int, datetime, str]


@dataclass(frozen=True)
class QueueGroup:
    """One (Project, pinned revision) with queued Runs, as the walk saw it."""

    project_id: str
    group_id: str  # the pinned revision's id
    task_id: str
    # Placeable on a Session in scope with a free slot, Project and Task under
    # their limits: the group's Runs can be claimed now.
    servable: bool
    # Slots left under the Project's / the Task's limit; None: no limit.
    project_room: int | None = None
    task_room: int | None = None


@dataclass(frozen=True)
class RowsWanted:
    group: QueueGroup
    after: CandidateKey | None  # the last candidate of its Project this cycle emitted
    limit: int


class QueueReader(Protocol):
    def walk(self, *, start: WalkStart | None, cap: int) -> tuple[list[QueueGroup], bool]:
        """Groups with queued Runs in (project id, group id) order (ids compared
        as `id_sort_key`), beginning after `start` (None: from the first) and
        wrapping around to end at `start`, each group at most once; at most
        `cap`. Returns them and whether the walk stopped at `cap` with groups
        left. `servable` and the rooms as of now."""
        ...

    def rows(self, wanted: Sequence[RowsWanted]) -> Mapping[str, Sequence[Candidate]]:
        """By group id: the group's candidates (Attempt pending, Run queued, not
        cancelled, eligible at `observed_at`) after `after` in `candidate_order`,
        at most `limit`."""
        ...


def candidate_key(candidate: Candidate) -> CandidateKey:
    return (candidate.priority, candidate.queued_at, candidate.run_id)


def candidate_order(key: CandidateKey) -> tuple[int, datetime, tuple[int, int, str]]:
    """Within a Project: priority DESC, queued_at, run id (an ascending sort key)."""
    priority, queued_at, run_id = key
    return (-priority, queued_at, id_sort_key(run_id))


class Rotation:
    """Where the next cycle's round-robin starts: after the last Project served.

    One per process (a web process's pulls share it, a dispatcher's cycles
    share it); thread-safe. `served` is told of every candidate a cycle plans,
    in the order the cycle takes them, so the next cycle starts with the
    Project after the last one that had its turn.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: str | None = None

    def start(self) -> WalkStart | None:
        with self._lock:
            return None if self._last is None else (self._last, None)

    def served(self, project_id: str) -> None:
        with self._lock:
            self._last = project_id

    def reset(self) -> None:
        """Forget the turn (tests: each starts as a fresh process)."""
        with self._lock:
            self._last = None


@dataclass
class _State:
    start: WalkStart | None
    # By project: the key of the last candidate this cycle emitted of it.
    after: dict[str, CandidateKey] = field(default_factory=dict)
    # Projects with nothing more to give this cycle (all read, or room used).
    done: set[str] = field(default_factory=set)
    # Pages read: a cursor never repeats, even if a walk comes round again.
    page: int = 0


def fair_page(
    reader: QueueReader, *, cursor: str | None, limit: int, rotation: Rotation
) -> Page[Candidate]:
    """One page of candidates, Projects interleaved round-robin (module docstring)."""
    state = _State(rotation.start()) if cursor is None else _decode(cursor)
    groups, truncated = reader.walk(start=state.start, cap=WALK_CAP)

    projects: list[str] = []  # with a servable group, in walk order
    servable: dict[str, list[QueueGroup]] = {}
    for group in groups:
        if not group.servable or group.project_id in state.done:
            continue
        if group.project_id not in servable:
            projects.append(group.project_id)
            servable[group.project_id] = []
        servable[group.project_id].append(group)
    chosen = projects[:limit]
    more_projects = len(projects) > len(chosen)

    # Each group is asked for its Project's share of the page and one more
    # (within its room): the round-robin takes at most a share of each Project
    # while the others have Runs, and the one more fills the page when another
    # has fewer. Asking every group for a whole page read up to `limit` rows of
    # each of `limit` Projects for a page of `limit`, and made a large backlog
    # cost more than a small one (bench/dispatch_bench.py). A page the shares
    # do not fill — several Projects short of their share — is followed by the
    # next one (the cursor), as when claims are lost.
    share = min(limit, -(-limit // len(chosen)) + 1) if chosen else limit
    wanted: list[RowsWanted] = []
    for project in chosen:
        for group in servable[project]:
            room = _room(group.project_room, group.task_room)
            ask = share if room is None else min(share, room)
            if ask > 0:
                wanted.append(RowsWanted(group, state.after.get(project), ask))
    found = reader.rows(wanted) if wanted else {}

    queues: dict[str, list[Candidate]] = {}
    more_behind: set[str] = set()
    for project in chosen:
        asked = [w for w in wanted if w.group.project_id == project]
        lists = [list(found.get(w.group.group_id, ())) for w in asked]
        for w, rows in zip(asked, lists, strict=True):
            if len(rows) > w.limit:
                raise ValueError("a queue reader returned more rows than asked")
            # A full answer that the room did not cap may have more behind it.
            room = _room(w.group.project_room, w.group.task_room)
            if len(rows) == w.limit and (room is None or w.limit < room):
                more_behind.add(project)
        queues[project] = _merged(asked, lists)

    items: list[Candidate] = []
    last_emitted: str | None = None
    while len(items) < limit and any(queues.values()):
        for project in chosen:
            if len(items) >= limit:
                break
            if queues[project]:
                candidate = queues[project].pop(0)
                items.append(candidate)
                state.after[project] = candidate_key(candidate)
                last_emitted = project
    leftovers = any(queues.values())
    maybe_more = bool(more_behind)
    for project in chosen:
        if not queues[project] and project not in more_behind:
            state.done.add(project)  # everything it may give this cycle was given

    if not items and not state.after and groups:
        # Nothing this cycle walked so far could be served: those Projects
        # forfeit their turn, so the next cycle does not walk them first again.
        rotation.served(groups[-1].project_id)

    next_start: WalkStart | None
    if last_emitted is not None and (leftovers or maybe_more):
        next_start = (last_emitted, None)
    elif more_projects:
        next_start = (chosen[-1], None)
    elif truncated:
        last = groups[-1]
        next_start = (last.project_id, last.group_id)
    else:
        next_start = None
    if next_start is None:
        return Page(tuple(items), None)
    state.start = next_start
    state.page += 1
    return Page(tuple(items), _encode(state))


def _room(project_room: int | None, task_room: int | None) -> int | None:
    rooms = [room for room in (project_room, task_room) if room is not None]
    return min(rooms) if rooms else None


def _merged(asked: list[RowsWanted], lists: list[list[Candidate]]) -> list[Candidate]:
    """One Project's groups merged in its order, within its Project and Task rooms."""
    project_room = next(
        (w.group.project_room for w in asked if w.group.project_room is not None), None
    )
    task_room = {w.group.task_id: w.group.task_room for w in asked}
    merged: list[Candidate] = []
    for candidate in heapq.merge(*lists, key=lambda c: candidate_order(candidate_key(c))):
        if project_room is not None and len(merged) >= project_room:
            break
        room = task_room.get(candidate.task_id)
        if room is not None:
            if room <= 0:
                continue
            task_room[candidate.task_id] = room - 1
        merged.append(candidate)
    return merged


# --------------------------------------------------------------- the cursor


def _encode(state: _State) -> str:
    start = None if state.start is None else list(state.start)
    after = {p: [k[0], k[1].isoformat(), k[2]] for p, k in state.after.items()}
    raw = {"s": start, "a": after, "d": sorted(state.done), "n": state.page}
    return json.dumps(raw, separators=(",", ":"), sort_keys=True)


def _decode(cursor: str) -> _State:
    try:
        raw = json.loads(cursor)
        start_raw = raw["s"]
        start: WalkStart | None = None
        if start_raw is not None:
            project, group = start_raw
            start = (str(project), None if group is None else str(group))
        after: dict[str, CandidateKey] = {}
        for project, (priority, queued_at, run_id) in raw["a"].items():
            moment = datetime.fromisoformat(queued_at)
            if moment.tzinfo is None or isinstance(priority, bool):
                raise ValueError
            after[str(project)] = (int(priority), moment, str(run_id))
        done = {str(project) for project in raw["d"]}
        page = raw["n"]
        if isinstance(page, bool) or not isinstance(page, int):
            raise ValueError
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ValueError("not a cursor of this source") from None
    return _State(start, after, done, page)
