"""AWQ on one tiny random decoder layer whose inputs have outlier channels."""

import copy
import logging
from functools import partial

import pytest
import torch
from torch import nn

from edgellm.errors import InvalidParameterError, UnsupportedArchitectureError
from edgellm.quantize import awq as awq_module
from edgellm.quantize import pipeline
from edgellm.quantize.awq import (
    ScaleGroup,
    SequenceProbe,
    _loss_fn,
    _mean_abs,
    _scale_group,
    awq_quantize_layer,
    fake_quantize,
    group_output_error,
    guard_clip,
    scale_groups,
    search_clip,
    search_scale,
)
from edgellm.quantize.layerwise import LayerRunner
from edgellm.quantize.pipeline import QuantizeOptions, _stages, quantize_layer
from edgellm.quantize.rtn import QuantConfig, quantize_rtn
from tests.conftest import ours_from_hf, tiny_hf_model

N_TOKENS = 256
MHA = {"num_key_value_heads": 4}  # the tiny default has 4 heads over 2 KV heads
OUTLIERS = [3, 17, 40]  # hidden channels 20-50x larger, as in real LLM activations

CONFIGS = [
    QuantConfig(bits=4, group_size=32, symmetric=True),
    QuantConfig(bits=4, group_size=32, symmetric=False),
    QuantConfig(bits=3, group_size=32, symmetric=False),
]


def tiny_layer(model_type: str = "llama", **over) -> nn.Module:
    hf, cfg = tiny_hf_model(model_type, **over)
    return ours_from_hf(hf, cfg).model.layers[0]


def layer_input(hidden: int, seed: int) -> torch.Tensor:  # [T, D]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TOKENS, hidden, generator=g)
    x[:, OUTLIERS] *= torch.tensor([20.0, 35.0, 50.0])
    return x


def attention_mix(seed: int) -> torch.Tensor:  # [T, T], causal rows sum to 1
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(N_TOKENS, N_TOKENS, generator=g) * 2
    return scores.masked_fill(torch.ones_like(scores).triu(1).bool(), -torch.inf).softmax(-1)


def o_proj_input(layer: nn.Module, x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:  # [T, H*hd]
    """Attention output with one mixing matrix for all heads: each head reads its KV head."""
    attn = layer.self_attn
    v = attn.v_proj(layer.input_layernorm(x)).view(-1, attn.n_kv_heads, attn.head_dim)
    v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # [T, H, hd]
    return mix @ v.flatten(1)


def group_outputs(layer: nn.Module, x, o_in, h, v_scale: torch.Tensor | float = 1.0) -> dict:
    """Each group's output on the float inputs of the group (errors do not propagate).

    v_scale undoes the 1/s that AWQ folds into v_proj's rows (o_proj's columns absorb s).
    """
    attn, xn = layer.self_attn, layer.input_layernorm(x)
    qkv = torch.cat([attn.q_proj(xn), attn.k_proj(xn), attn.v_proj(xn) * v_scale], -1)
    return {"qkv": qkv, "o": attn.o_proj(o_in), "mlp": layer.mlp(layer.post_attention_layernorm(h))}


def _keep_input(inputs: dict, name: str, module: nn.Module, args: tuple) -> None:
    inputs.setdefault(name, args[0])


def capture_inputs(layer: nn.Module, x: torch.Tensor, mix: torch.Tensor) -> dict:
    """Inputs of every linear, captured by forward hooks while the float layer runs."""
    inputs, hooks = {}, []
    for name, mod in layer.named_modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(partial(_keep_input, inputs, name)))
    o_in = o_proj_input(layer, x, mix)
    h = x + layer.self_attn.o_proj(o_in)
    group_outputs(layer, x, o_in, h)
    for hook in hooks:
        hook.remove()
    return inputs


def with_weights(layer: nn.Module, weights: dict) -> nn.Module:
    """A copy of layer whose linears carry the given (dequantized) weights."""
    layer = copy.deepcopy(layer)
    for name, w in weights.items():
        layer.get_submodule(name).weight.copy_(w)
    return layer


def v_scale(orig: nn.Module, layer: nn.Module) -> torch.Tensor:
    """The s folded from o_proj's columns into v_proj's rows [KV*hd] (under GQA the query
    heads of one KV head share it: their first head's)."""
    attn = layer.self_attn
    s = attn.o_proj.weight.norm(dim=0) / orig.self_attn.o_proj.weight.norm(dim=0)  # [H*hd]
    r = attn.n_heads // attn.n_kv_heads
    return s.view(attn.n_kv_heads, r, attn.head_dim)[:, 0].reshape(-1)


def relative_errors(ref: dict, got: dict) -> dict:
    return {k: float((got[k] - ref[k]).pow(2).mean() / ref[k].pow(2).mean()) for k in ref}


def eval_outputs(qlayer: nn.Module, flayer: nn.Module, orig: nn.Module, x, mix) -> dict:
    """Group outputs of qlayer, each group fed what the float layer flayer gives it."""
    o_in = o_proj_input(flayer, x, mix)  # AWQ's o_proj reads its own scaled v_proj
    h = x + orig.self_attn.o_proj(o_proj_input(orig, x, mix))
    return group_outputs(qlayer, x, o_in, h, v_scale(orig, flayer))


@torch.no_grad()
def run_awq(config: QuantConfig, model_type: str, max_shrink: float = 0.5, **over):
    """(original layer, AWQ-scaled float layer, its dequantized twin, the RTN twin of orig)."""
    layer = tiny_layer(model_type, **over)
    hidden = layer.input_layernorm.weight.numel()
    inputs = capture_inputs(layer, layer_input(hidden, seed=0), attention_mix(seed=1))
    orig = copy.deepcopy(layer)
    rtn = {n: quantize_rtn(orig.get_submodule(n).weight, config).dequantize() for n in inputs}
    qws = awq_quantize_layer(layer, inputs, config, model_type, max_shrink=max_shrink)
    awq = with_weights(layer, {n: qw.dequantize() for n, qw in qws.items()})
    return orig, layer, awq, with_weights(orig, rtn)


@torch.no_grad()
def awq_vs_rtn(config: QuantConfig, model_type: str = "llama", **over) -> dict:
    """Per group, output error of the AWQ layer / that of plain RTN, on held-out tokens."""
    orig, layer, awq, rtn = run_awq(config, model_type, **over)
    x, mix = layer_input(orig.input_layernorm.weight.numel(), seed=2), attention_mix(seed=3)
    ref = eval_outputs(orig, orig, orig, x, mix)
    rtn_err = relative_errors(ref, eval_outputs(rtn, orig, orig, x, mix))
    awq_err = relative_errors(ref, eval_outputs(awq, layer, orig, x, mix))
    return {k: awq_err[k] / rtn_err[k] for k in ref}


def config_id(c: QuantConfig) -> str:
    return f"{c.bits}b-g{c.group_size}-{'sym' if c.symmetric else 'asym'}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize(
    "model_type,over", [("llama", MHA), ("qwen2", {})], ids=["llama-mha", "qwen2-gqa"]
)
def test_awq_beats_rtn_with_outliers(config, model_type, over):
    ratios = awq_vs_rtn(config, model_type, **over)
    print(config_id(config), model_type, {k: round(v, 3) for k, v in ratios.items()})
    assert all(r < 0.8 for r in ratios.values()), ratios


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm() / b.norm()).detach())


@pytest.mark.parametrize(
    "model_type,over", [("llama", MHA), ("qwen2", {})], ids=["llama-mha", "qwen2-gqa"]
)
def test_folding_keeps_the_float_function(model_type, over):
    config = QuantConfig(bits=4, group_size=32)
    orig, layer, _, _ = run_awq(config, model_type, max_shrink=0, **over)
    x, mix = layer_input(orig.input_layernorm.weight.numel(), seed=2), attention_mix(seed=3)
    with torch.no_grad():
        ref = eval_outputs(orig, orig, orig, x, mix)
        got = eval_outputs(layer, layer, orig, x, mix)
    assert {k: rel(got[k], ref[k]) for k in ref} == pytest.approx({k: 0 for k in ref}, abs=1e-4)
    assert rel(layer.input_layernorm.weight, orig.input_layernorm.weight) > 0.01  # it did scale


def test_no_clip_returns_plain_rtn_of_the_scaled_weights():
    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    _, layer, awq, _ = run_awq(config, "llama", max_shrink=0)
    for name, mod in awq.named_modules():
        if isinstance(mod, nn.Linear):
            expect = quantize_rtn(layer.get_submodule(name).weight.detach(), config).dequantize()
            torch.testing.assert_close(mod.weight, expect, rtol=0, atol=0)


def test_gqa_ties_o_scales_across_the_query_heads_of_each_kv_head(caplog):
    config = QuantConfig(bits=4, group_size=32)
    with caplog.at_level(logging.INFO, logger="edgellm.quantize.awq"):
        orig, layer, _, _ = run_awq(config, "qwen2")  # 4 heads over 2 KV heads
    assert "skips" not in caplog.text
    attn, attn0 = layer.self_attn, orig.self_attn
    kv, r, hd = attn.n_kv_heads, attn.n_heads // attn.n_kv_heads, attn.head_dim
    assert r == 2
    s = (attn.o_proj.weight.norm(dim=0) / attn0.o_proj.weight.norm(dim=0)).view(kv, r, hd)
    torch.testing.assert_close(s, s[:, :1].expand_as(s), rtol=1e-5, atol=0)  # tied
    assert float(s.std() / s.mean()) > 0.01  # and it did scale
    s_v = s[:, 0].reshape(-1)
    s_in = orig.input_layernorm.weight / layer.input_layernorm.weight  # q/k/v's input scales
    torch.testing.assert_close(attn.v_proj.weight * s_v[:, None], attn0.v_proj.weight * s_in)
    torch.testing.assert_close(attn.v_proj.bias * s_v, attn0.v_proj.bias)  # Qwen2's qkv bias
    with caplog.at_level(logging.INFO, logger="edgellm.quantize.awq"):
        orig, layer, _, _ = run_awq(config, "llama", **MHA)
    assert "skips" not in caplog.text
    assert rel(layer.self_attn.o_proj.weight, orig.self_attn.o_proj.weight) > 0.01


def test_pairs_that_cannot_share_scales_are_skipped(caplog):
    """A linear whose outputs do not map onto the next one's inputs head by head."""
    layer = tiny_layer("llama")
    layer.mlp.down_proj = nn.Linear(layer.mlp.up_proj.out_features // 2, 64, bias=False)
    group = ScaleGroup("mlp.up_proj", ["mlp.down_proj"])
    x = torch.randn(32, layer.mlp.down_proj.in_features)
    before = copy.deepcopy(layer.state_dict())
    with caplog.at_level(logging.INFO, logger="edgellm.quantize.awq"):
        s = _scale_group(layer, group, x, QuantConfig(group_size=32), n_grid=4)
    assert "skips mlp.up_proj -> mlp.down_proj" in caplog.text
    assert torch.equal(s, torch.ones(x.shape[1]))
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


def test_unknown_model_type_is_rejected():
    layer = tiny_layer("llama")
    with pytest.raises(UnsupportedArchitectureError, match="'gemma'.*llama, mistral, qwen2"):
        awq_quantize_layer(layer, {}, QuantConfig(), "gemma")


@pytest.mark.parametrize(
    "keep,config,match",
    [
        (["self_attn.q_proj"], QuantConfig(group_size=32), "self_attn.o_proj"),
        # 100-wide layers have no power-of-two group that divides them (see for_features)
        (None, QuantConfig(group_size=48), None),
    ],
    ids=["missing-inputs", "bad-group-size"],
)
def test_bad_calls_are_rejected_before_any_change(keep, config, match):
    layer = tiny_layer("llama")
    inputs = capture_inputs(layer, layer_input(64, seed=0), attention_mix(seed=1))
    inputs = {k: v for k, v in inputs.items() if keep is None or k in keep}
    if match is None:
        down = layer.mlp.down_proj
        layer.mlp.down_proj = torch.nn.Linear(100, down.out_features, bias=False)
        inputs["mlp.down_proj"] = torch.randn(inputs["mlp.down_proj"].shape[0], 100)
        match = "does not divide the 100 input features"
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(InvalidParameterError, match=match):
        awq_quantize_layer(layer, inputs, config, "llama")
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


def test_a_bad_protected_share_is_rejected_before_any_change():
    layer = tiny_layer("llama")
    inputs = capture_inputs(layer, layer_input(64, seed=0), attention_mix(seed=1))
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(InvalidParameterError, match="protect_share"):
        awq_quantize_layer(layer, inputs, QuantConfig(group_size=32), "llama", protect_share=1.5)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


def test_outputs_not_row_for_row_with_the_inputs_are_rejected_before_any_change():
    layer = tiny_layer("llama")
    inputs = capture_inputs(layer, layer_input(64, seed=0), attention_mix(seed=1))
    with torch.no_grad():
        mlp_out = layer.mlp(inputs["mlp.gate_proj"])[:-1]  # one row short
    before = copy.deepcopy(layer.state_dict())
    with pytest.raises(InvalidParameterError, match="outputs of 'mlp' for"):
        awq_quantize_layer(layer, inputs, QuantConfig(group_size=32), "llama",
                           outputs={"mlp": mlp_out})  # fmt: skip
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())


def testscale_groups_name_real_modules():
    layer = tiny_layer("qwen2")
    assert scale_groups("llama") == scale_groups("mistral") == scale_groups("qwen2")
    for group in scale_groups("qwen2"):
        for name in [group.prev, *group.linears, *([group.inspect] if group.inspect else [])]:
            layer.get_submodule(name)


def test_group_error_from_gram_matches_token_outputs():
    g = torch.Generator().manual_seed(0)
    x, d = (
        torch.randn(50, 3, 8, generator=g),
        torch.randn(5, 3, 8, generator=g),
    )  # [n, G, g], [out, G, g]
    gram = torch.einsum("ngk,ngl->gkl", x, x) / x.shape[0]
    direct = torch.einsum("ngk,ogk->nog", x, d).pow(2).mean(0)  # partial outputs per group
    torch.testing.assert_close(group_output_error(d, gram), direct)


def test_scale_loss_from_gram_matches_output_mse():
    layer = tiny_layer("llama")
    group = scale_groups("llama")[0]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    ws = [layer.get_submodule(n).weight.detach() for n in group.linears]
    cands = [fake_quantize(w, QuantConfig(bits=3, group_size=16)) for w in ws]
    direct = torch.cat([x @ (c - w).T for c, w in zip(cands, ws, strict=True)], -1).pow(2).mean()
    assert _loss_fn(layer, group, x, ws)(cands) == pytest.approx(float(direct), rel=1e-4)


def test_module_loss_in_bf16_compute_is_the_float_loss_within_bf16_rounding():
    """compute=bfloat16: the MLP's candidates are scored with bf16 products (as the bf16
    forward that captured the reference), close to the float32 score, yet not equal to it."""
    layer = tiny_layer("llama")
    group = scale_groups("llama")[2]  # gate/up, scored on the MLP's output
    x = layer_input(64, seed=1)
    ws = [layer.get_submodule(n).weight.detach() for n in group.linears]
    cands = [fake_quantize(w, QuantConfig(bits=3, group_size=16)) for w in ws]
    f32 = _loss_fn(layer, group, x, ws)(cands)
    bf16 = _loss_fn(layer, group, x, ws, compute=torch.bfloat16)(cands)
    assert bf16 != f32 and bf16 == pytest.approx(f32, rel=0.05)
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fake_quantize_matches_rtn_and_clip_never_hurts(config):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 64, generator=g), torch.randn(100, 64, generator=g)
    clip = search_clip(w, x, config, clip_grid=10, max_shrink=0.5)
    # value for value (in place arithmetic, same roundings)
    assert torch.equal(fake_quantize(w, config, clip), quantize_rtn(w, config, clip).dequantize())
    s = torch.rand(64, generator=g) + 0.5  # AWQ's candidates: quantize w * s, divide by s
    assert torch.equal(
        fake_quantize(w, config, col_scale=s), quantize_rtn(w * s, config).dequantize() / s
    )
    assert search_clip(w, x, config, clip_grid=10, max_shrink=0) == 1.0
    xg = x.view(100, 2, 32)
    gram = torch.einsum("ngk,ngl->gkl", xg, xg) / 100
    err = {
        c: group_output_error((fake_quantize(w, config, c) - w).view(16, 2, 32), gram)
        for c in (1.0, clip)
    }
    assert (err[clip] <= err[1.0]).all() and err[clip].sum() < err[1.0].sum()


def test_clip_guard_reverts_rows_whose_whole_output_error_the_clip_raises():
    # every group has outliers, and a few tokens line up with row 0's: clipping each of row
    # 0's groups lowers the per-group errors, but on those tokens the shrunken outliers add
    # up across the groups (as in Qwen2.5's massive first-token activations)
    config = QuantConfig(bits=4, group_size=32)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 256, generator=g)
    w[:, ::16] *= 4
    x = torch.randn(512, 256, generator=g)
    x[::128] = 8 * torch.sign(w[0]) * (w[0].abs() > 3)
    clip = search_clip(w, x, config, clip_grid=20, max_shrink=0.5)
    assert isinstance(clip, torch.Tensor) and (clip < 1).any(1).all()  # every row clipped

    guarded = guard_clip(w, x, config, clip)
    reverted = (guarded == 1).all(1)
    assert reverted[0] and reverted.sum() <= 4  # row 0, not the rows the clip helps

    def row_error(c):
        return (x @ (fake_quantize(w, config, c) - w).T).pow(2).sum(0)

    assert (row_error(guarded) <= torch.minimum(row_error(clip), row_error(1.0))).all()
    assert row_error(clip)[0] > row_error(1.0)[0]
    assert torch.equal(guarded[~reverted], clip[~reverted])
    assert guard_clip(w, x, config, 1.0) == 1.0

    # the same tokens left out of the sample (sinks) but protected: row 0 keeps its range
    sinks, ordinary = x[::128], x[torch.arange(512) % 128 != 0]
    clip = search_clip(w, ordinary, config, clip_grid=20, max_shrink=0.5)
    assert (guard_clip(w, ordinary, config, clip) < 1).any(1)[0]
    protected = guard_clip(w, ordinary, config, clip, protect=sinks)
    assert (protected[0] == 1).all() and (protected < 1).any(1).sum() >= 8


def test_scale_statistic_counts_the_left_out_sinks_at_their_share():
    """A channel only the sinks use: searched on the other tokens alone, its scale is tiny and
    the sinks' outputs through it lose their precision; counted at its share in mean|x|,
    the sinks' error shrinks and the others' barely moves."""
    config = QuantConfig(bits=4, group_size=32)
    layer = tiny_layer("llama", **MHA)
    group = scale_groups("llama")[0]  # input_layernorm -> q, k, v
    hidden = layer.self_attn.q_proj.in_features
    x = layer_input(hidden, seed=6)
    x[:, 5] *= 1e-3  # idle for the ordinary tokens
    sinks = torch.zeros(4, hidden)
    sinks[:, 5] = 60.0
    share = 4 / 2048
    stats = _mean_abs(x, sinks, share)
    assert torch.allclose(stats, (1 - share) * x.abs().mean(0) + share * sinks.abs().mean(0))
    assert torch.equal(_mean_abs(x, None, share), x.abs().mean(0))

    def errors(s):  # (ordinary, sinks): summed squared output error of q, k, v
        out = []
        for t in (x, sinks):
            out.append(sum(float((t @ (fake_quantize(lin.weight, config, col_scale=s)
                                      - lin.weight).T).pow(2).sum())
                           for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                       layer.self_attn.v_proj)))  # fmt: skip
        return out

    with torch.no_grad():
        alone = errors(search_scale(copy.deepcopy(layer), group, x, config, n_grid=10))
        counted = errors(search_scale(copy.deepcopy(layer), group, x, config, 10, x_mean=stats))
        rtn = errors(torch.ones(hidden))
    assert alone[1] > 4 * rtn[1]  # the failure: the sinks lose far more than under RTN
    assert counted[1] < alone[1] / 4
    assert counted[0] < 1.1 * alone[0] and counted[0] < rtn[0]


@pytest.mark.parametrize("group_index", [2, 3])  # the MLP (module output), up -> down (direct)
def test_screened_scale_search_scores_few_candidates_on_every_token(group_index):
    """With screening, every candidate is scored on a few tokens and only the best
    `screen_keep` on all: on outlier activations it picks what scoring every candidate on
    every token picks, and without screening all are scored on all."""
    import edgellm.quantize.awq as awq

    layer = tiny_layer("llama", **MHA)
    group = scale_groups("llama")[group_index]
    width = layer.get_submodule(group.linears[0]).in_features
    if group.inspect:  # costs per token whatever the shapes
        x = layer_input(width, seed=4)
    else:  # direct (per token) only with fewer tokens than inputs: 96 < 128
        x = torch.randn(96, width, generator=torch.Generator().manual_seed(4)).abs() * 3
        x[:, [5, 70]] *= 30
    config = QuantConfig(bits=3, group_size=16)
    calls: list[int] = []

    def counting(layer_, group_, x_, weights, ref=None, compute=torch.float32):
        fn = _loss_fn(layer_, group_, x_, weights, ref, compute)

        def scored(cand):
            calls.append(x_.shape[0])
            return fn(cand)

        return scored

    picks = {}
    for screen in (0, 48):
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(awq, "_loss_fn", counting)
            picks[screen] = search_scale(layer, group, x, config, 10, screen, 2)
        if screen == 0:
            assert calls == [x.shape[0]] * 10
        else:
            assert calls.count(48) == 10 and calls.count(x.shape[0]) == 2
    assert torch.equal(picks[0], picks[48])


@pytest.mark.parametrize("group_index", [0, 2])  # q/k/v (through the Gram matrix), the MLP
def test_duo_scaling_picks_the_best_of_autoawqs_candidates(group_index):
    """duo: s = mean|x|^a / (mean|w|^(1-a) + 1e-4), mean|w| per input over the group's rows
    of |w| / its weight group's max (AutoAWQ's and llm-compressor's default), a = 0 plain
    RTN: the search returns the candidate of least output error, computed here apart."""
    layer = tiny_layer("llama", **MHA)
    group = scale_groups("llama")[group_index]
    width = layer.get_submodule(group.linears[0]).in_features
    x = layer_input(width, seed=6)
    config = QuantConfig(bits=3, group_size=16)
    ws = [layer.get_submodule(n).weight.float() for n in group.linears]
    w = torch.cat(ws).abs().view(-1, width // 16, 16)
    w_mean = (w / (w.amax(-1, keepdim=True) + 1e-6)).view(-1, width).mean(0)
    x_mean = x.abs().mean(0)
    cands = [torch.ones(width)]
    for i in range(1, 10):
        s = (x_mean ** (i / 10) / (w_mean ** (1 - i / 10) + 1e-4)).clamp(min=1e-4)
        cands.append(s / (s.max() * s.min()).sqrt())
    loss = _loss_fn(layer, group, x, ws)
    losses = [loss([fake_quantize(w_, config, col_scale=s) for w_ in ws]) for s in cands]
    got = search_scale(layer, group, x, config, 10, duo=True)
    torch.testing.assert_close(got, cands[min(range(10), key=lambda i: (losses[i], i))])
    assert not torch.equal(got, cands[0])  # outlier inputs: some scaling beats RTN


def test_the_next_layer_calibrates_on_the_quantized_layers_output():
    """awq_propagate: the next layer's inputs are this layer's output with its quantized
    weights and folded scales, as GPTQ's; off (the default): the float layer's output."""
    hf, cfg = tiny_hf_model("llama")
    model = ours_from_hf(hf, cfg)
    layer, args = model.model.layers[0], model.args
    hidden = torch.randn(4, 16, args.hidden_size, generator=torch.Generator().manual_seed(0))
    runner = LayerRunner(args, 16, chunk=2)
    float_out = runner(copy.deepcopy(layer), hidden)
    assert not QuantizeOptions().awq_propagate
    for propagate in (True, False):
        quantized = copy.deepcopy(layer)
        opts = QuantizeOptions("awq", group_size=32, awq_tokens=48, awq_propagate=propagate)
        _, after = quantize_layer(quantized, runner, hidden, opts, "llama", _stages(args))
        if propagate:
            assert torch.equal(after, runner(quantized, hidden))
            assert (after - float_out).abs().max() > 1e-3  # W4 of a random layer: not float
        else:
            assert torch.equal(after, float_out)


def test_awq_samples_leave_out_tokens_with_massive_residuals(monkeypatch):
    # position 0's residual 200x the others', as Qwen2.5's attention sinks from layer 2 on:
    # its squared errors would dominate every search, though RMSNorm divides them away
    # (awq_sink_guard "all", the default: every group leaves them out)
    hf, cfg = tiny_hf_model("llama")
    model = ours_from_hf(hf, cfg)
    layer, args = model.model.layers[0], model.args
    N, L, D = 8, 16, args.hidden_size
    hidden = torch.randn(N, L, D, generator=torch.Generator().manual_seed(0))
    hidden[:, 0] *= 200
    with torch.no_grad():  # what q_proj sees, before AWQ folds scales into the norm
        normed = layer.input_layernorm(hidden.reshape(-1, D))
    seen = {}
    real = pipeline.awq_quantize_layer

    def spy(layer, inputs, *args, **kwargs):
        seen.update(inputs)
        seen["protect"] = kwargs["protect"]
        seen["sequences"] = kwargs["sequences"]
        # the MLP's outputs captured in the forward are its outputs on the sampled inputs,
        # row for row (the scale search's reference)
        with torch.no_grad():
            ref = layer.mlp(inputs["mlp.gate_proj"])
        seen["mlp outputs"] = torch.allclose(kwargs["outputs"]["mlp"], ref, atol=1e-5)
        return real(layer, inputs, *args, **kwargs)

    monkeypatch.setattr(pipeline, "awq_quantize_layer", spy)
    opts = QuantizeOptions(method="awq", group_size=32, awq_tokens=96)  # 3 in 4 tokens
    quantize_layer(layer, LayerRunner(args, L, chunk=2), hidden, opts, "llama", _stages(args))

    x = seen["self_attn.q_proj"]
    assert x.shape[0] == 96  # the quota, refilled from the spare sample
    rows = torch.cdist(x, normed).argmin(1)  # the token each sampled row came from
    torch.testing.assert_close(x, normed[rows])
    assert len(set(rows.tolist())) == 96 and not (rows % L == 0).any()
    protect = seen.pop("protect")
    # the attention's scoring sequences: the first chunk's, whole, the massive rows marked
    probe = seen.pop("sequences")["self_attn"]
    torch.testing.assert_close(probe.x, normed[: 2 * L])
    assert torch.equal(probe.sinks, torch.arange(2 * L) % L == 0)
    assert probe.args[3].context_lens == [L, L]
    assert seen.pop("mlp outputs")
    assert all(v.shape[0] == 96 for v in seen.values())
    # ... yet their outputs are what the clip guard protects: every sequence's position 0
    torch.testing.assert_close(protect["self_attn.q_proj"], normed[::L])
    assert all(v.shape[0] == N for v in protect.values())


def test_sinks_stay_in_the_groups_whose_inputs_they_do_not_dominate(monkeypatch):
    """awq_sink_guard="massive". After the input norm a sink's input is an ordinary token's
    size: q/k/v, o and gate/up sample it at its rate, and their clip guards leave it to the
    sample (the scale searches still admit by its error). Only down_proj, whose input from
    the sink is massive here (its gate/up columns amplify the sink's channel), leaves it out
    and guards it apart."""
    hf, cfg = tiny_hf_model("llama")
    model = ours_from_hf(hf, cfg)
    layer, args = model.model.layers[0], model.args
    N, L, D = 8, 16, args.hidden_size
    hidden = torch.randn(N, L, D, generator=torch.Generator().manual_seed(0))
    hidden[:, 0] = 0
    hidden[:, 0, 3] = 200 * D**0.5  # one massive channel, as real sinks carry
    with torch.no_grad():
        layer.mlp.gate_proj.weight[:, 3] *= 30
        layer.mlp.up_proj.weight[:, 3] *= 30
        normed = layer.input_layernorm(hidden.reshape(-1, D))
    seen, guarded = {}, {}
    real, real_guard = pipeline.awq_quantize_layer, awq_module.guard_clip

    def spy(layer, inputs, *args, **kwargs):
        seen.update(inputs, protect=kwargs["protect"], sequences=kwargs["sequences"])
        seen["sampled"] = kwargs["sampled"]
        return real(layer, inputs, *args, **kwargs)

    def guard_spy(w, x, config, clip, protect=None):
        guarded[w.shape] = protect is not None
        return real_guard(w, x, config, clip, protect)

    monkeypatch.setattr(pipeline, "awq_quantize_layer", spy)
    monkeypatch.setattr(awq_module, "guard_clip", guard_spy)
    opts = QuantizeOptions(method="awq", group_size=32, awq_tokens=96, awq_sink_guard="massive")
    quantize_layer(layer, LayerRunner(args, L, chunk=2), hidden, opts, "llama", _stages(args))

    names = [n for s in _stages(args) for n in s]
    assert seen["sampled"] == set(names) - {"mlp.down_proj"}
    assert all(seen["protect"][n].shape[0] == N for n in names)  # the scale searches admit
    down = layer.mlp.down_proj.weight.shape
    assert guarded[down] and not any(v for k, v in guarded.items() if k != down)
    assert torch.equal(seen["sequences"]["self_attn"].sinks, torch.arange(2 * L) % L == 0)
    rows = torch.cdist(seen["self_attn.q_proj"], normed).argmin(1)
    assert (rows % L == 0).any()  # sinks sampled with the others
    x = seen["mlp.down_proj"]
    assert x.shape[0] == 96
    assert x.norm(dim=1).max() < seen["protect"]["mlp.down_proj"].norm(dim=1).min() / 10


def test_sink_guard_choices():
    assert QuantizeOptions().awq_sink_guard == "all"
    with pytest.raises(InvalidParameterError, match="awq_sink_guard"):
        QuantizeOptions(awq_sink_guard="some")


def _attention_error(layer, xn, args, config, s) -> float:
    """The attention's output MSE on whole sequences with q, k, v fake-quantized at column
    scales s (acting on the unscaled input), against its float output."""
    attn = layer.self_attn
    with torch.no_grad():
        ref = attn(xn, *args)
        quant = copy.deepcopy(attn)
        for lin in (quant.q_proj, quant.k_proj, quant.v_proj):
            lin.weight.data = fake_quantize(lin.weight, config, col_scale=s)
        return float((quant(xn, *args) - ref).pow(2).mean())


def test_q_k_v_are_judged_by_the_attention_output_on_whole_sequences():
    """Given whole sequences, q/k/v's scale candidates are scored by the attention's output
    on them (q and k act through the scores, which their own output MSE does not weigh):
    the scales chosen so beat, on the attention's output, those that q, k and v's own outputs
    choose and plain RTN; without sequences the linears' outputs judge, as before."""
    hf, cfg = tiny_hf_model("llama")
    model = ours_from_hf(hf, cfg)
    layer, args = model.model.layers[0], model.args
    group = scale_groups("llama")[0]
    assert group.inspect == "self_attn" and group.whole_sequences
    assert group.on_tokens.inspect is None
    n, L = 2, 64
    seq_args = LayerRunner(args, L, chunk=n).sequence_args(n)
    with pytest.raises(ValueError, match="1 to 2 sequences"):
        LayerRunner(args, L, chunk=n).sequence_args(n + 1)
    with torch.no_grad():
        xn = layer.input_layernorm(layer_input(args.hidden_size, seed=1)[: n * L])
    config = QuantConfig(bits=3, group_size=16)
    probe = SequenceProbe(xn, seq_args, torch.zeros(n * L, dtype=torch.bool))
    with torch.no_grad():
        by_attention = search_scale(layer, group, xn, config, 10, probe=probe)
        by_linears = search_scale(layer, group, xn, config, 10)
        assert torch.equal(by_linears, search_scale(layer, group.on_tokens, xn, config, 10))
    errors = [_attention_error(layer, xn, seq_args, config, s)
              for s in (by_attention, by_linears, torch.ones(xn.shape[1]))]  # fmt: skip
    assert errors[0] < errors[1] and errors[0] < errors[2]


def test_sequence_probe_leaves_sinks_out_of_the_loss_and_admits_by_them():
    """The probe's sink rows do not count in the loss; a candidate that worsens their
    attention output over RTN's is not admitted."""
    from edgellm.quantize.awq import _probe_score

    hf, cfg = tiny_hf_model("llama")
    model = ours_from_hf(hf, cfg)
    layer, args = model.model.layers[0], model.args
    group = scale_groups("llama")[0]
    n, L = 2, 32
    seq_args = LayerRunner(args, L, chunk=n).sequence_args(n)
    with torch.no_grad():
        xn = layer.input_layernorm(layer_input(args.hidden_size, seed=5)[: n * L])
    sinks = torch.arange(n * L) % L == 0
    ws = [layer.get_submodule(name).weight.float() for name in group.linears]
    config = QuantConfig(bits=3, group_size=16)
    cand = [fake_quantize(w, config) for w in ws]
    with torch.no_grad():
        with_sinks = _probe_score(layer, group, SequenceProbe(xn, seq_args, sinks), ws)(cand)
        none = _probe_score(layer, group, SequenceProbe(xn, seq_args, sinks & False), ws)(cand)
        assert _probe_score(layer, group, SequenceProbe(xn, seq_args, sinks), ws)(ws) == (0, 0)
    assert none[1] is None and with_sinks[1] > 0
    # the loss is the others' mean: all rows' mean mixes the sinks' in at their share
    share = float(sinks.float().mean())
    assert none[0] == pytest.approx((1 - share) * with_sinks[0] + share * with_sinks[1], rel=1e-5)
    with pytest.raises(InvalidParameterError, match="sinks"):
        _probe_score(layer, group, SequenceProbe(xn, seq_args, sinks[1:]), ws)
