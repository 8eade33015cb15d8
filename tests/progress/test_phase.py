"""A long phase's progress (finetune/progress/phase.py): off a terminal one line per update and never a carriage
return, on a terminal one line rewritten in place; a quick phase says nothing; the libraries' bars are off in a
captured log of a real run; a hub id that cannot be reached is one line, not a minute of retries."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import pytest
from helpers import QUICKSTART, ROOT, TINY, run_cli

from finetune.progress import Phase
from finetune.progress import phase as phase_module


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_update_is_a_line_with_rate_and_time_left(monkeypatch):
    monkeypatch.setattr(phase_module, "DELAY_S", 0.0)
    log = io.StringIO()
    ticks = threading.Event()
    with Phase("reference log-probabilities", total=100, unit="pairs", every=0.05, stream=log) as phase:
        phase.advance(40)
        ticks.wait(0.3)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 3, lines
    assert lines[1].startswith("reference log-probabilities: 40/100 pairs (") and "/s, about " in lines[1], lines
    assert lines[-1].startswith("reference log-probabilities: 40 pairs done in "), lines


def test_on_a_terminal_the_line_is_rewritten_in_place(monkeypatch):
    monkeypatch.setattr(phase_module, "DELAY_S", 0.0)
    screen = Terminal()
    with Phase("model: de-quantizing m.gguf (GGUF)", every=0.05, stream=screen):
        threading.Event().wait(0.2)
    text = screen.getvalue()
    assert text.startswith("\r\x1b[Kmodel: de-quantizing m.gguf (GGUF): 0s so far") and text.endswith("\n")
    assert text.count("\n") == 1  # one line, ended when the phase ends


def test_a_quick_phase_says_nothing_and_an_error_leaves_no_done_line():
    log = io.StringIO()
    with Phase("quick", total=3, stream=log) as phase:
        phase.advance(3)
    assert log.getvalue() == ""
    with pytest.raises(KeyError), Phase("failing", stream=log):
        raise KeyError("x")
    assert "done" not in log.getvalue()


def test_a_real_runs_captured_log_has_no_carriage_returns(tmp_path):
    """A pretrained tiny model (transformers draws a 'Loading weights' bar when it loads one) trained with stdout and
    stderr piped, in a plain process: the log holds lines only."""
    from conftest import TINY_MODEL_CONFIG
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_MODEL_CONFIG, vocab_size=1024)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TQDM_DISABLE", None), env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run([sys.executable, "-m", "finetune", "train", str(QUICKSTART), *TINY,
                           "model.init=pretrained", f"model.path={tmp_path / 'model'}", "model.config=null",
                           "train.max_steps=2", f"output_dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


def test_a_hub_id_the_hub_cannot_give_is_one_line_at_once(tmp_path):
    r = run_cli("train", str(QUICKSTART), *TINY, "model.init=pretrained", "model.path=no-org/no-model",
                "model.config=null", f"output_dir={tmp_path / 'run'}", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Retrying" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: model.path: 'no-org/no-model' is a hub id, and the hub cannot be reached from this machine (no "
        "connection to https://huggingface.co within 3 s, or HF_HUB_OFFLINE is set) nor is it in the local cache: "
        "download it where there is a network (hf download no-org/no-model), or set model.path to a local directory")


def test_a_cached_hub_model_loads_from_the_cache_alone(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from finetune.model import hub

    snapshot = tmp_path / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_reachable.cache_clear()
    try:
        assert hub.local_files_only("org/cached", "model.path") is True
        assert hub.local_files_only(str(tmp_path), "model.path") is False  # a local folder is not a hub id
        with pytest.raises(Exception, match="'org/missing' is a hub id"):
            hub.local_files_only("org/missing", "model.path")
    finally:
        hub.hub_reachable.cache_clear()
