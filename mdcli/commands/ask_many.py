"""`mdcli ask-many`: many questions about one document."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mdcli.commands.common import (
    AttnOpt, ChunkOpt, DebugOpt, DeviceMapOpt, DeviceOpt, DtypeOpt, EightBitOpt, FourBitOpt, JsonlOpt,
    MaxNewOpt, MinPOpt, ModelOpt, NoChatOpt, Output, OutputOpt, QuietOpt, RemoteCodeOpt, SeedOpt,
    StopOpt, SystemOpt, TemperatureOpt, TopKOpt, TopPOpt, errors, header, load, read_document,
    read_questions_file, render, sampling_params,
)


def ask_many(
    document: Annotated[str, typer.Argument(help="Document file, or - for stdin.", show_default=False)],
    question: Annotated[
        Optional[list[str]], typer.Option("--question", "-q", help="A question (repeatable).", show_default=False)
    ] = None,
    questions_file: Annotated[
        Optional[Path],
        typer.Option("--questions-file", help="More questions, one per line (blank lines skipped).", show_default=False),
    ] = None,
    template: Annotated[
        Optional[str],
        typer.Option("--template", help="User-turn template with $document and $question.", show_default=False),
    ] = None,
    system: SystemOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    attn: AttnOpt = "sdpa",
    load_in_4bit: FourBitOpt = False,
    load_in_8bit: EightBitOpt = False,
    device_map: DeviceMapOpt = None,
    trust_remote_code: RemoteCodeOpt = False,
    max_new_tokens: MaxNewOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    no_chat_template: NoChatOpt = False,
    output: OutputOpt = Output.auto,
    jsonl: JsonlOpt = False,
    quiet: QuietOpt = False,
    max_forward_tokens: ChunkOpt = 1024,
    debug: DebugOpt = False,
) -> None:
    """Ask many questions about one document: every answer decodes at once over the document's cache.

    The user turn for each question is the template (default: the document, then "Answer this
    question about the text above." and "Question: <question>"), chat-templated when the model has
    one. Exact: with greedy decoding each answer is token for token what the model gives for that
    question alone.
    """
    with errors(debug):
        from mdcli.strategies.ask_many import DEFAULT_TEMPLATE, AskMany

        questions = list(question or []) + read_questions_file(questions_file)
        job = AskMany(
            document=read_document(document),
            questions=questions,
            system=system,
            template=template or DEFAULT_TEMPLATE,
            chat_template=not no_chat_template,
            sampling=sampling_params(temperature, top_p, top_k, min_p, seed),
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
        )
        job.validate()
        mode = Output.jsonl if jsonl else output
        lm = load(model, device, dtype, attn, load_in_4bit, load_in_8bit, device_map, trust_remote_code, mode, quiet)

        from mdcli.api import run_specs

        events = run_specs(
            lm, job.branches(lm.tokenizer), strategy="ask-many", seed=seed, max_forward_tokens=max_forward_tokens
        )
        render(events, mode, quiet, header=header(lm))
