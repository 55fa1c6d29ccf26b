"""Our torch model against transformers' on the same weights."""

import pytest
import torch

from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig
from edgellm.engine.scheduler import ScheduledSeq
from edgellm.engine.sequence import Sequence
from edgellm.sampling.params import SamplingParams
from tests.conftest import ours_from_hf, tiny_hf_model

CASES = [
    ("llama", False, {}),
    ("llama", True, {}),
    ("llama", False, {"num_key_value_heads": 4}),  # MHA
    ("qwen2", False, {}),
    ("qwen2", True, {}),
    ("mistral", False, {}),
    (
        "llama",
        False,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
]


def run_prefill(
    model, token_ids: list[int], block_size: int = 16, chunk: int | None = None
) -> torch.Tensor:
    """All-position logits of one sequence through the paged backend, optionally chunked."""
    backend = TorchBackend(model, EngineConfig(kv_cache_mb=4, block_size=block_size))
    seq = Sequence("t", list(token_ids), SamplingParams())
    n_blocks = -(-len(token_ids) // block_size)
    seq.block_table = list(range(n_blocks))[::-1]  # deliberately non-contiguous
    rows = []
    while seq.num_computed_tokens < len(seq):
        n = min(chunk or len(seq), len(seq) - seq.num_computed_tokens)
        rows.append(backend.forward([ScheduledSeq(seq, n)], all_logits=True))
        seq.num_computed_tokens += n
    return torch.cat(rows)


@pytest.mark.parametrize("model_type,tie,over", CASES)
def test_logits_match_transformers(model_type, tie, over):
    hf, cfg = tiny_hf_model(model_type, tie, **over)
    ours = ours_from_hf(hf, cfg)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = run_prefill(ours, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_block_size_do_not_change_logits():
    hf, cfg = tiny_hf_model("qwen2")
    ours = ours_from_hf(hf, cfg)
    ids = list(range(3, 60))
    full = run_prefill(ours, ids)
    torch.testing.assert_close(
        run_prefill(ours, ids, block_size=4, chunk=7), full, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        run_prefill(ours, ids, block_size=32, chunk=1), full, atol=1e-5, rtol=1e-5
    )


def test_mixed_prefill_and_decode_batch_equals_separate():
    """A step holding prefill chunks and decodes gives each row the logits it gets alone."""
    hf, cfg = tiny_hf_model("llama")
    ours = ours_from_hf(hf, cfg)
    backend = TorchBackend(ours, EngineConfig(kv_cache_mb=4, block_size=4))
    seqs = [Sequence(str(i), list(range(1 + i, 14 + 3 * i)), SamplingParams()) for i in range(4)]
    next_block = 0
    for s in seqs:
        n = -(-len(s) // 4)
        s.block_table = list(range(next_block, next_block + n))
        next_block += n
    # sequences 0 and 2 have all but their last token cached already: they "decode"
    for s in (seqs[0], seqs[2]):
        backend.forward([ScheduledSeq(s, len(s) - 1)])
        s.num_computed_tokens = len(s) - 1
    batch = [ScheduledSeq(s, len(s) - s.num_computed_tokens) for s in seqs]
    mixed = backend.forward(batch)
    for s, row in zip(seqs, mixed, strict=True):
        ref = run_prefill(ours, s.token_ids)[-1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


def test_forward_stages_equals_forward():
    """The staged forward the quantizers use is the same function as forward."""
    from edgellm.quantize.layerwise import LayerRunner

    hf, cfg = tiny_hf_model("qwen2")
    model = ours_from_hf(hf, cfg)
    layer = model.model.layers[0]
    runner = LayerRunner(model.args, seq_len=24, chunk=2)
    x = torch.randn(5, 24, model.args.hidden_size)
    seen = []
    staged = runner.staged(layer, x, 4, lambda i, inp: seen.append((i, inp.shape)))
    torch.testing.assert_close(staged, runner(layer, x), atol=1e-5, rtol=1e-5)
    assert [i for i, _ in seen] == [0, 1, 2, 3] and seen[3][1] == (5 * 24, 128)


def test_bf16_compute_runs_the_products_in_bf16():
    """LayerRunner(compute=bfloat16): the same function within bf16's rounding, not the
    float32 numbers (the products did run in bf16), float32 out, staged equal to plain."""
    from edgellm.quantize.layerwise import LayerRunner

    hf, cfg = tiny_hf_model("qwen2")
    model = ours_from_hf(hf, cfg)
    layer = model.model.layers[0]
    x = torch.randn(5, 24, model.args.hidden_size)
    ref = LayerRunner(model.args, seq_len=24, chunk=2)(layer, x)
    runner = LayerRunner(model.args, seq_len=24, chunk=2, compute=torch.bfloat16)
    got = runner(layer, x)
    assert got.dtype == torch.float32
    rel = float((got - ref).norm() / (ref - x).norm())
    assert 1e-4 < rel < 3e-2, rel
    staged = runner.staged(layer, x, 4, lambda i, inp: None)
    torch.testing.assert_close(staged, got, atol=0, rtol=0)
    assert not torch.is_autocast_enabled("cpu")  # left as it was
