"""SIGTERM during GRPO's generation: the generator asks the stop request between tokens and raises Interrupted
instead of finishing the batch, every rank agrees, and the run stops after the steps done, with their checkpoint
(train/stop.py). Before, a signal that came after a step's counts waited for the whole next batch's generation."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from grpo_files import tiny_lm, write_prompts
from helpers import QUICKSTART, TINY, final_weights, run_cli, train_lines

from finetune import dist
from finetune.errors import Interrupted
from finetune.recipe import GRPOConfig
from finetune.rl.generation import HFGenerator, cut_at_end
from finetune.rl.live import LiveRollouts
from finetune.rl.prompts import Prompt
from finetune.run import checkpoint


class _Pad:
    pad_token_id = 0


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_a_stop_request_cuts_the_generation_short_within_a_token():
    lm = tiny_lm()
    forwards: list[int] = []
    lm.register_forward_hook(lambda *_: forwards.append(1))
    generator = HFGenerator(lm, _Pad(), GRPOConfig(max_new_tokens=40), {2}, torch.device("cpu"), batch_size=2)
    with pytest.raises(Interrupted):
        generator.generate(PROMPTS, stop=lambda: len(forwards) >= 3)
    assert len(forwards) == 3 and lm.training  # asked after each token; the policy is back in training mode
    forwards.clear()
    with pytest.raises(Interrupted):
        generator.generate(PROMPTS, stop=lambda: True)  # asked before the first batch too: nothing generated
    assert forwards == []


def test_a_stop_request_never_made_changes_no_sample():
    lm = tiny_lm().eval()
    cfg = GRPOConfig(max_new_tokens=8)
    generator = HFGenerator(lm, _Pad(), cfg, {2}, torch.device("cpu"), batch_size=4)
    torch.manual_seed(3)
    ours = generator.generate(PROMPTS[:2])
    torch.manual_seed(3)
    ids = torch.tensor([[0, 5, 6, 7], [0, 0, 8, 9]])
    plain = lm.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=8, eos_token_id=[2],
                        pad_token_id=0, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    assert ours == [cut_at_end(row, generator.end_ids) for row in plain[:, 4:].tolist()]


class _Cut:
    def generate(self, prompts, greedy=False, stop=None):
        raise Interrupted


def test_rollouts_cut_short_are_interrupted_whole():
    from finetune.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, [*TINY, "train.objective=grpo", "grpo.num_generations=2", "eval_datasets=[]",
                                      "datasets.0.format=prompt", "data.packing=false",
                                      "grpo.rewards=[{function: length}]"])
    prompts = [Prompt([{"role": "user", "content": "x"}], [5, 6], {}, f"row {i}") for i in range(4)]
    live = LiveRollouts(prompts, recipe, dist.World(), _Cut(), [], None, 4)
    with pytest.raises(Interrupted):
        live(0)
    with pytest.raises(Interrupted):
        live.evaluate(prompts)


REWARDS = """import os, signal
LOG = {log!r}
def length(prompts, completions, **kw):
    with open(LOG, 'a') as f:
        f.write('call\\n')
    if len(open(LOG).read().splitlines()) == {call} and not os.environ.get('NO_STOP'):
        os.kill(os.getpid(), signal.SIGTERM)
    return [float(len(c)) for c in completions]
"""


def _args(tmp_path, out, every, at_start, steps: int = 2) -> list[str]:
    prompts = write_prompts(tmp_path / "p.jsonl", 8, 1)
    return [*TINY, "data.packing=false", "train.objective=grpo", f"datasets.0.path={prompts}",
            "datasets.0.format=prompt", f"eval_datasets=[{{path: {prompts}, format: prompt}}]",
            "grpo.num_generations=4", "grpo.max_new_tokens=4", "grpo.rewards=[{function: 'stop_rewards:length'}]",
            "train.micro_batch_size=4", "train.gradient_accumulation_steps=2", f"train.max_steps={steps}",
            "eval.every_steps=1", f"eval.at_start={str(at_start).lower()}", f"output_dir={out}",
            "model.config.attention_dropout=0.1", "--allow-code",  # the RNG's state must come back too
            *([f"checkpoint.every_steps={every}", "checkpoint.keep_last=5"] if every else [])]


@pytest.mark.parametrize(("call", "every", "at_start", "step"), [(2, None, False, 1), (4, 1, False, 2), (1, None, True, 1)],
                         ids=["eval-1", "eval-2-checkpointing", "eval-at-start"])
def test_sigterm_during_an_eval_stops_before_the_next_generation_and_resume_continues(tmp_path, call, every,
                                                                                       at_start, step):
    """The reward function sends SIGTERM on its `call`-th call, an eval's: 2, the eval after step 1 (4: after step 2,
    with a checkpoint every step, taken after the eval). Before, the next step's rollouts were then generated and
    trained (the signal came after the step's counts); now the run stops after that step, with its checkpoint, and
    the next generation never starts (no further reward call). Stopped in the eval at the start, before any step, a
    fresh run still trains step 1 and stops after it (with no checkpoint, a requeued resume: auto would fail).
    Resumed from the stop in the eval after step 1, the run ends where the uninterrupted one does, bit for bit."""
    (tmp_path / "stop_rewards.py").write_text(REWARDS.format(log=str(tmp_path / "calls"), call=call))
    out = tmp_path / "run"
    steps = step + 1  # the eval after the last step is the final one, which the signal would not stop before
    args = _args(tmp_path, out, every, at_start, steps)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = run_cli("train", str(QUICKSTART), *args, env=env)
    assert r.returncode == 143, r.stderr[-3000:]
    assert f"stopped on SIGTERM after step {step} of {steps}: {out / 'checkpoints' / f'step-{step}'}" in r.stderr, \
        r.stderr[-2000:]
    made = (step + 1) if at_start else 2 * step  # each step's rollouts and its eval (and the one at the start)
    assert (tmp_path / "calls").read_text().splitlines() == ["call"] * made
    assert [x["step"] for x in train_lines(out)] == list(range(1, step + 1))
    assert [p.name for p in checkpoint.complete_checkpoints(out / "checkpoints")] == \
        [f"step-{s}" for s in range(1, step + 1) if every or s == step]
    if every or at_start:  # the resume's exactness is the eval-1 case's to show (and test_grpo_resume.py's)
        return
    env["NO_STOP"] = "1"
    r = run_cli("train", str(QUICKSTART), *args, "resume=auto", env=env)
    assert r.returncode == 0 and f"resumed from {out / 'checkpoints' / f'step-{step}'}" in r.stdout, r.stderr
    straight = tmp_path / "straight"
    assert run_cli("train", str(QUICKSTART), *_args(tmp_path, straight, every, at_start, steps), env=env).returncode == 0
    figures = ("step", "loss", "grad_norm", "reward", "completion_length")
    assert [[x[k] for k in figures] for x in train_lines(out)] == [[x[k] for k in figures] for x in
                                                                   train_lines(straight)]
    ours, theirs = final_weights(out), final_weights(straight)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_sigterm_to_one_rank_while_generating_stops_both_after_the_same_step(tmp_path):
    """Under torchrun only rank 1 gets the signal, inside its reward call of the eval after step 1: that call ends
    there (rl/deadline.py), rank 0 scores its whole share of the eval and then learns from the agreement that rank 1
    was cut short; neither generates step 2's batch (two reward calls each), and both write step 1's checkpoint
    together (a collective: had they disagreed, one would wait forever in the gather while the other saved)."""
    from helpers import run_process

    (tmp_path / "stop_rewards.py").write_text(REWARDS.replace("LOG = {log!r}", "LOG = {log!r} + os.environ['RANK']")
                                              .replace("== {call} and", "== {call} and os.environ['RANK'] == '1' and")
                                              .format(log=str(tmp_path / "calls"), call=2))
    out = tmp_path / "run"
    args = [arg for arg in _args(tmp_path, out, None, False) if not arg.startswith("train.gradient_accumulation")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FINETUNE_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                     "finetune", "train", str(QUICKSTART), *args, "train.gradient_accumulation_steps=1"], env=env,
                    timeout=300)
    text = r.stdout + r.stderr
    assert text.count(f"stopped on SIGTERM after step 1 of 2: {out / 'checkpoints' / 'step-1'}") == 2, text[-3000:]
    assert "exitcode  : 143" in text, text[-3000:]
    calls = [len((tmp_path / f"calls{rank}").read_text().splitlines()) for rank in (0, 1)]
    assert calls == [2, 2], calls
    assert [p.name for p in checkpoint.complete_checkpoints(out / "checkpoints")] == ["step-1"]
