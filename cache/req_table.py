"""Request -> token table: req_to_token[row, pos] is the KV slot of token `pos`."""

from __future__ import annotations

import torch


class ReqToTokenTable:
    """Rows are handed out like pages; row 0 is reserved for padding rows.

    The table lives on the compute device; the scheduler writes a row's slots when it
    allocates pages, before the step that uses them is submitted. `scratch_rows` more
    rows (after the request rows) are lent for one step at a time: a token tree's side
    nodes run on them (kernel/speculative/tree.py), never taking a request's row.
    """

    def __init__(self, num_rows: int, max_context: int, device: torch.device, scratch_rows: int = 0) -> None:
        self.num_rows = num_rows  # request rows (row 0 included)
        self.max_context = max_context
        self.table = torch.zeros((num_rows + scratch_rows, max_context), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(num_rows - 1, 0, -1))
        self.num_scratch = scratch_rows
        self._scratch: list[int] = list(range(num_rows + scratch_rows - 1, num_rows - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row <= 0 or row in self._free:
            raise RuntimeError(f"request row {row} freed twice or reserved")
        self._free.append(row)

    @property
    def num_scratch_free(self) -> int:
        return len(self._scratch)

    def allocate_scratch(self) -> int:
        return self._scratch.pop()

    def free_scratch(self, row: int) -> None:
        if row < self.num_rows or row in self._scratch:
            raise RuntimeError(f"scratch row {row} freed twice or not a scratch row")
        self._scratch.append(row)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Slots [0, length) of row `src` into row `dst` (on the loop's stream, like writes)."""
        self.table[dst, :length].copy_(self.table[src, :length], non_blocking=True)

    def write_slots(self, row: int, start: int, slots: list[int]) -> None:
        self._write(row, start, torch.tensor(slots, dtype=torch.int64))

    def write_pages(self, row: int, first_page_index: int, pages: list[int], page_size: int) -> None:
        """Write the slots of `pages` as page numbers first_page_index.. of the row."""
        if not pages:
            return
        start = first_page_index * page_size
        page_t = torch.tensor(pages, dtype=torch.int64)
        slots = (page_t[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        self._write(row, start, slots)

    def _write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if self.table.is_cuda:
            # NOTE: from pageable memory the copy would make the loop thread wait for the
            # device; from a pinned block it is queued on the loop thread's (default)
            # stream, which every device-thread job waits for (gpu/device_thread.py).
            slots = slots.pin_memory()
        self.table[row, start : start + slots.numel()].copy_(slots, non_blocking=True)
