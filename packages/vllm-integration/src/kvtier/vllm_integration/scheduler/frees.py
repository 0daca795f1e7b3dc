"""When vLLM may free a finished request's blocks (the scheduler side's ``request_finished``).

A request whose KV kvtier is still copying off the device must keep its blocks: vLLM would hand
them to another request while the copy reads them. What the blocks wait for is the copy, not
the lower-tier write. Each step's metadata carries a serial number (``KVTierMetadata.step``);
every worker reports, with each step's output, the last step whose saves it has all copied
(``RankReport.saves_copied``: its saver runs them in order). A request that finishes after
every rank has copied the saves of its last save step frees its blocks at once; the workers
are told (``KVTierMetadata.unheld``) so they do not report it in ``finished_sending``. A
request still being copied keeps its blocks until the workers report it done through
``get_finished`` (``finished_sending``), one step or more later. Waiting for that report
always would cost every request a step after it finished, even one whose saves were copied
long before (a prompt's chunks are saved during its prefill), and under memory pressure the
next request would wait that step for the blocks.
"""

from __future__ import annotations


class BlockFrees:
    """Finished requests' blocks: freed at once, or held until their saves are reported."""

    def __init__(self, num_workers: int) -> None:
        self._copied = [-1] * num_workers  # per rank: every save of steps <= this is copied
        self._held: set[str] = set()  # finished requests whose blocks wait for their saves
        self._unheld: list[str] = []  # freed at once, for the next step's metadata
        self.stats = {"finished_freed_at_once": 0, "finished_held": 0}

    def copied(self, rank: int, step: int) -> None:
        """``rank`` has copied every save of the steps up to ``step``."""
        if 0 <= rank < len(self._copied):
            self._copied[rank] = max(self._copied[rank], step)

    def finished(self, req_id: str, last_save_step: int) -> bool:
        """Whether the blocks of ``req_id`` (whose last save went out in ``last_save_step``;
        -1: it had none) must wait for the workers' ``finished_sending``."""
        if last_save_step < 0:
            return False
        if last_save_step <= min(self._copied):
            self._unheld.append(req_id)
            self.stats["finished_freed_at_once"] += 1
            return False
        self._held.add(req_id)
        self.stats["finished_held"] += 1
        return True

    @property
    def copied_through(self) -> int:
        """The last step whose saves every rank has copied."""
        return min(self._copied)

    def sent(self, req_ids: set[str]) -> None:
        """The workers report these requests' saves done (vLLM frees their blocks now)."""
        self._held -= req_ids

    @property
    def pending(self) -> bool:
        return bool(self._held)

    def take_unheld(self) -> list[str]:
        out, self._unheld = self._unheld, []
        return out
