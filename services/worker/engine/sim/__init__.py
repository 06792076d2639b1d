"""The simulated engine: the real scheduler and block manager with a model runner that computes nothing
(sim_runner), its timing model and vocabulary (sim_model), and the fit of that model to the real engine's step
costs (sim_calibrate). See docs/simulated_engine.md."""
