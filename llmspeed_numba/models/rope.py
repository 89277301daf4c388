"""Rotary-embedding tables of a model config: inverse frequencies (with Llama 3's scaling) and
the ``(max_position, head_dim)`` cos / sin cache that ``rotary_embedding`` reads.

The cache is computed the way transformers computes it (float32 angles, cos / sin rounded to the
model dtype), so rotated queries and keys round like the reference model's.
"""

import math


def inverse_frequencies(config):
    """float32 tensor (head_dim // 2,) of the rotary frequencies, after ``rope_scaling``."""
    import torch

    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise NotImplementedError(f"rope_scaling: type {rope_type!r} is not supported; "
                                  f"expected None, 'default' or 'llama3'")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(config, max_position, dtype, device):
    """``(max_position, head_dim)`` table: cos of the angles, then sin (``rotary_embedding``'s
    ``cos_sin_cache`` layout), in ``dtype`` on ``device``."""
    import torch

    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_position, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return table.to(dtype).to(device).contiguous()
