"""`mdcli beam`: beam search as one tree in one cache, identical to Hugging Face's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import announce_loading, errors, load, read_document, read_questions_file
from mdcli.cli.flags import in_flags
from mdcli.cli.groups import takes
from mdcli.cli.options import (
    LOAD, OUTPUT, UNSAMPLED, DecodeFlags, LoadFlags, OutputFlags, QuestionsFileOpt, SaveRecipeOpt,
)


@takes(loading=LOAD, decoding=UNSAMPLED, out=OUTPUT)
def beam(
    prompt: Annotated[
        str,
        typer.Argument(
            help="The prompt text; or a file (or - for stdin): its text, or with -q a document to question.",
            show_default=False,
        ),
    ],
    question: Annotated[
        Optional[list[str]],
        typer.Option("--question", "-q", help="A question about the document: one beam set each (repeatable).",
                     show_default=False),
    ] = None,
    questions_file: QuestionsFileOpt = None,
    width: Annotated[int, typer.Option("--width", "-w", help="Beams kept per prompt (num_beams).")] = 4,
    num_return: Annotated[int, typer.Option("--num-return", help="Hypotheses returned per prompt, best first.")] = 1,
    length_penalty: Annotated[
        float, typer.Option("--length-penalty", help="Score = logprob / length**penalty (>0 favours longer).")
    ] = 1.0,
    early_stopping: Annotated[
        str,
        typer.Option(
            "--early-stopping",
            help="true: stop once `width` hypotheses end; false: HF's heuristic; never: until no beam can improve.",
        ),
    ] = "false",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens per hypothesis.")] = 64,
    template: Annotated[
        Optional[str],
        typer.Option("--template", help="With -q: user-turn template with $document and $question.", show_default=False),
    ] = None,
    save_recipe: SaveRecipeOpt = None,
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags,
) -> None:
    """Beam search, every beam a leaf of ONE shared KV cache: the sequences and scores of
    transformers' generate(num_beams=W, do_sample=False).

    Each step is one forward over every live beam of every prompt; a beam that forks costs one
    token, a beam that loses leaves at once. With a document and several -q, each question gets
    its own beam set over the document's cache.

    Plain and live output head each returned sequence with its score and finish reason ("stop
    (EOS)" or "length (-n)") and draw its trailing whitespace (⏎ newline, · space): generate may
    return sequences that differ only there, and they are kept, as generate keeps them, not merged.
    -n defaults to 64 here (every beam runs until EOS or -n). --save-recipe FILE writes the
    equivalent recipe; `mdcli run FILE` (with a document: `--input DOC`) gives the same hypotheses.
    """
    with errors(out.debug), in_flags():
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        from mdcli import api  # lazy: `mdcli --help` must not load the decoding stack

        questions = list(question or []) + read_questions_file(questions_file)
        job = api.Beam(
            prompt=prompt,
            questions=questions,
            width=width,
            num_return=num_return,
            length_penalty=length_penalty,
            early_stopping=api.parse_early_stopping(early_stopping),
            max_new_tokens=max_new_tokens,
            system=decoding.system,
            template=template,
            chat_template=not decoding.no_chat_template,
        )
        job.validate()  # before the model loads
        if _is_input_file(prompt):
            text = read_document(prompt)
            if not questions:  # the file is the prompt: drop the newline `echo` and editors end it with
                text = text.rstrip("\r\n")
            job = job.model_copy(update={"prompt": text})
        if save_recipe is not None:
            # lazy: the recipe code costs `mdcli --help` ~150 ms (pydantic, yaml)
            from mdcli.cli.ask_many import write_recipe
            from mdcli.recipes import beam_recipe_text

            write_recipe(save_recipe, beam_recipe_text(job))
        mode = out.mode()
        options = decoding.run_options()
        lm = load(loading.options(out, announced=announced))
        out.render(api.beam_search(lm, job, options=options), mode, lm)


def _is_input_file(argument: str) -> bool:
    """'-' (stdin) or an existing path is read; anything else is the prompt text itself."""
    if argument == "-":
        return True
    if "\n" in argument or len(argument) > 4096:
        return False
    try:
        return Path(argument).exists()
    except (OSError, ValueError):
        return False

