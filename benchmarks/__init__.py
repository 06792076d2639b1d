"""Benchmarks of Conveyor, one command a measurement (`python -m benchmarks.<group>.<name>`; each file's docstring
says what and how), by what they run: engine/ the engine and its kernels in one process; peer/ Conveyor against
vLLM's CPU build (serve_vs_vllm, burst, overload, multi-turn) and the peer's server and client (vllm_peer);
cluster/ a `conveyor up` cluster under load or faults (soak, chaos, first_token, CPU contention, tracing);
scale/ the control plane at thousands of streams and on a Redis Cluster. common.py: the cluster and process
helpers they share; results in docs/results/."""
