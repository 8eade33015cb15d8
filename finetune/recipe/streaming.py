"""What data.streaming allows. A streamed dataset is read as training goes (finetune/data/stream.py): nothing is
known of it before the run, not its length, not its samples, so whatever needs the whole dataset first is refused
here, before torch is imported, each with why."""

from __future__ import annotations

from finetune.recipe.schema import DataConfig, Recipe

_WHY = "data.streaming"


def streaming_checks(recipe: Recipe) -> list[str]:
    """The recipe's problems with data.streaming (none when it is off, but a stream_buffer set for nothing)."""
    d, t = recipe.data, recipe.train
    if not d.streaming:
        default = DataConfig.model_fields["stream_buffer"].default
        return [] if d.stream_buffer == default else [
            "data.stream_buffer: set, but data.streaming is false; set data.streaming: true to stream the datasets"]
    problems = []
    if t.max_steps is None:
        problems.append(f"train.max_steps: required with {_WHY}: a streamed dataset's length is unknown until it has "
                        "been read, so the run (and its learning-rate schedule) is max_steps optimizer steps long")
    if t.epochs not in (None, 1):
        problems.append(f"train.epochs: {t.epochs}, and with {_WHY} the run is train.max_steps steps long, reading the "
                        "datasets again from their start as often as that takes; leave epochs out (or null)")
    if t.objective != "sft":  # sft's formats (chat, alpaca, completion) are the ones streamed: no format check
        problems.append(f"train.objective: {t.objective} is not streamed ({_WHY} trains sft on chat, alpaca or "
                        "completion rows, packed as they come; preference pairs, prompts and teachers are preprocessed)")
    if d.val_fraction:
        problems.append(f"data.val_fraction: a held-out split needs every row counted before training, which {_WHY} "
                        "never does; give eval_datasets instead (they are preprocessed and cached as usual)")
    if d.deduplicate != "none":
        problems.append(f"data.deduplicate: exact needs every row seen so far, for the whole run and in every "
                        f"checkpoint, which {_WHY} does not keep; deduplicate the corpus before training")
    for section in ("eval", "checkpoint"):
        if getattr(recipe, section).every_epochs is not None:
            problems.append(f"{section}.every_epochs: an epoch's length is unknown with {_WHY}; use "
                            f"{section}.every_steps")
    if recipe.distributed.context_parallel > 1:
        problems.append(f"distributed.context_parallel: not with {_WHY} yet (each data-parallel rank reads its own "
                        "share of the stream; the ranks of a context-parallel group would have to share theirs)")
    return problems
