"""RoPE inverse-frequency tables for every rope type that transformers 5.25 serves to decoder LLMs.

Each `_compute_*` below repeats transformers' own `modeling_rope_utils._compute_*_parameters` expression
by expression (same torch ops, same order, same Python-float versus float32 steps), so that on CPU the
float32 frequencies, and the cos/sin tables built from them, are bit-identical to what the HF model
computes. Rewriting a formula into an algebraically equal form (say `inv / f` as `inv * (1 / f)`)
would break that, hence the sometimes odd-looking spelling.

Two rope types change their frequencies with the length of the forward's sequence in transformers;
a serving engine keeps one table for every position, so for those we chose (see `rope_frequencies`):
  * dynamic (NTK): the frequencies transformers uses up to `max_position_embeddings`;
  * longrope: short factors below `original_max_position_embeddings`, long factors from it, per position
    (neither transformers' nor vLLM's choice: those pick one table per forward or per deployment).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")

# Phi-3 era checkpoints name longrope "su"; transformers' Phi3Config maps it to "longrope". It also maps
# "yarn" to "longrope" for Phi-3, which is family specific and left to the caller (yarn here is real yarn).
_ALIASES = {"su": "longrope"}


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor  # float32 [rotary_dim // 2] for positions below `switch_at`
    attention_factor: float  # cos and sin are multiplied by it (yarn's mscale, longrope's factor; 1.0 otherwise)
    long_inv_freq: torch.Tensor | None = None  # longrope: the frequencies for positions >= switch_at
    switch_at: int | None = None  # longrope: original_max_position_embeddings


def _base_inv_freq(dim: int, base) -> torch.Tensor:
    # transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _compute_linear(dim: int, base, sc: dict) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(dim, base)
    inv_freq /= sc["factor"]  # in place, as transformers does
    return inv_freq, 1.0


def _compute_dynamic(dim: int, base, sc: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # transformers evaluates the NTK base at seq_len = max(seq_len, max_position_embeddings). We fix
    # seq_len = max_position_embeddings: the ratio below is 1 up to rounding, and evaluating it the same
    # way keeps even that rounding identical to transformers. (dim == 2 divides by zero there; the exact
    # answer is the plain base.)
    factor = sc["factor"]
    seq_len = max_position_embeddings
    if dim > 2:
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(dim, base), 1.0


def _yarn_get_mscale(scale=1, mscale=1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _compute_yarn(dim: int, base, sc: dict, max_position_embeddings: int,
                  original_max: int) -> tuple[torch.Tensor, float]:
    factor = sc.get("factor")
    attention_factor = sc.get("attention_factor")
    mscale = sc.get("mscale")
    mscale_all_dim = sc.get("mscale_all_dim")
    # DeepSeek-V3 style configs may leave factor out: the context ratio stands in for it
    if factor is None:
        factor = max_position_embeddings / original_max

    if attention_factor is None:
        # both must be truthy (0 or missing falls back to the plain mscale), as in transformers
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)

    # `or`: an explicit 0 (or None) means the paper's default, as in transformers
    beta_fast = sc.get("beta_fast") or 32
    beta_slow = sc.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min_, max_, dim):
        if min_ == max_:
            max_ += 0.001  # transformers' guard against a zero-width ramp
        linear_func = (torch.arange(dim, dtype=torch.float32) - min_) / (max_ - min_)
        return torch.clamp(linear_func, 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)

    truncate = sc.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max, truncate)

    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2).to(dtype=torch.float)
    inv_freq = (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )
    return inv_freq, attention_factor


def _compute_longrope(dim: int, base, sc: dict, max_position_embeddings: int,
                      original_max: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    factor = sc.get("factor")
    attention_factor = sc.get("attention_factor")
    # Phi-3 gives no factor: the ratio of the extended to the pretraining context stands in for it
    if factor is None:
        factor = max_position_embeddings / original_max
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max))

    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def table(ext):
        ext_factors = torch.tensor(ext, dtype=torch.float32)
        if ext_factors.shape != (dim // 2,):
            raise ValueError(f"longrope factors must have rotary_dim // 2 = {dim // 2} entries, got {len(ext)}")
        return 1.0 / (ext_factors * base**inv_freq_shape)

    return table(sc["short_factor"]), table(sc["long_factor"]), attention_factor


def _compute_llama3(dim: int, base, sc: dict, original_max: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(dim, base)

    factor = sc["factor"]
    low_freq_factor = sc["low_freq_factor"]
    high_freq_factor = sc["high_freq_factor"]
    old_context_len = original_max

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama, 1.0


def rope_frequencies(rotary_dim: int, theta: float, scaling: dict | None,
                     max_position_embeddings: int,
                     original_max_position_embeddings: int | None = None) -> RopeFrequencies:
    """The inverse frequencies (and cos/sin multiplier) transformers 5.25 computes for this rope config.

    rotary_dim: the rotated width, int(head_dim * partial_rotary_factor), as every transformers rope
        function computes it. (A partial_rotary_factor stored inside `scaling` is not applied here.)
    theta: the top-level rope_theta; a `rope_theta` inside `scaling` (the transformers-5 `rope_parameters`
        layout) takes precedence, as transformers' `setdefault` gives it.
    scaling: the checkpoint's `rope_scaling` / `rope_parameters` dict (or None): `rope_type` or legacy `type`.
    original_max_position_embeddings: the top-level config value. For llama3, yarn and longrope it wins
        over the one inside `scaling` (transformers' `standardize_rope_params` gives a config attribute
        priority: Phi-3 keeps it there); with neither, max_position_embeddings stands in.

    Rope types whose transformers frequencies depend on the forward's sequence length:

    * dynamic (NTK): transformers recomputes the base for the whole forward once its sequence grows past
      max_position_embeddings (theta * (factor * seq_len / max_position_embeddings - (factor - 1))
      ** (d / (d - 2))), and resets it when a shorter one follows. We serve one fixed table: the frequencies
      transformers uses for sequences up to max_position_embeddings (the unscaled ones, with transformers'
      own rounding of that ratio), so every position of such a sequence is exact. Past that length we do
      not follow transformers: its values there depend on the length of the whole sequence, which a
      table shared by every sequence, with keys kept in the KV cache, cannot follow. vLLM also serves one fixed table, and
      its base formula ((max_len / max_position_embeddings) - (factor - 1) with max_len =
      max_position_embeddings * factor) also comes to the unscaled base; it only tabulates further.
    * longrope: transformers uses long_factor for every position of a forward whose sequence is longer
      than original_max_position_embeddings, short_factor otherwise (and Phi-3's generate drops its KV
      cache when a sequence crosses that length, to recompute all of it with the long factors). We switch
      per position instead: `inv_freq` (short) below `switch_at` = original_max_position_embeddings,
      `long_inv_freq` from it, so cached keys never need recomputing. Exact to transformers for sequences
      within original_max_position_embeddings, and for the positions >= switch_at of longer ones; the
      positions below switch_at of a longer sequence keep the short factors where transformers uses the
      long ones. (vLLM does not switch per position either: older releases use the long table for every
      token of a batch that has any position > original; current ones use it for every token of every
      sequence whenever max_model_len > original.) attention_factor is transformers': sqrt(1 + ln(factor) / ln(original)) with factor =
      max_position_embeddings / original_max_position_embeddings unless given, the same for both halves.
    """
    sc = dict(scaling or {})
    rope_type = sc.get("rope_type", sc.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    base = sc.get("rope_theta", theta)

    if rope_type in ("llama3", "yarn", "longrope"):
        if original_max_position_embeddings is not None:
            original_max = original_max_position_embeddings
        else:
            original_max = sc.get("original_max_position_embeddings", max_position_embeddings)

    if rope_type == "default":
        return RopeFrequencies(_base_inv_freq(rotary_dim, base), 1.0)
    if rope_type == "linear":
        inv, att = _compute_linear(rotary_dim, base, sc)
    elif rope_type == "dynamic":
        inv, att = _compute_dynamic(rotary_dim, base, sc, max_position_embeddings)
    elif rope_type == "llama3":
        inv, att = _compute_llama3(rotary_dim, base, sc, original_max)
    elif rope_type == "yarn":
        inv, att = _compute_yarn(rotary_dim, base, sc, max_position_embeddings, original_max)
    else:
        short, long, att = _compute_longrope(rotary_dim, base, sc, max_position_embeddings, original_max)
        return RopeFrequencies(short, float(att), long_inv_freq=long, switch_at=int(original_max))
    return RopeFrequencies(inv, float(att))


def rope_tables(freqs: RopeFrequencies, max_positions: int, dtype,
                device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim] in the HF/neox layout (the half-width frequency table
    duplicated: cat((f, f), -1)), computed in float32 on CPU, times attention_factor, then cast; a
    position p uses long_inv_freq when switch_at is set and p >= switch_at.

    Same ops as the transformers rotary embedding forward (position.float() * inv_freq, cat, cos/sin,
    times the Python-float attention scaling in float32, cast last), so a CPU table equals its output.
    Computed on CPU whatever `device` is, so every device serves the same values.
    """
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    inv = freqs.inv_freq.to(device="cpu", dtype=torch.float)
    if freqs.switch_at is not None and freqs.long_inv_freq is not None:
        split = max(0, min(freqs.switch_at, max_positions))
        long = freqs.long_inv_freq.to(device="cpu", dtype=torch.float)
        table = torch.cat((pos[:split, None] * inv, pos[split:, None] * long), dim=0)
    else:
        table = pos[:, None] * inv
    emb = torch.cat((table, table), dim=-1)
    cos = emb.cos() * freqs.attention_factor
    sin = emb.sin() * freqs.attention_factor
    return cos.to(dtype=dtype).to(device), sin.to(dtype=dtype).to(device)
