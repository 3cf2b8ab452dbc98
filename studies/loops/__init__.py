"""The trainers' own training loops (per-step ``backward()``), unchanged and with ``jaggc.stepwise``.

One module per trainer: ``flow_grpo`` (accelerate, peft LoRA on SD3, CFG, KL reference),
``dance_grpo`` (a random permutation of a random subset of steps, per-step backward, FSDP in its
multi-GPU runs), ``mix_grpo`` (a moving window of steps). Each has ``train_unchanged`` (the loop as
the trainer writes it) and ``train_jaggc`` (the same loop with the user's change); ``diff`` says
which lines differ.
"""
