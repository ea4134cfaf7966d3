"""Release composer checkpoints load into the Flax compressor (release parity item 6).

A torch port of the release's compressor (docs/method.md, "Compressor": Perceiver-resampler
block shared over depth iterations, feed-forward without bias) is written here, randomly initialized, and
its state dict imported with lopd_jax.method.compressor_import; both give the same latents on a
padded batch (<= 1e-5).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

from lopd_jax.method.compressor import Compressor
from lopd_jax.method.compressor_import import load_release_compressor, release_compressor_params

D, HEADS, K, DEPTH, FF = 16, 4, 5, 3, 4


class TorchAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm_media, self.norm_latents = nn.LayerNorm(d), nn.LayerNorm(d)
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_kv = nn.Linear(d, 2 * d, bias=False)
        self.to_out = nn.Linear(d, d, bias=False)

    def forward(self, media, latents, key_mask):
        n, k, d = latents.shape
        x, lat = self.norm_media(media), self.norm_latents(latents)
        kv_in = torch.cat([x, lat], 1)
        q = self.to_q(lat).view(n, k, self.heads, self.hd) * self.hd ** -0.25
        key, val = self.to_kv(kv_in).chunk(2, dim=-1)
        key = key.reshape(n, -1, self.heads, self.hd) * self.hd ** -0.25
        val = val.reshape(n, -1, self.heads, self.hd)
        s = torch.einsum("nqhd,nkhd->nhqk", q, key)  # (the release softmaxes in fp32; float64 here)
        s = s.masked_fill(~key_mask[:, None, None, :], torch.finfo(s.dtype).min)
        att = torch.einsum("nhqk,nkhd->nqhd", s.softmax(-1), val).reshape(n, k, d)
        return self.to_out(att)


class TorchBlock(nn.Module):
    def __init__(self, d, heads, ff_mult):
        super().__init__()
        self.attn = TorchAttention(d, heads)
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ff_mult * d, bias=False), nn.GELU(),
                                nn.Linear(ff_mult * d, d, bias=False))

    def forward(self, media, latents, key_mask):
        latents = latents + self.attn(media, latents, key_mask)
        return latents + self.ff(latents)


class TorchCompressor(nn.Module):
    """The release's compressor as docs/method.md, "Compressor" describes it (one block, depth times)."""

    def __init__(self, d, heads, k, depth, ff_mult):
        super().__init__()
        self.depth = depth
        self.latents = nn.Parameter(torch.randn(k, d) / d ** 0.5)
        self.proj_in = nn.Linear(d, d)
        self.block = TorchBlock(d, heads, ff_mult)
        self.proj_out = nn.Linear(d, d)
        self.norm_out = nn.LayerNorm(d)

    def forward(self, hidden, mask):
        media = self.proj_in(hidden)
        lat = self.latents.expand(hidden.shape[0], -1, -1)
        key_mask = torch.cat([mask, torch.ones(mask.shape[0], lat.shape[1], dtype=torch.bool)], 1)
        for _ in range(self.depth):
            lat = self.block(media, lat, key_mask)
        return self.norm_out(self.proj_out(lat))


def _torch_model(seed=0):
    torch.manual_seed(seed)
    m = TorchCompressor(D, HEADS, K, DEPTH, FF).double()
    with torch.no_grad():  # LayerNorm affine and biases away from their 1 / 0 init
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _flax():
    return Compressor(D, HEADS, num_latents=K, depth=DEPTH, ff_mult=FF, rngs=nnx.Rngs(0))


def test_release_state_dict_gives_equal_latents_with_padding():
    tm = _torch_model()
    comp = load_release_compressor(_flax(), {"compressor." + k: v for k, v in tm.state_dict().items()},
                                   prefix="compressor.")
    rng = np.random.RandomState(0)
    hidden = rng.randn(3, 9, D)
    mask = np.arange(9)[None] < np.array([9, 5, 2])[:, None]
    hidden[~mask] = 1e3  # padding rows hold garbage
    with torch.no_grad():
        ref = tm(torch.tensor(hidden), torch.tensor(mask)).numpy()
    out = np.asarray(comp(jnp.asarray(hidden, jnp.float32), jnp.asarray(mask)))
    assert out.shape == (3, K, D)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert comp.block.ff_in.bias is None and comp.block.ff_out.bias is None


def test_separate_k_v_weights_and_clear_errors():
    tm = _torch_model(1)
    sd = dict(tm.state_dict())
    kv = sd.pop("block.attn.to_kv.weight")
    sd["block.attn.to_k.weight"], sd["block.attn.to_v.weight"] = kv[:D], kv[D:]
    a = release_compressor_params(sd, _flax())
    b = release_compressor_params(tm.state_dict(), _flax())
    np.testing.assert_array_equal(np.asarray(a["block"]["v_proj"]["kernel"]), np.asarray(b["block"]["v_proj"]["kernel"]))
    with pytest.raises(ValueError, match="lacks block.ff.1.weight"):
        release_compressor_params({k: v for k, v in sd.items() if k != "block.ff.1.weight"}, _flax())
    with pytest.raises(ValueError, match="does not use"):
        release_compressor_params({**sd, "block.ff.1.bias": torch.zeros(FF * D)}, _flax())
    with pytest.raises(ValueError, match="ff_bias=False"):
        biased = Compressor(D, HEADS, num_latents=K, depth=DEPTH, ff_mult=FF, ff_bias=True, rngs=nnx.Rngs(0))
        release_compressor_params(sd, biased)
