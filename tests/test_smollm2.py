"""Integration on the real SmolLM2-135M-Instruct against transformers and llama.cpp."""

import math

import numpy as np
import pytest
import torch

from edgellm.eval.perplexity import perplexity, windows
from edgellm.loaders.texts import load_text
from edgellm.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "Les mathématiques sont",
]


@pytest.fixture(scope="module")
def llm():
    from edgellm import LLM

    return LLM(backend="torch", max_num_batched_tokens=512, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


def test_logits_equal_transformers(llm, hf_model):
    ids = llm.tokenizer.encode(load_text("sotu")[:2000], add_special_tokens=False)[:200]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = llm.score(ids)
    expect = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, expect, atol=2e-4, rtol=1e-4)


def test_greedy_matches_transformers_generate(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                min_new_tokens=32,
                pad_token_id=2,
            )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.text
    assert out.outputs[0].finish_reason == "stop"


def test_streaming_equals_final_text(llm):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40)
    messages = [{"role": "user", "content": "Write one sentence in Chinese and one emoji."}]
    text = "".join(llm.stream_chat(messages, params))
    assert text == llm.last_output.text
    assert "\ufffd" not in text


def test_perplexity_agrees_with_llama_cpp(llm, smollm2_path):
    from llama_cpp import Llama

    tokens = llm.tokenizer.encode(load_text("sotu"), add_special_tokens=False)[:1536]
    ours = perplexity(llm.score, tokens, ctx=512)
    lcpp = Llama(
        model_path=str(smollm2_path), n_ctx=512, n_batch=512, logits_all=True, verbose=False
    )
    nll, count = 0.0, 0
    for begin, end, first in windows(len(tokens), 512, 512):
        lcpp.reset()
        lcpp.eval(tokens[begin:end])
        logits = torch.from_numpy(np.array(lcpp.scores[: end - begin], dtype=np.float32))
        logp = logits.log_softmax(-1)[:-1].gather(
            1, torch.tensor(tokens[begin + 1 : end])[:, None]
        )[:, 0]
        nll -= float(logp[first - begin - 1 :].double().sum())
        count += end - first
    theirs = math.exp(nll / count)
    assert count == ours.tokens_scored
    assert abs(ours.ppl / theirs - 1) < 0.01, (ours.ppl, theirs)


def test_convert_loads_in_transformers_with_identical_logits(tmp_path, llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgellm.quantize.export_hf import convert_to_hf

    out = convert_to_hf(None, tmp_path / "smol", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "The State of the Union is strong. 世界 🙂"
    ids = llm.tokenizer.encode(text)
    assert tok(text)["input_ids"] == ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expect = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(llm.score(ids), expect, atol=1e-4, rtol=1e-4)
    # our own loader reads the converted directory too, and the source GGUF is untouched
    from edgellm.loaders.model import load_model

    assert load_model(out).args == llm.loaded.args.__class__(
        **{**_asdict(llm.loaded.args), "rope_scaling": None}
    )


def _asdict(args):
    from dataclasses import asdict

    return asdict(args)
