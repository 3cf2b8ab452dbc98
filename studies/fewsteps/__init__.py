"""Does JAGG beat training fewer steps? The few-step GRPO schedules in their own form (Flow-GRPO-Fast,
MixGRPO, DanceGRPO's random subset), each composed with ``jaggc.stepwise`` where it trains >= 3 steps,
trained side by side at equal CPU budgets (``jaggc study fewsteps``, docs/fewsteps.md)."""
