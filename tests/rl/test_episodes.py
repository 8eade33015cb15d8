"""Multi-turn rollouts (finetune/rl/episodes.py, tools.py, tool_calls.py): a scripted policy (it answers from the
text it is shown, so every case is deterministic) on Qwen2.5's official template, which renders tools and tool calls:
the sampled ids kept, the environment's turns as the template renders them (env_mask 0), TRL's conventions for a tool
that raises, hangs, is unknown or returns something else than text, a call that does not parse, the turn and token
limits, a long result cut, and an environment class (reset, its methods as tools, get_reward)."""

from __future__ import annotations

import time

import pytest
from chat_families import FAMILY

from finetune import dist
from finetune.chat.spans import render_chat
from finetune.errors import UserError
from finetune.recipe import GRPOConfig, Recipe
from finetune.rl.episodes import Episodes
from finetune.rl.live import LiveRollouts
from finetune.rl.prompts import Prompt
from finetune.rl.rewards import Reward, environment_rewards
from finetune.rl.tool_calls import call_parser
from finetune.rl.tools import environment_tools, tool_of

QWEN = FAMILY["qwen2.5"]
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def explode(a: int) -> str:
    """Raise.

    Args:
        a: anything
    """
    raise RuntimeError("tool broke")


def hang(a: int) -> str:
    """Hang.

    Args:
        a: anything
    """
    time.sleep(3600)
    return "never"


def long_text(a: int) -> str:
    """A long result.

    Args:
        a: how many words
    """
    return " ".join(f"word{i}" for i in range(a))


class Scripted:
    """A policy that writes `script(text so far)` and its end token: deterministic turns for the episode loop."""

    def __init__(self, tokenizer, script) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, greedy=False, stop=lambda: False, max_new_tokens=None):
        self.calls.append(max_new_tokens)
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            turn = self.tokenizer(self.script(text), add_special_tokens=False)["input_ids"] + [self.end]
            out.append(turn[:max_new_tokens])
        return out


def call(name: str, **args) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def calls_then_answers(name: str, **args):
    """Calls `name` once, then answers with the last tool result it saw."""
    def script(text: str) -> str:
        if "<tool_response>" not in text:
            return call(name, **args)
        return "The answer is " + text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0] + "."
    return script


def episodes(script, tools, *, env_class=None, **grpo):
    tokenizer = QWEN.build()
    recipe = Recipe(grpo=GRPOConfig(**{"max_new_tokens": 256, "tool_timeout_s": 0.5, **grpo}))
    schemas = [t.schema for t in tools]
    run = Episodes(Scripted(tokenizer, script), tokenizer, recipe, tools, env_class,
                   call_parser(tokenizer, "auto", schemas), {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    prompt = Prompt(QUESTION, [], {"answer": "42"}, "p.jsonl:1", [dict(m) for m in QUESTION])
    return tokenizer, run, run.run([prompt, prompt], False, lambda: False)


def test_a_tool_call_its_result_and_the_answer_keep_the_sampled_ids_and_mask_the_environments():
    tokenizer, run, made = episodes(calls_then_answers("multiply", a=6, b=7), [tool_of(multiply, "t")])
    e = made[0]
    text = tokenizer.decode(e.completion)
    assert text.startswith(call("multiply", a=6, b=7) + "<|im_end|>") and text.endswith("The answer is 42.<|im_end|>")
    env = tokenizer.decode([t for t, m in zip(e.completion, e.env_mask) if not m])
    assert env == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    conversation = [*QUESTION, e.messages[1], {"role": "tool", "name": "multiply", "content": "42"},
                    {"role": "assistant", "content": "The answer is 42."}]
    whole = render_chat(tokenizer, conversation, None, tools=[tool_of(multiply, "t").schema])
    assert whole.startswith(tokenizer.decode(e.prompt_ids + e.completion))  # what the template renders, exactly
    assert (e.turns, e.calls, e.malformed) == (2, 1, False) and run.counts.calls == 2 and run.counts.errors == 0
    assert e.messages[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert "multiply" in tokenizer.decode(e.prompt_ids)  # the prompt offers the tool's schema


@pytest.mark.parametrize(("tool", "name", "result"), [
    (explode, "explode", "{'error': 'tool broke'}"),
    (hang, "hang", "{'error': 'Tool hang did not return within 0.5 s.'}"),
    (multiply, "divide", "{'error': 'Tool divide not found.'}"),
])
def test_a_failing_call_is_its_error_result_and_counted(tool, name, result):
    args = {"a": 6, "b": 7} if name in ("multiply", "divide") else {"a": 1}
    tokenizer, run, made = episodes(calls_then_answers(name, **args), [tool_of(tool, "t")])
    assert made[0].completion_messages[2]["content"] == "The answer is " + result + "."
    assert run.counts.errors == 2 and run.counts.timeouts == (2 if tool is hang else 0)


def test_a_non_text_result_is_given_as_str_as_trl_does():
    def listing(n: int) -> list:
        """A list.

        Args:
            n: its length
        """
        return list(range(n))

    made = episodes(calls_then_answers("listing", n=3), [tool_of(listing, "t")])[2]
    assert made[0].messages[2]["content"] == "[0, 1, 2]"


def test_a_call_that_does_not_parse_ends_the_episode_and_is_counted():
    tokenizer, run, made = episodes(lambda text: '<tool_call>\n{"name": "multiply", "arguments": {"a": 6\n</tool_call>',
                                    [tool_of(multiply, "t")])
    e = made[0]
    assert e.done and e.turns == 1 and e.malformed and e.calls == 0 and 0 not in e.env_mask


def test_max_turns_and_the_token_budget_end_an_episode():
    always = [tool_of(multiply, "t")]
    made = episodes(lambda text: call("multiply", a=1, b=2), always, max_turns=3)[2]
    assert made[0].turns == 3 and made[0].calls == 2  # the third turn's call is not run
    tokenizer, run, made = episodes(lambda text: call("multiply", a=1, b=2), always, max_new_tokens=60, max_turns=8)
    e = made[0]
    assert len(e.completion) <= 60 and e.env_mask[-1] == 1  # the environment's turn that would fill it is dropped
    assert run.generator.calls[0] == 60 and all(b <= 60 for b in run.generator.calls)


def test_a_long_result_is_cut_to_its_token_cap_keeping_the_chosen_end():
    for keep, start in (("head", "word0 word1"), ("tail", "[... ")):
        tokenizer, run, made = episodes(calls_then_answers("long_text", a=400), [tool_of(long_text, "t")],
                                        tool_result_max_tokens=20, tool_result_keep=keep)
        content = made[0].messages[2]["content"]
        assert content.startswith(start) and "tokens cut]" in content and run.counts.cut == 2
        assert len(tokenizer(content.split(" [...")[0] if keep == "head" else content)["input_ids"]) < 40


class Counter:
    """A TRL-style environment: reset(**row) gives an observation, its public methods are tools."""

    def __init__(self) -> None:
        self.total = 0

    def reset(self, prompt=None, answer=None, **row) -> str:
        self.total = 0
        return f" (start from 0; the answer is {answer})"

    def add(self, n: int) -> int:
        """Add to the total.

        Args:
            n: how much
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total == 42)


def test_an_environment_resets_per_rollout_offers_its_methods_and_gives_its_reward():
    tokenizer, run, made = episodes(calls_then_answers("add", n=42), [], env_class=Counter)
    e = made[0]
    assert e.messages[0]["content"] == "What is 6 times 7? (start from 0; the answer is 42)"
    assert made[0].environment is not made[1].environment and e.environment.total == 42
    assert [t.name for t in environment_tools(Counter(), "env")] == ["add"]
    [reward] = environment_rewards(Counter)
    assert reward.name == "Counter" and reward.fn([], [], environments=[x.environment for x in made]) == [1.0, 1.0]


def test_an_environment_that_cannot_start_names_itself_and_the_row():
    class Broken(Counter):
        def reset(self, **row):
            raise KeyError("no task")

    with pytest.raises(UserError, match=r"grpo.environment .* failed to start an episode for p.jsonl:1: KeyError"):
        episodes(calls_then_answers("add", n=1), [], env_class=Broken, environment="tests:Broken")


def test_live_rollouts_give_rewards_the_episodes_messages_and_train_on_their_env_mask():
    tokenizer = QWEN.build()
    recipe = Recipe(grpo=GRPOConfig(num_generations=2, max_new_tokens=256, tools=["m:multiply"]))
    seen = {}

    def judge(prompts, completions, **fields):
        seen["completions"] = completions
        return [1.0 if "42" in c[-1]["content"] else 0.0 for c in completions]

    prompt = Prompt(QUESTION, [], {}, "p.jsonl:1", [dict(m) for m in QUESTION])
    generator = Scripted(tokenizer, calls_then_answers("multiply", a=6, b=7))
    live = LiveRollouts([prompt], recipe, dist.World(), generator, [Reward("judge", 1.0, judge, {})], tokenizer, 2)
    tools = [tool_of(multiply, "t")]
    live.episodes = Episodes(generator, tokenizer, recipe, tools, None,
                             call_parser(tokenizer, "auto", [t.schema for t in tools]),
                             {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    rollouts = live(0)
    assert [r.reward for r in rollouts] == [1.0, 1.0] and all(r.env_mask and 0 in r.env_mask for r in rollouts)
    assert seen["completions"][0][0]["tool_calls"] and seen["completions"][0][1]["role"] == "tool"
    assert live.figures["turns"] == 2.0 and live.figures["tool_calls"] == 1.0 and live.figures["tool_errors"] == 0.0


class ScriptedEngine(Scripted):
    """Scripted, with log-probabilities as the paged engine gives them: token i of call k gets -(k + 1 + i / 100)."""

    def generate(self, prompts, greedy=False, stop=lambda: False, max_new_tokens=None):
        out = super().generate(prompts, greedy, stop, max_new_tokens)
        k = len(self.calls)
        self.logprobs = [[-(k + i / 100) for i in range(len(ids))] for ids in out]
        return out


def test_an_episodes_engine_logprobs_follow_its_policy_tokens_and_reach_the_rollouts():
    """An engine that gives log-probabilities (grpo.engine: paged): an episode keeps one per completion token, the
    engine's for the tokens the policy sampled in each turn, 0.0 for the environment's (never read: no loss), so that
    the importance correction weighs multi-turn rollouts too; an engine without them (generate) gives None."""
    tokenizer = QWEN.build()
    recipe = Recipe(grpo=GRPOConfig(num_generations=2, max_new_tokens=256, tools=["m:multiply"]))
    prompt = Prompt(QUESTION, [], {}, "p.jsonl:1", [dict(m) for m in QUESTION])
    tools = [tool_of(multiply, "t")]
    for engine, logged in ((ScriptedEngine, True), (Scripted, False)):
        generator = engine(tokenizer, calls_then_answers("multiply", a=6, b=7))
        live = LiveRollouts([prompt], recipe, dist.World(), generator,
                            [Reward("one", 1.0, lambda prompts, completions, **_: [1.0] * len(completions), {})],
                            tokenizer, 2)
        live.episodes = Episodes(generator, tokenizer, recipe, tools, None,
                                 call_parser(tokenizer, "auto", [t.schema for t in tools]),
                                 {tokenizer.convert_tokens_to_ids("<|im_end|>")})
        for r in live(0):
            if not logged:
                assert r.logprobs is None
                continue
            assert len(r.logprobs) == len(r.completion_ids) == len(r.env_mask)
            mine = [lp for lp, m in zip(r.logprobs, r.env_mask) if m]
            first = r.env_mask.index(0)  # the first turn ends where the environment's tokens begin
            assert mine == [-(1 + i / 100) for i in range(first)] + [-(2 + i / 100) for i in range(len(mine) - first)]
            assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.env_mask) if not m)


def test_a_run_with_tools_through_the_cli_logs_its_episodes(tmp_path):
    """The tiny random policy rarely writes a call, but the whole path runs: the tools imported with consent, their
    schemas, the parser of the format named, the episodes, and the step line's multi-turn figures."""
    import json

    from grpo_files import write_prompts
    from helpers import QUICKSTART, TINY, run_cli, train_lines

    (tmp_path / "calc.py").write_text("def multiply(a: int, b: int) -> int:\n    \"\"\"Multiply.\n\n    Args:\n"
                                      "        a: the first\n        b: the second\n    \"\"\"\n    return a * b\n")
    prompts = write_prompts(tmp_path / "p.jsonl", 4, 1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {QUICKSTART}\ndatasets: [{{path: {prompts}, format: prompt}}]\neval_datasets: []\n"
                      "data: {packing: false}\n"
                      "train: {objective: grpo, micro_batch_size: 2, gradient_accumulation_steps: 2, max_steps: 1}\n"
                      "grpo: {num_generations: 2, max_new_tokens: 8, tools: ['calc:multiply'], "
                      "tool_call_format: hermes, rewards: [{function: length, args: {target: 4}}]}\n")
    r = run_cli("train", str(recipe), f"output_dir={tmp_path / 'run'}", *TINY, "--allow-code")
    assert r.returncode == 0, r.stderr[-3000:]
    [line] = train_lines(tmp_path / "run")
    assert line["turns"] >= 1.0 and line["tool_calls"] >= 0.0 and "unparsed_calls" in line, json.dumps(line)
    record = json.loads((tmp_path / "run" / "versions.json").read_text())["run"]["code"]
    assert record["grpo.tools.0"]["ref"] == "calc:multiply" and record["grpo.tools.0"]["sha256"]
