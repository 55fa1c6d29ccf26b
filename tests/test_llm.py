"""The embedded API on a tiny random model: per-prompt SamplingParams, config overrides."""

from __future__ import annotations

import pytest

from edgellm import LLM, SamplingParams
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from tests.conftest import bpe_tokenizer, tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    hf, _ = tiny_hf_model("llama", vocab_size=264)
    path = tmp_path_factory.mktemp("llm") / "hf"
    hf.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def test_generate_takes_one_sampling_params_per_prompt(tiny_dir):
    llm = LLM(str(tiny_dir), backend="torch", kv_cache_mb=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    per = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
    ]
    both = llm.generate(prompts, per)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, per, strict=True)]
    assert [len(o.outputs[0].token_ids) for o in both] == [5, 9]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(InvalidParameterError, match="2 SamplingParams for 3 prompts"):
        llm.generate([*prompts, [3]], per)
    assert llm.engine.num_unfinished_requests == 0  # the refused call left nothing queued


def test_config_overrides_are_engine_config_fields(tiny_dir):
    llm = LLM(str(tiny_dir), backend="torch", config=EngineConfig(block_size=8), kv_cache_mb=3)
    assert (llm.config.block_size, llm.config.kv_cache_mb) == (8, 3)
    assert llm.backend.block_size == 8 and llm.engine.block_manager.block_size == 8
    with pytest.raises(InvalidParameterError, match="unknown option.*kv_cache_gb"):
        LLM(str(tiny_dir), backend="torch", kv_cache_gb=1)
