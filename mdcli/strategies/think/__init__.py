"""think: parallel chains of thought, as Map / Process / Reduce.

    job    what a run asks (ThinkOptions, the parameters, shared with the recipe; Think, the job)
           and the prompts built from it
    run    the run: plan, paths, vote and merge over one cache (run.py documents the phases)
    text   the fixed texts, plan parsing, answer extraction and the vote
"""

from mdcli.strategies.think.job import CONCLUSION_SEED_KEY, MERGE_MODES, PLAN_SEED_KEY, Think, ThinkOptions
from mdcli.strategies.think.run import ThinkRun, run_think
from mdcli.strategies.think.text import (
    ANSWER_MARKER_PATTERN,
    ATTEND_INSTRUCTION,
    CONCLUSION_INTRO_PATHS,
    CONCLUSION_INTRO_PLAN,
    CONCLUSION_TEMPLATE,
    EMPTY_PATH_TEXT,
    ITEM_TEMPLATE,
    LABEL_WIDTH,
    LAST_NUMBER_PATTERN,
    PATH_ENTRY_TEMPLATE,
    PLAN_INSTRUCTION,
    REASONING_INSTRUCTION,
    Turn,
    Vote,
    after_answer_token_ids,
    conclusion_user_text,
    conversation_token_ids,
    extract_answer,
    majority_vote,
    normalize_answer,
    parse_plan,
    short_label,
    with_instruction,
)

__all__ = [
    "ANSWER_MARKER_PATTERN", "ATTEND_INSTRUCTION", "CONCLUSION_INTRO_PATHS", "CONCLUSION_INTRO_PLAN",
    "CONCLUSION_SEED_KEY", "CONCLUSION_TEMPLATE", "EMPTY_PATH_TEXT", "ITEM_TEMPLATE", "LABEL_WIDTH",
    "LAST_NUMBER_PATTERN", "MERGE_MODES", "PATH_ENTRY_TEMPLATE", "PLAN_INSTRUCTION", "PLAN_SEED_KEY",
    "REASONING_INSTRUCTION", "Think", "ThinkOptions", "ThinkRun", "Turn", "Vote", "after_answer_token_ids",
    "conclusion_user_text", "conversation_token_ids", "extract_answer", "majority_vote", "normalize_answer",
    "parse_plan", "run_think", "short_label", "with_instruction",
]
