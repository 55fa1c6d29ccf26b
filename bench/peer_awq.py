"""vLLM's llm-compressor quantizing a GGUF model's float weights: the reference AWQ (or its
plain round-to-nearest, as a control) beside ours in bench/bench_awq_peer.py. Runs inside the
peer's own virtual environment (`make peers-llmcompressor`), which has llm-compressor and not
edgellm.

    <venv>/bin/python bench/peer_awq.py MODEL.gguf CALIB.json OUT_DIR --method awq|rtn

The float weights are the GGUF dequantized by transformers' GGUF loader (float32), the same
weights edgellm quantizes from that file. CALIB.json: {"input_ids": [[...], ...]}, edgellm's
own calibration windows, so both quantizers see the same tokens. The checkpoint is saved
compressed (compressed-tensors, pack-quantized): edgellm exports it to GGUF like its own.
Writes OUT_DIR.json: seconds, peak RSS (this process's VmHWM) and versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_scale import vm_hwm_mb  # stdlib only at import: fine in the peer's venv


def float_model(gguf: Path, cache: Path):
    """The GGUF's weights dequantized to float32, saved once as a plain model directory
    (`cache`) and loaded from it: transformers keeps the GGUF's quantization_config on the
    loaded config and will not save a model with it, and llm-compressor looks the model up
    by the directory it came from."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (cache / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        state = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
        cfg = loaded.config.to_dict()
        del loaded
        for key in ("quantization_config", "_name_or_path"):
            cfg.pop(key, None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        tmp = cache.with_name(cache.name + ".partial")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model, state
        tmp.rename(cache)
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(cache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("calib", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--method", choices=("awq", "rtn"), default="awq")
    ap.add_argument("--scheme", default="W4A16", help="W4A16: symmetric INT4, group 128")
    args = ap.parse_args()
    t0 = time.perf_counter()

    import compressed_tensors
    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        # AWQ pins its cached activations for fast copies to a GPU; on a CPU-only machine
        # Tensor.pin_memory() raises. Pinning moves no values: skipping it changes nothing.
        IntermediatesCache.pin_memory = lambda self, *a, **k: None

    model, tok = float_model(args.gguf, args.out.parent / f"{args.gguf.stem}-float32")
    quant = QuantizationModifier(targets=["Linear"], scheme=args.scheme, ignore=["lm_head"])
    if args.method == "awq":
        ids = json.loads(args.calib.read_text())["input_ids"]
        n, seq_len = len(ids), len(ids[0])
        data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq_len] * n})
        # AWQ's defaults: mappings inferred from the architecture, duo scaling, a grid of 20
        t1 = time.perf_counter()
        oneshot(
            model=model, tokenizer=tok, dataset=data, recipe=[AWQModifier(), quant],
            max_seq_length=seq_len, num_calibration_samples=n, shuffle_calibration_samples=False,
        )  # fmt: skip
    else:
        n, t1 = 0, time.perf_counter()
        oneshot(model=model, tokenizer=tok, recipe=[quant])
    quantize_s = time.perf_counter() - t1
    tmp = args.out.with_name(args.out.name + ".partial")
    model.save_pretrained(tmp, save_compressed=True)
    tok.save_pretrained(tmp)
    if args.out.exists():
        import shutil

        shutil.rmtree(args.out)
    tmp.rename(args.out)
    record = {
        "method": args.method, "scheme": args.scheme, "n_samples": n,
        "quantize_s": quantize_s, "seconds": time.perf_counter() - t0, "peak_rss_mb": vm_hwm_mb(),
        "versions": {"llmcompressor": llmcompressor.__version__, "torch": torch.__version__,
                     "compressed_tensors": compressed_tensors.__version__},
    }  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
