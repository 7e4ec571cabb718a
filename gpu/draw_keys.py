"""The keys of random draws: 64-bit integers, pure functions of a row's (seed, step).

gpu/sampling.py turns a key into Gumbel noise over the vocabulary; gpu/rejection.py salts
the key apart for the two other draws a speculative verify step makes (a draft model's own
draw, and the uniform that decides whether a draft is kept), so the three are independent.
"""

from __future__ import annotations

_MASK64 = 0xFFFFFFFFFFFFFFFF
_ACCEPT_SALT = 0x5EC7ACCEB7ED0001
_DRAFT_SALT = 0x5EC7D4AF7ED00002


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, step: int) -> int:
    """64-bit key for one draw; two splitmix rounds decorrelate neighbouring seeds and steps."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def accept_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that decides whether step `step`'s drafted token is kept."""
    return (_splitmix64(mix_seed(seed, step) ^ _ACCEPT_SALT) >> 11) * 2.0**-53


def draft_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) by which a draft model draws the token at step `step`
    (gpu.sampling.draw_drafts: inverse CDF)."""
    return (_splitmix64(mix_seed(seed, step) ^ _DRAFT_SALT) >> 11) * 2.0**-53
