"""GRAFT trainer: GRPO/GRAFT loss, gate, re-tokenisation, peer prefetch, training loop, graft-train."""
