"""A run stopped by SIGTERM, or killed by SIGKILL, in the middle of an episode (inside a tool call) resumes to the
uninterrupted run's losses and weights bit for bit: the batch cut short is dropped and made again on resume, with new tool calls and the same
seeded sampling (docs/rl.md, "Tools and environments": no environment state is restored, an episode is regenerated).

The policy's turns are scripted (a generator that writes a call to `multiply` with numbers drawn from torch's RNG,
which the run seeds per batch, then the tool's result as its answer), so that every rollout is a two-turn episode;
what trains is the tiny model on those tokens, as with any generator behind the seam."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from grpo_files import write_prompts
from helpers import QUICKSTART, TEST_ENV, TINY, final_weights, run_process

from finetune.errors import Stopped
from finetune.rl import sources
from finetune.rl.generation import HFGenerator

TOOL = '''
import os, signal
from pathlib import Path

def multiply(a: int, b: int) -> int:
    """Multiply.

    Args:
        a: the first
        b: the second
    """
    log = Path(os.environ["CALLS"])
    with log.open("a") as f:
        f.write("call\\n")
    if len(log.read_text().splitlines()) == int(os.environ.get("STOP_AT", "0")):
        # preempted while the tool runs, or killed outright
        os.kill(os.getpid(), signal.SIGKILL if os.environ.get("KILL") else signal.SIGTERM)
    return a * b
'''


class ScriptedPolicy(HFGenerator):
    """Calls multiply with two numbers from torch's RNG, then answers with the tool's result."""

    def generate(self, prompts, greedy=False, stop=lambda: False, max_new_tokens=None):
        tokenizer = self.tokenizer
        out = []
        for ids in prompts:
            text = tokenizer.decode(ids)
            if text.rstrip().endswith("assistant") and "<|im_start|>tool" in text.rsplit("<|im_start|>user", 1)[-1]:
                turn = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
            else:
                a, b = torch.randint(2, 10, (2,)).tolist()
                turn = "<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>"
            if stop():
                from finetune.errors import Interrupted

                raise Interrupted
            out.append(tokenizer(turn, add_special_tokens=False)["input_ids"] + [self.end_ids[0]])
        return out


def scripted_generator(lm, tokenizer, cfg, end_ids, device, batch_size) -> ScriptedPolicy:
    """sources.HFGenerator's stand-in: the scripted policy."""
    policy = ScriptedPolicy(lm, tokenizer, cfg, end_ids, device, batch_size)
    policy.tokenizer = tokenizer
    policy.end_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return policy


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(sources, "HFGenerator", scripted_generator)


def _train(tmp_path, run, resume=False, stop_at=0):
    from rich.console import Console

    from finetune.recipe import load_recipe
    from finetune.train.loop import train

    os.environ["CALLS"], os.environ["STOP_AT"] = str(tmp_path / f"calls-{run}"), str(stop_at)
    prompts = write_prompts(tmp_path / "p.jsonl", 8, 1)
    recipe = load_recipe(QUICKSTART, [*TINY, f"output_dir={tmp_path / run}", "data.packing=false",
                                      "train.objective=grpo", f"datasets.0.path={prompts}", "datasets.0.format=prompt",
                                      "eval_datasets=[]", "grpo.num_generations=2", "grpo.max_new_tokens=64",
                                      "grpo.tools=[steptools:multiply]", "grpo.tool_call_format=hermes",
                                      "grpo.rewards=[{function: length, args: {target: 2, scale: 1}}]",
                                      "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
                                      "train.max_steps=3", "train.warmup_steps=0", "train.lr=1e-2",
                                      "checkpoint.every_steps=1", "checkpoint.keep_last=5",
                                      *(["resume=auto"] if resume else [])], allow_code=True)
    with open(os.devnull, "w") as quiet:
        train(recipe, console=Console(file=quiet))


def test_sigterm_inside_a_tool_call_resumes_bit_for_bit(tmp_path, scripted, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "steptools.py").write_text(TOOL)
    _train(tmp_path, "straight")
    straight = (tmp_path / "calls-straight").read_text().splitlines()
    assert len(straight) == 12  # 3 steps x 4 episodes, one call each
    with pytest.raises(Stopped):
        _train(tmp_path, "stopped", stop_at=6)  # inside step 2's episodes: step 1's checkpoint holds the run
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-1"]
    _train(tmp_path, "stopped", resume=True)
    ours, theirs = final_weights(tmp_path / "stopped"), final_weights(tmp_path / "straight")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    lines = [json.loads(x) for x in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3] and all(x["tool_calls"] == 1.0 for x in lines
                                                                           if "loss" in x)


def test_sigkill_inside_a_tool_call_resumes_bit_for_bit(tmp_path, scripted, monkeypatch):
    """kill -9 while a tool runs, in a child process running the same scripted training: nothing of the episode
    survives but step 1's checkpoint, and the resumed run is the straight one, bit for bit."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "steptools.py").write_text(TOOL)
    _train(tmp_path, "straight")
    here = Path(__file__).resolve().parent
    child = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}, {str(tmp_path)!r}]\n"
             "from pathlib import Path\nimport test_episode_resume as t\nfrom finetune.rl import sources\n"
             f"sources.HFGenerator = t.scripted_generator\nt._train(Path({str(tmp_path)!r}), 'killed', stop_at=7)\n")
    r = run_process([sys.executable, "-c", child], env={**TEST_ENV, "KILL": "1"}, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step-1"]
    _train(tmp_path, "killed", resume=True)
    ours, theirs = final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    lines = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]
