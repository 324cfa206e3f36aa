"""`mdcli explore`: step-level search, k candidate steps decoded together, the best kept."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import announce_loading, errors, load, read_document
from mdcli.cli.flags import in_flags
from mdcli.cli.groups import takes
from mdcli.cli.options import DECODE, LOAD, OUTPUT, DecodeFlags, LoadFlags, OutputFlags, SaveRecipeOpt


@takes(loading=LOAD, decoding=DECODE.without("stop", "speculate"), out=OUTPUT)
def explore(
    prompt: Annotated[str, typer.Argument(help="The prompt: text, a file holding it, or - for stdin.")],
    k: Annotated[int, typer.Option(
        "--candidates", "-k", "--k",
        help="Candidates sampled per kept path at each step (--k is its old spelling).")] = 4,
    keep: Annotated[int, typer.Option("--keep", help="Paths kept after each step (at most --candidates).")] = 1,
    chunk_tokens: Annotated[Optional[int], typer.Option(
        "--chunk-tokens", help="Steps of exactly this many tokens. Default: a step ends at the end of a sentence or a "
        "line (or after 64 tokens).")] = None,
    score: Annotated[str, typer.Option(
        "--score", help="How candidates are ranked: logprob (mean token logprob of the step) or judge (the model's "
        "own Yes-minus-No logit when asked whether the step is correct and helpful, a branch of the same "
        "forest).")] = "logprob",
    temperature: Annotated[float, typer.Option(
        "--temperature", "-t", min=0.0,
        help="Sampling temperature of the candidates; 0 = greedy (then the k candidates are all the same).")] = 0.8,
    save_recipe: SaveRecipeOpt = None,
    *, loading: LoadFlags, decoding: DecodeFlags, out: OutputFlags,
) -> None:
    """Step-level search: at each step (a sentence or line, or --chunk-tokens) -k sampled
    candidates decode together in one forest; the best --keep by --score go on, the rest leave
    the cache; until EOS or -n.

    Every candidate's tokens are what sampling its prompt (the prompt + the steps chosen so far)
    alone gives with candidate i's own generator, seeded from --seed and i. With -k 1 the answer
    is plain decoding of the prompt (with -t 0: model.generate's greedy answer). JSONL: each
    candidate is a fork ending in a prune whose reason holds its score and rank; the answer is the
    final finish. --save-recipe FILE writes the equivalent recipe; `mdcli run FILE` gives the same
    tokens.
    """
    with errors(out.debug), in_flags():
        announced = announce_loading(loading.model, out.quiet, out.progress)  # before the imports below, which take seconds
        # here, not at the top: mdcli.api brings pydantic (~0.2 s) that `mdcli --help` need not pay
        from mdcli.api import Explore
        from mdcli.api import explore as run_explore

        job = Explore(
            prompt=read_prompt(prompt),
            k=k,
            keep=keep,
            chunk_tokens=chunk_tokens,
            score=score,
            system=decoding.system,
            chat_template=not decoding.no_chat_template,
            sampling=decoding.sampling(),
            max_new_tokens=decoding.max_new_tokens,
            constraint=decoding.constraint(),
        )
        job.validate()  # bad input exits 2 before the model loads
        if save_recipe is not None:
            # lazy: the recipe code costs `mdcli --help` ~150 ms (pydantic, yaml)
            from mdcli.cli.ask_many import write_recipe
            from mdcli.recipes import explore_recipe_text

            write_recipe(save_recipe, explore_recipe_text(job))
        mode = out.mode()
        options = decoding.run_options()
        lm = load(loading.options(out, announced=announced))
        out.render(run_explore(lm, job, options=options), mode, lm)


def read_prompt(source: str) -> str:
    """'-' reads stdin and an existing file is read (without the newline editors end it with);
    anything else is the prompt text itself."""
    looks_like_a_path = source == "-" or ("\n" not in source and len(source) < 4096 and Path(source).is_file())
    return read_document(source).rstrip("\r\n") if looks_like_a_path else source
