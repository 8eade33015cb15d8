"""Masking long chats: seconds to tokenize and mask one conversation of N messages, per chat-template family.

    .venv/bin/python benchmarks/chat_masking.py                        # 2,000 and 10,000 messages, 4 families
    .venv/bin/python benchmarks/chat_masking.py --messages 400 --one-by-one --families qwen2.5 mistral-nemo

Each message is located with four renderings of the conversation whatever its length (finetune/chat/regions.py),
so the time grows linearly with N. `--one-by-one` also times locating the messages one rendering per message, the
way used for a conversation the fast way cannot check (quadratic: keep N small). Families and tokenizers are the
ones the tests use (tests/chat_families.py: vendored, offline). Timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from chat_families import FAMILY  # noqa: E402

from finetune.chat.regions import regions_one_by_one  # noqa: E402
from finetune.chat.spans import render_chat  # noqa: E402
from finetune.data.formats import to_example  # noqa: E402
from finetune.data.sources import RawRow  # noqa: E402
from finetune.data.tokenize import tokenize_example  # noqa: E402


def conversation(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i // 2}: what is {i} + {i}?"} if i % 2 == 0
            else {"role": "assistant", "content": f"It is {i - 1}."} for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--families", nargs="+", default=["qwen2.5", "llama3.1", "mistral-nemo", "gpt-oss"])
    parser.add_argument("--one-by-one", action="store_true", help="also time one rendering per message")
    args = parser.parse_args(argv)
    print(f"{'family':<20} {'messages':>8} {'tokens':>8} {'masking s':>10}" + ("  one-by-one s" if args.one_by_one else ""))
    for name in args.families:
        family = FAMILY[name]
        tokenizer = family.build()
        for n in args.messages:
            messages = conversation(n)
            example = to_example(RawRow({"messages": messages}, "bench:1"), "chat")
            started = time.perf_counter()
            sample = tokenize_example(example, tokenizer, family.kwargs)
            line = f"{name:<20} {n:>8} {len(sample['input_ids']):>8} {time.perf_counter() - started:>10.2f}"
            if args.one_by_one:
                render = functools.partial(render_chat, tokenizer, template_kwargs=family.kwargs)
                started = time.perf_counter()
                regions_one_by_one(render, messages, render(messages))
                line += f"  {time.perf_counter() - started:>12.2f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
