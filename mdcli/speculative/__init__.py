"""Speculative decoding inside the forest: draft guesses from text already seen, decide how many to verify, the forward cost model that decides."""
