"""`edgellm distill`: a smaller or INT4 student learns from its float teacher, on the CPU.

The student is made first, in a work directory beside the output (`OUT.distill-work`):

- `bits=4`: the teacher quantized by our post-training quantizer (`init` = awq | gptq |
  rtn), then its scales / zero points / norms learn against the teacher (DWQ-style);
- pruning options: the teacher pruned (`edgellm prune`), then every weight learns;
- `student=DIR`: an existing student (a pruned float model or an INT checkpoint).

Training windows are disjoint `seq_len`-token slices of the calibration source (for the
built-in `sotu`, the addresses before 2000: the evaluation split `sotu` never overlaps);
a few are held out to measure the KL to the teacher before, during and after. The training
state is saved to the work directory every `save_every_s` seconds and on Ctrl-C / SIGTERM;
`resume=True` continues from it (same options, bit-identical result). The output is the
student's directory with the trained tensors replaced, in their stored dtypes, written
under a temporary name and renamed when complete; the work directory is then removed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from safetensors.torch import load_file, save_file

from edgellm.distill.kd import (
    LOSSES,
    KDOptions,
    Student,
    TrainState,
    held_out_kl,
    prepare_student,
    train,
    windows_ppl,
)
from edgellm.distill.prune import PruneOptions, prune
from edgellm.distill.prune import check_options as check_prune
from edgellm.errors import InvalidParameterError
from edgellm.fsutil import atomic_path, check_output, terminate_raises
from edgellm.loaders.model import LoadedModel, load_model
from edgellm.loaders.texts import BUILTIN, load_text, text_documents
from edgellm.quantize.build import build_model
from edgellm.quantize.calibration import calibration_documents, token_stream
from edgellm.quantize.format import QuantConfig
from edgellm.quantize.pipeline import (
    METHODS,
    QuantizeOptions,
    check_shapes,
    peak_rss_mb,
    quantize,
)
from edgellm.registry import resolve_model
from edgellm.version import __version__

STATE_FILE = "state.pt"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True, slots=True)
class DistillOptions:
    # the student
    bits: int | None = None  # 4 (or 8): distil into INT from `init`
    group_size: int = 128
    symmetric: bool = True
    init: str = "awq"  # rtn | awq | gptq
    drop_layers: int = 0
    mlp_width: int | None = None
    heads: int | None = None
    student: str | None = None  # an existing student instead
    dtype: str = "bfloat16"  # a pruned student's stored weights
    # training
    loss: str = "kl"  # kl | ce (plain fine-tuning, for comparison)
    steps: int = 120
    batch: int = 2
    seq_len: int = 256
    lr: float | None = None  # default: 1e-3 INT (relative to each scale), 1e-4 float
    warmup: int = 10
    freeze_embeddings: bool = True
    calib: str = "sotu"
    chat_template: bool = False
    held_out: int = 8  # windows kept aside for the held-out KL
    evals: int = 5  # held-out KL measured this many times during the run
    seed: int = 0
    save_every_s: float = 300.0

    @property
    def prunes(self) -> bool:
        return bool(self.drop_layers or self.mlp_width or self.heads)

    @property
    def kind(self) -> str:
        if self.student:
            return "student"
        return "int" if self.bits else "pruned" if self.prunes else "none"

    def kd(self, int_student: bool) -> KDOptions:
        lr = self.lr if self.lr is not None else (1e-3 if int_student else 1e-4)
        return KDOptions(
            steps=self.steps, batch=self.batch, lr=lr, warmup=min(self.warmup, self.steps),
            loss=self.loss, freeze_embeddings=self.freeze_embeddings, seed=self.seed,
        )  # fmt: skip


@dataclass(slots=True)
class DistillReport:
    out_dir: str
    options: dict
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    tokens: int = 0  # training tokens seen
    kl_before: float = 0.0  # held-out KL(teacher || student)
    kl_after: float = 0.0
    evals: list[dict] = field(default_factory=list)  # {"step", "tokens", "kl"}
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0


def check_options(opts: DistillOptions) -> None:
    """One clear error for options that cannot work, before anything is read or written."""
    kinds = [k for k, on in (("--bits", opts.bits), ("pruning", opts.prunes)) if on]
    if opts.student and kinds:
        raise InvalidParameterError(f"--student is an existing student: drop {kinds[0]}")
    if len(kinds) == 2:
        raise InvalidParameterError(
            "prune and distil first (--drop-layers/--mlp-width/--heads), then distil the result "
            "into INT4 with --student: one student per run"
        )
    if opts.kind == "none":
        raise InvalidParameterError(
            "nothing to distil into: give --bits 4, pruning (--drop-layers, --mlp-width, "
            "--heads) or --student DIR"
        )
    if opts.bits is not None:
        QuantizeOptions(opts.init, opts.bits, opts.group_size, opts.symmetric)  # validates
    if opts.init not in METHODS:
        raise InvalidParameterError(f"unknown --init {opts.init!r} (choose from {', '.join(METHODS)})")
    if opts.loss not in LOSSES:
        raise InvalidParameterError(f"unknown --loss {opts.loss!r} (choose from {', '.join(LOSSES)})")
    if opts.steps < 1 or opts.batch < 1 or opts.seq_len < 8 or opts.held_out < 1:
        raise InvalidParameterError(
            "--steps and --batch must be >= 1, --seq-len >= 8, --held-out >= 1"
        )
    if opts.lr is not None and not opts.lr > 0:
        raise InvalidParameterError(f"--lr {opts.lr} must be positive")


def split_windows(
    stream: list[int], seq_len: int, held_out: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Disjoint `seq_len` windows of the stream, shuffled: (train [n, L], held out [h, L])."""
    n = len(stream) // seq_len
    if n < held_out + 1:
        raise InvalidParameterError(
            f"the calibration text has {len(stream)} tokens: fewer than {held_out + 1} windows "
            f"of {seq_len} (held out + training)"
        )
    windows = torch.tensor(stream[: n * seq_len]).view(n, seq_len)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return windows[order[held_out:]], windows[order[:held_out]]


def stored_dtypes(loaded: LoadedModel) -> dict[str, torch.dtype]:
    out = {}
    for name in loaded.weights.names():
        d = loaded.weights.info(name).dtype
        out[name] = _DTYPES.get(d, getattr(torch, d, torch.float32))
    return out


def _eval_windows(loaded: LoadedModel, text: str | None, n: int, seq_len: int) -> list[list[int]]:
    if text is None:
        return []
    if text not in BUILTIN:
        raise InvalidParameterError(f"unknown eval text {text!r} (choose from {', '.join(BUILTIN)})")
    full, chars, ids = load_text(text), n * 4, []
    while len(ids) < n and chars < 2 * len(full):  # tokenize no more of the text than needed
        ids = loaded.tokenizer.encode(full[:chars], add_special_tokens=False)
        chars *= 2
    ids = ids[:n]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def work_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir).expanduser()
    return out.with_name(out.name + ".distill-work")


def _record(opts: DistillOptions, teacher: LoadedModel) -> dict:
    return {
        "teacher": str(teacher.path),
        "options": dataclasses.asdict(opts),
        "edgellm_version": __version__,
    }


def _make_student(
    teacher: str | None, opts: DistillOptions, work: Path, progress: bool
) -> Path:
    """The student's starting directory (made once; a resumed run finds it)."""
    if opts.student:
        return resolve_model(opts.student)
    init = work / "student-init"
    if (init / "config.json").exists():
        return init
    if opts.bits:
        q = QuantizeOptions(
            opts.init, opts.bits, opts.group_size, opts.symmetric, opts.calib,
            seed=opts.seed, chat_template=opts.chat_template,
        )  # fmt: skip
        quantize(teacher, str(init), q, force=True, progress=progress)
    else:
        prune(teacher, init, _prune_options(opts), force=True, progress=progress)
    return init


def _prune_options(opts: DistillOptions) -> PruneOptions:
    return PruneOptions(
        opts.drop_layers, opts.mlp_width, opts.heads, calib=opts.calib, seed=opts.seed,
        dtype=opts.dtype,
    )  # fmt: skip


def distill(
    teacher: str | None,
    out_dir: str | Path,
    options: DistillOptions | None = None,
    force: bool = False,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,  # tests: raise KeyboardInterrupt after this many steps
    eval_text: str | None = None,
    eval_tokens: int = 4096,
) -> DistillReport:
    """Distil the float `teacher` into a student written to `out_dir` (see the module doc).

    With `eval_text` (a built-in text: sotu, shakespeare), every evaluation also records
    the student's perplexity on its first `eval_tokens` tokens, in `seq_len` windows."""
    opts = options or DistillOptions()
    check_options(opts)
    if eval_text is not None and set(calibration_documents(opts.calib)) & set(
        text_documents(eval_text)
    ):
        raise InvalidParameterError(
            f"--eval-text {eval_text} is the training text {opts.calib} (or part of it): "
            "choose another"
        )
    t0 = time.perf_counter()
    check_output(out_dir, force, source=resolve_model(teacher), is_dir=True)
    work = work_dir(out_dir)
    state_file = work / STATE_FILE
    state: TrainState | None = None
    if resume:
        if not state_file.exists():
            raise InvalidParameterError(f"--resume: no saved state at {state_file}")
        saved = torch.load(state_file, weights_only=False)
        if saved["options"] != dataclasses.asdict(opts):
            changed = [k for k, v in dataclasses.asdict(opts).items() if saved["options"][k] != v]
            raise InvalidParameterError(
                f"--resume: the saved run used other options ({', '.join(changed)})"
            )
        state = saved["state"]
    elif work.exists():
        if not force:
            raise InvalidParameterError(
                f"{work} holds an interrupted run: pass --resume to continue it or --force to "
                "start over"
            )
        shutil.rmtree(work)
    loaded_teacher = load_model(teacher)
    if loaded_teacher.config and loaded_teacher.config.get("quantization_config"):
        raise InvalidParameterError(f"the teacher {loaded_teacher.path} must be a float model")
    if opts.bits:
        check_shapes(loaded_teacher.args, QuantConfig(opts.bits, opts.group_size, opts.symmetric))
    if opts.prunes:
        check_prune(loaded_teacher.args, _prune_options(opts))
    work.mkdir(parents=True, exist_ok=True)
    student_dir = _make_student(teacher, opts, work, progress)
    loaded = load_model(str(student_dir))
    if loaded.args.vocab_size != loaded_teacher.args.vocab_size:
        raise InvalidParameterError(
            f"the student's vocabulary ({loaded.args.vocab_size}) is not the teacher's "
            f"({loaded_teacher.args.vocab_size})"
        )
    stream = token_stream(loaded_teacher.tokenizer, opts.calib, opts.chat_template)
    train_w, held = split_windows(stream, opts.seq_len, opts.held_out, opts.seed)
    del stream
    ppl_windows = _eval_windows(loaded_teacher, eval_text, eval_tokens, opts.seq_len)
    teacher_model = build_model(loaded_teacher)  # KL targets and the held-out KL
    record = _record(opts, loaded_teacher)
    del loaded_teacher  # its file mapping: only the built model is needed from here
    student = prepare_student(
        build_model(loaded), stored_dtypes(loaded), opts.freeze_embeddings
    )
    del loaded
    kd = opts.kd(int_student=bool(student.quantized))
    report = DistillReport(str(out_dir), dataclasses.asdict(opts))
    report.resumed_from = state.step if state else 0

    def evaluate(step: int) -> None:
        row = {"step": step, "tokens": step * kd.batch * opts.seq_len}
        row["kl"] = held_out_kl(student.model, teacher_model, held)
        if ppl_windows:
            row[f"ppl_{eval_text}"] = windows_ppl(student.model, ppl_windows)
        report.evals.append(row)

    if state is None:
        evaluate(0)
        state = TrainState(evals=report.evals)
    report.evals = state.evals
    every = max(1, kd.steps // max(1, opts.evals))
    last_save = [time.monotonic()]

    def save_state(s: TrainState) -> None:
        tmp = state_file.with_suffix(".tmp")
        torch.save({"options": dataclasses.asdict(opts), "state": s}, tmp)
        tmp.replace(state_file)
        last_save[0] = time.monotonic()

    def after_step(s: TrainState) -> None:
        if s.step % every == 0 or s.step == kd.steps:
            if not s.evals or s.evals[-1]["step"] != s.step:
                evaluate(s.step)
        if time.monotonic() - last_save[0] > opts.save_every_s:
            save_state(s)
        if stop_after is not None and s.step - report.resumed_from >= stop_after:
            raise KeyboardInterrupt

    live = [state]
    try:
        with terminate_raises(), _TrainBar(progress, kd, opts.seq_len, state.step) as on_step:
            live[0] = train(student, teacher_model, train_w, kd, state, on_step, after_step)
    except (KeyboardInterrupt, SystemExit):
        save_state(live[0])
        Console(stderr=True).print(
            f"interrupted at step {live[0].step}/{kd.steps}: state saved in {work}; "
            "run the same command with --resume to continue"
        )
        raise
    state = live[0]
    report.kl_before, report.kl_after = state.evals[0]["kl"], state.evals[-1]["kl"]
    report.losses, report.tokens = state.losses, kd.steps * kd.batch * opts.seq_len
    write_student(student_dir, out_dir, student, record, report, force)
    shutil.rmtree(work, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mb = peak_rss_mb()
    return report


def write_student(
    src: Path, out_dir: str | Path, student: Student, record: dict, report: DistillReport,
    force: bool,
) -> None:  # fmt: skip
    """The student's directory with its trained tensors replaced (same names, shapes, dtypes)."""
    trained = student.export()
    with atomic_path(out_dir, force=force, is_dir=True) as tmp:
        seen = set()
        for f in sorted(Path(src).iterdir()):
            if f.suffix == ".safetensors":
                tensors = load_file(str(f))
                for name in tensors.keys() & trained.keys():
                    new = trained[name]
                    if new.shape != tensors[name].shape or new.dtype != tensors[name].dtype:
                        raise AssertionError(f"{name}: trained {new.shape} {new.dtype}")
                    tensors[name] = new
                    seen.add(name)
                save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
            elif f.is_file() and f.name != "distillation.json":
                shutil.copy2(f, tmp / f.name)
        if missing := set(trained) - seen:
            raise AssertionError(f"trained tensors not in the student: {sorted(missing)[:3]}")
        summary = {
            **record,
            "held_out_kl": {"before": report.kl_before, "after": report.kl_after},
            "tokens": report.tokens,
            "evals": report.evals,
        }
        (tmp / "distillation.json").write_text(json.dumps(summary, indent=2))
        cfg_file = tmp / "config.json"
        cfg = json.loads(cfg_file.read_text())
        if "quantization_config" in cfg:  # our provenance record: the INT checkpoint was distilled
            prov = cfg["quantization_config"].setdefault("edgellm", {})
            prov["distillation"] = {k: summary[k] for k in ("options", "held_out_kl", "tokens")}
            cfg_file.write_text(json.dumps(cfg, indent=2))


class _TrainBar:
    """Rich progress over steps: tokens seen, loss, tokens/s, time left."""

    def __init__(self, enabled: bool, kd: KDOptions, seq_len: int, start: int):
        self.enabled, self.kd, self.seq_len, self.start = enabled, kd, seq_len, start

    def __enter__(self):
        if not self.enabled:
            return lambda step, loss: None
        self.progress = Progress(
            TextColumn(f"distil ({self.kd.loss})"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps {task.fields[tokens]} tokens loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self.progress.__enter__()
        task = self.progress.add_task(
            "", total=self.kd.steps, completed=self.start, tokens="0", loss="-", rate="-"
        )
        t0 = time.perf_counter()
        per_step = self.kd.batch * self.seq_len

        def on_step(step: int, loss: float) -> None:
            done = step + 1 - self.start
            rate = done * per_step / max(time.perf_counter() - t0, 1e-9)
            self.progress.update(
                task, completed=step + 1, tokens=f"{(step + 1) * per_step:,}",
                loss=f"{loss:.4f}", rate=f"{rate:.0f}",
            )  # fmt: skip

        return on_step

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)


def print_report(r: DistillReport) -> None:
    o = r.options
    if o["bits"]:
        kind = f"INT{o['bits']} g{o['group_size']} {'sym' if o['symmetric'] else 'asym'} from {o['init']}"
    elif o["student"]:
        kind = f"student {o['student']}"
    else:
        kind = f"pruned (drop {o['drop_layers']} layers, MLP {o['mlp_width']}, heads {o['heads']})"
    t = Table(title=f"wrote {r.out_dir}", show_header=False, title_justify="left")
    t.add_row("student", kind)
    t.add_row("training", f"{o['loss']}: {o['steps']} steps x {o['batch']} x {o['seq_len']} tokens"
              + (f" (resumed at step {r.resumed_from})" if r.resumed_from else ""))  # fmt: skip
    t.add_row("held-out KL", f"{r.kl_before:.4f} -> {r.kl_after:.4f}")
    for key in (k for k in r.evals[-1] if k.startswith("ppl_")):
        first = next(e[key] for e in r.evals if key in e)
        t.add_row(f"perplexity {key[4:]}", f"{first:.3f} -> {r.evals[-1][key]:.3f}")
    t.add_row("time", f"{r.seconds:.1f} s")
    t.add_row("peak memory", f"{r.peak_rss_mb:.0f} MiB resident")
    Console().print(t)
