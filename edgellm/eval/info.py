"""`edgellm info`: what a model file is, without building the model."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from rich.table import Table

from edgellm.backends.cuda import describe as cuda_describe
from edgellm.backends.memory import MemoryPlan
from edgellm.backends.mlx import describe as mlx_describe
from edgellm.backends.registry import AUTO_ORDER, BACKENDS, resolve_backend
from edgellm.backends.torch import describe as torch_describe
from edgellm.loaders.model import file_size, load_model


@dataclass(slots=True)
class ModelInfo:
    path: str
    format: str
    architecture: str
    parameters: int
    layers: int
    hidden_size: int
    heads: str
    context_length: int
    file_bytes: int
    tensor_types: dict[str, tuple[int, int, float]]  # type -> (tensors, parameters, bits/weight)
    tokenizer: str
    vocab_size: int
    special_tokens: str
    chat_template: str | None

    @property
    def bits_per_weight(self) -> float:
        bits = sum(p * b for _, p, b in self.tensor_types.values())
        return bits / self.parameters if self.parameters else 0.0


def model_info(model: str | None) -> ModelInfo:
    loaded = load_model(model)
    a, tok = loaded.args, loaded.tokenizer
    types: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for name in loaded.weights.names():
        ti = loaded.weights.info(name)
        n = 1
        for s in ti.shape:
            n *= s
        entry = types[ti.dtype]
        entry[0] += 1
        entry[1] += n
        entry[2] = ti.bits_per_weight
    special = ", ".join(
        f"{k}={tok.id_to_token(v)!r}({v})"
        for k, v in (("bos", tok.bos_id), ("eos", tok.eos_id))
        if v is not None
    )
    return ModelInfo(
        str(loaded.path),
        loaded.format,
        a.model_type,
        sum(t[1] for t in types.values()),
        a.num_hidden_layers,
        a.hidden_size,
        f"{a.num_attention_heads} query / {a.num_key_value_heads} KV, head_dim {a.head_dim}",
        a.max_position_embeddings,
        file_size(loaded.path),
        {k: tuple(v) for k, v in types.items()},
        type(tok.backend.model).__name__,
        tok.vocab_size,
        special + f"; stop ids {sorted(tok.stop_ids)}",
        tok.chat_template,
    )


def render_info(info: ModelInfo) -> Table:
    t = Table(title=info.path, show_header=False, title_justify="left")
    rows = [
        ("format", info.format),
        ("architecture", info.architecture),
        ("parameters", f"{info.parameters / 1e6:.1f}M"),
        ("layers / hidden", f"{info.layers} / {info.hidden_size}"),
        ("attention", info.heads),
        ("context length", str(info.context_length)),
        (
            "file size",
            f"{info.file_bytes / 2**20:.1f} MiB ({info.bits_per_weight:.2f} bits/weight)",
        ),
        (
            "tensor types",
            ", ".join(
                f"{k}: {n} tensors, {p / 1e6:.1f}M params, {b:g} b/w"
                for k, (n, p, b) in sorted(info.tensor_types.items())
            ),
        ),
        ("tokenizer", f"{info.tokenizer}, vocab {info.vocab_size}"),
        ("special tokens", info.special_tokens),
        ("chat template", "yes" if info.chat_template else "none (ChatML fallback)"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def backends_table() -> Table:
    """The registered backends, whether this machine can run each, and `auto`'s pick."""
    pick = resolve_backend("auto")
    t = Table(title="backends on this machine", title_justify="left")
    for col in ("backend", "available", "what", "auto"):
        t.add_column(col)
    for name, entry in BACKENDS.items():
        rank = f"#{AUTO_ORDER.index(name) + 1}" if name in AUTO_ORDER else ""
        chosen = "<- picked" if name == pick else rank
        t.add_row(name, "yes" if entry.available() else "no", entry.description, chosen)
    t.caption = f"{torch_describe()}\n{mlx_describe()}\n{cuda_describe()}"
    t.caption_justify = "left"
    return t


def memory_plan_table(plan: MemoryPlan, lengths: tuple[int, ...] = (512, 2048, 8192)) -> Table:
    """`edgellm info --memory-budget`: where the budget goes, and what fits in the KV pool
    with each K/V storage the backend offers."""
    mib = 2**20
    t = Table(
        title=f"memory budget {plan.budget / mib:,.0f} MiB on {plan.backend}", title_justify="left"
    )
    for col in ("", "MiB"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("this process (interpreter, libraries, tokenizer)", f"{plan.base / mib:,.0f}")
    t.add_row("weights", f"{plan.weights / mib:,.0f}")
    t.add_row("working memory (step buffers, runtime)", f"{plan.working / mib:,.0f}")
    name = plan.options[plan.kv_dtype][0]
    t.add_row(f"KV pool ({name}: {plan.tokens:,} tokens)", f"{plan.kv_bytes / mib:,.0f}")
    t.add_row("total", f"{plan.total / mib:,.0f}")
    fits = Table(title="what the KV pool holds", title_justify="left")
    for col in ("K/V", "bytes/token", "tokens", *(f"seqs of {n}" for n in lengths)):
        fits.add_column(col, justify="left" if col == "K/V" else "right")
    for key, (label, per_token, tokens) in plan.options.items():
        mark = " <- planned" if key == plan.kv_dtype else ""
        row = [f"{label} (--kv-cache-dtype {key}){mark}", f"{per_token:,}", f"{tokens:,}"]
        row += [f"{plan.sequences(n, key):,}" for n in lengths]
        fits.add_row(*row)
    grid = Table.grid()
    grid.add_row(t)
    grid.add_row(fits)
    return grid
