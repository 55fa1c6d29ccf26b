"""vLLM's CPU build on the same requests as bench/bench_engine.py; runs inside the peer's own
virtual environment (`make peers`), which has vLLM and not edgellm.

    <vllm venv>/bin/python bench/peer_vllm.py MODEL_DIR REQUESTS.json OUT.json --dtype float32

REQUESTS.json: {"offline": {name: [[prompt ids, max_tokens], ...]}, "single": [prompt ids,
max_tokens], "repeats": n}. OUT.json gets, per offline set and for the single stream, the
seconds of each repeat and the generated token ids (to check that both engines computed the
same thing). The start (model load and compile) is timed separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    work = json.loads(open(args.requests).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )
    result: dict = {"start_s": time.perf_counter() - t0, "offline": {}, "dtype": args.dtype}
    import vllm

    result["version"] = vllm.__version__

    def run(reqs):
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    run([[work["single"][0], 4]])  # warm-up
    for name, reqs in work["offline"].items():
        times = []
        for _ in range(work["repeats"]):
            dt, ids = run(reqs)
            times.append(dt)
            print(f"vllm {name}: {sum(map(len, ids)) / dt:.1f} tok/s", file=sys.stderr, flush=True)
        result["offline"][name] = {"seconds": times, "outputs": ids}
    p, m = work["single"]
    single = []
    for _ in range(work["repeats"]):
        t1, _ = run([[p, 1]])
        tm, ids = run([[p, m]])
        single.append({"first_s": t1, "total_s": tm})
    result["single"] = {"runs": single, "outputs": ids[0]}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
