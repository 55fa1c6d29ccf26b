"""Outputs never cost anything but themselves: source models, unrelated files and the old
output survive refused, failed and interrupted runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgellm.errors import InvalidParameterError, OutputExistsError
from edgellm.fsutil import atomic_path, check_output
from edgellm.quantize.export_gguf import export_gguf
from edgellm.quantize.export_hf import convert_to_hf
from edgellm.quantize.pipeline import QuantizeOptions, quantize

from .conftest import tiny_hf_model

EDGELLM = str(Path(sys.executable).with_name("edgellm"))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture()
def workdir(tmp_path) -> Path:
    """DIR holding a source model (tiny HF directory) and a file of the user's."""
    hf, _ = tiny_hf_model()
    hf.save_pretrained(tmp_path / "work" / "src")
    (tmp_path / "work" / "notes.txt").write_text("mine")
    return tmp_path / "work"


@pytest.mark.parametrize(
    "out, message",
    [(".", "contains the source"), ("src", "is the source"), ("src/q", "inside the source")],
)
def test_quantize_refuses_output_overlapping_source(workdir, out, message):
    before = _snapshot(workdir)
    with pytest.raises(InvalidParameterError, match=message):
        quantize(str(workdir / "src"), str(workdir / out), QuantizeOptions("rtn"), force=True)
    assert _snapshot(workdir) == before


def test_exports_refuse_output_overlapping_source(workdir):
    before = _snapshot(workdir)
    with pytest.raises(InvalidParameterError, match="contains the source"):
        convert_to_hf(str(workdir / "src"), workdir, force=True)
    with pytest.raises(InvalidParameterError, match="inside the source"):
        export_gguf(workdir / "src", workdir / "src" / "m.gguf", force=True)
    assert _snapshot(workdir) == before


def test_force_replaces_only_a_previous_model_output(tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"x")
    with pytest.raises(InvalidParameterError, match="other files"):
        check_output(other, force=True, is_dir=True)
    with pytest.raises(InvalidParameterError, match="is a directory"):
        check_output(other, force=True)  # a file output over a directory
    with pytest.raises(OutputExistsError):
        check_output(other / "a.jpg", force=False)
    model = tmp_path / "old-checkpoint"
    model.mkdir()
    (model / "config.json").write_text("{}")
    check_output(model, force=True, is_dir=True)  # a previous output: replaceable
    check_output(tmp_path / "empty-new" / "deeper", force=False, is_dir=True)


def test_output_location_is_checked_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(InvalidParameterError, match="is a file, not a directory"):
        check_output(blocker / "out", force=False, is_dir=True)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(InvalidParameterError, match="not writable"):
            check_output(ro / "out", force=False)
    # quantize of a model that does not even exist fails on the output first, loading nothing
    with pytest.raises(InvalidParameterError, match="is a file"):
        quantize("smollm2-135m", str(blocker / "out"), QuantizeOptions("rtn"))


def test_failed_write_keeps_old_output_and_leaves_no_partial(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(out, force=True, is_dir=True) as tmp:
        (tmp / "config.json").write_text("new")
        raise RuntimeError("writer failed")
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_sigterm_during_quantize_removes_the_partial_output(tmp_path):
    """A real `edgellm quantize` killed with SIGTERM mid-write leaves nothing behind."""
    out = tmp_path / "q"
    proc = subprocess.Popen(
        [EDGELLM, "quantize", "smollm2-135m", "-o", str(out), "--method", "rtn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".q.partial-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "quantize never started writing"
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    assert rc == 128 + signal.SIGTERM, proc.stderr.read().decode()
    assert list(tmp_path.iterdir()) == []
