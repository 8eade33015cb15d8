"""On-policy distillation (distill.lmbda; finetune/objectives/on_policy.py): a seeded fraction of steps train on the
student's own completions of their rows' prompts; the same completions in every split of the step and after a
resume (bit for bit), the run's RNG untouched by the sampling, and the recipes it cannot serve refused."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from helpers import QUICKSTART, TINY, final_weights, rel_diff, run_cli, teacher_dir, train_lines

from finetune.objectives.on_policy import OnPolicyPlan, completed_row, prompt_of

ON_POLICY = ["train.objective=distill", "distill.max_new_tokens=6", "data.packing=false", "datasets.0.max_rows=24",
             "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return teacher_dir(tmp_path_factory.mktemp("teacher"))


def test_the_prompt_ends_before_the_last_trained_turn_and_only_the_completion_is_trained():
    row = {"input_ids": list(range(10)), "labels": [-100, -100, 2, 3, -100, -100, -100, 7, 8, 9]}
    assert prompt_of(row) == [0, 1, 2, 3, 4, 5, 6]  # the first turn (2, 3) is context now
    assert prompt_of({"input_ids": [0, 1], "labels": [-100, -100]}) == [0, 1]
    done = completed_row([0, 1, 2], [40, 41, 42], None)
    assert done == {"input_ids": [0, 1, 2, 40, 41, 42], "labels": [-100, -100, -100, 40, 41, 42]}
    assert completed_row([0, 1, 2], [40, 41, 42], 4) == {"input_ids": [0, 1, 2, 40], "labels": [-100, -100, -100, 40]}


class _Echo:
    """A generator that answers each prompt with its last token + 100, once per call, drawing from torch's RNG."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, greedy=False, stop=lambda: False, max_new_tokens=None):
        self.calls.append(prompts)
        torch.rand(3)  # sampling draws: the run's own stream must not see them
        self.outputs = [[p[-1] + 100, int(torch.randint(0, 50, ()))] for p in prompts]
        return self.outputs


def test_the_plan_draws_its_steps_from_the_seed_and_leaves_the_rng_alone():
    from finetune.recipe import load_recipe

    samples = [{"input_ids": [1, 2, 3, 4 + i], "labels": [-100, -100, 3, 4 + i]} for i in range(40)]
    recipe = load_recipe(QUICKSTART, ["train.objective=distill", "distill.teacher=x", "distill.lmbda=0.3",
                                      "data.packing=false", "train.micro_batch_size=2",
                                      "train.gradient_accumulation_steps=1", "train.epochs=null",
                                      "train.max_steps=1000"])
    plan = OnPolicyPlan(samples, recipe, 1, _Echo())
    drawn = [plan.on_policy(s) for s in range(1000)]
    assert 250 <= sum(drawn) <= 350 and drawn == [plan.on_policy(s) for s in range(1000)]
    step = drawn.index(True)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    _, rows = plan.step(step)
    assert torch.equal(torch.get_rng_state(), before)
    again = OnPolicyPlan(samples, recipe, 1, _Echo()).step(step)[1]
    assert rows == again  # seeded by (seed, step): the same completions, whatever came before
    for r in rows:
        assert r["labels"][:2] == [-100, -100] and r["input_ids"][2] == r["input_ids"][1] + 100
    assert plan.info(step)["on_policy"] == 1.0 and plan.info(drawn.index(False)) == {"on_policy": 0.0}


@pytest.mark.parametrize("engine", ["generate", "paged"])
def test_on_policy_steps_are_the_same_in_any_split(tmp_path, teacher, engine):
    """Every step on-policy, 24 rows in steps of 8: 8 x 1 and 2 x 4 sample the same completions and train the same
    weights (each tensor within 1e-5), with either engine (distill.engine)."""
    runs = []
    for micro, accumulation in ((8, 1), (2, 4)):
        run = tmp_path / f"m{micro}"
        r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, *ON_POLICY, f"distill.teacher={teacher}",
                    "distill.lmbda=1", f"distill.engine={engine}", f"train.micro_batch_size={micro}",
                    f"train.gradient_accumulation_steps={accumulation}", "train.max_steps=null", "train.epochs=1")
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(run)
    a, b = train_lines(runs[0]), train_lines(runs[1])
    assert len(a) == 3 and all(x["on_policy"] == 1.0 and x["completion_tokens"] > 0 for x in a)
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    ref = final_weights(runs[0])
    for name, weight in final_weights(runs[1]).items():
        assert rel_diff(weight, ref[name]) < 1e-5, name


def test_a_resumed_on_policy_run_is_bitwise_the_straight_one(tmp_path, teacher):
    args = [*TINY, *ON_POLICY, f"distill.teacher={teacher}", "distill.lmbda=0.5", "train.max_steps=6",
            "checkpoint.every_steps=3", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2"]
    straight = tmp_path / "straight"
    r = run_cli("train", str(QUICKSTART), f"output_dir={straight}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = train_lines(straight)
    assert {x["on_policy"] for x in lines} == {0.0, 1.0}  # both kinds of step, before and after the resume
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-6")
    r = run_cli("train", str(QUICKSTART), f"output_dir={resumed}", *args, "resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(x["step"], x["loss"]) for x in train_lines(resumed)] == [(x["step"], x["loss"]) for x in lines]
    wa, wb = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("extra, message", [
    (["data.packing=true"], "distill.lmbda: its steps replace each row"),
    (["distill.teacher=null", "distill.teacher_logprobs=teacher"], "distill.lmbda: sampled completions need"),
    (["distributed.strategy=fsdp"], "distributed.strategy: distill.lmbda samples completions on every rank"),
    (["distill.lmbda=0", "distill.seq_kd=true"], "distill.seq_kd: its steps replace each row"),
])
def test_what_on_policy_cannot_serve_is_refused(extra, message):
    from finetune.errors import UserError
    from finetune.recipe import load_recipe

    with pytest.raises(UserError, match=message):
        load_recipe(QUICKSTART, ["train.objective=distill", "distill.teacher=x", "distill.lmbda=0.5", *extra])


def test_seeded_draws_do_not_depend_on_pythons_global_random():
    random.seed(1)
    from finetune.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, ["train.objective=distill", "distill.teacher=x", "distill.lmbda=0.5",
                                      "data.packing=false"])
    samples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 16
    first = [OnPolicyPlan(samples, recipe, 1, _Echo()).on_policy(s) for s in range(50)]
    random.seed(2)
    assert first == [OnPolicyPlan(samples, recipe, 1, _Echo()).on_policy(s) for s in range(50)]


def test_seq_kd_steps_are_the_teachers_completions():
    """distill.seq_kd: the steps that are not on-policy take the teacher's generator, the others the student's."""
    from finetune.recipe import load_recipe

    samples = [{"input_ids": [1, 2, 3, 4 + i], "labels": [-100, -100, 3, 4 + i]} for i in range(40)]
    recipe = load_recipe(QUICKSTART, ["train.objective=distill", "distill.teacher=x", "distill.lmbda=0.5",
                                      "distill.seq_kd=true", "data.packing=false", "train.micro_batch_size=2",
                                      "train.gradient_accumulation_steps=1"])
    student, teacher = _Echo(), _Echo()
    plan = OnPolicyPlan(samples, recipe, 1, student, teacher)
    kinds = [plan.on_policy(s) for s in range(6)]
    for s in range(6):
        plan.step(s)
        assert plan.info(s)["seq_kd"] == (0.0 if kinds[s] else 1.0) and plan.info(s)["completion_tokens"] == 2
    assert len(student.calls) == sum(kinds) and len(teacher.calls) == 6 - sum(kinds) and 0 < sum(kinds) < 6


def test_a_seq_kd_run_trains_on_the_teachers_completions(tmp_path, teacher):
    run = tmp_path / "seq-kd"
    r = run_cli("train", str(QUICKSTART), f"output_dir={run}", *TINY, *ON_POLICY, f"distill.teacher={teacher}",
                "distill.seq_kd=true", "train.max_steps=2", "eval_datasets.0.max_rows=8")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = train_lines(run)
    assert [x["seq_kd"] for x in lines] == [1.0, 1.0] and all(0 < x["completion_tokens"] <= 6 for x in lines)


def test_an_on_policy_step_is_the_step_on_its_completions_replayed():
    """The rows an on-policy step trains on are exactly the prompts and the sampled completions: collated, they are the
    micro-batches of the same completions given as data (replayed), tensor for tensor."""
    from finetune.data import collate
    from finetune.recipe import load_recipe

    samples = [{"input_ids": [1, 2, 3, 4 + i, 9], "labels": [-100, -100, 3, 4 + i, 9]} for i in range(8)]
    recipe = load_recipe(QUICKSTART, ["train.objective=distill", "distill.teacher=x", "distill.lmbda=1",
                                      "data.packing=false", "train.micro_batch_size=4",
                                      "train.gradient_accumulation_steps=1"])
    student = _Echo()
    _, generated = OnPolicyPlan(samples, recipe, 1, student).step(0)
    # the replay: each sample's prompt (its tokens before the trained turn: [1, 2]) and the completion sampled for it
    replayed = [{"input_ids": [1, 2, *out], "labels": [-100, -100, *out]} for out in student.outputs]
    a, b = collate(generated, recipe.data, 0), collate(replayed, recipe.data, 0)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and a.targets == b.targets == 8
