"""How the model is wrapped and how ranks talk: one strategy per parallel mode (none, dp, ddp)."""
