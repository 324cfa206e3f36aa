"""`mdcli explore`: step-level search, k candidate steps decoded together, the best kept."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.cli.common import (
    AttnOpt, ChoicesOpt, ChunkOpt, RegexOpt, SchemaOpt, constraint_from_flags, DebugOpt, DeviceMapOpt, DeviceOpt, DtypeOpt, CpuWeightsOpt, PromptCacheOpt, EightBitOpt, FourBitOpt, JsonlOpt, JsonOpt, PlainOpt, announce_loading, output_mode, MaxNewOpt,
    MinPOpt, ModelOpt, NoChatOpt, Output, OutputOpt, ProgressOpt, QuietOpt, RemoteCodeOpt, SeedOpt, SystemOpt,
    TopKOpt, TopPOpt, check_progress, errors, header, load, load_options, read_document, render, sampling_params,
    VerboseOpt,
)
from mdcli.cli.flags import in_flags


def explore(
    prompt: Annotated[
        str, typer.Argument(help="The prompt: text, a file holding it, or - for stdin.", show_default=False)
    ],
    k: Annotated[
        int, typer.Option("--candidates", "-k", "--k", help="Candidates sampled per kept path at each step (--k is its "
                          "old spelling).")
    ] = 4,
    keep: Annotated[int, typer.Option("--keep", help="Paths kept after each step (at most --candidates).")] = 1,
    chunk_tokens: Annotated[
        Optional[int],
        typer.Option(
            "--chunk-tokens",
            help="Steps of exactly this many tokens. Default: a step ends at the end of a sentence or a line "
            "(or after 64 tokens).",
            show_default=False,
        ),
    ] = None,
    score: Annotated[
        str,
        typer.Option(
            "--score",
            help="How candidates are ranked: logprob (mean token logprob of the step) or judge (the model's "
            "own Yes-minus-No logit when asked whether the step is correct and helpful, a branch of the same "
            "forest).",
        ),
    ] = "logprob",
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature", "-t", min=0.0,
            help="Sampling temperature of the candidates; 0 = greedy (then the k candidates are all the same).",
        ),
    ] = 0.8,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    max_new_tokens: MaxNewOpt = 256,
    choices: ChoicesOpt = None,
    regex: RegexOpt = None,
    schema: SchemaOpt = None,
    system: SystemOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    attn: AttnOpt = "sdpa",
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    cpu_weights: CpuWeightsOpt = "float32",
    prompt_cache: PromptCacheOpt = "auto",
    device_map: DeviceMapOpt = None,
    trust_remote_code: RemoteCodeOpt = False,
    no_chat_template: NoChatOpt = False,
    output: OutputOpt = Output.auto,
    jsonl: JsonlOpt = False,
    as_json: JsonOpt = False,
    plain: PlainOpt = False,
    quiet: QuietOpt = False,
    progress: ProgressOpt = False,
    save_recipe: Annotated[
        Optional[Path],
        typer.Option("--save-recipe", help="Write these settings as a recipe YAML, then run as usual.",
                     show_default=False),
    ] = None,
    max_forward_tokens: ChunkOpt = 1024,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
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
    with errors(debug), in_flags():
        announced = announce_loading(model, quiet, progress)  # before the imports below, which take seconds
        # here, not at the top: mdcli.api brings pydantic (~0.2 s) that `mdcli --help` need not pay
        from mdcli.api import Explore
        from mdcli.api import explore as run_explore

        job = Explore(
            prompt=read_prompt(prompt),
            k=k,
            keep=keep,
            chunk_tokens=chunk_tokens,
            score=score,
            system=system,
            chat_template=not no_chat_template,
            sampling=sampling_params(temperature, top_p, top_k, min_p, seed),
            max_new_tokens=max_new_tokens,
            constraint=constraint_from_flags(choices, regex, schema),
        )
        job.validate()  # bad input exits 2 before the model loads
        if save_recipe is not None:
            # lazy: the recipe code costs `mdcli --help` ~150 ms (pydantic, yaml)
            from mdcli.cli.ask_many import write_recipe
            from mdcli.recipes import explore_recipe_text

            write_recipe(save_recipe, explore_recipe_text(job))
        mode = output_mode(output, jsonl=jsonl, plain=plain, json=as_json)
        check_progress(quiet, progress)
        lm = load(load_options(locals(), announced=announced))
        events = run_explore(lm, job, max_forward_tokens=max_forward_tokens)
        render(events, mode, quiet, header=header(lm, verbose), progress=progress)


def read_prompt(source: str) -> str:
    """'-' reads stdin and an existing file is read (without the newline editors end it with);
    anything else is the prompt text itself."""
    looks_like_a_path = source == "-" or ("\n" not in source and len(source) < 4096 and Path(source).is_file())
    return read_document(source).rstrip("\r\n") if looks_like_a_path else source
