"""Frontends: capture a user's GRPO loss as an fx graph whose DiT calls are ``dit_call`` nodes."""
