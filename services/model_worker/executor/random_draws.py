"""Counter-based random draws: each value a pure function of (seed, counter, stream, token id).

A draw never depends on a generator's state, on the batch, on a row's position in it or on the batch
size, so a seeded sequence draws the same tokens alone or in any batch, and a stream can resume on
another worker from its seed and its output length alone.

  seed     a sequence's 64-bit seed: the request's, else a random one (engine/sequence.py).
  counter  the index of the output token the draw is for (tokens still in flight counted).
  stream   the kind of draw, so that no two draws of a sequence share (seed, counter, stream):
             SAMPLE    the sampler's draw of a token; also speculative decoding's bonus token after every
                       proposal was accepted (the draw a plain step would make for that token),
             ACCEPT    the rejection sampler's uniform for the proposal at that index,
             RESIDUAL  its draw from the residual distribution after rejecting that proposal,
             DRAFT     the draft model's proposal for that index.
           Proposals discarded after a rejection are drawn again, with the same values, when the
           next step proposes for those indices: nothing emitted depended on them.
  token    the vocabulary id a value belongs to (the exponential race draws one value per token).

The hash, on int64 tensors holding 32-bit values: the seed becomes two 32-bit words (s0, s1) by
SplitMix64's output function (exact Python integers, once per seed); a row's key is
k_i = lowbias32(s_i ^ w) with w = (counter * NUM_STREAMS + stream) mod 2**32; a token's value is
h = lowbias32(lowbias32(token ^ k0) ^ k1), whose top 23 bits m give u = (2m + 1) / 2**24 in (0, 1),
exact in float32, and the exponential variate -log(u). lowbias32 is C. Wellons' 32-bit integer hash
(hash-prospector); every product in it is a 32-bit value times a constant of magnitude below 2**31
(0x846ca68b is used as 0x846ca68b - 2**32, equal mod 2**32), so nothing overflows int64 and every
device computes the same uniforms. A C kernel on the CPU (kernels/random_draws.c) and a Triton kernel on a
GPU (kernels/triton_random_draws.py) compute them in one pass; the variates' logs may differ in the last bit
between the kernels and the torch path, which is the reference and the fallback.
"""
from __future__ import annotations

import functools
import logging
import random

import torch

from services.model_worker.executor.transfer import upload
from services.model_worker.kernels import cpu_argmax, cpu_random_draws

SAMPLE, ACCEPT, RESIDUAL, DRAFT = range(4)
NUM_STREAMS = 4

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
# Elements hashed per pass by the torch path: on a CPU a block that stays in cache between its ~25 passes; on a
# GPU a bound on the int64 temporaries (two of 128 MiB).
_BLOCK = {"cpu": 1 << 15}
_DEVICE_BLOCK = 1 << 24
_SYSTEM_RANDOM = random.SystemRandom()
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1 << 16)
def seed_words(seed: int) -> tuple[int, int]:
    """The seed's two 32-bit words: SplitMix64's first output for it (a bijection of 64-bit seeds)."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & _MASK32, z >> 32


def draw_words(draws: list[tuple[int, int] | None], stream: int, device: torch.device) -> torch.Tensor:
    """(R, 3) int64 rows (s0, s1, w) for each row's (seed, counter) in `stream`, in one copy to the device.
    A row without a key (None) gets a fresh seed: an unseeded draw that nothing needs to repeat."""
    if None in draws:
        draws = [draw if draw is not None else (fresh_seed(), 0) for draw in draws]
    if draws:
        seeds, counters = zip(*draws)
        words = cpu_random_draws.words(seeds, counters, stream, NUM_STREAMS)
        if words is not None:
            return upload(words, device)
    return upload(_words_reference(draws, stream), device)


def _words_reference(draws: list[tuple[int, int]], stream: int) -> torch.Tensor:
    """draw_words's rows in Python: the reference for the kernel, and the path for what it does not take."""
    words = []
    for draw in draws:
        seed, counter = draw
        words += seed_words(seed & _MASK64)
        words.append((counter * NUM_STREAMS + stream) & _MASK32)
    return torch.tensor(words, dtype=torch.long).view(-1, 3)


def fresh_seed() -> int:
    """A 64-bit seed from the operating system's random source, for a sequence whose request gave none."""
    return _SYSTEM_RANDOM.getrandbits(64)


def exponential(words: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, W) float32 Exp(1) variates -log(u) for each row's words and token ids ((W,) shared by every row,
    or (R, W))."""
    ids = token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(0)
    out = _kernel_draw(words, ids, exponential=True)
    return out if out is not None else uniform_reference(words, ids).log_().neg_()


def race(candidates: torch.Tensor, words: torch.Tensor, token_ids: torch.Tensor | None,
         temperature: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) int64: each row's column of argmax_t exp(x_t - max) / E_t, the exponential race over x = candidates /
    temperature ((R, W), -inf where masked out; temperature (R, 1) float32 or None for none), with E_t the variate
    of the row's words for token_ids[.., t] ((W,) or (R, W); None: the column is the token id). exp(x - max) is
    each token's probability times the row's normalizer, which does not move the argmax. One pass in C on the CPU;
    the same arithmetic in torch elsewhere (its exp may differ from the kernel's in the last bit)."""
    if candidates.device.type == "cpu":
        ids = None if token_ids is None else token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(0)
        out = cpu_random_draws.race(candidates, words, ids, temperature)
        if out is not None:
            return out
    x = candidates.float() if temperature is None else candidates / temperature
    if token_ids is None:
        token_ids = torch.arange(x.shape[1], device=x.device)
    weights = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return cpu_argmax.argmax(weights.div_(exponential(words, token_ids)))  # the lowest column among equal maxima


def uniform(words: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, W) float32 uniforms in (0, 1), as exponential() takes them."""
    ids = token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(0)
    out = _kernel_draw(words, ids, exponential=False)
    return out if out is not None else uniform_reference(words, ids)


def _kernel_draw(words: torch.Tensor, ids: torch.Tensor, exponential: bool) -> torch.Tensor | None:
    """The one-pass kernel's values (C on the CPU, Triton on a GPU); None where neither runs."""
    if words.device.type == "cpu":
        return cpu_random_draws.draw(words, ids, exponential)
    if words.device.type == "cuda" and _triton_agrees(words.device):
        from services.model_worker.kernels import triton_random_draws  # imports triton: CUDA hosts only
        return triton_random_draws.draw(words, ids, exponential)
    return None


@functools.cache
def _triton_agrees(device: torch.device) -> bool:
    """Whether the Triton kernel gives the torch path's uniforms on this device: checked once, at its first
    draw (one read of the device), so that a kernel this GPU compiles differently is never used."""
    from services.model_worker.kernels import triton_random_draws
    if not triton_random_draws.available():
        return False
    words = draw_words([(0, 0), (2 ** 64 - 1, 2 ** 20), (12345, 7)], RESIDUAL, device)
    ids = torch.arange(3000, device=device).unsqueeze(0)
    try:
        agrees = torch.equal(triton_random_draws.draw(words, ids, False), uniform_reference(words, ids))
    except Exception as e:  # a compiler error, of whichever type this Triton raises
        log.warning("random draws: the Triton kernel does not run here (%s); using the torch path", e)
        return False
    if not agrees:
        log.warning("random draws: the Triton kernel's values differ from the torch path's; using the torch path")
    return agrees


def uniform_reference(words: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The uniforms in torch integer ops, block by block (any device); ids: (1 or R, W) int64."""
    rows, width = words.shape[0], ids.shape[1]
    out = torch.empty(rows, width, device=words.device)
    if rows == 0 or width == 0:
        return out
    keys = words[:, :2] ^ words[:, 2:]
    keys = lowbias32_(keys, torch.empty_like(keys))
    block = _BLOCK.get(words.device.type, _DEVICE_BLOCK)
    col_step = min(width, block)
    row_step = min(rows, max(1, block // width))
    x = torch.empty(row_step, col_step, dtype=torch.long, device=words.device)
    tmp = torch.empty_like(x)
    for r in range(0, rows, row_step):
        r_end = min(rows, r + row_step)
        k0, k1 = keys[r:r_end, :1], keys[r:r_end, 1:]
        for c in range(0, width, col_step):
            c_end = min(width, c + col_step)
            xb, tb = x[:r_end - r, :c_end - c], tmp[:r_end - r, :c_end - c]
            torch.bitwise_xor(ids[r:r_end, c:c_end] if ids.shape[0] > 1 else ids[:, c:c_end], k0, out=xb)
            lowbias32_(xb, tb).bitwise_xor_(k1)
            lowbias32_(xb, tb)
            # The top 23 bits m as 2m + 1 (exact in float32): u = (2m + 1) / 2**24 lies in (0, 1), never 0 or 1.
            xb.bitwise_right_shift_(8).bitwise_or_(1)
            out[r:r_end, c:c_end].copy_(xb).mul_(2.0 ** -24)
    return out


def lowbias32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 of int64 values in [0, 2**32), in place; tmp: scratch of x's shape."""
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp).mul_(_MUL1).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    x.bitwise_xor_(tmp).mul_(_MUL2).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=tmp)
    return x.bitwise_xor_(tmp)
