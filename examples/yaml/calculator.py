"""The calculator tool of examples/yaml/grpo-smollm2-tools.yaml (found next to the recipe that names it:
`calculator:multiply`; it runs only with --allow-code, as all code a recipe names)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b
