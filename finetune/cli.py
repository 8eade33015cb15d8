"""Command line: argv -> recipe -> command. The only module that knows exit codes.

A user error (bad recipe, missing file, bad data row, wrong versions) exits 2 with one clear message and no
traceback; `--debug` shows the traceback. Heavy modules (torch, the trainer) are imported only by the
commands that need them, so `finetune validate` answers in well under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from finetune import __version__
from finetune.errors import EXIT_STOPPED, Stopped, UserError

if TYPE_CHECKING:  # annotations only: the recipe module is imported by the commands that need it
    from finetune.recipe import Recipe

EXIT_USER_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    from finetune.progress import log_friendly_libraries

    log_friendly_libraries()  # before transformers is imported: off a terminal, no carriage-return bars
    parser = build_parser()
    # Options may come before or after the key=value overrides: argparse stops filling `overrides` at the first
    # option, so whatever it leaves over is taken as more overrides (and anything else is an error).
    args, extra = parser.parse_known_args(argv)
    for item in extra:
        if item.startswith("-") or not hasattr(args, "overrides") or "=" not in item:
            print(f"error: {_unrecognized(item, extra, args)}", file=sys.stderr)
            return EXIT_USER_ERROR
        args.overrides.append(item)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        result = args.handler(args)
        return int(result or 0)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Stopped as e:  # SIGTERM: a checkpoint of the last step was written
        print(e, file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _unrecognized(item: str, extra: list[str], args: argparse.Namespace) -> str:
    """What an argument argparse did not take means: an option that is a recipe key (`--max-steps 3` is
    `train.max_steps=3`), a value without its key, or nothing finetune knows."""
    command = getattr(args, "command", None) or ""
    options = [x for x in extra if x.startswith("-")]
    if hasattr(args, "overrides") and options:
        from finetune.recipe.hints import key_for_option

        key = key_for_option(options[0])
        if key is not None:
            after = extra[extra.index(options[0]) + 1:]
            value = options[0].split("=", 1)[1] if "=" in options[0] else \
                after[0] if after and not after[0].startswith("-") else "VALUE"
            return (f"unrecognized option {options[0]}: recipe keys are set as key.path=value after the recipe, "
                    f"e.g. finetune {command} RECIPE {key}={value}")
    if hasattr(args, "overrides") and not item.startswith("-"):
        return (f"unrecognized argument {item!r}: after the recipe come key.path=value overrides (e.g. "
                f"train.lr=1e-4) and options (finetune {command} --help)")
    return f"unrecognized argument: {item} (finetune {command + ' ' if command else ''}--help lists the options)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Config-driven fine-tuning of language models.")
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    sub = parser.add_subparsers(dest="command")

    def command(name: str, handler: Callable, help_text: str, recipe: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if recipe:
            p.add_argument("recipe", help="recipe YAML file, or a recipe name (see `finetune recipes list`)")
            p.add_argument("overrides", nargs="*", metavar="key.path=value",
                           help="override recipe keys; values are parsed as YAML scalars")
            p.add_argument("--allow-code", action="store_true",
                           help="import and run the code the recipe names (reward functions module:function; "
                                "docs/rl.md, 'Code in recipes'): the same trust as running that Python yourself")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        p.set_defaults(handler=handler)
        return p

    p = command("train", cmd_train, "run a recipe")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in output_dir")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="run even if pinned libraries are at other versions (recorded in versions.json)")
    p.add_argument("--nproc", type=int, default=None, help="run data-parallel on N local processes via torchrun")
    command("validate", cmd_validate, "check a recipe and print it fully resolved")
    p = command("preprocess", cmd_preprocess, "tokenize and cache a recipe's data; print dataset and packing "
                "statistics")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="print the first N training samples, trained tokens marked (colored on a terminal)")
    p.add_argument("--rebuild", action="store_true", help="tokenize again even if the cache has this data")
    p = command("eval", cmd_eval, "token-weighted eval loss of a recipe's model, or of a run's trained model "
                                  "(give the run directory as RECIPE)")
    p.add_argument("--model", default=None, help="evaluate this model directory instead (e.g. RUN/final)")
    p = command("verify", cmd_verify, "prove exact gradient accumulation on this recipe's first optimizer step")
    p.add_argument("--world", type=int, default=1, help="simulate this many data-parallel ranks")
    p.add_argument("--reference-micro-batch", type=int, default=None,
                   help="rows per pass of the reference gradient (default: all rows in one batch)")
    p = command("merge", cmd_merge, "merge a run's LoRA adapter into its base model (HF format)", recipe=False)
    p.add_argument("run_dir", help="a run directory (with final/ and recipe.yaml)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/merged)")
    for name, help_text in (("generate", "generate a reply to a prompt with a trained model"),
                            ("chat", "chat interactively with a trained model")):
        p = command(name, cmd_generate, help_text, recipe=False)
        p.add_argument("run_dir", help="a run directory, or an HF model directory")
        if name == "generate":
            p.add_argument("--prompt", required=True, help="the user message")
            p.add_argument("--image", action="append", default=[], metavar="PATH",
                           help="an image put before the prompt's text (a vision-language run; repeat for more)")
        p.add_argument("--system", default=None, help="a system message")
        p.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens")
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with a temperature > 0)")
        p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p = command("plot", cmd_plot, "plot loss, lr, grad norm and throughput of one or more runs", recipe=False)
    p.add_argument("run_dirs", nargs="+", help="run directories")
    p.add_argument("--out", default="curves.png", help="PNG file to write")
    p.add_argument("--x", choices=("steps", "tokens", "samples"), default="tokens", help="x axis")
    p = command("runs", cmd_runs, "compare runs", recipe=False)
    p.add_argument("action", choices=("compare",))
    p.add_argument("run_a")
    p.add_argument("run_b")
    p = command("convert", cmd_convert, "convert another tool's config into a recipe (docs/migrating-from-axolotl.md)",
                recipe=False)
    p.add_argument("tool", choices=("axolotl",), help="the tool the config is for")
    p.add_argument("config", help="the config file (YAML)")
    p.add_argument("-o", "--out", default=None, help="recipe file to write (default: stdout)")
    p.add_argument("--allow-approx", action="store_true",
                   help="accept approximations (each one is announced and listed in the recipe's header)")
    p.add_argument("--allow-template-path", action="store_true",
                   help="read chat_template_jinja from a file outside the config's folder too (its text is copied "
                        "into the recipe)")
    command("env", cmd_env, "show pinned vs installed library versions and the device", recipe=False)
    p = command("schema", cmd_schema, "write the recipe JSON Schema", recipe=False)
    p.add_argument("--out", default=None, help="file to write (default: stdout)")
    _add_recipes_commands(command)
    return parser


def _add_recipes_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """`finetune recipes list|add|update|remove`: the recipe names and the repositories they come from."""
    group = command("recipes", cmd_recipes, "list recipe names; add, update or remove recipe repositories",
                    recipe=False)
    actions = group.add_subparsers(dest="action", required=True, metavar="{list,add,update,remove}")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: an unset --debug here must not overwrite `finetune recipes --debug ...` from the group.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        return p

    action("list", "every recipe name, its description and where it comes from (the first row of a name wins)")
    p = action("add", "clone a git repository of recipes as NAME (its recipes are then NAME/recipe), pinned")
    p.add_argument("name")
    p.add_argument("url", metavar="URL_OR_DIR", help="git URL (https://, file://, git@host:) or a local git repo")
    p.add_argument("--ref", default=None, help="branch, tag or commit to pin (default: the default branch)")
    p = action("update", "fetch and move the pin of repository NAME (default: all) to its branch's newest commit")
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--ref", default=None, help="switch NAME to this branch, tag or commit")
    p = action("remove", "remove recipe repository NAME and its clone")
    p.add_argument("name")


def load_recipe_arg(args: argparse.Namespace, overrides: Sequence[str] | None = None) -> Recipe:
    """The RECIPE argument (a file or a recipe name) of any command -> the validated Recipe; prints load notes.

    After this, args.recipe is the resolved file, so a torchrun re-launch reads exactly the file resolved here.
    """
    from finetune.recipe import load_recipe, resolve_recipe

    notes: list[str] = []
    try:
        file = resolve_recipe(args.recipe, notes)
        # A name is loaded by its file (resolved once: a repository's pin is checked once); a path as written.
        given = args.recipe if Path(args.recipe).expanduser().resolve() == file else file
        recipe = load_recipe(given, list(args.overrides if overrides is None else overrides), notes=notes,
                             check_inputs=True, allow_code=getattr(args, "allow_code", False))
    finally:  # notes explain errors too (e.g. which file a shadowed name picked), so print them either way
        if os.environ.get("RANK", "0") == "0":  # under torchrun, once rather than once per rank
            for note in dict.fromkeys(notes):
                print(f"note: {note}", file=sys.stderr)
    args.recipe = str(file)
    from finetune.recipe import features
    from finetune.versions import require_packages

    require_packages(features(recipe))  # a feature's missing package fails here, not mid-run
    if getattr(args, "command", None) != "validate":  # validate names the code (cmd_validate); the rest may run it
        from finetune.recipe.code import import_all

        import_all(recipe)  # consent first; then a broken reference fails here, before anything slow
        from finetune.model.hub import offline_if_unreachable

        note = offline_if_unreachable(recipe)  # before the hub's library is imported: it reads its switch once
        if note and os.environ.get("RANK", "0") == "0":
            print(f"note: {note}", file=sys.stderr)
    return recipe


def cmd_train(args: argparse.Namespace) -> int:
    recipe = load_recipe_arg(args)
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        _preflight_output_dir(recipe, args.overwrite)
        return _exec_torchrun(args)
    from finetune.train.loop import train  # heavy: torch and transformers

    # FINETUNE_ALLOW_UNPINNED is read where the pins are enforced (versions.allow_unpinned_env), not here.
    train(recipe, overwrite=args.overwrite, allow_unpinned=args.allow_unpinned)
    return 0


def _preflight_output_dir(recipe: Recipe, overwrite: bool) -> None:
    """The output_dir checks the trainer makes, made before torchrun starts: a refusal then ends with our message
    and exit code 2, not with torchrun's traceback of a failed worker. Nothing is removed or locked here, and the
    checkpoints' sizes are checked, not their checksums (the trainer verifies those, once)."""
    from finetune.run.checkpoint import resume_path
    from finetune.run.lock import check_free
    from finetune.run.startup import check_output_dir

    out = Path(recipe.output_dir)
    check_free(out)
    said: list[str] = []  # the trainer says these again; shown here only when the check refuses
    try:
        resume_from = resume_path(recipe, out, warn=said.append, deep=False)
        check_output_dir(out, recipe, resume_from=resume_from, overwrite=overwrite)
    except UserError:
        for line in said:
            print(line, file=sys.stderr)
        raise


def _exec_torchrun(args: argparse.Namespace) -> int:
    """`--nproc N`: hand over to torchrun on this machine with the same recipe and flags."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            "-m", "finetune", "train", args.recipe, *args.overrides]
    argv += [flag for flag, on in (("--overwrite", args.overwrite), ("--allow-unpinned", args.allow_unpinned),
                                   ("--allow-code", args.allow_code), ("--debug", args.debug)) if on]
    os.execv(sys.executable, argv)
    return 0  # not reached


def cmd_preprocess(args: argparse.Namespace) -> int:
    recipe = load_recipe_arg(args)
    # heavy: transformers (the tokenizer). Not model.loading: the model's imports include torch._dynamo.
    from finetune.data.report import preprocess
    from finetune.model.tokenizer import load_tokenizer

    preprocess(recipe, load_tokenizer(recipe.tokenizer, recipe.model), show=args.show, rebuild=args.rebuild)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from finetune.recipe import to_yaml
    from finetune.recipe.code import describe_for_validate

    recipe = load_recipe_arg(args)
    code = describe_for_validate(recipe)  # imports each reference when allowed: a broken one fails here
    print(to_yaml(recipe), end="")
    for line in code:
        print(line, file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.model:
        overrides += [f"model.path={args.model}", "model.init=pretrained", "adapter.type=none"]
    from finetune.run.directory import RunDir, is_run

    run = Path(args.recipe).expanduser()
    run_dir = run if is_run(run) else None
    if run_dir is not None:  # a run directory: its own recipe, and its trained model
        from finetune.recipe import load_recipe
        from finetune.recipe.code import require_consent

        recipe = load_recipe(RunDir(run_dir).recipe, overrides, check_inputs=True, allow_code=args.allow_code)
        require_consent(recipe)
    else:
        recipe = load_recipe_arg(args, overrides)
    from finetune.train.evaluate import run_eval

    result = run_eval(recipe, run_dir=run_dir)
    units = ", ".join(f"{n} {'target tokens' if u == 'tokens' else u.replace('_', ' ')}" for u, n in result.counts.items())
    extra = "".join(f"; {k} {v:.6f}" for k, v in result.metrics.items())
    print(f"eval_loss {result.loss:.6f} over {units}{extra}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    recipe = load_recipe_arg(args)
    from finetune.commands.verify import verify

    result = verify(recipe, world_size=args.world, reference_micro_batch=args.reference_micro_batch,
                    say=lambda message: print(message, file=sys.stderr, flush=True))
    table = Table(title=f"first step: {result.rows} rows, {result.micro_batches} micro-batches, "
                        f"{result.targets} {'target tokens' if result.unit == 'tokens' else result.unit.replace('_', ' ')}")
    table.add_column("parameter group")
    table.add_column("configured vs one batch", justify="right")
    table.add_column("naive mean-of-means vs one batch", justify="right")
    for group, (configured, naive) in result.groups.items():
        table.add_row(group, f"{configured:.2e}", f"{naive:.2e}")
    console = Console()
    console.print(table)
    verdict = "PASS" if result.passed else "FAIL"
    console.print(f"{verdict}: max relative gradient difference {result.configured_max:.2e} "
                  f"(tolerance {result.tolerance:.0e}); the naive mean-of-means would be off by "
                  f"{result.naive_max:.2e}")
    if result.router_aux is not None:
        configured, reference = result.router_aux
        console.print(f"router load-balancing loss, left out of the gradients above (it is per forward, so no split "
                      f"of a step equals one batch): configured {configured:.6f} (each micro-batch's weighted by its "
                      f"target tokens), the reference {reference:.6f}, difference {configured - reference:+.2e}")
    return 0 if result.passed else 1


def cmd_merge(args: argparse.Namespace) -> int:
    from finetune.commands.merge import merge_run

    out = merge_run(args.run_dir, args.out)
    print(f"merged model written to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from finetune.commands.generate import GenerationOptions, chat, generate

    options = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, system=args.system)
    if args.command == "chat":
        chat(args.run_dir, options)
    else:
        generate(args.run_dir, args.prompt, options, images=args.image)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from finetune.commands.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.out, x=args.x)}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from finetune.commands.compare import compare_runs

    Console().print(compare_runs(args.run_a, args.run_b))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from finetune.convert import convert_axolotl

    result = convert_axolotl(args.config, allow_approx=args.allow_approx, allow_template_path=args.allow_template_path)
    for line in result.announcements:
        print(line, file=sys.stderr)
    if args.out:
        out = Path(args.out).expanduser()
        try:
            out.write_text(result.text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"--out {out}: cannot write the recipe ({e.strerror or e})") from None
        print(f"wrote {out}; check it with: finetune validate {out}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from rich.console import Console

    from finetune.versions import env_table

    # Piped or redirected, rich would assume 80 columns and fold the pip lines: give the table room instead.
    Console(width=None if sys.stdout.isatty() else 200).print(env_table())
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from finetune.recipe import Recipe

    text = json.dumps(Recipe.model_json_schema(), indent=2) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from rich.console import Console

    from finetune.recipe import names, repos

    if args.action == "list":
        Console().print(names.list_table())
    elif args.action == "add":
        repo = repos.add(args.name, args.url, args.ref)
        print(f"added {repo.name}: {repo.url} {repo.ref_kind} {repo.ref} pinned at {repo.commit[:12]} "
              f"({repo.dir}); use its recipes as {repo.name}/RECIPE")
    elif args.action == "update":
        for repo, before in repos.update(args.name, args.ref):
            moved = f"{before[:12]} -> {repo.commit[:12]}" if before != repo.commit else f"already at {before[:12]}"
            print(f"{repo.name}: {moved} ({repo.ref_kind} {repo.ref})")
    elif args.action == "remove":
        repo = repos.remove(args.name)
        print(f"removed {repo.name} ({repo.url}) and its clone {repo.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
