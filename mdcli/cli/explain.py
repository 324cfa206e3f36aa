"""`mdcli explain`: draw a recipe's forest and its attention mask, without running the model; or,
with --speculate N, run it until one speculative step and draw that step."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from mdcli.cli.common import errors, load
from mdcli.cli.groups import takes
from mdcli.cli.options import LOAD, OUTPUT, UNSAMPLED, DecodeFlags, LoadFlags, OutputFlags, RetrieveOpt
from mdcli.cli.run import InputOpt, RecipeArg, VarOpt, load_with_overrides, recipe_input
from mdcli.errors import MdcliError, UsageError

TokensOpt = Annotated[
    bool, typer.Option("--tokens", help="Draw the mask token by token, with token text (forests up to 48 tokens).")
]
SpeculateStepOpt = Annotated[
    int | None,
    typer.Option(
        "--speculate", min=1, metavar="N", show_default=False,
        help="Load the model and run the recipe with N draft tokens per branch until a guess is accepted; "
        "draw that step: each branch's guesses, their mask rows and what was accepted.",
    ),
]


@takes(
    loading=LOAD.only("model", "device", "trust_remote_code"),
    decoding=UNSAMPLED,
    out=OUTPUT.only("debug"),
)
def explain(
    recipe: RecipeArg,
    input: InputOpt = None,
    var: VarOpt = None,
    tokens: TokensOpt = False,
    retrieve: RetrieveOpt = None,
    chunk_tokens: Annotated[
        int | None, typer.Option("--chunk-tokens", min=16, show_default=False,
                                 help="With --retrieve: most tokens in one passage (default: the recipe's, else 256).")
    ] = None,
    speculate: SpeculateStepOpt = None,
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags,
) -> None:
    """Show how a recipe's branches share one cache: the tree of shared prompt prefixes (token
    counts, positions, follow-ups) and the attention mask that keeps every branch exact.

    Only the tokenizer is loaded. Positions are depths in the tree (the RoPE position ids the
    engine gives), slots are physical places in the cache. Follow-ups are listed but not placed:
    they fork after their parent's answer, whose length is known only when it runs.

    --retrieve K (an ask-many recipe with questions) draws the forest each question's K best
    passages make: questions that retrieved the same leading passages share them in the cache.

    A margins recipe is drawn at its margin phase: a branch per question and segment, every
    segment cached once and read by all questions (classifications and answers are prompted from
    the margins' text, known only at run time).

    With --speculate N the model loads and the recipe runs (greedy unless it says otherwise, output
    discarded) until the first step in which a branch's guess is accepted; that step is drawn from
    what the engine did: every branch's next token and guessed tokens at their positions, and the
    mask rows that let all of them be checked in one forward.
    """
    with errors(out.debug):
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
        # lazy: pydantic and yaml cost `mdcli --help` ~150 ms
        from mdcli.recipes import Sampling, check_run_inputs, compile_recipe, parse_vars
        from mdcli.render import color_disabled, make_console  # lazy: rich costs `mdcli --help` ~50 ms

        values = parse_vars(var or [])
        plan = load_with_overrides(
            recipe, values, system=decoding.system, no_chat_template=decoding.no_chat_template, sampling=Sampling()
        )
        plan = with_retrieval(plan, retrieve, chunk_tokens)
        input_text = recipe_input(plan, input)
        check_run_inputs(plan, input_text=input_text, vars=values)
        if speculate is not None and tokens:
            raise UsageError("--tokens draws the forest's mask; --speculate draws one step, already token by token",
                             fix="give one of them")
        if speculate is not None:
            plan.speculation(str(speculate))  # a recipe that cannot speculate says so before the model loads
            explain_speculative_step(plan, input_text, values, speculate, loading, decoding)
            return
        tokenizer = load_tokenizer(loading.model, loading.trust_remote_code)

        title = f"{plan.source} ({plan.strategy})"
        if plan.strategy == "margins":
            roots, title = margin_phase(plan, tokenizer, input_text, values)
        else:
            roots = compile_recipe(plan, tokenizer, input_text=input_text, vars=values)
        layout = api.plan_layout([root.prompt_ids for root in roots], decoding.run_options(speculate="off"))
        console = make_console(sys.stdout, color=not color_disabled(False), wrap_off_a_terminal=False)
        api.render_explanation(
            console, roots, layout, lambda token: tokenizer.decode([token]),
            title=title, tokens=tokens,
        )


def with_retrieval(plan, retrieve: int | None, chunk_tokens: int | None):
    """The recipe with --retrieve / --chunk-tokens on top (an ask-many recipe with questions and a context)."""
    if retrieve is None and chunk_tokens is None:
        return plan
    if plan.strategy != "ask-many" or plan.questions is None or plan.context is None:
        raise UsageError(
            f"--retrieve applies to an ask-many recipe with questions and a context; {plan.source} is not one",
            fix="drop --retrieve, or explain a recipe saved with mdcli ask-many --save-recipe",
        )
    if retrieve is None and plan.retrieve is None:
        raise UsageError("--chunk-tokens applies only with --retrieve", fix="add --retrieve K")
    update = {name: value for name, value in (("retrieve", retrieve), ("chunk_tokens", chunk_tokens)) if value}
    return plan.model_copy(update=update)


def explain_speculative_step(plan, input_text, values, most: int, loading: LoadFlags, decoding: DecodeFlags) -> None:
    """Run the recipe until a speculative step accepts a guess, and print that step."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
    from mdcli.recipes import recipe_events  # lazy: pydantic and yaml cost `mdcli --help` ~150 ms

    lm = load(loading.options())

    def run(setting):
        return recipe_events(plan, lm, input_text=input_text, vars=values, options=decoding.run_options(speculate=setting))

    step = api.first_verified_step(run, most)
    if step is None:
        raise MdcliError(
            f"{plan.source}: no branch had a guess to verify (none of its last tokens occurs earlier in what it reads)",
            fix="try a recipe whose answers quote their input, or a larger max_new_tokens in it",
        )
    text = lm.tokenizer.decode
    for line in api.describe_step(step, lambda token: text([token]), title=f"{plan.source} with --speculate {most}"):
        print(line)


def margin_phase(plan, tokenizer, input_text: str | None, values: dict[str, str]):
    """A margins recipe's margin branches (question-major) and a title that says what they are."""
    from mdcli.recipes import margins_job  # lazy: pydantic and yaml cost `mdcli --help` ~150 ms

    job = margins_job(plan, input_text=input_text, vars=values)
    job.validate()
    segments = job.segments(tokenizer)
    questions = len(job.all_questions())
    title = (
        f"{plan.source} (margins, {job.resolved_layout()}: the margin phase, {questions} "
        f"question{'s' if questions != 1 else ''} x {len(segments)} segments; each segment is cached once "
        "and read by every question's margin)"
    )
    if job.classify and job.classify_constraint:
        title += "; each margin's classification then decodes under regex: (YES|NO)#[^\\n]*"
    return job.margin_specs(tokenizer, segments), title


def load_tokenizer(model: str | None, trust_remote_code: bool):
    """Just the tokenizer of `model` (default: the embedded one), found the way load_model finds it,
    so errors read exactly as for a full load."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    return api.load_tokenizer(model, trust_remote_code=trust_remote_code, quiet=True)
