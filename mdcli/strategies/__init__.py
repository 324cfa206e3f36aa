"""Strategies: which branches exist and what each reads. Each has one pydantic job model (the recipe's schema, the API's argument, what its command fills) and a policy over the step loop."""
