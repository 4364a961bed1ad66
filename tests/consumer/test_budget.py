"""An on-demand worker's budget: what to unload, least recently used first, so one more model
fits under a model count and a memory figure measured at load."""

from __future__ import annotations

from consumer.budget import MIB, Held, LoadBudget


def held(**models: tuple[int, float]) -> dict[str, Held]:
    """name=(resident MiB, used at)."""
    return {name: Held(mib * MIB, used) for name, (mib, used) in models.items()}


def test_no_budget_unloads_nothing():
    assert LoadBudget().to_unload(held(a=(500, 1), b=(500, 2)), 10_000 * MIB) == []


def test_a_full_model_count_unloads_the_least_recently_used_one():
    budget = LoadBudget.of(max_loaded_models=2, max_memory_mib=0)
    assert budget.to_unload(held(a=(1, 5.0), b=(1, 3.0))) == ["b"]
    assert budget.to_unload(held(a=(1, 5.0))) == []


def test_memory_unloads_as_many_of_the_oldest_as_it_takes_to_fit():
    budget = LoadBudget.of(max_loaded_models=0, max_memory_mib=1000)
    models = held(a=(400, 1.0), b=(300, 2.0), c=(200, 3.0))
    assert budget.to_unload(models, 100 * MIB) == []
    assert budget.to_unload(models, 250 * MIB) == ["a"]
    assert budget.to_unload(models, 700 * MIB) == ["a", "b"]


def test_after_a_load_the_new_model_is_kept_and_the_others_make_room():
    budget = LoadBudget.of(max_loaded_models=0, max_memory_mib=1000)
    models = held(a=(600, 1.0), new=(600, 9.0))
    assert budget.to_unload(models, keep="new") == ["a"]


def test_a_model_bigger_than_the_budget_still_loads_alone():
    budget = LoadBudget.of(max_loaded_models=0, max_memory_mib=100)
    assert budget.to_unload(held(a=(50, 1.0)), 5000 * MIB) == ["a"]
    assert budget.to_unload(held(new=(5000, 1.0)), keep="new") == []
