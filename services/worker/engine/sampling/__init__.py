"""From logits to tokens: sampling (sampler), grammar-constrained decoding (structured), prompt-lookup speculative
decoding (spec) and the prompt positions a step owes log probabilities for (prompt_logprobs)."""
