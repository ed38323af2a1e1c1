"""Public randomness keyed by (request seed, sequence position, stream), and Gumbel-max sampling from it.

Legend: B batch rows (requests), K positions per row, V vocabulary, N flattened (row, position) pairs.

A request that shares its batch with others, whose draft depth changes from step to step, must not
draw its random numbers from a generator consumed in call order: what it gets would then depend on
its neighbours and on how many draws came before. Here every random number is a **pure function**
of ``(seed, position, stream, vocab index)``: the same on every call, on every device, whatever
other rows share the batch (row b's numbers depend only on row b's seed).

Streams (independent families of numbers at the same position):

- ``"sample"``: the token at a position (plain decoding, the bonus token, the ``gumbel`` rule, and a
  drafter that wants to agree with it: :func:`draft_keyed`);
- ``"accept"``: rejection sampling's acceptance uniform at a position;
- ``"residual"``: sampling the recovered token from the residual at a position;
- ``"draft"``: a drafter's own sampling, independent of the target's;
- ``"tree"``: the acceptance uniforms of a token tree's nodes (keyed by the block's root position
  and the node, :func:`specdec.verify.tree.tree_rejection_sample`);
- ``"draft_tree"``: a drafter's Gumbel noise for the children of a token tree's node (keyed by the
  tree's first draft position and the node, :mod:`specdec.drafters.eagle.tree`).

**Generator.** A counter-based hash, SplitMix64's output function (Steele, Lea and Flood 2014,
"Fast splittable pseudorandom number generators"; the finaliser of Stafford's "Mix13") in int64
torch ops. The key of ``(seed, position, stream)`` is ``mix(mix(mix(seed) + stream·C) + position·γ)``
(γ the golden-ratio increment); the number at vocab index v is ``mix(key + (v+1)·γ)``, i.e. the
SplitMix64 sequence started at that key, and the scalar uniform of a position is ``mix(key)``.
SplitMix64 passes BigCrush; two keys' sequences overlap with probability ~2V/2^64.
Why not one ``torch.Generator`` per (seed, position, stream): the CPU generator (mt19937) keeps
only the low 32 bits of its seed (``manual_seed(1)`` and ``manual_seed(1 + 2**40)`` draw the same
numbers), so hashed keys would collide after ~65,000 positions; CUDA's Philox draws different numbers
than the CPU for the same seed; and a generator cannot give the noise of 50 top-k tokens without
drawing all V. The price: a dense keyed sample hashes all V weights (int64 multiplies, which AVX2
has no instruction for), a top-k row only its k (timings: docs/randomness.md). The rules draw full-V noise
only where they need it (``exact``: one row per request and step; ``gumbel``: up to the first
mismatch). Uniforms: float64 from the top 52 bits, float32 from the
top 23 bits, both ``(m + ½)·2^-bits``, in the open interval (0, 1).

**Sampling.** :func:`sample_keyed` is Gumbel-max, ``argmax_v log w_v + G_v`` with
``G_v = −log(−log u_v)``, computed as the equivalent exponential race ``argmax_v log(u_v) / w_v``
(one logarithm instead of three, the same winner): an exact sample from ``w / Σw`` (weights need
not be normalised; a zero weight scores −∞ and is never chosen). When few weights are non-zero
(top-k, top-p, residuals) only those are hashed: the noise at a vocab index does not depend on the
others. :func:`sample_keyed_inverse` is inverse-CDF sampling with **one** keyed uniform per row (one
hash, a cumulative sum): also an exact sample, not coupled to any other draw's Gumbel noise, for a
stream nothing else reads per token (the drafters' ``"draft"``: their proposals only need to be drawn
from the distribution they report).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdec.host_sync import avoids_host
from specdec.sampling import inverse_cdf
from specdec.seeds import check_seed

__all__ = [
    "STREAMS",
    "PositionNoise",
    "sample_keyed",
    "sample_keyed_inverse",
    "sample_with_keys",
    "draft_keyed",
]

STREAMS: dict[str, int] = {"sample": 1, "accept": 2, "residual": 3, "draft": 4, "tree": 5, "draft_tree": 6}
"""Stream name -> the id mixed into the key."""


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio, odd)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
# Each stream's base offset: id · an odd constant (mod 2^64), mixed into the key.
_STREAM_SALT = {name: _signed((sid * 0xD1B54A32D192ED03) % (1 << 64)) for name, sid in STREAMS.items()}
_ONE_F64 = 0x3FF0000000000000  # the bits of 1.0 (float64), and of 1.0 (float32) below
_ONE_F32 = 0x3F800000
_LOW = {s: (1 << (64 - s)) - 1 for s in (12, 27, 30, 31, 41)}  # logical right shift = arithmetic & mask
_DENSE_CHUNK = 1 << 15  # CPU elements hashed at a time: the int64 work stays in L2 (2x faster than one pass)
_SPARSE_FRACTION = 0.125  # hash only the non-zero weights when they are at most this share


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bits (a bijection of 64-bit words); returns a new tensor."""
    z = z ^ ((z >> 30) & _LOW[30])
    z = z * _M1
    z = z ^ ((z >> 27) & _LOW[27])
    z = z * _M2
    return z ^ ((z >> 31) & _LOW[31])


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64` in place (``tmp`` is scratch of the same shape)."""
    for shift, mul in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_(_LOW[shift])
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)
    return z


def _bits_to_unit_(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Hash bits -> uniforms in (0, 1): the top 52 (float64) or 23 (float32) bits m as (m + ½)·2^-bits.

    No int64 -> float conversion (slow without AVX-512): m goes into the mantissa of a float
    in [1, 2), 1 + m·2^-bits, and subtracting 1 − 2^-(bits+1) is exact (Sterbenz). Consumes ``h``.
    """
    if dtype == torch.float64:
        h.bitwise_right_shift_(12).bitwise_and_(_LOW[12]).bitwise_or_(_ONE_F64)
        return h.view(torch.float64).sub_(1.0 - 2.0**-53)
    m = h.bitwise_right_shift_(41).bitwise_and_(_LOW[41]).to(torch.int32)
    return m.bitwise_or_(_ONE_F32).view(torch.float32).sub_(1.0 - 2.0**-24)


def _stream_salt(stream: str) -> int:
    if stream not in _STREAM_SALT:
        raise ValueError(f"stream must be one of {sorted(STREAMS)}, got {stream!r}")
    return _STREAM_SALT[stream]


def _race_scores_(u: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Exponential-race scores log(u) / w in place on ``u`` (argmax = Gumbel-max; w = 0 gives −∞)."""
    return u.log_().div_(weights)


class PositionNoise:
    """Public randomness for B rows, each keyed by its own seed (see the module doc).

    Args:
        seeds: one int per row in ``[0, 2**64)``, or an int64 tensor ``[B]`` (read as the same bits).
        device: where the numbers are made (default: the seeds' device, else CPU).

    Every method takes positions as an integer tensor whose first dim is B (``[B]``, ``[B, K]``, ...)
    and returns numbers of that shape (plus ``V``): entry ``[b, ...]`` depends only on
    ``seeds[b]``, the position there, the stream and the vocab index.
    """

    def __init__(self, seeds: Sequence[int] | torch.Tensor, *, device: Any = None) -> None:
        if isinstance(seeds, torch.Tensor):
            if seeds.ndim != 1 or seeds.dtype != torch.int64:
                raise ValueError(
                    f"seeds must be a 1-d int64 tensor or a sequence of ints, got "
                    f"{seeds.dtype} of shape {tuple(seeds.shape)}"
                )
            seeds_B = seeds.to(device) if device is not None else seeds
        else:
            values = [_signed(check_seed(s, "seeds")) for s in seeds]
            seeds_B = torch.tensor(values, dtype=torch.int64, device=device)
        self.seeds_B = seeds_B
        self._base_B = _mix64(seeds_B)  # stream-independent part of every key

    @property
    def num_rows(self) -> int:
        """B: how many rows (seeds) this noise serves."""
        return self.seeds_B.shape[0]

    @property
    def device(self) -> torch.device:
        return self.seeds_B.device

    def select(self, rows: Sequence[int] | torch.Tensor) -> PositionNoise:
        """The noise of a subset (or reordering) of the rows: row i of the result is ``rows[i]`` here."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        return PositionNoise(self.seeds_B[index])

    def check_positions(self, positions_BK: torch.Tensor) -> torch.Tensor:
        """``positions_BK`` as int64 on this device; ``ValueError`` unless integer, ``[B, ...]``, >= 0."""
        if (
            not isinstance(positions_BK, torch.Tensor)
            or positions_BK.is_floating_point()
            or positions_BK.is_complex()
            or positions_BK.dtype == torch.bool
        ):
            kind = getattr(positions_BK, "dtype", type(positions_BK).__name__)
            raise ValueError(f"positions_BK must be an integer tensor, got {kind}")
        if positions_BK.ndim < 1 or positions_BK.shape[0] != self.num_rows:
            raise ValueError(
                f"positions_BK must have the noise's B={self.num_rows} rows as its first dim, got "
                f"shape {tuple(positions_BK.shape)}"
            )
        if positions_BK.numel() and int(positions_BK.min()) < 0:
            raise ValueError(f"positions_BK must be >= 0, got min {int(positions_BK.min())}")
        return positions_BK.to(device=self.device, dtype=torch.int64)

    def keys(self, positions_BK: torch.Tensor, stream: str, *, validate: bool = True) -> torch.Tensor:
        """int64 keys of ``(seed, position, stream)``, the shape of ``positions_BK``."""
        if validate:
            positions_BK = self.check_positions(positions_BK)
        base_B = _mix64(self._base_B + _stream_salt(stream))
        base = base_B.reshape((-1,) + (1,) * (positions_BK.ndim - 1))
        return _mix64(base + positions_BK * _GAMMA)

    def uniform_BK(
        self,
        positions_BK: torch.Tensor,
        stream: str,
        *,
        dtype: torch.dtype = torch.float64,
        validate: bool = True,
    ) -> torch.Tensor:
        """One uniform in (0, 1) per ``(row, position)``: float64 (52 bits) or float32 (23 bits).
        ``validate=False`` trusts the positions (checking them reads their minimum on the host)."""
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
        return _bits_to_unit_(_mix64(self.keys(positions_BK, stream, validate=validate)), dtype)

    def uniform_BKV(self, positions_BK: torch.Tensor, V: int, stream: str) -> torch.Tensor:
        """float32 uniforms in (0, 1), ``positions_BK.shape + (V,)``: one per vocab index."""
        _check_vocab(V)
        keys_N = self.keys(positions_BK, stream).reshape(-1)
        out_NV = torch.empty((keys_N.shape[0], V), dtype=torch.float32, device=self.device)
        _vocab_uniforms(keys_N, V, out_NV)
        return out_NV.reshape(*positions_BK.shape, V)

    def gumbel_BKV(self, positions_BK: torch.Tensor, V: int, stream: str) -> torch.Tensor:
        """float32 standard Gumbel noise ``−log(−log u)``, ``positions_BK.shape + (V,)``."""
        return self.uniform_BKV(positions_BK, V, stream).log_().neg_().log_().neg_()

    def __repr__(self) -> str:
        return f"PositionNoise(num_rows={self.num_rows}, device={self.device})"


def _check_vocab(V: int) -> None:
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        raise ValueError(f"V must be an int >= 1, got {V!r}")


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(V: int, device: torch.device) -> torch.Tensor:
    """``(v + 1)·γ`` for v < V (int64, cached per device, grown as needed)."""
    have = _COUNTERS.get(device)
    if have is None or have.shape[0] < V:
        have = torch.arange(1, max(V, 1 << 16) + 1, dtype=torch.int64, device=device) * _GAMMA
        _COUNTERS[device] = have
    return have[:V]


def _row_chunks(N: int, V: int, device: torch.device) -> list[tuple[int, int]]:
    """Row ranges to hash at once: whole rows, ~_DENSE_CHUNK elements each on CPU, everything on GPU."""
    if device.type != "cpu":
        return [(0, N)]
    step = max(1, _DENSE_CHUNK // V)
    return [(r, min(r + step, N)) for r in range(0, N, step)]


def _vocab_uniforms(keys_N: torch.Tensor, V: int, out_NV: torch.Tensor) -> None:
    """Fill ``out_NV`` (float32) with the uniforms of every vocab index under each key."""
    ctr_V = _counters(V, keys_N.device)
    for r0, r1 in _row_chunks(keys_N.shape[0], V, keys_N.device):
        z = keys_N[r0:r1, None] + ctr_V
        _mix64_(z, torch.empty_like(z))
        out_NV[r0:r1] = _bits_to_unit_(z, torch.float32)


def _race_argmax(weights_NV: torch.Tensor, keys_N: torch.Tensor) -> torch.Tensor:
    """Gumbel-max (exponential race) token per row of non-negative weights under each row's key.

    Ties go to the lowest vocab id (as ``argmax``); the sparse and dense passes give the same tokens.
    On an accelerator only the dense pass runs: choosing would read a count on the host.
    """
    N, V = weights_NV.shape
    device = weights_NV.device
    if N == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if not avoids_host(weights_NV) and int(torch.count_nonzero(weights_NV)) <= _SPARSE_FRACTION * N * V:
        # Only the non-zero weights (their noise is the same as in the dense pass), then a per-row
        # argmax over those entries: the row maximum, and the lowest vocab id that reaches it.
        rows_M, vocab_M = weights_NV.nonzero(as_tuple=True)
        z = keys_N[rows_M] + _counters(V, device)[vocab_M]
        _mix64_(z, torch.empty_like(z))
        scores_M = _race_scores_(_bits_to_unit_(z, torch.float32), weights_NV[rows_M, vocab_M])
        best_N = torch.full((N,), float("-inf"), dtype=scores_M.dtype, device=device)
        best_N.scatter_reduce_(0, rows_M, scores_M, reduce="amax")
        at_best_M = torch.where(scores_M == best_N[rows_M], vocab_M, V)
        return torch.full((N,), V, dtype=torch.long, device=device).scatter_reduce_(
            0, rows_M, at_best_M, reduce="amin"
        )
    out_N = torch.empty(N, dtype=torch.long, device=device)
    ctr_V = _counters(V, device)
    chunks = _row_chunks(N, V, device)
    tmp = torch.empty((chunks[0][1] - chunks[0][0], V), dtype=torch.int64, device=device)
    for r0, r1 in chunks:
        z = keys_N[r0:r1, None] + ctr_V
        _mix64_(z, tmp[: r1 - r0])
        scores = _race_scores_(_bits_to_unit_(z, torch.float32), weights_NV[r0:r1])
        out_N[r0:r1] = scores.argmax(dim=-1)
    return out_N


def sample_keyed_inverse(
    probs_BV: torch.Tensor, noise: PositionNoise, positions_B: torch.Tensor, *, stream: str = "draft"
) -> torch.Tensor:
    """Inverse-CDF sample from each row of ``probs [B, V]`` (non-negative, positive mass; checked by
    the caller) with one keyed uniform per row, ``u = unit(mix64(key))`` of the row's (seed,
    position, stream) key (:meth:`PositionNoise.uniform_BK`); long ``[B]``:
    :func:`specdec.sampling.inverse_cdf`. A row's draw depends on its own probabilities and key only
    (batch invariant)."""
    if probs_BV.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs_BV.device)
    return inverse_cdf(probs_BV, noise.uniform_BK(positions_B, stream, validate=False).reshape(-1))


def sample_keyed(
    probs_BV: torch.Tensor,
    noise: PositionNoise,
    positions_B: torch.Tensor,
    *,
    stream: str = "sample",
    validate: bool = True,
) -> torch.Tensor:
    """Gumbel-max sample from ``probs [B, ..., V]`` keyed at ``positions [B, ...]``; long ``[B, ...]``.

    ``probs`` are processed probabilities (:func:`specdec.sampling.logits_to_probs`) or any
    non-negative weights with positive mass per row: the token is ``argmax_v log probs_v + G_v``
    with ``G = noise.gumbel_BKV(positions, V, stream)`` (computed as the equivalent race
    ``argmax log(u_v) / probs_v``), an exact sample from ``probs / Σ probs``; a zero-probability token
    is never chosen. At temperature 0 (one-hot rows) it is the argmax. Plain decoding with this
    function and ``stream="sample"`` is what the ``gumbel`` verification rule reproduces exactly.
    """
    if validate:
        if not isinstance(probs_BV, torch.Tensor) or not probs_BV.is_floating_point() or probs_BV.ndim < 2:
            raise ValueError(
                "probs_BV must be a floating-point tensor [B, ..., V], got "
                f"{getattr(probs_BV, 'dtype', type(probs_BV).__name__)} of shape "
                f"{tuple(getattr(probs_BV, 'shape', ()))}"
            )
        shape = tuple(probs_BV.shape[:-1])
        if not isinstance(positions_B, torch.Tensor) or tuple(positions_B.shape) != shape:
            raise ValueError(
                f"positions_B must have shape {shape} (probs_BV without its vocab dim), "
                f"got {tuple(getattr(positions_B, 'shape', ()))}"
            )
        if probs_BV.numel():
            # Two passes: a NaN or inf in a row makes its sum non-finite.
            sums = probs_BV.sum(dim=-1)
            if not bool(torch.isfinite(sums).all()) or float(probs_BV.amin()) < 0:
                raise ValueError("probs_BV must be finite and non-negative")
            if bool((sums <= 0).any()):
                raise ValueError("probs_BV has a row with no mass (every probability is 0)")
    keys_N = noise.keys(positions_B, stream, validate=validate).reshape(-1)
    V = probs_BV.shape[-1]
    tokens_N = _race_argmax(probs_BV.reshape(-1, V), keys_N)
    return tokens_N.reshape(probs_BV.shape[:-1])


def sample_with_keys(weights_NV: torch.Tensor, keys_N: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sample per row of non-negative ``weights [N, V]`` under each row's own key ``[N]``
    (int64, from :meth:`PositionNoise.keys`): the token :func:`sample_keyed` gives at that key, for
    rows whose keys come from different streams (keyed ``exact``'s recovered and bonus tokens in one
    call). Inputs are trusted (no checks)."""
    return _race_argmax(weights_NV, keys_N)


def draft_keyed(
    draft_probs_BV: torch.Tensor, noise: PositionNoise, positions_B: torch.Tensor, *, validate: bool = True
) -> torch.Tensor:
    """A drafter's token drawn with the target's own public noise (stream ``"sample"``).

    ``argmax log draft_probs + G(seed, position, "sample")``: still an exact sample from
    ``draft_probs``, but coupled with the target's keyed sample at the same position (Daliri, Musco
    and Suresh, arXiv 2408.07978): under the ``gumbel`` rule a draft is accepted iff it equals that
    sample, which happens with probability ≥ (1 − TV) / (1 + TV) instead of Σ draft·target for an
    independent draw. A drafter that draws this way keeps ``exact`` (rejection sampling) exact too,
    since that rule's acceptance and residual use the other streams. Never draw drafts from the
    ``"accept"`` or ``"residual"`` streams.
    """
    return sample_keyed(draft_probs_BV, noise, positions_B, stream="sample", validate=validate)
