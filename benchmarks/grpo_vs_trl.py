"""GRPO step one, ours against TRL 1.16.0's GRPOTrainer, on the same fixed rollouts of a tiny random Llama.

    .venv/bin/python benchmarks/grpo_vs_trl.py --trl-path /tmp/trl_pkgs   # TRL installed with
        .venv/bin/pip install --no-deps --target /tmp/trl_pkgs trl==1.16.0   (its other needs are in our venv)
    .venv/bin/python benchmarks/grpo_vs_trl.py --cli all    # ours through `finetune train` for every case (slow)
    .venv/bin/python benchmarks/grpo_vs_trl.py --pins       # also print TRL's figures as tests/rl/test_grpo_trl.py pins
    .venv/bin/python benchmarks/grpo_vs_trl.py --trl-path /tmp/trl_pkgs --only multiturn   # issue 42's cases only

One optimizer step of a 2-layer Llama (hidden 32, vocabulary 1024, float32, CPU, weights drawn from a seeded
generator: `write_model`) on 16 replayed completions (4 groups of 4, `write_replay`), for each TRL loss_type and
our grpo.normalize (dapo = tokens, grpo = sequences, dr_grpo = constant) x scale_rewards (group, batch, none) x
beta (0; 0.04 against a separate reference model) x split (micro 16 x accumulation 1, 4 x 4, 1 x 16). Printed:
both step-one losses and pre-clip gradient norms, their relative differences, and the relative difference of the
whole gradient (||ours - TRL|| / ||TRL||). Then TRL's bnpo (per-micro-batch token mean) at each split against its
own one-batch step, which we do not reproduce on purpose.

Multi-turn (issue 42; rows "mt16-..." and "mt64-..."): the same grid on the first 16 rollouts of
examples/data/grpo_replay_multiturn.jsonl (step one of examples/yaml/grpo-replay-multiturn.yaml: 4 groups, 12 of the
16 calling the calculator tool, whose result and the template's headers are 12 environment tokens, env_mask 0), the
lines copied as they are (`write_multiturn_replay`). TRL's rollout function returns each line's `env_mask` (all 1s
for a line without one: a completion the policy wrote alone), which GRPOTrainer multiplies into its loss mask;
max_new_tokens = max_completion_length = 128 (grpo.max_new_tokens' default, the example recipe's; dr_grpo's
constant). Extra rows: the whole file as one step (mt64, 16 x 4), plain k3, temperature 0.7, and rollouts carrying
the policy's log-probabilities with the environment's left null.

Ours: the trainer's own step functions (train/parts.py load_parts and plan_for, the collated micro-batches,
train/step.py step_counts, forward_backward, clip_gradients, read_step: what `finetune train` runs) for every
case, and the real CLI (`finetune train` with train.max_steps 1, figures read from metrics.jsonl) for the cases of
`--cli` (default: one per normalize and beta at 4 x 4). TRL: GRPOTrainer with its `rollout_func` hook returning
the replayed ids, so everything after generation (padding, masks, rewards to advantages, log-probabilities, the
loss and its normalizer, accumulation, clipping) is TRL's code; each completion's reward is looked up by a reward
function from a field the rollout function returns. Its loss and pre-clip norm come from the trainer's log, its
gradient from a callback before the optimizer step (max_grad_norm 1e9 on both sides: nothing is clipped).

Conventions that had to match (docs/rl-trl-figures.md):
  * Prompts of equal length (6 ids). TRL left-pads prompts and passes no position_ids, so a padded prompt's
    positions start later; under RoPE that is the same maths but not the same float rounding. `--varied-prompts`
    measures that case.
  * The reference: TRL 1.16's GRPOTrainer has no ref_model argument; it loads the reference from the policy's
    config._name_or_path (trl/trainer/grpo_trainer.py, `create_model_from_path(get_config_model_id(...))`), which
    we point at the reference directory, so TRL's own code loads and prepares it. Ours: grpo.reference: PATH.
  * bf16=False: TRL's GRPOConfig defaults to bf16=True, on a CPU too; left so, its step-one loss still agreed
    within 1.4e-7 but its gradient moved by 1.4 % (the row "-trlbf16").
  * max_completion_length 16 = grpo.max_new_tokens (dr_grpo's constant); temperature 1; shuffle_dataset off
    (TRL's generation batch is still shuffled before the split: it changes no sum but bnpo's).
Rows marked "!" show settings where the two differ, left out of the worst difference: TRL's bf16 default. Rows
"-t0.7" (both score logits / temperature, policy and reference) and "-lp0.05" (rollouts whose `logprobs` are off
the policy's by N(0, 0.05): with grpo.ratio_against: policy, the default, both take the ratio against the
policy's own log-probabilities and ignore them) should match.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): trl_compare beside it
    sys.path.append(str(Path(__file__).resolve().parent))
import trl_compare  # noqa: E402

ROOT = trl_compare.ROOT
ours_step, rel = trl_compare.ours_step, trl_compare.rel  # the tests' bench.ours_step and bench.rel

TOKENIZER = ROOT / "examples" / "tokenizer"
# The tiny Llama: vocabulary = the example tokenizer's 1024 tokens; pad 0, bos 1, eos 2 (<|im_end|>), as it has.
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
GROUP_SIZE, MAX_NEW, EOS = 4, 16, 2
# Each group's rewards: none constant, non-binary, so group and batch scaling differ.
REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 2.0, 1.0, 1.0], [0.25, 0.75, 0.5, 1.0], [1.0, 1.0, 0.0, 1.0]]
LOSS_TYPE = {"tokens": "dapo", "sequences": "grpo", "constant": "dr_grpo"}
SCALES = ("group", "batch", "none")
BETAS = (0.0, 0.04)
SPLITS = ((16, 1), (4, 4), (1, 16))
MULTITURN = ROOT / "examples" / "data" / "grpo_replay_multiturn.jsonl"
MULTITURN_MAX_NEW = 128  # grpo.max_new_tokens' default, as examples/yaml/grpo-replay-multiturn.yaml runs; >= 74 ids


# --- the fixed inputs: model, reference, rollouts ------------------------------------------------------------

def write_model(path: Path, seed: int, base: Path | None = None, mix: float = 0.3) -> Path:
    """A tiny Llama whose every weight comes from torch.Generator(seed), parameters in name order (transformers'
    own init is overwritten, so a change there changes nothing): norms 1 + 0.1 N, the (tied) embedding 0.3 N,
    linear layers N / sqrt(fan_in): logits of std ~1.7, far from uniform. With `base`, base's weights plus `mix`
    times those: a reference model near the policy."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG))
    start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict() if base else None
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            fresh = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:
                value = 0.1 * fresh + (0 if start else 1)
            elif "embed_tokens" in name:
                value = 0.3 * fresh
            else:
                value = fresh / math.sqrt(param.shape[1])
            param.copy_(start[name] + mix * value if start else value)
    model.save_pretrained(path)
    return path


def write_models(work: Path) -> tuple[Path, Path]:
    """(the policy, a reference near it) as model directories."""
    policy = write_model(work / "policy", seed=0)
    return policy, write_model(work / "reference", seed=1, base=policy)


def weights_digest(path: Path) -> str:
    """sha256 of a model directory's tensors (names, shapes and bytes in name order): the same model, whatever
    the file's metadata."""
    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(path / "model.safetensors")).items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_replay(path: Path, varied_prompts: bool = False, seed: int = 0) -> Path:
    """16 rollouts in 4 groups: prompts of 6 random ids (3 to 9 with varied_prompts), completions of 1 to 12
    random ids, half of them then ending with the end token 2 (the others are truncated), rewards REWARDS."""
    rng = random.Random(seed)
    lines = []
    for group, rewards in enumerate(REWARDS):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 10) if varied_prompts else 6)]
        for reward in rewards:
            completion = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 13))]
            completion += [EOS] if rng.random() < 0.5 else []
            lines.append({"group": group, "prompt_ids": prompt, "completion_ids": completion, "reward": reward})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@dataclass(frozen=True)
class Case:
    """One step-one comparison."""

    normalize: str = "tokens"
    scale: str = "group"
    beta: float = 0.0
    micro: int = 16
    accum: int = 1
    mask_truncated: bool = False
    kl_gradient: str = "exact"  # exact = TRL's use_bias_correction_kl (its default); k3 = False
    trl_bf16: bool = False  # TRL only: its GRPOConfig's default bf16=True (autocast, on a CPU too)
    temperature: float = 1.0  # grpo.temperature; TRL's temperature
    logprobs_noise: float | None = None  # rollouts with sampling log-probs: the policy's + N(0, this)
    multiturn: int = 0  # the first N rollouts of MULTITURN (env_mask); 0: write_replay's single-turn rollouts

    @property
    def name(self) -> str:
        extra = ("-masked" if self.mask_truncated else "") + ("-k3" if self.kl_gradient != "exact" else "")
        extra += ("-trlbf16" if self.trl_bf16 else "") + (f"-t{self.temperature:g}" if self.temperature != 1 else "")
        extra += f"-lp{self.logprobs_noise:g}" if self.logprobs_noise is not None else ""
        turns = f"mt{self.multiturn}-" if self.multiturn else ""
        return f"{turns}{self.normalize}-{self.scale}-b{self.beta:g}-{self.micro}x{self.accum}{extra}"

    @property
    def max_new(self) -> int:
        """grpo.max_new_tokens = TRL's max_completion_length: dr_grpo's constant, and at least every completion."""
        return MULTITURN_MAX_NEW if self.multiturn else MAX_NEW

    @property
    def known_difference(self) -> bool:
        """A row that shows a setting where ours and TRL's differ (left out of the worst difference)."""
        return self.trl_bf16


def all_cases(multiturn: int = 0) -> list[Case]:
    return [Case(n, s, b, m, a, multiturn=multiturn) for b in BETAS for n in LOSS_TYPE for s in SCALES
            for m, a in SPLITS]


# Beyond the grid: truncated completions masked, the plain-k3 KL gradient (TRL: use_bias_correction_kl=False), and
# TRL left at its bf16 default against our float32.
EXTRA_CASES = [Case("tokens", "group", 0.04, 4, 4, mask_truncated=True),
               Case("sequences", "group", 0.04, 4, 4, mask_truncated=True),
               Case("constant", "group", 0.04, 4, 4, mask_truncated=True),
               Case("tokens", "group", 0.04, 4, 4, kl_gradient="k3"),
               Case("tokens", "group", 0.04, 4, 4, logprobs_noise=0.0),
               Case("tokens", "group", 0.0, 16, 1, trl_bf16=True),
               Case("tokens", "group", 0.04, 16, 1, temperature=0.7),
               Case("tokens", "group", 0.04, 4, 4, logprobs_noise=0.05)]

# Multi-turn beyond its grid: the whole file as one step of 64 (16 prompts) per normalizer; the plain-k3 KL
# gradient and temperature 0.7 (both score the environment's tokens too, and must still leave them out); rollouts
# with the policy's log-probabilities, null on the environment's tokens (both ignore them: ratio against the policy).
MULTITURN_EXTRA_CASES = [*(Case(n, "group", 0.04, 16, 4, multiturn=64) for n in LOSS_TYPE),
                         Case("tokens", "group", 0.04, 4, 4, kl_gradient="k3", multiturn=16),
                         Case("sequences", "group", 0.04, 16, 1, temperature=0.7, multiturn=16),
                         Case("tokens", "group", 0.04, 4, 4, logprobs_noise=0.05, multiturn=16)]


def write_multiturn_replay(path: Path, lines: int) -> Path:
    """The first `lines` rollouts of examples/data/grpo_replay_multiturn.jsonl, byte for byte (whole groups of 4:
    each step of the example recipe is 16 of them)."""
    path.write_text("".join(MULTITURN.read_text().splitlines(keepends=True)[:lines]))
    return path


def case_files(case: Case, work: Path, inputs: tuple[Path, Path, Path]) -> tuple[Path, Path, Path]:
    """(policy, reference, rollouts) of `case`: the multi-turn ones or `inputs`' own, with log-probabilities when
    the case asks for them (each file written once)."""
    policy, reference, replay = inputs
    if case.multiturn:
        replay = work / f"multiturn-{case.multiturn}.jsonl"
        if not replay.exists():
            write_multiturn_replay(replay, case.multiturn)
    if case.logprobs_noise is not None:
        noisy = replay.with_name(f"{replay.stem}-lp{case.logprobs_noise:g}.jsonl")
        replay = noisy if noisy.exists() else replay_with_logprobs(replay, policy, case.logprobs_noise)
    return policy, reference, replay


def replay_with_logprobs(replay: Path, policy: Path, noise: float, seed: int = 1) -> Path:
    """The rollouts with `logprobs`: the policy's own log-probabilities of each completion token (float64 from
    its logits), plus N(0, noise) (a sampler slightly off the trainer), capped at 0; null on the environment's
    tokens (env_mask 0), which no sampler scored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    rng = random.Random(seed)
    lines = []
    for line in (json.loads(x) for x in replay.read_text().splitlines()):
        ids = torch.tensor([line["prompt_ids"] + line["completion_ids"]])
        start = len(line["prompt_ids"])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, start - 1:-1], -1).gather(1, ids[0, start:, None])
        sampled = [min(0.0, x + rng.gauss(0, noise)) for x in logps[:, 0].tolist()]
        mine = line.get("env_mask") or [1] * len(sampled)
        lines.append({**line, "logprobs": [x if m else None for x, m in zip(sampled, mine, strict=True)]})
    path = replay.with_name(f"{replay.stem}-lp{noise:g}.jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# --- ours ----------------------------------------------------------------------------------------------------

def write_recipe(case: Case, work: Path, policy: Path, reference: Path, replay: Path) -> Path:
    import yaml

    grpo = {"replay": str(replay), "num_generations": GROUP_SIZE, "max_new_tokens": case.max_new, "beta": case.beta,
            "normalize": case.normalize, "scale_rewards": case.scale, "mask_truncated": case.mask_truncated,
            "kl_gradient": case.kl_gradient, "temperature": case.temperature}
    if case.beta:
        grpo["reference"] = str(reference)
    recipe = {
        "output_dir": str(work / f"ours-{case.name}"), "seed": 0,
        "model": {"path": str(policy), "dtype": "float32"},
        "tokenizer": {"path": str(TOKENIZER)},
        "data": {"packing": False, "max_seq_len": 256},
        "train": {"objective": "grpo", "micro_batch_size": case.micro, "gradient_accumulation_steps": case.accum,
                  "max_steps": 1, "lr": 1e-3, "lr_scheduler": "constant", "max_grad_norm": 1e9},
        "grpo": grpo,
        "eval": {"at_start": False, "every_steps": None},
        "logging": {"every_steps": 1},
    }
    path = work / f"ours-{case.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --- TRL -----------------------------------------------------------------------------------------------------

def line_reward(line: dict) -> float:
    """A replay line's total reward as ours reads it with no grpo.rewards weights: `reward`, or the sum of
    `rewards`' non-null values (the multi-turn file's {"exact_answer": ...})."""
    if "reward" in line:
        return line["reward"]
    return sum(v for v in line["rewards"].values() if v is not None)


def trl_step(case: Case, loss_type: str, work: Path, policy: Path, reference: Path, replay: Path
             ) -> tuple[float, float, dict[str, Any]]:
    """(loss, pre-clip grad norm, gradients by name) of TRL's GRPOTrainer's first step on the replayed rollouts."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    lines = [json.loads(x) for x in replay.read_text().splitlines()]
    groups: dict[int, list[dict]] = {}
    for line in lines:
        groups.setdefault(line["group"], []).append(line)

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list]:
        """The replayed completions of each prompt (a group's name), in file order; TRL calls it with every
        prompt repeated num_generations times. Multi-turn rollouts add `env_mask`, one list per completion (a
        line without one is all the policy's: 1s), which GRPOTrainer takes as its tool_mask."""
        seen: Counter = Counter()
        picked = []
        for prompt in prompts:
            group = json.loads(prompt)
            picked.append(groups[group][seen[group]])
            seen[group] += 1
        logprobs = [x["logprobs"] for x in picked] if "logprobs" in picked[0] else None
        out = {"prompt_ids": [x["prompt_ids"] for x in picked], "completion_ids": [x["completion_ids"] for x in
               picked], "logprobs": logprobs, "replay_reward": [line_reward(x) for x in picked]}
        if any("env_mask" in x for x in picked):
            out["env_mask"] = [x.get("env_mask") or [1] * len(x["completion_ids"]) for x in picked]
        return out

    def replay_reward(prompts: list, completions: list, replay_reward: list[float], **kwargs: Any) -> list[float]:
        return list(replay_reward)

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    if case.beta:  # TRL builds its reference from the policy's _name_or_path: point it at ours
        model.config._name_or_path = str(reference)
    output_dir = work / f"trl-{loss_type}-{case.name}"
    step_one = trl_compare.trl_args(output_dir, case.micro, case.accum, case.trl_bf16)
    args = GRPOConfig(
        **step_one, num_generations=GROUP_SIZE, max_completion_length=case.max_new, beta=case.beta,
        loss_type=loss_type, scale_rewards=case.scale, mask_truncated_completions=case.mask_truncated,
        use_bias_correction_kl=case.kl_gradient == "exact", temperature=case.temperature, shuffle_dataset=False)
    return trl_compare.trl_first_step(lambda callbacks: GRPOTrainer(
        model=model, reward_funcs=replay_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [json.dumps(g) for g in groups]}),
        processing_class=AutoTokenizer.from_pretrained(TOKENIZER), rollout_func=rollout_func,
        callbacks=callbacks))


# --- the comparison --------------------------------------------------------------------------------------------

def compare(cases: list[Case], cli: set[str], work: Path, inputs: tuple[Path, Path, Path]) -> list[dict]:
    """Each case: ours (step functions; the CLI too when named in `cli`) and TRL."""
    table = trl_compare.Table(36, 14, 9, 12, 7, zero=True)
    return trl_compare.side_by_side(
        cases, cli, table, lambda case: write_recipe(case, work, *case_files(case, work, inputs)),
        lambda case: trl_step(case, LOSS_TYPE[case.normalize], work, *case_files(case, work, inputs)))


def bnpo(work: Path, inputs: tuple[Path, Path, Path]) -> list[dict]:
    """TRL's bnpo (each micro-batch over its own tokens) at each split against its own one-batch step (= dapo
    = our tokens there), beta 0 and 0.04, scale group."""
    rows = []
    print(f"\n{'bnpo case':<32} {'TRL loss':>14} {'TRL |g|':>12} {'grad rel to 16x1':>17} {'ours tokens |g|':>16}")
    for beta in BETAS:
        one = None
        for micro, accum in SPLITS:
            case = Case("tokens", "group", beta, micro, accum)
            t_loss, t_norm, grads = trl_step(case, "bnpo", work, *inputs)
            one = one or grads
            ours = ours_step(write_recipe(case, work, *inputs))[1]
            rows.append({"case": f"bnpo-{case.name}", "trl_loss": t_loss, "trl_grad_norm": t_norm,
                         "grad_rel_to_one_batch": trl_compare.grad_rel(grads, one),
                         "ours_tokens_grad_norm": ours})
            print(f"{'bnpo-' + case.name:<32} {t_loss:>14.9f} {t_norm:>12.7f} "
                  f"{rows[-1]['grad_rel_to_one_batch']:>17.2e} {ours:>16.7f}", flush=True)
    return rows


def main() -> None:
    cli = [f"{t}{n}-group-b{b:g}-4x4" for t in ("", "mt16-") for b in BETAS for n in LOSS_TYPE]
    parser = trl_compare.make_parser(__doc__, cli, work="models, rollouts and runs")
    parser.add_argument("--only", choices=("single", "multiturn"),
                        help="the single-turn cases (and bnpo) or the multi-turn ones only (default: both)")
    parser.add_argument("--varied-prompts", action="store_true", help="prompts of 3 to 9 ids (TRL left-pads them)")
    parser.add_argument("--quick", action="store_true", help="the split 4 x 4 only")
    trl_compare.add_outputs(parser, "tests/rl/test_grpo_trl.py")
    args = parser.parse_args()
    trl = trl_compare.start_trl(args.trl_path, user_warnings=False)
    import torch

    print(f"TRL {trl.__version__}, torch {torch.__version__}; prompts {'varied' if args.varied_prompts else 'equal'}")
    work = trl_compare.work_dir(args.work, "grpo-vs-trl-")
    policy, reference = write_models(work)
    inputs = (policy, reference, write_replay(work / "replay.jsonl", args.varied_prompts))
    print(f"policy {weights_digest(policy)[:16]}, reference {weights_digest(reference)[:16]}, rollouts "
          f"{hashlib.sha256(inputs[2].read_bytes()).hexdigest()[:16]} (sha256)")
    multiturn = write_multiturn_replay(work / "multiturn-16.jsonl", 16)
    print(f"multi-turn rollouts {hashlib.sha256(multiturn.read_bytes()).hexdigest()[:16]} (sha256; the first 16 "
          f"lines of {MULTITURN.relative_to(ROOT)})")
    cases = []
    for multiturn, extra in ((0, EXTRA_CASES), (16, MULTITURN_EXTRA_CASES)):
        if args.only != ("single" if multiturn else "multiturn"):
            cases += [c for c in all_cases(multiturn) if not args.quick or (c.micro, c.accum) == (4, 4)] + extra
    rows = compare(cases, set(args.cli), work, inputs)
    rows += [] if args.only == "multiturn" else bnpo(work, inputs)
    print(f"\n* a loss that is 0 mathematically: absolute difference\n! a setting where ours and TRL's differ "
          f"(docs/rl-trl-figures.md)\nworst relative difference of a loss or grad norm, ours vs TRL, other rows: "
          f"{trl_compare.worst(rows, whole_gradient=False):.2e}")
    trl_compare.write_json(args.json, rows)
    if args.pins:  # the rows that should match, full precision: tests/rl/test_grpo_trl.py's TRL table
        print(trl_compare.pins(r for r in rows if "loss_rel" in r and not r["known_difference"]), end="")


if __name__ == "__main__":
    main()
