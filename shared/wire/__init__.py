"""What travels between the services and how: every event (events), every key and stream name (constants), the
bus's one stream writer and reader (bus), a loop's dispatch table (dispatch), the errors every service shares,
and the packed forms of log probabilities (logprobs) and KV block hashes (block_hash)."""
