"""Conveyor against vLLM's CPU build on the same machine, model and client (vllm_peer: the peer's server and its
`vllm bench serve`)."""
