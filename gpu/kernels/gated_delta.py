"""Gated delta rule (Gated DeltaNet, Qwen3.5 / Qwen3-Next linear attention) in plain torch.

Per head, with a state S [k_dim, v_dim], and per token t a log-space decay g_t <= 0, a
write strength beta_t in (0, 1), a unit-norm key k_t, a scaled query q_t and a value v_t:

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      (delta rule: write only the error)
    o_t = S^T q_t

Three forms of the same recurrence:
- `recurrent_step`: one token for a batch of requests (decode);
- `recurrent_prefill`: a loop of `recurrent_step` over one request's tokens, bit-identical
  to running those tokens as decode steps (deterministic mode);
- `chunk_prefill`: the chunked (WY / UT-transform) form, a few matmuls per chunk of 64
  tokens; faster for long prompts, equal to the recurrent form up to rounding.
And the recurrent form natively (`native_varlen`, gpu/kernels/cpu/gated_delta.cpp): every
request's tokens in one C++ call, decode and prefill alike, its arithmetic per (request,
head) fixed, so deterministic mode runs it on CPU where it builds (not torch's bits: a
process uses one or the other for every step).
`gated_delta_varlen` runs a whole step's flattened tokens (several requests, mixed
prefill and decode) with one of them. Each takes the per-token inputs as one `DeltaInputs`;
all inputs and states are float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpu.batch_invariant import pointwise
from gpu.kernels import cpu
from gpu.upload import to_device

CHUNK_SIZE = 64


class DeltaInputs(NamedTuple):
    """The per-token inputs: q, k [T, H, dk], v [T, H, dv], g, beta [T, H], with T the
    tokens (in `recurrent_step`, one token each of B requests)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def rows(self, index: slice | torch.Tensor) -> DeltaInputs:
        """The same tokens of every input."""
        return DeltaInputs(*(x[index] for x in self))


def _sum_keys(x: torch.Tensor) -> torch.Tensor:
    """Sum over the k_dim axis of x [..., k_dim, v_dim] in a fixed pairwise order.

    NOTE: invariant 7. `sum(-2)` (or a matmul) may pick its reduction order by the shape
    of the whole batch; halving with elementwise adds gives every (request, head, column)
    the same order whatever else is in the batch, so a state reached in prefill equals,
    bit for bit, one reached by decode steps. Zero padding to a power of two is exact.
    """
    n = x.shape[-2]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, 0, 0, width - n))
    while x.shape[-2] > 1:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    return x[..., 0, :]


def recurrent_step(x: DeltaInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for B requests: x [B, ...], state [B, H, dk, dv] -> (output [B, H, dv],
    new state). The input state is not modified."""
    q, k, v, g, beta = x
    s = state * g.exp()[..., None, None]
    predicted = _sum_keys(s * k[..., :, None])  # S^T k: what the state already recalls for k
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return _sum_keys(s * q[..., :, None]), s


def recurrent_prefill(x: DeltaInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's L tokens, one `recurrent_step` each: x [L, ...], state [H, dk, dv]
    -> (output [L, H, dv], state after the last token)."""
    out, s, _ = recurrent_prefill_tracked(x, state, ())
    return out, s


def recurrent_prefill_tracked(
    x: DeltaInputs, state: torch.Tensor, track: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`recurrent_prefill`, plus the states after each of the first n tokens for n in
    `track` (0 < n < L) -> [M, H, dk, dv]: the very states a run of n tokens ends with."""
    _check_track(track, x.q.shape[0])
    out = torch.empty_like(x.v)
    tracked = state.new_empty((len(track), *state.shape))
    at = {n: m for m, n in enumerate(track)}
    s = state[None]
    for t in range(x.q.shape[0]):
        o, s = recurrent_step(x.rows(slice(t, t + 1)), s)
        out[t] = o[0]
        if t + 1 in at:
            tracked[at[t + 1]] = s[0]
    return out, s[0], tracked


def _check_track(track: Sequence[int], length: int) -> None:
    if any(not 0 < n < length for n in track) or list(track) != sorted(set(track)):
        raise ValueError(f"tracked lengths {list(track)} must increase inside (0, {length})")


def chunk_prefill(
    x: DeltaInputs,
    state: torch.Tensor,
    start_pos: int,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of `recurrent_prefill` for tokens at absolute positions start_pos...

    The chunk grid is anchored at absolute position 0: the first chunk ends on the next
    multiple of `chunk_size`, so a prompt split across steps at any point sees the same
    chunks after the split as an unsplit run (equal results as far as the grid allows).
    This is done by padding the front with `start_pos % chunk_size` no-op tokens (k, v,
    q = 0, beta = 0, g = 0: they leave the state unchanged and nothing attends to them).
    """
    out, s, _ = _chunk_loop(x, state, start_pos, chunk_size, set())
    return out, s


def chunk_prefill_tracked(
    x: DeltaInputs,
    state: torch.Tensor,
    start_pos: int,
    track: Sequence[int],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_prefill`, plus the states after each of the first n tokens for n in `track`
    (0 < n < L) -> [M, H, dk, dv], each as `chunk_prefill` over only those n tokens would
    leave it.

    Where start_pos + n is on the chunk grid that state is the one after a chunk of this
    run. Elsewhere, a run stopping at n ends with a partial chunk from the grid point
    before it: the same partial chunk is run again from the state there (one chunk of
    extra work per off-grid point), rather than stepping token by token, so that it is
    the stopping run's own arithmetic.
    """
    length = x.q.shape[0]
    _check_track(track, length)
    lead = start_pos % chunk_size
    # Chunks done before each point: the state there is the loop's after that many chunks.
    done_rest = [divmod(lead + n, chunk_size) for n in track]
    out, s, boundaries = _chunk_loop(x, state, start_pos, chunk_size, {d for d, _ in done_rest})
    tracked = state.new_empty((len(track), *state.shape))
    for m, (n, (done, rest)) in enumerate(zip(track, done_rest)):
        if rest == 0:
            tracked[m] = boundaries[done]
        else:
            begin = max(done * chunk_size - lead, 0)
            part = x.rows(slice(begin, n))
            _, tracked[m], _ = _chunk_loop(part, boundaries[done], start_pos + begin, chunk_size, set())
    return out, s, tracked


def _chunk_loop(
    x: DeltaInputs, state: torch.Tensor, start_pos: int, chunk_size: int, keep: set[int]
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The chunked form -> (output, final state, {i: state after the first i chunks} for
    i in `keep`; 0 is the start state). Only those are kept: all of them would be a
    state per 64 tokens, per layer."""
    length, heads, _ = x.q.shape
    lead = start_pos % chunk_size
    tail = (-(lead + length)) % chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, N, C, ...]
        t = t.movedim(0, 1)
        pad = [0, 0] * (t.dim() - 2) + [lead, tail]
        t = F.pad(t, pad)
        return t.reshape(heads, -1, chunk_size, *t.shape[2:])

    qc, kc, vc, gc, bc = (chunked(t) for t in x)
    cum = gc.cumsum(-1)  # [H, N, C]: log decay from the chunk start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i; masked before exp so it cannot overflow.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = kc * bc[..., None]
    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay))^-1 applied to the
    # beta-weighted values and to the decayed keys that read the state at the chunk start.
    system = (k_beta @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_read = qc * cum.exp()[..., None]  # queries read the start state decayed to their position
    k_write = kc * (cum[..., -1:] - cum).exp()[..., None]  # keys decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(u)
    s = state
    boundaries = {0: s} if 0 in keep else {}
    for n in range(qc.shape[1]):
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = q_read[:, n] @ s + intra[:, n] @ v_new
        s = s * chunk_decay[:, n] + k_write[:, n].transpose(-1, -2) @ v_new
        if n + 1 in keep:
            boundaries[n + 1] = s
    out = out.reshape(heads, -1, out.shape[-1])[:, lead : lead + length]
    return out.movedim(1, 0).contiguous(), s, boundaries


NATIVE = "gated_delta"  # gpu/kernels/cpu/gated_delta.cpp


def native_available(device: torch.device) -> bool:
    """Whether the C++ recurrence runs here (CPU, the kernel built)."""
    return device.type == "cpu" and cpu.load(NATIVE)


def native_varlen(
    x: DeltaInputs, states: torch.Tensor, extend_lens: Sequence[int], track: Sequence[tuple[int, int]] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_delta_varlen`'s recurrent mode in one C++ call (same arguments and results).
    The decay exp(g) is taken in torch first, through `pointwise` (a batch-invariant
    elementwise exp)."""
    if all(n == 1 for n in extend_lens):
        # A decode step: no tensor made from host values (a captured graph would freeze them;
        # the NOTE of `gated_delta_varlen`), and nothing tracked inside one token.
        starts = torch.arange(len(extend_lens) + 1)
    else:
        starts = torch.zeros(len(extend_lens) + 1, dtype=torch.int64)
        starts[1:] = torch.tensor(list(extend_lens), dtype=torch.int64).cumsum(0)
    new_states = states.contiguous().clone()
    out = torch.empty_like(x.v, memory_format=torch.contiguous_format)
    tracked = states.new_empty((len(track), *states.shape[1:]))
    pairs = torch.tensor([list(p) for p in track], dtype=torch.int64) if track else torch.empty((0, 2), dtype=torch.int64)
    q, k, v, g, beta = (t.contiguous() for t in x)
    torch.ops.tierserve_cpu.gated_delta_recurrent(q, k, v, pointwise(torch.exp, g).contiguous(), beta, new_states,
                                                  starts, out, pairs, tracked)
    return out, new_states, tracked


def gated_delta_varlen(
    x: DeltaInputs,
    states: torch.Tensor,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    recurrent: bool,
    track: Sequence[tuple[int, int]] = (),
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's flattened tokens (requests back to back, `extend_lens` each, starting at
    `prefix_lens`) from per-request states [R, H, dk, dv] -> (output [T, H, dv], states
    after each request's last token [R, H, dk, dv], tracked states [M, H, dk, dv]).

    `track`: (request r, n) pairs, 0 < n < extend_lens[r], increasing per request: the
    state after r's first n tokens, as a step that brought only those n would leave it.

    `recurrent`: every token by `recurrent_step` (deterministic mode), all requests
    advanced together one position at a time. Otherwise one-token requests are batched
    through `recurrent_step` and longer ones run `chunk_prefill`.

    `native`: the whole step through `native_varlen` instead, whatever `recurrent` says
    (it is the recurrent form), decode steps included (its arithmetic is not torch's: the
    caller picks it for every step).

    NOTE: a decode step (one token per request) is one `recurrent_step` over the inputs
    as they are, in either mode: no index tensor built from the lengths, nothing read
    back, so a captured decode graph of a hybrid model replays the step itself.
    """
    if any(not 0 < n < extend_lens[r] for r, n in track):
        raise ValueError(f"tracked points {list(track)} are not inside their chunks {list(extend_lens)}")
    if native:
        return native_varlen(x, states, extend_lens, track)
    out = torch.empty_like(x.v)
    new_states = states.clone()
    tracked = states.new_empty((len(track), *states.shape[1:]))
    starts = [0]
    for n in extend_lens:
        starts.append(starts[-1] + n)
    if recurrent:
        _recurrent_varlen(x, new_states, extend_lens, starts, out, track, tracked)
        return out, new_states, tracked
    decodes = [r for r, n in enumerate(extend_lens) if n == 1]
    if len(decodes) == len(extend_lens):
        out[:], new_states[:] = decode_step(x, states)
        return out, new_states, tracked
    if decodes:
        tok = to_device([starts[r] for r in decodes], torch.int64, x.q.device)
        req = to_device(decodes, torch.int64, x.q.device)
        o, s = recurrent_step(x.rows(tok), states[req])
        out[tok] = o
        new_states[req] = s
    for r, n in enumerate(extend_lens):
        if n > 1:
            sl = slice(starts[r], starts[r] + n)
            ms = [m for m, (tr, _) in enumerate(track) if tr == r]
            ends = [track[m][1] for m in ms]
            out[sl], new_states[r], at = chunk_prefill_tracked(x.rows(sl), states[r], prefix_lens[r], ends)
            for m, end, state in zip(ms, ends, at):
                if end == 1:
                    # A step stopping after one token runs it as a decode, not a chunk.
                    state = recurrent_step(x.rows(slice(starts[r], starts[r] + 1)), states[r : r + 1])[1][0]
                tracked[m] = state
    return out, new_states, tracked


def decode_step(x: DeltaInputs, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step of `gated_delta_varlen`: token r is request r's only token, so the
    inputs go to `recurrent_step` as they are (the NOTE of `gated_delta_varlen`)."""
    return recurrent_step(x, states)


def _recurrent_varlen(
    x: DeltaInputs,
    states: torch.Tensor,
    extend_lens: Sequence[int],
    starts: list[int],
    out: torch.Tensor,
    track: Sequence[tuple[int, int]],
    tracked: torch.Tensor,
) -> None:
    """Position t of every request that has one, as one batched `recurrent_step`; since
    that step is batch-invariant, each request gets exactly its `recurrent_prefill`
    (and a tracked state, copied after its n-th token, that of a run stopping there)."""
    device = x.q.device
    if all(n == 1 for n in extend_lens):  # nothing tracked: no point inside one token
        out[:], states[:] = decode_step(x, states)
        return
    for t in range(max(extend_lens, default=0)):
        active = [r for r, n in enumerate(extend_lens) if n > t]
        tok = to_device([starts[r] + t for r in active], torch.int64, device)
        req = to_device(active, torch.int64, device)
        o, s = recurrent_step(x.rows(tok), states[req])
        out[tok] = o
        states[req] = s
        for m, (r, n) in enumerate(track):
            if n == t + 1:
                tracked[m] = states[r]


def gated_delta_static(
    x: DeltaInputs, states: torch.Tensor, lens: torch.Tensor, steps: int, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrent form of `gated_delta_varlen` with the lengths as a device tensor (lens
    [R] int64, summing to T, each at most `steps`) -> (output [T, H, dv], states after each
    request's last token [R, ...], the state after each token [T, ...]): the static-shape
    form of a graph runner's verify bucket. Every request slot runs `steps` batched
    `recurrent_step`s; a slot past its length computes a row that is dropped (its state
    kept, its output and state written to a spare row). Nothing read back, no tensor made
    from host values: a captured graph replays it for any lengths within `steps`.

    `native` (CPU only, never captured): the C++ recurrence tracking every position,
    the arithmetic every step of such a model runs (`gated_delta_varlen`)."""
    tokens, reqs = x.q.shape[0], states.shape[0]
    if native:
        extend = [int(n) for n in lens.tolist()]
        track = [(r, n) for r, length in enumerate(extend) for n in range(1, length)]
        out, final, tracked = native_varlen(x, states, extend, track)
        picks, m = [], 0  # per token: its tracked row (in request order), a request's last its final state
        for r, length in enumerate(extend):
            if length:
                picks += list(range(m, m + length - 1)) + [len(track) + r]
                m += length - 1
        return out, final, torch.cat([tracked, final])[torch.tensor(picks, dtype=torch.int64)]
    starts = torch.cumsum(lens, 0) - lens
    spare = tokens + torch.arange(reqs, device=lens.device)  # a row of its own per slot past its length
    out = x.v.new_zeros((tokens + reqs, *x.v.shape[1:]))
    after = states.new_zeros((tokens + reqs, *states.shape[1:]))
    s = states.clone()
    for t in range(steps):
        live = lens > t
        tok = torch.where(live, starts + t, spare)
        o, s_next = recurrent_step(x.rows(tok.clamp(max=max(tokens - 1, 0))), s)
        s = torch.where(live.view(-1, *([1] * (s.dim() - 1))), s_next, s)
        out.index_copy_(0, tok, o.to(out.dtype))
        after.index_copy_(0, tok, s_next)
    return out[:tokens], s, after[:tokens]
