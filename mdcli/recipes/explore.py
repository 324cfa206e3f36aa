"""The explore recipe: step-level search over one prompt, run by api.explore."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from mdcli import api
from mdcli.errors import RecipeError
from mdcli.recipes.errors import Problem
from mdcli.recipes.schema import RecipeBase, Sampling, TemplateSite
from mdcli.recipes.templates import fill
from mdcli.strategies.explore import DEFAULT_TEMPERATURE, REFUSES, Explore, ExploreOptions

if TYPE_CHECKING:
    from mdcli.events import Event
    from mdcli.models.load import LoadedModel
    from mdcli.speculative.planner import Speculate
    from mdcli.strategies.job import RunOptions


class ExploreRecipe(RecipeBase, ExploreOptions):
    """explore: at each step (a sentence or line, or `chunk_tokens` tokens) `k` sampled candidates
    per kept path decode together, the best `keep` by `score` go on. `prompt` may use $context and
    $vars. `sampling.temperature` defaults to 0.8 (greedy candidates would all be the same)."""

    strategy: Literal["explore"]
    prompt: str
    # the rest of the fields are explore's own parameters, with their defaults and bounds: ExploreOptions

    field_fixes: ClassVar[dict[str, str]] = {
        "k": "use a whole number of at least 1 (candidates per kept path at each step)",
        "keep": "use a whole number of at least 1 (and at most k)",
        "chunk_tokens": "use a whole number of at least 1, or remove it to end steps at sentences and lines",
    }

    def check(self, var_names: set[str]) -> None:
        if not self.prompt.strip():
            raise Problem(("prompt",), "is empty", "write the prompt text")
        if self.keep > self.k:
            raise Problem(("keep",), f"{self.keep} is more than k {self.k}", "use keep <= k (paths kept of k per step)")

    def template_sites(self) -> Iterator[TemplateSite]:
        yield TemplateSite(("prompt",), self.prompt, "root")

    def speculation(self, flag: str | None) -> Speculate | None:
        """Never: candidates stop at step boundaries to be ranked against each other."""
        if flag is not None or self.speculate is not None:
            raise RecipeError(
                f"{self.source}: speculate: explore does not speculate ({REFUSES['speculate']})", fix="remove speculate from the recipe and --speculate from the command")
        return None

    def events(
        self, model: LoadedModel, values: dict[str, str], context: str | None, *,
        options: RunOptions,
    ) -> Iterator[Event]:
        settings = Sampling(temperature=DEFAULT_TEMPERATURE).then(self.sampling)
        job = Explore(
            prompt=fill(self.prompt, values), system=self.system, chat_template=self.chat_template,
            sampling=settings.params(), max_new_tokens=settings.new_tokens(Explore.model_fields["max_new_tokens"].default),
            **{name: getattr(self, name) for name in ExploreOptions.model_fields},
        )
        return api.explore(model, job, options=options)
