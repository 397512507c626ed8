"""What a fair page asks each queue group for (docs/adr/0012, issue #12).

A page of `limit` interleaves its Projects round-robin, so while the others
have Runs it takes at most a share of each: a group is asked for its
Project's share and one more (within its room), so a page reads as many rows
at a backlog of 100,000 as at 100. A page the shares do not fill is followed
by the next, and nothing is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from dispatch.core.fairness import (
    QueueGroup,
    Rotation,
    RowsWanted,
    WalkStart,
    candidate_key,
    candidate_order,
    fair_page,
)
from dispatch.core.ports import Candidate

T0 = datetime(2026, 12, 5, tzinfo=UTC)


class Reader:
    """Projects "p0".."pN", one group each, with the given numbers of Runs."""

    def __init__(self, runs_per_project: Sequence[int]) -> None:
        self.runs = {
            f"p{p}": [
                Candidate(
                    run_id=f"r{p}-{i:03d}",
                    attempt_id=f"a{p}-{i:03d}",
                    project_id=f"p{p}",
                    task_id=f"t{p}",
                    task_revision=1,
                    executor_type="shell",
                    priority=0,
                    queued_at=T0 + timedelta(seconds=i),
                    attempt_version=1,
                    lease_generation=0,
                )
                for i in range(count)
            ]
            for p, count in enumerate(runs_per_project)
        }
        self.asked: list[int] = []  # the limit of every group asked, in order

    def walk(self, *, start: WalkStart | None, cap: int) -> tuple[list[QueueGroup], bool]:
        names = list(self.runs)
        if start is not None:
            at = names.index(start[0]) + 1
            names = names[at:] + names[:at]
        groups = [QueueGroup(n, f"g{n}", f"t{n}", servable=True) for n in names[:cap]]
        return groups, len(names) > cap

    def rows(self, wanted: Sequence[RowsWanted]) -> Mapping[str, Sequence[Candidate]]:
        found = {}
        for want in wanted:
            self.asked.append(want.limit)
            after = None if want.after is None else candidate_order(want.after)
            rows = [
                c
                for c in self.runs[want.group.project_id]
                if after is None or candidate_order(candidate_key(c)) > after
            ]
            found[want.group.group_id] = rows[: want.limit]
        return found


def cycle(reader: Reader, limit: int) -> list[list[str]]:
    rotation, cursor, out = Rotation(), None, []
    for _ in range(100):
        page = fair_page(reader, cursor=cursor, limit=limit, rotation=rotation)
        out.append([c.run_id for c in page.items])
        if page.next_cursor is None:
            return out
        cursor = page.next_cursor
    raise AssertionError("paging did not end")


def test_each_group_is_asked_for_its_share_and_one_more_whatever_the_backlog() -> None:
    small, large = Reader([2] * 50), Reader([2000] * 50)
    for reader in (small, large):
        page = fair_page(reader, cursor=None, limit=8, rotation=Rotation())
        assert [c.project_id for c in page.items] == [f"p{i}" for i in range(8)]
    # 8 Projects on a page of 8: one each, and one more.
    assert small.asked == large.asked == [2] * 8


def test_a_lone_project_is_asked_for_the_whole_page() -> None:
    reader = Reader([100])
    page = fair_page(reader, cursor=None, limit=8, rotation=Rotation())
    assert len(page.items) == 8
    assert reader.asked == [8]


def test_projects_short_of_their_share_are_made_up_by_the_next_page() -> None:
    # 3 Projects on a page of 8: a share of 3, asked 4. Two hold one Run each,
    # so the first page has 1 + 1 + 4 = 6; the next page brings the rest of the
    # big Project, in its order, and nothing comes twice or is skipped.
    reader = Reader([1, 20, 1])
    pages = cycle(reader, 8)
    assert reader.asked[:3] == [4, 4, 4]
    assert pages[0] == ["r0-000", "r1-000", "r2-000", "r1-001", "r1-002", "r1-003"]
    flat = [run for page in pages for run in page]
    assert len(flat) == len(set(flat)) == 22
    assert [r for r in flat if r.startswith("r1-")] == [f"r1-{i:03d}" for i in range(20)]
    assert all(len(page) <= 8 for page in pages)
