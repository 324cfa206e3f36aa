"""`mdcli run`: decode a recipe (a YAML file or a built-in name)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mdcli.cli.common import announce_loading, errors, load, read_document, read_inputs
from mdcli.cli.each import EACH, EachFlags, EachOutputOpt, run_each
from mdcli.cli.groups import takes
from mdcli.cli.options import DECODE, LOAD, OUTPUT, DecodeFlags, LoadFlags, OutputFlags
from mdcli.errors import RecipeError, UsageError

RecipeArg = Annotated[str, typer.Argument(help="Recipe file, or the name of a built-in recipe.", show_default=False)]
InputOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input", "-i", help="The context of a recipe with `context: {input: true}`: a file, or - for stdin "
        "(repeatable; folders and globs too, several documents read in order, each under a '# path' line).",
        show_default=False,
    ),
]
VarOpt = Annotated[
    list[str] | None,
    typer.Option("--var", help="Set a recipe variable: --var name=value (repeatable).", show_default=False),
]


# None = not given: the recipe's value stands (its prompt cache, sampling and speculation, else the defaults)
@takes(
    loading=LOAD.defaults(prompt_cache=None),
    decoding=DECODE.defaults(max_new_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None, speculate=None),
    out=OUTPUT,
    each_run=EACH,
)
def run(
    ctx: typer.Context,
    recipe: RecipeArg,
    input: InputOpt = None,
    var: VarOpt = None,
    output: EachOutputOpt = "auto",
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags, each_run: EachFlags,
) -> None:
    """Run a recipe: its branches (and their follow-ups) decode together over one shared cache.

    The recipe's sampling settings are the defaults; sampling flags given here win over the
    recipe everywhere, per-branch settings included; so do --choices / --regex / --schema (ask-many,
    tree, think and explore recipes). See docs/recipes.md for the format and
    `mdcli recipes list` for the built-in recipes.

    --each runs an ask-many or margins recipe (`questions:`) on every document of its input (--input
    FOLDER, files or globs; or its `context: {files: [...]}`) on its own, one tree per document, exactly
    as `mdcli ask-many --each` / `mdcli margins --each` do: the same output, --output FILE.jsonl,
    --budget-tokens, --workers and --ray-address. Other recipes are refused with --each.
    """
    with errors(out.debug):
        mode, results = each_run.destination(output)
        each = each_run.each
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        # here, not at the top: building the recipe schema (pydantic) costs about a second, which
        # `mdcli --help` and every other command would pay
        from mdcli.recipes import check_run_inputs, parse_vars, recipe_events, sampling_from_flags, with_constraint

        options = decoding.run_options()  # a bad value fails before anything loads; a --speculate given wins
        values = parse_vars(var or [])
        d = decoding
        plan = load_with_overrides(
            recipe, values, system=d.system, no_chat_template=d.no_chat_template,
            sampling=sampling_from_flags(
                temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p, seed=d.seed,
                max_new_tokens=d.max_new_tokens, stop=d.stop,
            ),
        )
        plan = with_constraint(plan, d.constraint())
        if each:
            from mdcli.recipes import each_plan  # lazy: as above

            job, sources, base = each_plan(plan, input, values)  # before the slow model load
            run_each(ctx, sources, job, out.mode(mode), results, announced, loading=loading,
                     options=plan.run_options(options), out=out, each_run=each_run, base=base,
                     prompt_cache=plan.prompt_cache or "off")
            return
        input_text = recipe_input(plan, input)
        check_run_inputs(plan, input_text=input_text, vars=values)  # before the slow model load
        mode = out.mode(mode)
        lm = load(loading.options(out, announced=announced, prompt_cache=loading.prompt_cache or plan.prompt_cache or "auto"))
        out.render(recipe_events(plan, lm, input_text=input_text, vars=values, options=options), mode, lm)


def load_with_overrides(recipe: str, values: dict[str, str], *, system, no_chat_template, sampling):
    """The recipe with the command line's explicit settings on top (shared by run and explain)."""
    from mdcli.recipes import load_recipe, with_flags  # not at the top: see run()

    plan = load_recipe(recipe, var_names=values)
    return with_flags(plan, system=system, chat_template=False if no_chat_template else None, sampling=sampling)


def recipe_input(plan, sources: list[str] | None):
    """The --input documents (api.Document list), read only when given, or the text piped to
    stdin when the recipe reads its context from input (it counts as `--input -`)."""
    if sources:
        return read_inputs(sources)
    if plan.context is None or not plan.context.input:
        return None
    missing = RecipeError(
        f"{plan.source}: context.input: the recipe reads its context from --input",
        fix="give --input FILE, or pipe the text to stdin",
    )
    if sys.stdin is None or sys.stdin.isatty():
        raise missing
    try:
        return read_document("-")
    except UsageError:
        raise missing from None
