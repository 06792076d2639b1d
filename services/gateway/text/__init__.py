"""Token ids to text: incremental detokenization, stop strings, log probabilities and the render threads that
build heavy answers off the event loop."""
