"""Group-wise round-to-nearest: codes, error ordering and bad configurations."""

import pytest
import torch

from edgellm.errors import InvalidParameterError
from edgellm.quantize.rtn import QuantConfig, dequantize, quantize_rtn

W = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("sym", [True, False])
def test_error_decreases_with_smaller_groups_and_more_bits(sym):
    errs = {
        (b, g): quantize_rtn(W, QuantConfig(b, g, sym)).error
        for b in (2, 3, 4, 8)
        for g in (-1, 128, 64, 32)
    }
    for b in (2, 3, 4, 8):
        assert errs[(b, -1)] > errs[(b, 128)] > errs[(b, 64)] > errs[(b, 32)]
    for g in (-1, 128, 64, 32):
        assert errs[(2, g)] > errs[(3, g)] > errs[(4, g)] > errs[(8, g)]
    assert errs[(8, 32)] < 1e-4


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_codes_in_range_and_error_reported(bits, sym):
    cfg = QuantConfig(bits, 32, sym)
    qw = quantize_rtn(W, cfg)
    assert qw.q.dtype == torch.int8 and cfg.qmin <= int(qw.q.min()) and int(qw.q.max()) <= cfg.qmax
    assert (qw.zero is None) == sym
    recon = dequantize(qw.q, qw.scale, qw.zero, cfg)
    assert qw.error == pytest.approx(float((recon - W).pow(2).mean()))
    # RTN is the nearest grid point: no code can be moved by one step to reduce the error
    assert ((recon - W).abs() <= qw.scale.repeat_interleave(32, 1) / 2 + 1e-6).float().mean() > 0.98


def test_asymmetric_handles_one_sided_groups_exactly():
    w = torch.rand(8, 64) + 1.0  # all positive: asymmetric uses the whole grid
    sym, asym = (
        quantize_rtn(w, QuantConfig(4, 32, True)),
        quantize_rtn(w, QuantConfig(4, 32, False)),
    )
    assert asym.error < sym.error / 2


@pytest.mark.parametrize("kw", [{"bits": 1}, {"bits": 9}, {"group_size": 0}, {"group_size": -2}])
def test_bad_configs(kw):
    with pytest.raises(InvalidParameterError):
        QuantConfig(**kw)


def test_group_size_must_divide_inputs():
    with pytest.raises(InvalidParameterError, match="does not divide the 100 input features"):
        quantize_rtn(torch.randn(4, 100), QuantConfig(4, 64))


def test_group_size_falls_back_per_layer_to_a_power_of_two_divisor():
    cfg = QuantConfig(4, 128)
    assert cfg.for_features(1536) is cfg
    assert cfg.for_features(576) == QuantConfig(4, 64)  # SmolLM2's hidden size
    assert QuantConfig(4, -1).for_features(100).group_size == -1
    with pytest.raises(InvalidParameterError, match="per-channel"):
        cfg.for_features(100)
