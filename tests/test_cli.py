"""The CLI: bad input is one line on stderr with exit code 1, never a traceback."""

import json
import shutil
import sys

import pytest

from edgellm.entrypoints import cli


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["edgellm", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def assert_one_line_error(code, err, needle: str):
    assert code == 1
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0], lines[0]


def write_tiny_gguf(path, arch: str = "llama", truncate: bool = False):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 64])


def test_missing_file(capsys, monkeypatch, tmp_path):
    code, _, err = run_cli(["info", str(tmp_path / "nope.gguf")], capsys, monkeypatch)
    assert_one_line_error(code, err, "not found")


def test_not_a_gguf(capsys, monkeypatch, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("hello, I am not a model")
    code, _, err = run_cli(["info", str(bad)], capsys, monkeypatch)
    assert_one_line_error(code, err, "not a GGUF file")


def test_truncated_gguf(capsys, monkeypatch, tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(smollm2_path.stat().st_size // 2))
    code, _, err = run_cli(["info", str(cut)], capsys, monkeypatch)
    assert_one_line_error(code, err, "truncated")
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, truncate=True)
    code, _, err = run_cli(["info", str(tiny)], capsys, monkeypatch)
    assert code == 1 and err.startswith("error:") and "Traceback" not in err


def test_unknown_architecture(capsys, monkeypatch, tmp_path):
    g = tmp_path / "falcon.gguf"
    write_tiny_gguf(g, arch="falcon")
    code, _, err = run_cli(["info", str(g)], capsys, monkeypatch)
    assert_one_line_error(code, err, "unsupported GGUF architecture 'falcon'")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    code, _, err = run_cli(["info", str(d)], capsys, monkeypatch)
    assert_one_line_error(code, err, "unsupported architecture 'gpt_neox'")


def test_missing_tokenizer(capsys, monkeypatch, tmp_path):
    from tests.conftest import tiny_hf_model

    hf, _ = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "notok")
    capsys.readouterr()  # transformers' own progress output
    code, _, err = run_cli(["generate", "hi", "-m", str(tmp_path / "notok")], capsys, monkeypatch)
    assert_one_line_error(code, err, "tokenizer.json")


def test_prompt_longer_than_context(capsys, monkeypatch):
    code, _, err = run_cli(["generate", "word " * 40, "--ctx", "16"], capsys, monkeypatch)
    assert_one_line_error(code, err, "context holds 16")


@pytest.mark.parametrize("opt", [["--temperature", "-1"], ["--top-p", "0"], ["--max-tokens", "0"]])
def test_invalid_sampling_values(capsys, monkeypatch, opt):
    code, _, err = run_cli(["generate", "hi", *opt], capsys, monkeypatch)
    assert_one_line_error(code, err, "invalid sampling parameters")


def test_generate_and_info_work(capsys, monkeypatch):
    code, out, err = run_cli(
        ["generate", "--chat", "What is the capital of France?", "-n", "16"], capsys, monkeypatch
    )
    assert code in (0, None) and "Paris" in out
    code, out, _ = run_cli(["info"], capsys, monkeypatch)
    assert "llama" in out and "Q4_1" in out and "134.5M" in out


def test_convert_refuses_to_overwrite_and_leaves_no_partial_output(capsys, monkeypatch, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["convert", "smollm2-135m", str(out)], capsys, monkeypatch)
    assert_one_line_error(code, err, "exists")
    assert (out / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    shutil.rmtree(out)


def test_every_model_command_defaults_to_backend_auto():
    """`--backend auto` is the default wherever a model runs (typer keeps the defaults)."""
    import inspect

    commands = [c.callback for c in cli.app.registered_commands]
    commands += [
        c.callback for g in cli.app.registered_groups for c in g.typer_instance.registered_commands
    ]
    with_backend = [f for f in commands if "backend" in inspect.signature(f).parameters]
    assert {f.__name__ for f in with_backend} >= {"generate", "chat", "serve", "bench", "eval_ppl"}
    for f in with_backend:
        assert inspect.signature(f).parameters["backend"].default == "auto", f.__name__


def test_python_dash_m_edgellm_is_the_cli():
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "edgellm", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "quantize" in r.stdout and "serve" in r.stdout


@pytest.mark.slow
def test_llama_cpp_logs_reach_the_terminal_only_with_verbose():
    import subprocess

    base = [sys.executable, "-m", "edgellm", "generate", "hi", "-n", "2", "-b", "llamacpp"]
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "llama_context" not in quiet.stderr and "n_ctx" not in quiet.stderr
    loud = subprocess.run([*base, "--verbose"], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0 and "llama_context" in loud.stderr


@pytest.mark.parametrize(
    ("opt", "needle"),
    [
        (["--kv-cache-mb", "0"], "kv_cache_mb must be positive"),
        (["--dtype", "float8"], "unknown dtype"),
        (["-b", "mlx-metal"], "unknown backend"),
    ],
)
def test_engine_options_are_checked_by_engine_config(capsys, monkeypatch, opt, needle):
    code, _, err = run_cli(["generate", "hi", *opt], capsys, monkeypatch)
    assert_one_line_error(code, err, needle)
