"""Vectorized next-token sampling for a batch of rows with per-row parameters.

`SamplingBatch.build` turns per-request parameters into tensors once per step, creating
only what some row needs, so the common case (all greedy, no penalties, no logprobs) is
one argmax.

Logprobs are computed only for the rows that ask for them (`logprob_rows`), from the
model distribution after `logit_bias` (as OpenAI reports them) and the grammar mask of
structured outputs (gpu/grammar_mask.py: the constrained distribution) but before
penalties, temperature or truncation: a log_softmax over those rows only. The other rows
report NaN (never a plausible value: a logprob nobody asked for must not pass for one).
Only a batch with a biased row pays for the bias (one scatter_add over its entries), and
only one with a constrained row for the mask.

Random draws are a pure function of (seed, step) per row: a counter-based hash of
(row key, token id) gives each token its own uniform number, so a row draws the same
token whatever the batch size, row order or device (CPU and CUDA compute identical
noise bits), and a request recomputed after retraction repeats its draws exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from gpu import rejection
from gpu.draw_keys import accept_uniform, mix_seed
from gpu.grammar_mask import TokenMask, TokenMasker, apply_token_mask, build_token_mask
from gpu.kernels import cpu
from gpu.ranked_top import ranked_top
from gpu.readback import HostCopy, Pending
from gpu.upload import to_device

# Below this temperature logits/T overflows float32; such rows are treated as greedy.
_MIN_TEMPERATURE = 1e-5
_MASK32 = 0xFFFFFFFF
NATIVE_ARGMAX = "sampling"  # gpu/kernels/cpu/sampling.cpp


class SamplingSettings(Protocol):
    """The per-row settings the sampler reads (gpu.forward_batch.SamplingRow has them;
    so does the API-level SamplingParams, which tests pass directly)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def top_logprobs_num(self) -> int: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    token_tensor: torch.Tensor | None = None  # token_ids, still on the device


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    # In place (x * c) mod 2^32 for int64 x in [0, 2^32) without signed overflow: a
    # constant >= 2^31 is used as c - 2^32 (same low 32 bits), so |x * c| < 2^63.
    return x.mul_(c - (1 << 32) if c >= 1 << 31 else c).bitwise_and_(_MASK32)


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """In place lowbias32, a strong 32-bit integer mixer, over int64 values in [0, 2^32)."""
    x ^= x >> 16
    _mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    _mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def gumbel_noise(keys: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(keys), V] float32 Gumbel noise; row r depends only on keys[r].

    Integer ops give the same bits on every device, and in-place ops keep the cost to a
    few passes over an int64 [R, V] buffer (a few ms for 8 x 49k on one CPU core).
    """
    # Split in Python: a 64-bit key does not fit a signed int64 tensor.
    halves = to_device([[k & _MASK32, k >> 32] for k in keys], torch.int64, device)
    bits = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0) ^ halves[:, :1]
    _hash32_(bits)
    bits ^= halves[:, 1:]
    _hash32_(bits)
    # Exponential noise E = -log(1 - v). Building v near 0 (not u = 1 - v near 1) keeps E
    # finely resolved where the winning token's E lies, so near-uniform rows over a large
    # vocabulary do not tie; the clamp keeps v < 1 after float32 rounding.
    v = bits.to(torch.float32).add_(0.5).mul_(2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return v.neg_().log1p_().neg_().log_().neg_()


@dataclass
class SamplingBatch:
    size: int
    vocab_size: int
    # Rows drawn at random (the rest are greedy) and their per-row settings, [R, 1].
    random_rows: torch.Tensor | None = None
    draw_keys: list[int] | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    log_min_p: torch.Tensor | None = None
    # Penalties over all rows, [B, 1], with their token statistics, [B, V].
    repetition_penalty: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    # logit_bias of every biased row, flattened: flat indices row * V + id, and biases.
    bias_index: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Structured outputs: the allowed-token bitmask of the constrained rows.
    token_mask: TokenMask | None = None
    top_logprobs_nums: tuple[int, ...] = ()
    # Rows whose logprobs are reported (None: every row), as indices.
    logprob_rows: torch.Tensor | None = None
    logprob_row_ids: tuple[int, ...] = ()
    # Argmax by the C++ op (gpu/kernels/cpu/sampling.cpp): same indices, CPU only.
    native_argmax: bool = False
    # Speculative verify rows that test a drafted token by rejection sampling (gpu/rejection.py).
    tests: rejection.Tests | None = None
    # Every row plain greedy (`plain_greedy`, no grammar): its token is its logits' argmax.
    plain_greedy: bool = False

    @property
    def all_greedy(self) -> bool:
        return self.random_rows is None

    @property
    def any_penalty(self) -> bool:
        return self.repetition_penalty is not None or self.output_counts is not None

    @property
    def picks_only(self) -> bool:
        """Only each row's token is read: plain greedy rows, and random rows drawn by their
        temperature alone (`plain_draw`): what a decode run picks in-step."""
        return self.plain_greedy or (
            not self.logprob_row_ids and not self.any_penalty and self.bias_index is None and self.token_mask is None
            and self.top_k is None and self.top_p is None and self.log_min_p is None and self.tests is None)

    @classmethod
    def build(cls, params: Sequence[SamplingSettings], seeds: list[int], steps: list[int],
              prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device, maskers: Sequence[TokenMasker | None] = (),
              want_logprobs: Sequence[bool] | None = None, native_argmax: bool = False) -> SamplingBatch:
        """maskers: per row, the grammar constraining it (or None); empty: no row is.
        want_logprobs: per row, whether it reports logprobs (None: every row does; a row
        asking for top logprobs always does). native_argmax: see `native_argmax_ready`."""
        n = len(params)
        if not n == len(seeds) == len(steps) == len(prompt_ids) == len(output_ids) or len(maskers) not in (0, n):
            raise ValueError("SamplingBatch.build: per-row lists differ in length")
        if want_logprobs is not None and len(want_logprobs) != n:
            raise ValueError("SamplingBatch.build: per-row lists differ in length")
        if not maskers and all(plain_greedy(p, want_logprobs is not None and not want_logprobs[i])
                               for i, p in enumerate(params)):
            # The common case, built without a tensor: every field the helpers below set stays unset.
            return cls(size=n, vocab_size=vocab_size, top_logprobs_nums=(0,) * n, native_argmax=native_argmax,
                       plain_greedy=True)
        batch = cls(size=n, vocab_size=vocab_size,
                    top_logprobs_nums=tuple(p.top_logprobs_num for p in params), native_argmax=native_argmax)
        batch._set_logprob_rows(params, want_logprobs, device)
        batch._set_random(params, seeds, steps, device)
        batch._set_penalties(params, prompt_ids, output_ids, device)
        batch._set_bias(params, device)
        batch.token_mask = build_token_mask(maskers, vocab_size, device)
        return batch

    def _set_logprob_rows(self, params: Sequence[SamplingSettings], want: Sequence[bool] | None,
                          device: torch.device) -> None:
        rows = tuple(i for i, p in enumerate(params) if want is None or want[i] or p.top_logprobs_num)
        self.logprob_row_ids = rows
        if len(rows) < self.size:
            self.logprob_rows = to_device(rows, torch.int64, device)

    def _set_bias(self, params: Sequence[SamplingSettings], device: torch.device) -> None:
        pairs = [(r * self.vocab_size + t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
        if not pairs:
            return
        if any(not 0 <= t < self.vocab_size for p in params for t, _ in p.logit_bias):
            raise ValueError(f"logit_bias token id outside the vocabulary [0, {self.vocab_size})")
        self.bias_index = to_device([i for i, _ in pairs], torch.int64, device)
        self.bias_values = to_device([b for _, b in pairs], torch.float32, device)

    def _set_random(self, params: Sequence[SamplingSettings], seeds: list[int], steps: list[int],
                    device: torch.device) -> None:
        rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if not rows:
            return
        chosen = [params[i] for i in rows]
        self.random_rows = to_device(rows, torch.int64, device)
        self.draw_keys = [mix_seed(seeds[i], steps[i]) for i in rows]
        self.temperature = _column([p.temperature for p in chosen], device)
        if any(p.top_k > 1 for p in chosen):
            ks = [p.top_k if p.top_k > 0 else self.vocab_size for p in chosen]
            self.top_k = to_device(ks, torch.int64, device).unsqueeze(1)
        if any(p.top_p < 1.0 for p in chosen):
            # 2.0 for untruncated rows so float rounding in the cumsum never cuts their tail.
            self.top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in chosen], device)
        if any(p.min_p > 0.0 for p in chosen):
            self.log_min_p = torch.log(_column([p.min_p for p in chosen], device))
        tested = [(k, i) for k, i in enumerate(rows) if getattr(params[i], "draft_token", -1) >= 0]
        if tested:
            self.tests = rejection.Tests.build(
                [k for k, _ in tested], [getattr(params[i], "draft_token", -1) for _, i in tested],
                [accept_uniform(seeds[i], steps[i]) for _, i in tested],
                [getattr(params[i], "draft_q", None) for _, i in tested], self.vocab_size, device)

    def _set_penalties(self, params: Sequence[SamplingSettings], prompt_ids: Sequence[Sequence[int]],
                       output_ids: Sequence[Sequence[int]], device: torch.device) -> None:
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            self.repetition_penalty = _column([p.repetition_penalty for p in params], device)
            seen = [[*prompt_ids[i], *output_ids[i]] for i in rep_rows]
            self.seen_mask = self._count(rep_rows, seen, device) > 0
        freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        if freq_rows:
            self.frequency_penalty = _column([p.frequency_penalty for p in params], device)
            self.presence_penalty = _column([p.presence_penalty for p in params], device)
            self.output_counts = self._count(freq_rows, [output_ids[i] for i in freq_rows], device)

    def _count(self, rows: list[int], ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """[B, V] float32 token counts for the given rows (zeros elsewhere)."""
        counts = torch.zeros(self.size, self.vocab_size, dtype=torch.float32, device=device)
        flat = [r * self.vocab_size + t for r, row_ids in zip(rows, ids) for t in row_ids]
        if flat:
            index = to_device(flat, torch.int64, device)
            counts.view(-1).scatter_add_(0, index, torch.ones(len(flat), device=device))
        return counts


def is_greedy(p: SamplingSettings) -> bool:
    return p.temperature < _MIN_TEMPERATURE or p.top_k == 1


def plain_greedy(p: SamplingSettings, no_logprobs: bool) -> bool:
    """A greedy row that reports no logprobs and has no penalty or bias: its token is the argmax."""
    return is_greedy(p) and _token_only(p, no_logprobs)


def plain_draw(p: SamplingSettings, no_logprobs: bool) -> bool:
    """A random row whose draw reads only its temperature (no top-k, top-p or min-p cut),
    reporting no logprobs, with no penalty or bias: a decode run draws its tokens in-step."""
    return (not is_greedy(p) and p.top_k < 1 and p.top_p >= 1.0 and p.min_p <= 0.0
            and _token_only(p, no_logprobs))


def _token_only(p: SamplingSettings, no_logprobs: bool) -> bool:
    return (no_logprobs and not p.top_logprobs_num and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty)


class RunRow(SamplingSettings, Protocol):
    """A row's settings and its draw's (seed, step): gpu.forward_batch.SamplingRow."""

    @property
    def seed(self) -> int: ...
    @property
    def step(self) -> int: ...


def run_draws(rows: Sequence[RunRow], steps: int, vocab_size: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode run's draws (gpu/graphs/cpu_step.py `replay_run`): each row's temperature
    (float32 [B], 0 on a greedy row) and Gumbel noise (float32 [steps, B, V]; zeros on a
    greedy row), at run step s the noise `_draw` gives the row at its step + s. Empty
    tensors when every row is greedy. NOTE: the same keys (mix_seed(seed, step + s)) and
    the same `gumbel_noise`, whose rows depend on their keys alone, so a run draws the
    tokens its steps one at a time would."""
    drawn = [b for b, r in enumerate(rows) if not is_greedy(r)]
    if not drawn:
        return torch.empty(0), torch.empty(0)
    keys = [mix_seed(rows[b].seed, rows[b].step + s) for s in range(steps) for b in drawn]
    noise = torch.zeros(steps, len(rows), vocab_size, device=device)
    noise[:, drawn] = gumbel_noise(keys, vocab_size, device).view(steps, len(drawn), vocab_size)
    temperature = to_device([0.0 if is_greedy(r) else r.temperature for r in rows], torch.float32, device)
    return temperature, noise


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Pick one token per row of `logits` [B, V]; the input tensor is not modified."""
    return sample_on_device(logits, batch).finish()


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
    """`sample`'s device work, with the copies of its results to the host started; no
    host<->device synchronization (`finish()` reads the results back)."""
    if logits.shape != (batch.size, batch.vocab_size):
        raise ValueError(f"logits shape {tuple(logits.shape)} != {(batch.size, batch.vocab_size)}")
    logits = apply_token_mask(apply_bias(logits.float(), batch), batch.token_mask)
    scores = apply_penalties(logits, batch)
    tokens = argmax_rows(scores, batch.native_argmax) if batch.all_greedy else _draw(scores, batch)
    if not batch.logprob_row_ids:  # the common case: nobody asked, no log_softmax at all
        return DeviceSample(batch, tokens, HostCopy(tokens))
    rows = batch.logprob_rows
    asked = logits if rows is None else logits.index_select(0, rows)
    logprobs = torch.log_softmax(asked, dim=-1)
    chosen = logprobs.gather(1, (tokens if rows is None else tokens[rows]).unsqueeze(1)).squeeze(1)
    # One device->host copy for both lists (float64 holds any token id exactly).
    both = HostCopy(torch.cat([tokens.double(), chosen.double()]))
    return DeviceSample(batch, tokens, both, _top_logprobs(logprobs, batch))


def picked_sample(tokens: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
    """`sample_on_device`'s result for a plain-greedy batch whose argmax was already taken
    (tokens [B] int64: the native CPU decode step picks it inside the step), or whose
    decode run picked [B, k] (k tokens a row, each row's in order: gpu/graphs/cpu_step.py)."""
    if not (batch.plain_greedy or (batch.picks_only and tokens.dim() == 2)) or tokens.dim() not in (1, 2) \
            or tokens.shape[0] != batch.size:
        raise ValueError("picked tokens stand for a plain-greedy batch's sampling (or a decode run's), "
                         "one (or one run) per row")
    if tokens.dim() == 2:  # a run: row b's k tokens are sampling rows b * k .. b * k + k - 1
        tokens = tokens.reshape(-1)
        batch = dataclasses.replace(batch, size=tokens.numel(), top_logprobs_nums=(0,) * tokens.numel())
    return DeviceSample(batch, tokens, HostCopy(tokens))


class DeviceSample(Pending):
    """Sampled tokens on the device, their copies to the host under way."""

    def __init__(self, batch: SamplingBatch, tokens: torch.Tensor, host: HostCopy, top: HostCopy | None = None) -> None:
        self.batch = batch
        self.tokens = tokens
        self.host = host  # the token ids, then (if any row asked) the chosen logprobs
        self.top = top  # top-logprob values and ids of the rows that report them

    def finish(self) -> SampleResult:
        batch, n = self.batch, self.batch.size
        (host,) = self.host.get()
        values = host.tolist()
        if not batch.logprob_row_ids:
            return SampleResult(values, [math.nan] * n, [[] for _ in range(n)], self.tokens)
        chosen_all = [math.nan] * n
        for r, lp in zip(batch.logprob_row_ids, values[n:]):
            chosen_all[r] = lp
        return SampleResult([int(t) for t in values[:n]], chosen_all, self._top_lists(), self.tokens)

    def _top_lists(self) -> list[list[tuple[int, float]]]:
        batch = self.batch
        tops: list[list[tuple[int, float]]] = [[] for _ in range(batch.size)]
        if self.top is None:
            return tops
        values, ids = self.top.get()
        host_values, host_ids = values.tolist(), ids.tolist()
        for i, r in enumerate(batch.logprob_row_ids):
            n = batch.top_logprobs_nums[r]
            tops[r] = list(zip(host_ids[i][:n], host_values[i][:n]))
        return tops


def native_argmax_ready(cpu_kernels: bool, device: torch.device) -> bool:
    """Whether greedy picks may run the C++ argmax (gpu/kernels/cpu/sampling.cpp): the
    CPU kernels allowed (model.cpu_kernels; an argmax is exact, so deterministic mode too) and built."""
    return cpu_kernels and device.type == "cpu" and cpu.load(NATIVE_ARGMAX)


def argmax_rows(scores: torch.Tensor, native: bool = False) -> torch.Tensor:
    """The first index of each row's maximum, as `argmax(dim=-1)` gives it (the first of
    tied values; a row's first NaN where it has one).

    native: run the C++ op on a contiguous float32 CPU tensor (see `native_argmax_ready`);
    it returns the same indices ~10x faster than torch's reduction over a 49k vocabulary.
    NOTE: `max(dim)` returns the same index as `argmax` and on CPU runs ~3x faster than it.
    """
    if native and scores.dtype == torch.float32 and scores.dim() == 2 and scores.size(1) > 0:
        return torch.ops.tierserve_cpu.sampling_argmax(scores.contiguous())  # type: ignore[no-any-return]
    return scores.max(dim=-1).indices


def apply_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits + each row's logit_bias (a new tensor when there is one: the input stays)."""
    if batch.bias_index is None or batch.bias_values is None:
        return logits
    biased = logits.clone(memory_format=torch.contiguous_format)
    biased.view(-1).index_add_(0, batch.bias_index, batch.bias_values)
    return biased


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF style, prompt+output) then frequency/presence (OpenAI style, output)."""
    if not batch.any_penalty:
        return logits
    if batch.repetition_penalty is not None and batch.seen_mask is not None:
        rp = batch.repetition_penalty
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(batch.seen_mask, penalized, logits)
    counts = batch.output_counts
    if counts is not None and batch.frequency_penalty is not None and batch.presence_penalty is not None:
        logits = logits - batch.frequency_penalty * counts - batch.presence_penalty * (counts > 0).float()
    return logits


def _draw(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Greedy argmax for every row, overwritten by a random draw on the random rows (on
    those that test a drafted token, the rejection rule's token: gpu/rejection.py)."""
    assert batch.random_rows is not None and batch.draw_keys is not None
    tokens = argmax_rows(scores, batch.native_argmax)
    rows = tempered(scores.index_select(0, batch.random_rows), batch)
    noise = gumbel_noise(batch.draw_keys, batch.vocab_size, scores.device)
    # Gumbel-max: argmax(log p + G) is an exact draw from softmax(rows).
    drawn = argmax_rows(rows + noise, batch.native_argmax)
    tests = batch.tests
    if tests is not None:
        drawn[tests.rows] = rejection.settle(rows[tests.rows], noise[tests.rows], tests)
    tokens[batch.random_rows] = drawn
    return tokens


def draw_drafts(logits: torch.Tensor, params: Sequence[SamplingSettings],
                uniforms: list[float]) -> tuple[list[int], list[torch.Tensor]]:
    """A draft model's draws under rejection-sampling acceptance (gpu/rejection.py): each
    row's token drawn from q, its logits over the temperature and truncated as the row's
    top-k / top-p / min-p say, by inverse CDF at its uniform (gpu.draw_keys.draft_uniform:
    one number, not a vocabulary of noise, since a draft step is one row's few ms); and q,
    float32 [V]. Penalties, bias and grammar are left out: any q keeps the target's
    distribution, they would only bring q closer to it. Every row must draw at random."""
    n, vocab = logits.shape
    batch = SamplingBatch(size=n, vocab_size=vocab)
    batch._set_random(params, [0] * n, [0] * n, logits.device)
    q = torch.softmax(tempered(logits, batch), dim=-1)
    cdf = q.double().cumsum(dim=-1)
    at = torch.tensor(uniforms, dtype=torch.float64, device=logits.device).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, at, right=True).squeeze(1).clamp_(max=vocab - 1)
    return [int(t) for t in tokens.tolist()], list(q.unbind(0))


def tempered(rows: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The random rows' scores as their draw reads them: over the temperature, truncated."""
    assert batch.temperature is not None
    return _truncate(rows / batch.temperature, batch)


def _truncate(rows: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask to -inf what top_k, then top_p, then min_p remove (the top token always stays)."""
    if batch.top_k is not None or batch.top_p is not None:
        ordered, order = rows.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if batch.top_k is not None:
            rank = torch.arange(rows.shape[1], device=rows.device).unsqueeze(0)
            drop = rank >= batch.top_k
            ordered = ordered.masked_fill(drop, float("-inf"))
        if batch.top_p is not None:
            probs = torch.softmax(ordered, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = drop | (mass_before >= batch.top_p)
        rows = rows.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if batch.log_min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p); no softmax needed.
        floor = rows.max(dim=-1, keepdim=True).values + batch.log_min_p
        rows = rows.masked_fill(rows < floor, float("-inf"))
    return rows


def _top_logprobs(logprobs: torch.Tensor, batch: SamplingBatch) -> HostCopy | None:
    """logprobs: [len(batch.logprob_row_ids), V], the rows that report them -> the top
    values and ids of each (as many as the row asking most wants), on their way to the host."""
    most = max((batch.top_logprobs_nums[r] for r in batch.logprob_row_ids), default=0)
    if most == 0:
        return None
    values, ids = ranked_top(logprobs, min(most, batch.vocab_size))  # NOTE: a row's list whatever `most` is
    return HostCopy(values, ids)
