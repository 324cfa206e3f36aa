"""`mdcli run`: decode a recipe (a YAML file or a built-in name)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mdcli.cli.common import (
    AttnOpt,
    ChoicesOpt,
    ChunkOpt,
    RegexOpt,
    SchemaOpt,
    constraint_from_flags,
    DebugOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    CpuWeightsOpt, PromptCacheOpt, EightBitOpt,
    FourBitOpt,
    JsonlOpt,
    JsonOpt,
    PlainOpt,
    announce_loading,
    output_mode,
    MaxNewOpt,
    MinPOpt,
    ModelOpt,
    NoChatOpt,
    Output,
    OutputOpt,
    ProgressOpt,
    QuietOpt,
    RemoteCodeOpt,
    SeedOpt,
    SpeculateOpt,
    StopOpt,
    SystemOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_progress,
    errors,
    header,
    load, load_options,
    read_document,
    read_inputs,
    render,
    speculate_setting,
    VerboseOpt,
)
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


def run(
    recipe: RecipeArg,
    input: InputOpt = None,
    var: VarOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    attn: AttnOpt = "sdpa",
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    cpu_weights: CpuWeightsOpt = "float32",
    prompt_cache: PromptCacheOpt = None,  # type: ignore[assignment]  # None = not given: the recipe's, else auto
    device_map: DeviceMapOpt = None,
    trust_remote_code: RemoteCodeOpt = False,
    # None = not given: the recipe's value stands
    max_new_tokens: MaxNewOpt = None,  # type: ignore[assignment]
    temperature: TemperatureOpt = None,  # type: ignore[assignment]
    top_p: TopPOpt = None,  # type: ignore[assignment]
    top_k: TopKOpt = None,  # type: ignore[assignment]
    min_p: MinPOpt = None,  # type: ignore[assignment]
    seed: SeedOpt = None,
    stop: StopOpt = None,
    choices: ChoicesOpt = None,
    regex: RegexOpt = None,
    schema: SchemaOpt = None,
    system: SystemOpt = None,
    no_chat_template: NoChatOpt = False,
    output: OutputOpt = Output.auto,
    jsonl: JsonlOpt = False,
    as_json: JsonOpt = False,
    plain: PlainOpt = False,
    quiet: QuietOpt = False,
    progress: ProgressOpt = False,
    max_forward_tokens: ChunkOpt = 1024,
    speculate: SpeculateOpt = None,  # type: ignore[assignment]  # None = not given: the recipe's, else auto
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run a recipe: its branches (and their follow-ups) decode together over one shared cache.

    The recipe's sampling settings are the defaults; sampling flags given here win over the
    recipe everywhere, per-branch settings included; so do --choices / --regex / --schema (ask-many,
    tree, think and explore recipes). See docs/recipes.md for the format and
    `mdcli recipes list` for the built-in recipes.
    """
    with errors(debug):
        announced = announce_loading(model, quiet, progress)  # before the imports below, which take seconds
        # here, not at the top: building the recipe schema (pydantic) costs about a second, which
        # `mdcli --help` and every other command would pay
        from mdcli.recipes import check_run_inputs, parse_vars, recipe_events, sampling_from_flags, with_constraint

        speculate_setting(speculate)  # a bad value fails before anything loads
        values = parse_vars(var or [])
        plan = load_with_overrides(
            recipe, values, system=system, no_chat_template=no_chat_template,
            sampling=sampling_from_flags(
                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                max_new_tokens=max_new_tokens, stop=stop,
            ),
        )
        plan = with_constraint(plan, constraint_from_flags(choices, regex, schema))
        input_text = recipe_input(plan, input)
        check_run_inputs(plan, input_text=input_text, vars=values)  # before the slow model load
        mode = output_mode(output, jsonl=jsonl, plain=plain, json=as_json)
        check_progress(quiet, progress)
        lm = load(load_options(locals(), announced=announced, prompt_cache=prompt_cache or plan.prompt_cache or "auto"))
        events = recipe_events(
            plan, lm, input_text=input_text, vars=values, max_forward_tokens=max_forward_tokens, speculate=speculate
        )
        render(events, mode, quiet, header=header(lm, verbose), progress=progress)


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
