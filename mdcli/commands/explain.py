"""`mdcli explain`: draw a recipe's forest and its attention mask, without running the model."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from mdcli.commands.common import ChunkOpt, DebugOpt, ModelOpt, NoChatOpt, RemoteCodeOpt, SystemOpt, errors
from mdcli.commands.run import InputOpt, RecipeArg, VarOpt, load_with_overrides, recipe_input

TokensOpt = Annotated[
    bool, typer.Option("--tokens", help="Draw the mask token by token, with token text (forests up to 48 tokens).")
]


def explain(
    recipe: RecipeArg,
    input: InputOpt = None,
    var: VarOpt = None,
    tokens: TokensOpt = False,
    model: ModelOpt = None,
    trust_remote_code: RemoteCodeOpt = False,
    system: SystemOpt = None,
    no_chat_template: NoChatOpt = False,
    max_forward_tokens: ChunkOpt = 1024,
    debug: DebugOpt = False,
) -> None:
    """Show how a recipe's branches share one cache: the tree of shared prompt prefixes (token
    counts, positions, follow-ups) and the attention mask that keeps every branch exact.

    Only the tokenizer is loaded. Positions are depths in the tree (the RoPE position ids the
    engine gives), slots are physical places in the cache. Follow-ups are listed but not placed:
    they fork after their parent's answer, whose length is known only when it runs.

    A margins recipe is drawn at its margin phase: a branch per question and segment, every
    segment cached once and read by all questions (classifications and answers are prompted from
    the margins' text, known only at run time).
    """
    with errors(debug):
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack
        # lazy: pydantic and yaml cost `mdcli --help` ~150 ms
        from mdcli.recipes import Sampling, check_run_inputs, compile_recipe, parse_vars
        from mdcli.render import color_disabled, make_console  # lazy: rich costs `mdcli --help` ~50 ms

        values = parse_vars(var or [])
        plan = load_with_overrides(
            recipe, values, system=system, no_chat_template=no_chat_template, sampling=Sampling()
        )
        input_text = recipe_input(plan, input)
        check_run_inputs(plan, input_text=input_text, vars=values)
        tokenizer = load_tokenizer(model, trust_remote_code)

        title = f"{plan.source} ({plan.strategy})"
        if plan.strategy == "margins":
            roots, title = margin_phase(plan, tokenizer, input_text, values)
        else:
            roots = compile_recipe(plan, tokenizer, input_text=input_text, vars=values)
        layout = api.plan_layout([root.prompt_ids for root in roots], max_forward_tokens=max_forward_tokens)
        console = make_console(sys.stdout, color=not color_disabled("NO_COLOR" in os.environ))
        api.render_explanation(
            console, roots, layout, lambda token: tokenizer.decode([token]),
            title=title, tokens=tokens,
        )


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
    return job.margin_specs(tokenizer, segments), title


def load_tokenizer(model: str | None, trust_remote_code: bool):
    """Just the tokenizer of `model` (default: the embedded one), found the way load_model finds it,
    so errors read exactly as for a full load."""
    from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

    return api.load_tokenizer(model, trust_remote_code=trust_remote_code, quiet=True)
