"""Checks of an `RLConfig`'s rollout keys against the rest of the config, run by `hybridflow.config.validate`
before any model loads: where the rollout runs (`rollout.placement`, `rollout.n_workers`), the off-policy modes
(`rollout.partial`, `rollout.pipeline`: docs/long_reasoning.md) and mixture-of-experts routes
(`rollout.record_routes`, `actor.router_replay`: docs/moe.md). Each returns its problems, each naming the keys,
their values and what would be valid."""

from __future__ import annotations

from typing import Any

from hybridflow.config.role_needs import agent_enabled, agent_setting, needs_greedy_baseline, rollout_workers


def divisors(n: int) -> list[int]:
    """The positive divisors of `n` in increasing order (`[]` for n < 1)."""
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def join_values(values: list[int]) -> str:
    """`values` as a list a message offers ("none" when empty)."""
    return ", ".join(map(str, values)) if values else "none"


def moe_problems(cfg: Any) -> list[str]:
    """What router replay and route recording need from the rest of the config."""
    problems, actor, rollout = [], cfg.actor, cfg.rollout
    if actor.router_replay == "rollout" and not rollout.record_routes:
        problems.append("actor.router_replay=rollout replays the experts the rollout engine recorded: set "
                        "rollout.record_routes=true (unset, it follows)")
    if actor.router_aux_loss_coef < 0:
        problems.append(f"actor.router_aux_loss_coef={actor.router_aux_loss_coef} must be >= 0 (0 = off)")
    if rollout.record_routes and rollout.engine == "hf":
        problems.append("rollout.record_routes=true needs the fast engine (rollout.engine=auto or fast); "
                        "transformers.generate (rollout.engine=hf) does not record routes")
    if rollout.record_routes and agent_enabled(cfg.agent):
        problems.append(f"rollout.record_routes=true records single-turn generations; multi-turn episodes "
                        f"({agent_setting(cfg.agent)}) are not supported with it")
    return problems


def placement_problems(cfg: Any) -> list[str]:
    """`rollout.placement` and `rollout.n_workers`: the separate rollout group's size and its share of prompts."""
    rollout, prompts = cfg.rollout, cfg.data.train_batch_size
    if rollout.placement != "separate":
        if rollout.n_workers is not None:
            return [f"rollout.n_workers={rollout.n_workers} sizes the separate rollout group, but "
                    f"rollout.placement={rollout.placement} runs the engine in the actor's trainer.n_workers "
                    f"processes; set rollout.placement=separate (unset, it follows) or rollout.n_workers=null"]
        return []
    if rollout.n_workers is not None and rollout.n_workers < 1:
        return [f"rollout.n_workers={rollout.n_workers} must be >= 1 or null (= trainer.n_workers)"]
    workers = rollout_workers(cfg)
    if prompts >= 1 and workers >= 1 and prompts % workers:
        return [f"data.train_batch_size={prompts} prompts must split evenly over the {workers} rollout ranks "
                f"(rollout.n_workers={rollout.n_workers}, null = trainer.n_workers); valid rollout.n_workers: "
                f"{join_values(divisors(prompts))}"]
    return []


def off_policy_problems(cfg: Any) -> list[str]:
    """`rollout.partial` and `rollout.pipeline`: what they run with, and what they cannot run with."""
    rollout, problems = cfg.rollout, []
    modes = [key for key, on in (("rollout.partial=true", rollout.partial), ("rollout.pipeline=true", rollout.pipeline))
             if on]
    if rollout.pipeline and rollout.placement != "separate":
        problems.append(f"rollout.pipeline=true overlaps the next step's generation with this step's update, on the "
                        f"rollout's own devices; set rollout.placement=separate (unset, it follows; got "
                        f"{rollout.placement})")
    if rollout.pipeline and rollout.max_staleness < 1:
        problems.append(f"rollout.pipeline=true trains each batch one policy version after the weights that "
                        f"generated it: rollout.max_staleness={rollout.max_staleness} must be >= 1")
    if rollout.partial and rollout.partial_stale == "finish" and rollout.partial_extra_batches > rollout.max_staleness:
        problems.append(f"rollout.partial_extra_batches={rollout.partial_extra_batches} keeps more prompt batches in "
                        f"flight than rollout.max_staleness={rollout.max_staleness} lets a step finish in time: with "
                        f"rollout.partial_stale=finish a step finishes at most its own share of the groups at the "
                        f"bound, and the rest would be dropped with their work; set rollout.partial_extra_batches <= "
                        f"{rollout.max_staleness} (or raise rollout.max_staleness, or rollout.partial_stale=drop)")
    if rollout.partial and rollout.partial_unfinished == "continue" and rollout.free_cache_after_generate:
        problems.append("rollout.partial_unfinished=continue keeps unfinished samples' KV slots from one step to the "
                        "next, which rollout.free_cache_after_generate=true frees after each generation; set "
                        "rollout.free_cache_after_generate=false (the cache then stays through training; unset, it "
                        "follows) or rollout.partial_unfinished=recompute")
    ranks = rollout_workers(cfg) if rollout.placement == "separate" else cfg.trainer.n_workers
    prompts = cfg.data.train_batch_size
    if rollout.partial and prompts >= 1 and ranks >= 1 and prompts % ranks:
        problems.append(f"rollout.partial=true takes data.train_batch_size={prompts} complete groups per step in "
                        f"equal shares from the {ranks} rollout ranks; valid data.train_batch_size: multiples of "
                        f"{ranks}")
    for mode in modes:
        clash = [what for what, on in (
            ("algorithm.filter_groups.enable=true (dynamic sampling draws several prompt batches a step)",
             cfg.algorithm.filter_groups.enable),
            ("algorithm.adv_estimator=remax (its greedy baselines are generated beside each step's prompts)",
             needs_greedy_baseline(cfg)),
            (f"{agent_setting(cfg.agent)} (multi-turn episodes)", agent_enabled(cfg.agent)),
            ("rollout.exact=true (the rollout's log-probs stand for the old ones, which tokens sampled by older "
             "weights are not)", cfg.rollout.exact),
            ("rollout.engine=hf (no sessions to carry samples in)", mode.startswith("rollout.partial")
             and rollout.engine == "hf"),
            ("rollout.record_routes=true (routes are recorded per generation call; a sample carried across steps "
             "would lose those of its earlier tokens)", mode.startswith("rollout.partial") and rollout.record_routes),
        ) if on]
        problems += [f"{mode} does not run with {what}; turn one of them off" for what in clash]
    return problems
