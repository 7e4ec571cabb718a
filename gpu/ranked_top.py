"""The k most likely tokens of each row, in one order whatever k: by logprob, ties broken by
the lower token id.

NOTE: torch.topk's order among equal values depends on k (a row that is -inf but for one
token gave ids [105, 1, 0] for k = 3 and [105, 1, 3, 0] for k = 4). A batch asks for as many
as its most demanding row wants, so a request's reported top logprobs changed with the
requests batched beside it (tokens a grammar rules out tie at -inf). Here the first j
entries are the same for every k >= j. Device ops only: no host read of the row's values.
"""

from __future__ import annotations

import torch

_ABOVE = 1 << 40  # selection keys: strictly above the k-th value; tied ones get -id


def ranked_top(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [rows, k] of each row of logprobs [rows, V] (k <= V): the k largest,
    largest first, equal values in ascending id order."""
    kth = logprobs.topk(k, dim=-1).values[:, -1:]
    ids = torch.arange(logprobs.shape[-1], device=logprobs.device)
    key = torch.where(logprobs > kth, _ABOVE, torch.where(logprobs == kth, -ids, -2 * _ABOVE))
    chosen = key.topk(k, dim=-1).indices.sort(dim=-1).values  # the set, ascending ids
    values = logprobs.gather(-1, chosen)
    order = values.sort(dim=-1, descending=True, stable=True).indices  # stable: equal values keep id order
    return values.gather(-1, order), chosen.gather(-1, order)
