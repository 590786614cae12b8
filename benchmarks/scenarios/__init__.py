"""The scenarios of issue 4, in order. Each module has NAME, TITLE and
`run(quick, bar) -> report.Result`; `bar` is a tqdm bar to reset and advance."""

from benchmarks.scenarios import (
    big_array,
    born,
    born_cost,
    dataframe,
    dataloader,
    dataloader_scale,
    dataloader_start,
    docker_shm,
    era5,
    lifetime,
    many_small,
    memory,
    metadata,
    model_workers,
    node_memory,
    per_item,
    string_frame,
)

SCENARIOS = {
    module.NAME: module
    for module in (
        big_array,
        era5,
        dataframe,
        per_item,
        many_small,
        dataloader,
        memory,
        node_memory,
        dataloader_start,
        born,
        metadata,
        docker_shm,
        string_frame,
        model_workers,
        lifetime,
        born_cost,
        dataloader_scale,
    )
}
# "core" is issue 2's benchmark: the 400 MB send and the per-item cost.
ALIASES = {"core": ["big_array", "per_item"], "all": list(SCENARIOS)}


def select(names):
    """Scenario modules for names, numbers (1-N) or aliases, in suite order."""
    wanted = []
    for name in names:
        name = name.strip()
        if name.isdigit() and 1 <= int(name) <= len(SCENARIOS):
            wanted.append(list(SCENARIOS)[int(name) - 1])
        elif name in ALIASES:
            wanted += ALIASES[name]
        elif name in SCENARIOS:
            wanted.append(name)
        else:
            choices = ", ".join(list(SCENARIOS) + list(ALIASES))
            raise ValueError(
                f"unknown scenario {name!r}: expected 1-{len(SCENARIOS)} or {choices}"
            )
    return [SCENARIOS[n] for n in SCENARIOS if n in wanted]
