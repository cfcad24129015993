"""GRAFT: Gated Replacement of Answer-Failed groups with peer Trajectories, with an offline trajectory store.

The one installed name: graft.schemas, graft.rollouts, graft.services (the store and the generator), graft.trainer and
graft.integrations (TRL, verl). docs/ARCHITECTURE.md lays them out."""
