"""The CPU demonstration of GRAFT: two tiny heterogeneous models, the store, the generator, the trainer."""
