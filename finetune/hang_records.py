"""The hang watchdog's progress records (finetune/hang.py): each rank's record in the store, and which ranks read
whose.

    python -m pytest tests/test_hang.py -q

Every rank publishes its record (step, phase, heartbeat, host, pid) under its own key. Three ranks read: the two
readers, rank 0 and rank W/2, read every other rank's record, in one `multi_get` per pass, once a slow phase overran
or at a SIGTERM; the backup, rank 3W/4, reads only the two readers' records (O(1) keys) and every record only when
both readers stopped beating. With torchrun's ranks in node order (node n holds ranks nL..nL+L-1) the three are on
three nodes whenever there are three (two when two), so one dead machine never takes all three. The other ranks read
no record: a verdict reaches them through FAILED_KEY (hang.py). HangWatchdog is this class plus the threads and rules.
"""

from __future__ import annotations

import json
import time

RETRY_S = 1.0  # a store that could not be read is tried once more after this


class ProgressRecords:
    """Mixin of HangWatchdog: needs self.store, rank, world_size, state, heartbeat, where, _seen, _last_records,
    _held."""

    def readers(self) -> tuple[int, ...]:
        """The ranks that read the other ranks' records: rank 0 and rank W/2 (on another node whenever there are
        two), so that one frozen reader is named by the other."""
        return tuple(sorted({0, self.world_size // 2})) if self.world_size > 1 else ()

    def backup(self) -> int | None:
        """The rank that watches the two readers: rank 3W/4 (a third node whenever there are three); None below W=3,
        where the readers are every rank."""
        rank = 3 * self.world_size // 4
        return rank if self.world_size > 2 and rank not in self.readers() else None

    def reads(self) -> bool:
        return self.rank in self.readers()

    def watches(self) -> bool:
        """A reader or the backup: a rank that checks heartbeats itself."""
        return self.reads() or self.rank == self.backup()

    def _key(self, rank: int) -> str:
        return f"finetune/progress/rank{rank}"

    def _publish(self) -> None:
        phase, step, _ = self.state
        record = {"step": step, "phase": phase, "heartbeat": self.heartbeat, **self.where}
        try:
            self.store.set(self._key(self.rank), json.dumps(record))
        except Exception:  # noqa: BLE001 - the store gone (agent stopping): nothing left to watch for
            pass

    def _records(self, ranks=None) -> dict[int, dict] | None:
        """The records of `ranks` (None: every other rank) in one multi_get; None when the store could not be read,
        even once retried: an unread record is no frozen rank."""
        ranks = [r for r in (range(self.world_size) if ranks is None else ranks) if r != self.rank]
        for attempt in range(2):
            try:
                have = self._published(ranks)
                return dict(zip(have, map(json.loads, self.store.multi_get([self._key(r) for r in have]))))
            except Exception:  # noqa: BLE001 - the store busy or gone: once more, then no verdict
                if attempt == 0:
                    time.sleep(RETRY_S)
        return None

    def _published(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` with a record (a missing key would hold multi_get until the store's timeout): one
        `check` of the ranks not seen yet, one per rank only while some has not published yet (a slow start)."""
        new = [r for r in ranks if r not in self._seen]
        if new and self.store.check([self._key(r) for r in new]):
            self._seen.update(new)
        elif new:
            self._seen.update(r for r in new if self.store.check([self._key(r)]))
        return [r for r in ranks if r in self._seen]

    def _stuck_ranks(self, frozen: list[int], my_step: int) -> list[int]:
        """Ranks to name when a `step` phase overran: the frozen ones; else those not in this step's collectives
        (another step or phase); else every rank (all wait on each other: a deadlock)."""
        if frozen:
            return frozen
        elsewhere = [r for r, rec in self._last_records.items() if (rec["step"], rec["phase"]) != (my_step, "step")]
        return elsewhere or list(range(self.world_size))

    def _confirmed(self, frozen: list[int], records: dict[int, dict], hold_s: float) -> list[int]:
        """Of `frozen`, those whose beat is still where `records` saw it `hold_s` later, if their record is in a slow
        phase (not `step`): there one C call holding the GIL stops a rank's beat thread as SIGSTOP would. The DCP
        coordinator's finish does (its pickle's memo, growing with T x W: docs/reliability.md), and a save overrunning
        the timeout is when a reader looks. One more read of the suspects only; a rank confirmed stays so (the backup
        looks twice: at the readers, then at everyone)."""
        slow = [r for r in frozen if r not in self._held and records.get(r, {}).get("phase") not in (None, "step")]
        if slow:
            time.sleep(hold_s)
            now = self._records(slow) or {}
            moved = {r for r in slow if r in now and now[r]["heartbeat"] != records[r]["heartbeat"]}
            frozen = [r for r in frozen if r not in moved]
        self._held.update(frozen)
        return frozen
