"""Fixed prompts for alpaca rows (`prompt_template`), as Axolotl's `type: alpaca[:style]` writes them.

`alpaca` is the Stanford Alpaca prompt; `alpaca_chat`, `alpaca_chatml` and `alpaca_phi` are Axolotl's other styles
of it. A row "has an input" when its `input` is a non-empty string; the system line depends on that. The response
is not part of the prompt: it is tokenized on its own (finetune/data/tokenize.py), as Axolotl does.
"""

from __future__ import annotations

SYSTEM_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.")
SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."

# style -> (system line, turn with input, turn without input): str.format templates.
STYLES: dict[str, tuple[str, str, str]] = {
    "alpaca": ("{system}\n\n",
               "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
               "### Instruction:\n{instruction}\n\n### Response:\n"),
    "alpaca_chat": ("SYSTEM: {system}\n",
                    "USER: {instruction}\n{input}\nASSISTANT:",
                    "USER: {instruction}\nASSISTANT:"),
    "alpaca_chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
                      "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
                      "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "alpaca_phi": ("<|system|>\n{system}<|end|>\n",
                   "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
                   "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}


def alpaca_prompt(style: str, instruction: str, input_text: str | None) -> str:
    """The prompt of one alpaca row in `style` (a key of STYLES), everything before the response."""
    system, with_input, without_input = STYLES[style]
    if input_text:
        return system.format(system=SYSTEM_WITH_INPUT) + with_input.format(instruction=instruction, input=input_text)
    return system.format(system=SYSTEM_NO_INPUT) + without_input.format(instruction=instruction)
