"""Controller programs: `rl` (the PPO-family loop behind `hybridflow train`) and `sft`."""
