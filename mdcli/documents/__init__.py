"""Documents: many inputs read as text with their paths, cut into chunks, and ranked per question.

A layer beside the strategies' helpers (segmenting, prompts): it knows text, paths and a token
counter handed to it, never a model, an engine or the command line.

    inputs.py    files, folders, globs and `-` -> Documents (path + text), and what was skipped
    chunks.py    Documents -> Chunks of at most N tokens on paragraph, then line boundaries
    retrieve.py  BM25 (bm25s) over the chunks: each question's top K, in corpus order, tagged
"""
