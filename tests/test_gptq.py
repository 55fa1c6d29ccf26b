"""GPTQ against RTN on the layer output error, a naive OBS twin, and its edge cases."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.errors import InvalidParameterError
from edgellm.quantize.gptq import (
    GPTQError,
    HessianAccumulator,
    _flip_,
    _inverse_hessian_factor,
    _invert_lower_,
    gptq_quantize,
    output_error,
)
from edgellm.quantize.rtn import QuantConfig, compute_qparams, quantize_rtn, quantize_values

CONFIGS = [
    QuantConfig(4, 32, True),
    QuantConfig(4, 128, True),
    QuantConfig(4, -1, True),
    QuantConfig(4, 32, False),
    QuantConfig(4, 128, False),
    QuantConfig(4, -1, False),
    QuantConfig(3, 128, True),
    QuantConfig(3, -1, False),
]


def correlated_inputs(n: int, inp: int, seed: int, n_outliers: int = 8) -> torch.Tensor:
    """x = z A [n, inp] with a few channels scaled 10-50x, like LLM activation outliers."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(inp, inp, generator=g) / inp**0.5 + torch.eye(inp)  # [inp, inp]
    x = torch.randn(n, inp, generator=g) @ A  # [n, inp]
    idx = torch.randperm(inp, generator=g)[:n_outliers]
    x[:, idx] *= 10 + 40 * torch.rand(n_outliers, generator=g)
    return x


@pytest.fixture(scope="module")
def layer():
    """A random linear w [64, 256], its inputs x [2048, 256] and H = 2/n X^T X."""
    x = correlated_inputs(2048, 256, seed=0)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) / 16
    return w, x, 2 * x.T @ x / x.shape[0]


def layer_output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((x.double() @ (w - wq).double().T).pow(2).sum())  # ||X W^T - X Q^T||^2


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gptq_beats_rtn_on_layer_output(layer, config):
    w, x, H = layer
    rtn = layer_output_error(x, w, quantize_rtn(w, config).dequantize())
    plain = layer_output_error(x, w, gptq_quantize(w, H, config).dequantize())
    act = layer_output_error(x, w, gptq_quantize(w, H, config, act_order=True).dequantize())
    assert plain < 0.85 * rtn  # measured 0.70-0.77
    assert act < 0.85 * rtn  # measured 0.34-0.36
    assert act < 1.1 * plain


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("config", [QuantConfig(4, 32, False), QuantConfig(3, -1, True)], ids=str)
def test_codes_valid_and_errors_consistent(layer, config, act_order):
    w, x, H = layer
    qw = gptq_quantize(w, H, config, act_order=act_order)
    assert qw.q.dtype == torch.int8 and qw.q.shape == w.shape
    assert int(qw.q.min()) >= config.qmin and int(qw.q.max()) <= config.qmax
    assert qw.scale.shape == (64, config.groups(256))
    assert (qw.zero is None) == config.symmetric
    wq = qw.dequantize()
    assert qw.error == pytest.approx(float((wq - w).pow(2).mean()), rel=1e-6)
    # tr((W-Q) H (W-Q)^T) / out is the layer output error per sample and row, times 2
    expect = 2 * layer_output_error(x, w, wq) / (x.shape[0] * w.shape[0])
    assert output_error(w, wq, H) == pytest.approx(expect, rel=1e-4)


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_equals_permuting_inputs_by_hand(layer, symmetric):
    """Per-channel, act_order is GPTQ on the permuted layer, un-permuted afterwards."""
    w, _, H = layer
    config = QuantConfig(4, -1, symmetric)
    perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    ours = gptq_quantize(w, H, config, act_order=True)
    by_hand = gptq_quantize(w[:, perm], H[perm][:, perm], config)
    assert torch.equal(ours.q, by_hand.q[:, torch.argsort(perm)])
    assert torch.equal(ours.scale, by_hand.scale)


def test_act_order_groups_are_static_in_original_order(layer):
    """With act_order each group's params are RTN's, from the original weight; codes follow."""
    w, x, H = layer
    config = QuantConfig(4, 32, False)
    qw = gptq_quantize(w, H, config, act_order=True)
    rtn = quantize_rtn(w, config)
    assert torch.equal(qw.scale, rtn.scale) and torch.equal(qw.zero, rtn.zero)
    # shuffling the returned columns would wreck the layer output, not improve it
    wrong = qw.dequantize()[:, torch.argsort(torch.diag(H), descending=True, stable=True)]
    assert layer_output_error(x, w, qw.dequantize()) < 0.1 * layer_output_error(x, w, wrong)


@pytest.mark.parametrize("static_groups", [False, True])
@pytest.mark.parametrize(
    "config", CONFIGS + [QuantConfig(2, 16, False), QuantConfig(8, 64, True)], ids=str
)
def test_identity_hessian_is_rtn(config, static_groups):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(2))
    qw = gptq_quantize(w, torch.eye(256), config, static_groups=static_groups)
    rtn = quantize_rtn(w, config)
    assert torch.equal(qw.q, rtn.q) and torch.equal(qw.scale, rtn.scale)
    assert qw.zero is None if config.symmetric else torch.equal(qw.zero, rtn.zero)
    assert qw.error == rtn.error


@settings(max_examples=15, deadline=None)
@given(
    out=st.integers(1, 9),
    n_groups=st.integers(1, 4),
    g=st.sampled_from([1, 3, 8]),
    bits=st.integers(2, 8),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_identity_hessian_is_rtn_any_shape(out, n_groups, g, bits, symmetric, seed):
    w = torch.randn(out, n_groups * g, generator=torch.Generator().manual_seed(seed))
    config = QuantConfig(bits, g, symmetric)
    qw = gptq_quantize(w, torch.eye(n_groups * g), config, block_size=5)
    assert torch.equal(qw.q, quantize_rtn(w, config).q)


def naive_obs(w: torch.Tensor, H: torch.Tensor, config: QuantConfig, act_order: bool = False):
    """The paper's OBS loop in float64: full weight update and inverse downdate per column.

    Columns go in index order with lazy group params, or by decreasing diag(H) with RTN's
    group params; nothing is permuted, the inverse Hessian just loses the quantized column.
    """
    W = w.double().clone()  # [out, in]
    Hd = H.double() + 0.01 * torch.diag(H).double().mean() * torch.eye(H.shape[0])
    Hinv = torch.linalg.inv(Hd)  # [in, in]: inverse Hessian of the columns left
    out, inp = W.shape
    g = config.group_len(inp)
    rtn = quantize_rtn(w, config)
    order = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else range(inp)
    q = torch.empty(out, inp, dtype=torch.int8)
    for j in map(int, order):
        if act_order:
            params = rtn.scale[:, j // g], None if rtn.zero is None else rtn.zero[:, j // g]
        elif j % g == 0:  # lazy group params from the updated weight
            params = compute_qparams(W[:, j : j + g], config)
        scale, zero = params
        q[:, j] = quantize_values(W[:, j, None], scale, zero, config)[:, 0]
        wq = (q[:, j].double() - (0 if zero is None else zero.double())) * scale.double()
        W -= ((W[:, j] - wq) / Hinv[j, j])[:, None] * Hinv[j][None, :]
        Hinv -= Hinv[:, j, None] @ Hinv[None, j, :] / Hinv[j, j]
    return q


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_size", [1, 7, 24, 128])
@pytest.mark.parametrize("config", [QuantConfig(3, 16, False), QuantConfig(4, -1, True)], ids=str)
def test_matches_naive_obs_twin(config, block_size, act_order):
    """Lazy blocks, groups that straddle blocks and act_order give the sequential OBS result."""
    x = correlated_inputs(512, 64, seed=3, n_outliers=3)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(4)) / 8
    H = 2 * x.T @ x / x.shape[0]
    ours = gptq_quantize(w, H, config, block_size=block_size, act_order=act_order)
    twin = naive_obs(w, H, config, act_order)
    # float32 against float64: allow a rare rounding flip (measured: none)
    assert (ours.q == twin).float().mean() > 0.99


def test_dead_inputs(layer):
    w, x, _ = layer
    dead = torch.tensor([0, 5, 100, 255])
    x = x.clone()
    x[:, dead] = 0
    H = 2 * x.T @ x / x.shape[0]
    config = QuantConfig(4, 32, False)
    rtn = layer_output_error(x, w, quantize_rtn(w, config).dequantize())
    for act_order in (False, True):
        wq = gptq_quantize(w, H, config, act_order=act_order).dequantize()
        assert torch.isfinite(wq).all()
        assert torch.all(wq[:, dead] == 0)
        assert layer_output_error(x, w, wq) < 0.85 * rtn


def test_indefinite_hessian_retries_with_more_damping(layer, caplog):
    """Eigenvalue -0.05 * mean: damping 0.01 fails, 0.1 works after one logged retry."""
    w, _, _ = layer
    Q, _ = torch.linalg.qr(torch.randn(256, 256, generator=torch.Generator().manual_seed(5)))
    eig = torch.linspace(0.5, 1.5, 256)
    eig[0] = -0.05
    H = Q @ torch.diag(eig) @ Q.T  # [256, 256]
    with caplog.at_level(logging.WARNING, logger="edgellm.quantize.gptq"):
        qw = gptq_quantize(w, H, QuantConfig(4, 32))
    assert torch.isfinite(qw.dequantize()).all()
    assert len(caplog.records) == 1 and "retrying at 0.1" in caplog.text


@pytest.mark.parametrize("n", [96, 601])  # one block; three blocks and an odd middle row
@pytest.mark.parametrize("act_order", [False, True])
def test_the_inverse_factor_computed_in_place_is_the_upper_cholesky_of_the_inverse(act_order, n):
    """Factored in reversed order and inverted inside one column-major copy of H, then
    flipped: the result is row-major, exactly upper triangular, U^T U = (P H P^T + d I)^-1,
    and H is untouched."""
    x = correlated_inputs(2 * n, n, seed=3)
    H = 2 / (2 * n) * x.T.double() @ x.double()
    H = H.float()
    H[5], H[:, 5] = 0, 0  # a dead input: diagonal 1 in the copy
    before = H.clone()
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n)
    U = _inverse_hessian_factor(H, perm, 0.01, (8, n))
    assert torch.equal(H, before)
    assert U.is_contiguous() and torch.equal(U, torch.triu(U)) and bool((U.diagonal() > 0).all())
    Hd = H[perm][:, perm].double()
    Hd.diagonal()[Hd.diagonal() == 0] = 1
    Hd.diagonal().add_(0.01 * float(torch.diag(H).mean()))
    inv = torch.linalg.inv(Hd)
    assert torch.allclose(U.double().T @ U.double(), inv, rtol=1e-3, atol=1e-4 * float(inv.abs().max()))


@pytest.mark.parametrize(("n", "block"), [(13, 4), (12, 4), (5, 8), (300, 64)])
def test_blocked_lower_inverse_and_flip_in_place(n, block):
    g = torch.Generator().manual_seed(n)
    L = torch.tril(torch.randn(n, n, generator=g, dtype=torch.float64)) / n**0.5
    L.diagonal().copy_(torch.rand(n, generator=g, dtype=torch.float64) + 1)
    m = L + torch.triu(torch.randn(n, n, generator=g, dtype=torch.float64), 1)  # never read
    _invert_lower_(m, block)
    assert torch.allclose(torch.tril(m), torch.linalg.inv(L), atol=1e-12)
    assert torch.equal(_flip_(m.clone(), rows=3), m.flip(0, 1))


def test_hopeless_hessian_raises_clear_error(layer):
    w, _, _ = layer
    with pytest.raises(GPTQError, match=r"\[64, 256\] layer is not positive definite.*damping 10 "):
        gptq_quantize(w, -torch.eye(256), QuantConfig(4, 32))
    H = torch.eye(256)
    H[3, 7] = float("nan")
    with pytest.raises(GPTQError, match=r"\[64, 256\] layer has NaN"):
        gptq_quantize(w, H, QuantConfig(4, 32))


def test_bad_arguments(layer):
    w, _, H = layer
    with pytest.raises(InvalidParameterError, match="g_idx"):
        gptq_quantize(w, H, QuantConfig(4, 32), act_order=True, static_groups=False)
    with pytest.raises(InvalidParameterError, match="does not match"):
        gptq_quantize(w, H[:128, :128], QuantConfig(4, 32))
    with pytest.raises(InvalidParameterError, match="does not divide"):
        gptq_quantize(w, H, QuantConfig(4, 96))


def test_hessian_accumulator_equals_one_shot():
    x = correlated_inputs(300, 32, seed=6)  # [300, 32]
    acc = HessianAccumulator(32)
    acc.add(x[:7])
    acc.add(x[7:7])  # empty batch: no-op
    acc.add(x[7:107].reshape(4, 25, 32))  # [batch, seq, in] like a real linear's input
    acc.add(x[107:])
    assert acc.n_samples == 300
    expect = 2 * x.double().T @ x.double() / 300
    # float32 sums: each entry within 1e-6 of its Cauchy-Schwarz scale sqrt(H_ii H_jj), far
    # below the damping GPTQ adds (1% of the mean diagonal)
    d = torch.diag(expect).sqrt()
    err = (acc.hessian.double() - expect).abs() / (d[:, None] * d[None, :])
    assert float(err.max()) < 1e-6
    assert torch.equal(acc.hessian, acc.hessian.T)  # exactly symmetric (mirrored blocks)
    assert acc.hessian.dtype == torch.float32
    with pytest.raises(InvalidParameterError, match="33 features"):
        acc.add(torch.zeros(2, 33))
