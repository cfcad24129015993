"""A TRL run as a peer: what `GraftGRPOTrainer` publishes of its own groups (graft_publish, or a co-training source),
and which behaviour logprobs (mu) they carry.

TRL's sampler decides what its logprobs are, and so whether the stored rows carry mu (schemas.mu_is_behaviour):
- vLLM, colocated: TRL runs the engine with logprobs_mode processed_logprobs: the logprobs of the distribution it sampled
  from (after temperature, penalties, top-k/top-p/min-p): mu (`processed`).
- vLLM, a server: the server's --logprobs-mode (TRL's own vllm-serve: processed_logprobs): `processed`; raw_logprobs:
  `raw` (mu only at temperature 1 without a cut); any other mode: none.
- transformers: TRL keeps no sampling logprobs. The policy that sampled is the one TRL trains on until its next update,
  and its forward is the one generation ran (under TRL's mixed precision: accelerate wraps the model's forward), so
  TRL's logprobs right after generation (its old logprobs, or one forward pass of its own, at its temperature) are the
  logprobs of the sampled distribution when sampling cuts nothing (top_p 1, top_k 0, no min_p, no penalty, no
  suppressed tokens): mu (`processed`). With a cut they are not the sampler's: published without mu, said.
The rows' rewards are TRL's total reward (the weighted sum of its reward functions), which the store keeps in [0, 1].
"""

from __future__ import annotations

from typing import Any

from graft.rollouts.sampling import SamplingParams
from graft.schemas import NO_LOGPROBS

# transformers' generation settings that change the sampled distribution, with the value that changes nothing
NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0}
SUPPRESSING = ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias")


def sampler_logprobs(trainer: Any) -> tuple[SamplingParams, str, str]:
    """What TRL's sampler samples with (stored with the rows), what its logprobs are (processed_logprobs, raw_logprobs
    or none: `assemble_group`'s engine mode) and a line saying which, for the run's log."""
    args = trainer.args
    params = SamplingParams(n=trainer.num_generations, temperature=trainer.temperature, top_p=trainer.top_p,
                            top_k=trainer.top_k or None, max_tokens=trainer.max_completion_length)
    if trainer.use_vllm:
        if trainer.vllm_mode == "colocate":
            return params, "processed_logprobs", ("vLLM colocated, which TRL runs with logprobs_mode processed_logprobs: "
                                                  "the sampled distribution's logprobs, mu")
        mode = trainer.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
        if mode in ("processed_logprobs", "raw_logprobs"):
            return params, mode, (f"the vLLM server's --logprobs-mode {mode}" + (
                ": mu" if mode == "processed_logprobs" else ": the model's own logprobs, mu only at temperature 1 "
                "without a top-p or top-k cut"))
        return params, NO_LOGPROBS, f"the vLLM server's --logprobs-mode {mode} gives no logprobs: published without mu"
    config = trainer.generation_config
    if not config.do_sample or (config.num_beams or 1) > 1:
        return params, NO_LOGPROBS, ("transformers decodes without sampling (do_sample false or beams): no behaviour "
                                     "distribution, published without mu")
    cuts = {name: getattr(config, name) for name, neutral in NEUTRAL.items()
            if getattr(config, name, None) not in (None, neutral)}
    cuts |= {name: getattr(config, name) for name in SUPPRESSING if getattr(config, name, None)}
    if cuts:
        return params, NO_LOGPROBS, (f"transformers samples with {cuts}, which the logprobs of TRL's forward pass (the "
                                     "policy at its temperature) do not apply: not the sampler's, published without mu")
    return params, "processed_logprobs", (f"transformers at temperature {args.temperature} without a cut: the policy's "
                                          "logprobs right after generation (its forward as it sampled), mu")
