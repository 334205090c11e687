"""What one rank does: the loop, its setup, data and loaders, models, optimizers, seeding, checkpoints."""
