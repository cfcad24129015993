"""GRAFT inside verl (0.9.1): `GraftPPOTrainer`, verl's synchronous v1 trainer grafting peer groups from the store into
its all-fail groups, registered as `trainer.v1.trainer_mode=graft_sync` by the `verl.plugins` entry point
(`graft.integrations.verl.plugin`). Runs in verl's own environment (`make install-verl`: .venv-verl); docs/verl.md.

Nothing is imported here: `python src/graft/integrations/verl/requirements.py` runs before verl and the project are
installed."""
