"""What runs the real model's forward pass: loading it (loader), the torch runner a step goes through
(model_runner), the engine's own Llama forward (fused_llama), paged attention (attention), and huge pages under
the big tensors (huge_pages). Importing this package does not import torch."""
